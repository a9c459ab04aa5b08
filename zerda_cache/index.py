"""Each replica's in-memory vector index: exact search, one sub-index per scope.

Vectors are L2-normalised float32, so cosine similarity is a dot product. ``ExactIndex``
keeps one contiguous float32 matrix and answers top-k by a matrix-vector product: the
reference, and fast enough for small tenants. ``ScopedIndex`` keeps one index per scope
(answers put under different instructions never match each other) and is what the
replica's ``TenantIndex`` (``zerda_cache/replica.py``) holds per tenant.

The index knows nothing of Redis; keeping it current is the replica's job.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]

#: Smallest capacity step of the matrix, and its growth factor. A small factor keeps the
#: slack (allocated but unused rows) under ~7% of the vectors' bytes.
_MIN_GROW_ROWS = 256
_GROW_FACTOR = 1.0625


class VectorIndex(Protocol):
    """What the replica needs of an index (exact or approximate)."""

    dim: int

    def add(self, entry_id: str, vector: Vector) -> None: ...
    def remove(self, entry_id: str) -> bool: ...
    def search(self, query: Vector, k: int, threshold: float) -> list[tuple[str, float]]: ...
    def __len__(self) -> int: ...
    def __contains__(self, entry_id: object) -> bool: ...
    def ids(self) -> Iterator[str]: ...
    def nbytes(self) -> int: ...


class ExactIndex:
    """Brute-force cosine top-k over a float32 matrix, with O(1) add and remove.

    Removal moves the last row into the freed one, so rows stay contiguous and a search
    touches exactly ``len(self)`` rows.
    """

    def __init__(self, dim: int) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = dim
        self._mat: Vector = np.empty((0, dim), dtype=np.float32)
        self._ids: list[str] = []
        self._row: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._row

    def ids(self) -> Iterator[str]:
        return iter(list(self._ids))

    def add(self, entry_id: str, vector: Vector) -> None:
        """Insert or replace ``entry_id``'s vector (expects an L2-normalised vector)."""
        if vector.shape != (self.dim,):
            raise ValueError(f"expected a ({self.dim},) vector, got {vector.shape}")
        row = self._row.get(entry_id)
        if row is None:
            row = len(self._ids)
            if row == self._mat.shape[0]:
                self._grow()
            self._ids.append(entry_id)
            self._row[entry_id] = row
        self._mat[row] = vector

    def _grow(self) -> None:
        rows = self._mat.shape[0]
        new_rows = max(rows + _MIN_GROW_ROWS, int(rows * _GROW_FACTOR))
        grown = np.empty((new_rows, self.dim), dtype=np.float32)
        grown[:rows] = self._mat
        self._mat = grown

    def remove(self, entry_id: str) -> bool:
        row = self._row.pop(entry_id, None)
        if row is None:
            return False
        last = len(self._ids) - 1
        if row != last:
            moved = self._ids[last]
            self._mat[row] = self._mat[last]
            self._ids[row] = moved
            self._row[moved] = row
        self._ids.pop()
        # Give memory back when the index has shrunk well below its capacity.
        if self._mat.shape[0] > _MIN_GROW_ROWS and len(self._ids) < self._mat.shape[0] // 2:
            self._mat = self._mat[: max(len(self._ids), _MIN_GROW_ROWS)].copy()
        return True

    def search(self, query: Vector, k: int, threshold: float) -> list[tuple[str, float]]:
        """Up to ``k`` ``(entry_id, cosine)`` pairs with cosine >= ``threshold``, best first."""
        n = len(self._ids)
        if n == 0 or k < 1:
            return []
        sims = self._mat[:n] @ query
        top = np.argpartition(sims, n - k)[n - k :] if k < n else np.arange(n)
        # Re-score the few winners in float64, row by row: a float32 matrix product can
        # round the same vector differently depending on its row, and the similarity a
        # caller sees (and ranks ties by) should not depend on where a vector is stored.
        exact = np.multiply(self._mat[top].astype(np.float64), query.astype(np.float64)).sum(axis=1)
        keep = exact >= threshold
        top, exact = top[keep], exact[keep]
        order = np.argsort(-exact, kind="stable")
        return [(self._ids[top[i]], float(exact[i])) for i in order]

    def vector(self, entry_id: str) -> Vector | None:
        row = self._row.get(entry_id)
        return None if row is None else self._mat[row].copy()

    def nbytes(self) -> int:
        """Approximate memory: matrix capacity plus the id list and map."""
        ids = len(self._ids)
        # str of 32 ASCII chars: 81 bytes; list slot: 8; dict entry: ~ 8 + 8 + 8 + slack.
        return int(self._mat.nbytes) + ids * (81 + 8) + len(self._row) * 42


class ScopedIndex:
    """One sub-index per scope; thread-safe.

    Tenants rarely have more than a handful of scopes, so removal asks each sub-index in
    turn instead of keeping a second id -> scope map (which would cost ~100 bytes per
    entry).

    Args:
        dim: vector dimension of the tenant.
        factory: builds the sub-index of a new scope (default ``ExactIndex``).
    """

    def __init__(self, dim: int, factory: type[ExactIndex] = ExactIndex) -> None:
        self.dim = dim
        self._factory = factory
        self._by_scope: dict[str, ExactIndex] = {}
        self._lock = threading.RLock()

    def add(self, entry_id: str, vector: Vector, scope: str) -> None:
        with self._lock:
            for other, other_sub in list(self._by_scope.items()):
                if other != scope and entry_id in other_sub:
                    self._remove_from(other, entry_id)
            target = self._by_scope.get(scope)
            if target is None:
                target = self._by_scope[scope] = self._factory(self.dim)
            target.add(entry_id, vector)

    def _remove_from(self, scope: str, entry_id: str) -> None:
        sub = self._by_scope[scope]
        sub.remove(entry_id)
        if len(sub) == 0:
            del self._by_scope[scope]

    def remove(self, entry_id: str) -> bool:
        with self._lock:
            for scope, sub in self._by_scope.items():
                if entry_id in sub:
                    self._remove_from(scope, entry_id)
                    return True
            return False

    def search(
        self, query: Vector, scope: str, k: int, threshold: float
    ) -> list[tuple[str, float]]:
        with self._lock:
            sub = self._by_scope.get(scope)
            return [] if sub is None else sub.search(query, k, threshold)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(sub) for sub in self._by_scope.values())

    def __contains__(self, entry_id: object) -> bool:
        with self._lock:
            return any(entry_id in sub for sub in self._by_scope.values())

    def ids(self) -> set[str]:
        with self._lock:
            return {eid for sub in self._by_scope.values() for eid in sub.ids()}

    def scopes(self) -> list[str]:
        with self._lock:
            return list(self._by_scope)

    def nbytes(self) -> int:
        with self._lock:
            return sum(sub.nbytes() for sub in self._by_scope.values())
