"""``ExactIndex``: exact top-k search over one contiguous float32 matrix.

Vectors are L2-normalised float32, so cosine similarity is a dot product: top-k is a
matrix-vector product. The reference the approximate indexes are checked against, and fast
enough for small scopes (``IndexPolicy.ann_threshold`` says when a scope switches).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]

#: Smallest capacity step of the matrix, and its growth factor. A small factor keeps the
#: slack (allocated but unused rows) under ~7% of the vectors' bytes.
MIN_GROW_ROWS = 256
GROW_FACTOR = 1.0625


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

    def add_many(self, entry_ids: list[str], vectors: Vector) -> None:
        """Insert or replace many vectors (rows of ``vectors``) in one copy."""
        new = [i for i, eid in enumerate(entry_ids) if eid not in self._row]
        for i, eid in enumerate(entry_ids):
            row = self._row.get(eid)
            if row is not None:
                self._mat[row] = vectors[i]
        start = len(self._ids)
        if start + len(new) > self._mat.shape[0]:
            self._grow(start + len(new))
        self._mat[start : start + len(new)] = vectors[new]
        for offset, i in enumerate(new):
            self._ids.append(entry_ids[i])
            self._row[entry_ids[i]] = start + offset

    def _grow(self, at_least: int = 0) -> None:
        rows = self._mat.shape[0]
        new_rows = max(rows + MIN_GROW_ROWS, int(rows * GROW_FACTOR), at_least)
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
        if self._mat.shape[0] > MIN_GROW_ROWS and len(self._ids) < self._mat.shape[0] // 2:
            self._mat = self._mat[: max(len(self._ids), MIN_GROW_ROWS)].copy()
        return True

    def search(self, query: Vector, k: int, threshold: float) -> list[tuple[str, float]]:
        """Up to ``k`` ``(entry_id, cosine)`` pairs with cosine >= ``threshold``, best first."""
        n = len(self._ids)
        if n == 0 or k < 1:
            return []
        # One thread, not BLAS: a multithreaded matrix-vector product per lookup collapses
        # on a busy CPU, where its pool's threads compete for the cores with the
        # replica's lookups, which already run in parallel, one per request thread or
        # task (bench_lookup times the exact index's lookups).
        sims = np.einsum("ij,j->i", self._mat[:n], query.astype(np.float32, copy=False))
        # Few vectors clear a cache's threshold: filter first, then partition those. The
        # slack keeps float32 rounding from dropping a vector the float64 re-score keeps.
        top = np.flatnonzero(sims >= threshold - 1e-5)
        if top.size > k:
            top = top[np.argpartition(sims[top], top.size - k)[top.size - k :]]
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

    def to_arrays(self) -> tuple[list[str], Vector]:
        """All ids and their vectors (a copy), in row order."""
        return list(self._ids), self._mat[: len(self._ids)].copy()

    def nbytes(self) -> int:
        """Approximate memory: matrix capacity plus the id list and map."""
        ids = len(self._ids)
        # str of 32 ASCII chars: 81 bytes; list slot: 8; dict entry: ~ 8 + 8 + 8 + slack.
        return int(self._mat.nbytes) + ids * (81 + 8) + len(self._row) * 42

    def dump(self) -> dict[str, Any]:
        """The index as plain data (``ScopedIndex.dump``): its ids and its matrix."""
        return {
            "kind": "exact",
            "ids": "".join(self._ids).encode("ascii"),
            "mat": self._mat[: len(self._ids)].tobytes(),
        }

    @classmethod
    def restore(cls, dim: int, data: Mapping[str, Any]) -> ExactIndex:
        raw_ids = bytes(data["ids"]).decode("ascii")
        n = len(raw_ids) // 32
        mat = np.frombuffer(bytes(data["mat"]), dtype=np.float32)
        if len(raw_ids) != n * 32 or mat.size != n * dim:
            raise ValueError("an exact index dump whose ids and matrix do not agree")
        index = cls(dim)
        if n:
            index.add_many([raw_ids[i * 32 : (i + 1) * 32] for i in range(n)], mat.reshape(n, dim))
        return index
