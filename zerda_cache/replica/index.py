"""Each replica's in-memory vector index: exact search, one sub-index per scope.

Vectors are L2-normalised float32, so cosine similarity is a dot product. ``ExactIndex``
keeps one contiguous float32 matrix and answers top-k by a matrix-vector product: the
reference, and fast enough for small tenants. ``ScopedIndex`` keeps one index per scope
(answers put under different instructions never match each other) and is what the
replica's ``TenantIndex`` (``zerda_cache/replica/indexes.py``) holds per tenant.

The index knows nothing of Redis; keeping it current is the replica's job.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zerda_cache.core.config import ANN_DTYPES as POLICY_DTYPES
from zerda_cache.core.config import USEARCH_DTYPES
from zerda_cache.core.validation import check_dim

Vector = npt.NDArray[np.float32]
log = logging.getLogger(__name__)

#: Smallest capacity step of the matrix, and its growth factor. A small factor keeps the
#: slack (allocated but unused rows) under ~7% of the vectors' bytes.
_MIN_GROW_ROWS = 256
_GROW_FACTOR = 1.0625
#: An uncalibrated HNSW index (see ``CALIBRATE_FROM``) searches wider as it grows:
#: ``ef_search`` up to this many entries, then doubled each time the size doubles (with
#: the default 16: 16 up to 125k, 32 up to 250k, 64 up to 500k, 128 up to 1M). With
#: M=32, ef_construction=128 and int8 graphs, near-copy recall@1 (bench_hnsw;
#: docs/BENCHMARKS.md, "HNSW parameters") is 0.998-1.000 at width 16 on 20k and 100k
#: real MiniLM embeddings and 20k clustered random 384-d vectors (as at 32), 0.999 on
#: 100k of those (1.000 at 32), 1.000 at 32 on 250k clustered vectors; on 1M of those,
#: 0.980 at 32 and 0.998 at 128. M=16 with ef_construction 64 gets 0.79 at 64 and 0.93
#: at 256 on the same 1M vectors: its graph is too sparse there, whatever the width.
WIDE_FROM = 125_000
#: A built HNSW index of this many entries or more measures the width it needs on its own
#: vectors (``_SlottedAnn.calibrate``) instead of taking ``WIDE_FROM``'s schedule, which
#: is set for hard data (clustered random vectors) and so searches real embeddings wider
#: than they need. Probes: stored vectors moved to this cosine (a paraphrase, further
#: than the benchmarks' near-copies at 0.97), searched at ``ef_search``, then twice as
#: wide, ... up to 32x; the first width at which no more than ``CALIBRATION_MISSES`` of
#: them miss (find nothing as similar as their source) is kept, or one between it and
#: the last that failed (``CALIBRATION_STEPS``). A width that misses 0.1% of such probes
#: passes 92% of the time, one that misses 0.5% 12%: the recall target is 99.5% of
#: near-copies (issue 13), which are easier than these probes.
CALIBRATE_FROM = 20_000
CALIBRATION_PROBES = 1_000
CALIBRATION_MISSES = 2
CALIBRATION_COSINE = 0.9
#: Widths tried: ``ef_search`` times 1, 2, ... 2**(CALIBRATION_STEPS - 1), then, below
#: the first that passes (if it is not the first tried), that width over sqrt(2): kept if
#: it passes too. A search's time grows about in step with its width, and the doubling
#: alone can keep up to twice the width needed; the step between the last two doublings
#: trades a little recall for a narrower, faster search (bench_cold_start measures both
#: against a baseline tree; docs/BENCHMARKS.md, "cold-start-1m-minilm-width").
CALIBRATION_STEPS = 6
#: The version of the method above, in a snapshot's calibrated width
#: (``ScopedIndex.dump``): a replica takes the worker's width only if measured as it
#: would measure it (probes, cosine, misses and widths as above). 2: the width between
#: the last two doublings is tried too.
CALIBRATION_METHOD = 2
#: The graph size from which usearch inserts a batch on every core (see
#: ``UsearchIndex._graph_add``).
PARALLEL_INSERT_FROM = 20_000
#: The first bytes of an index dump with its graphs beside the header (formats 2 and 3,
#: ``ScopedIndex.dump``; the header's ``v`` tells them apart).
SNAPSHOT_MAGIC = b"ZCIX\x02\0\0\0"
#: The dtypes whose graph holds coarse codes, with float16 rows beside it to re-score from.
ROW_DTYPES = ("i8", "b1")
#: ``auto`` (the default ``CacheConfig.ann_dtype``): ``b1`` for vectors of at least this
#: many dimensions, ``i8`` for fewer. On 384-d vectors (MiniLM and clustered random,
#: 100k to 1M: bench_hnsw and bench_lookup; docs/BENCHMARKS.md "hnsw-minilm-1000k-b1"
#: and "Lookup, put and index memory") a binary graph searches in about 2/3 the time of
#: an int8 one at the same width and recall; one bit a dimension of a short vector is a
#: coarse code that no benchmark here covers, so short vectors keep int8.
AUTO_B1_FROM_DIM = 256


def resolve_dtype(dtype: str, dim: int) -> str:
    """The usearch dtype a graph of ``dim``-dimensional vectors gets for ``dtype``
    (``auto``: see ``AUTO_B1_FROM_DIM``; any other is itself)."""
    if dtype != "auto":
        return dtype
    return "b1" if dim >= AUTO_B1_FROM_DIM else "i8"


#: A ``b1`` graph's bits are the signs of each vector less a centre, the mean of the first
#: vectors the graph gets when they are at least this many (else no centre: 0). Sentence
#: embeddings are not centred (MiniLM's mean over QQP has norm 0.21): without it, the
#: signs of the components where the mean is large would be alike for every vector.
CENTRE_FROM = 256
#: An ``i8`` graph's vectors are ``round(x * scale)``, the scale set from the first
#: vectors the graph gets: 127 over this much more than their largest component, so that
#: a stored vector's components use the int8 range (see ``UsearchIndex.quant``).
QUANT_HEADROOM = 1.25


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
        new_rows = max(rows + _MIN_GROW_ROWS, int(rows * _GROW_FACTOR), at_least)
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


#: How far under its source's similarity a probe's best may be and still count as found
#: (``_SlottedAnn.calibrate``): float64 rounding, not a nearer miss.
_SLACK = 1e-9


class _SlottedAnn:
    """Bookkeeping shared by the approximate indexes: entry ids <-> dense integer slots.

    The ANN libraries key vectors by integers. Slots are dense and reused after removal,
    so the graph does not fill with tombstones. Ids are kept as 128-bit integers (entry
    ids are 32 hex characters): two numpy arrays (slot -> id) and one dict (id -> slot),
    ~100 bytes per entry. Subclasses implement the graph operations; the few winners of a
    search are re-scored in float64 from the vectors the graph holds.
    """

    dim: int
    ef_search: int
    #: The graph is asked for this many times ``k`` candidates, re-scored, and the best
    #: ``k`` kept: more than 1 where the graph's own distances are coarse (int8).
    _oversample = 1

    def __init__(self, dim: int, capacity: int) -> None:
        self.dim = dim
        #: (entries, width) of the last ``calibrate``, if any.
        self.calibrated: tuple[int, int] | None = None
        #: The ``k`` and ``ef_search`` that calibration was made for (``calibrate``, or
        #: the snapshot the index was restored from), while the graph is the one it
        #: measured (any change clears it): a replica of the same ``top_k`` and
        #: configured width need not measure again (``ScopedIndex.calibrate``).
        self.calibrated_for: tuple[int, int] | None = None
        self._cap = capacity
        self._hi = np.zeros(capacity, dtype=np.uint64)  # slot -> id, high 64 bits
        self._lo = np.zeros(capacity, dtype=np.uint64)  # slot -> id, low 64 bits
        self._slot: dict[int, int] = {}  # 128-bit id -> slot
        self._free: list[int] = []
        self._next = 0

    # -- graph operations (subclasses) ---------------------------------------------------------
    def _graph_add(self, slots: npt.NDArray[np.int64], vectors: Vector) -> None:
        raise NotImplementedError

    def _graph_remove(self, slot: int) -> None:
        raise NotImplementedError

    def _graph_search(self, query: Vector, k: int) -> npt.NDArray[np.int64]:
        raise NotImplementedError

    def _graph_vectors(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        raise NotImplementedError

    def _graph_grow(self, capacity: int) -> None:
        """Make room for ``capacity`` slots (a no-op where the library grows itself)."""

    def _graph_nbytes(self) -> int:
        raise NotImplementedError

    # -- the index interface (as ExactIndex) ------------------------------------------------
    @staticmethod
    def _key(entry_id: str) -> int:
        try:
            return int(entry_id, 16)
        except ValueError:
            raise ValueError(f"ANN indexes need hex entry ids, got {entry_id!r}") from None

    def _id(self, slot: int) -> str:
        return f"{int(self._hi[slot]):016x}{int(self._lo[slot]):016x}"

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, entry_id: object) -> bool:
        if not isinstance(entry_id, str):
            return False
        try:
            return int(entry_id, 16) in self._slot
        except ValueError:
            return False

    def ids(self) -> Iterator[str]:
        return iter([self._id(slot) for slot in self._slot.values()])

    def _assign(self, key: int) -> tuple[int, bool]:
        """The slot of ``key``, allocating one if new; and whether it is new."""
        slot = self._slot.get(key)
        if slot is not None:
            return slot, False
        if self._free:
            slot = self._free.pop()
        else:
            if self._next == self._cap:
                self._grow()
            slot = self._next
            self._next += 1
        self._slot[key] = slot
        self._hi[slot] = key >> 64
        self._lo[slot] = key & 0xFFFFFFFFFFFFFFFF
        return slot, True

    def add(self, entry_id: str, vector: Vector) -> None:
        if vector.shape != (self.dim,):
            raise ValueError(f"expected a ({self.dim},) vector, got {vector.shape}")
        self.calibrated_for = None  # a changed graph: measured again before it is reused
        slot, new = self._assign(self._key(entry_id))
        if not new:
            self._graph_remove(slot)  # replace: drop the old vector first
        self._graph_add(np.array([slot], dtype=np.int64), vector.reshape(1, -1))

    def add_many(self, entry_ids: list[str], vectors: Vector) -> None:
        """Insert or replace many vectors: the new ones in one call of the library, which
        inserts them on every core (a replica's index build; an exact index converted)."""
        keys = [self._key(e) for e in entry_ids]
        self.calibrated_for = None
        new = [i for i, key in enumerate(keys) if key not in self._slot]
        for i, key in enumerate(keys):
            if key in self._slot:
                self.add(entry_ids[i], vectors[i])
        if not new:
            return
        need = self._next + max(0, len(new) - len(self._free))
        if need > self._cap:
            self._grow(need)
        slots = np.array([self._assign(keys[i])[0] for i in new], dtype=np.int64)
        self._graph_add(slots, np.ascontiguousarray(vectors[new]))

    def _grow(self, at_least: int = 0) -> None:
        cap = max(self._cap + _MIN_GROW_ROWS, int(self._cap * _GROW_FACTOR), at_least)
        self._graph_grow(cap)
        self._hi = np.concatenate([self._hi, np.zeros(cap - self._cap, dtype=np.uint64)])
        self._lo = np.concatenate([self._lo, np.zeros(cap - self._cap, dtype=np.uint64)])
        self._cap = cap

    def remove(self, entry_id: str) -> bool:
        slot = self._slot.pop(self._key(entry_id), None)
        if slot is None:
            return False
        self.calibrated_for = None
        self._graph_remove(slot)
        self._free.append(slot)
        return True

    def search_width(self) -> int:
        """The search width for the index's size: the calibrated one (``calibrate``) up
        to twice the entries it was calibrated at, then doubled each time the size
        doubles (the width the data needed, scaled as the schedule scales); uncalibrated,
        ``ef_search`` up to ``WIDE_FROM`` entries, doubled each time the size doubles
        past it (see ``WIDE_FROM``)."""
        n = len(self._slot)
        calibrated = self.calibrated
        if calibrated is not None:
            at, chosen = calibrated
            if n <= 2 * at:
                return chosen
            return int(chosen * 2 ** math.ceil(math.log2(n / (2 * at))))
        if n <= WIDE_FROM:
            return self.ef_search
        return int(self.ef_search * 2 ** math.ceil(math.log2(n / WIDE_FROM)))

    def calibrate(self, k: int, seed: int = 0) -> int | None:
        """Measure the narrowest search width at which probes near this index's own
        vectors find an entry at least as similar as their source (see
        ``CALIBRATE_FROM``; ``k`` candidates asked, as a lookup's ``top_k``), and use it;
        the width, or None below ``CALIBRATE_FROM`` entries (the schedule's then).

        Never narrower than ``ef_search`` (the configured width is a floor), at most 32
        times it (the widest tried, kept if none did better; ``CALIBRATION_STEPS`` says
        which widths are tried). Call it before the index is in use or with the index's
        lock held: the searches it makes set the width."""
        n = len(self._slot)
        if n < CALIBRATE_FROM or k < 1:
            return None
        rng = np.random.default_rng(seed)
        slots = np.fromiter(self._slot.values(), dtype=np.int64, count=n)
        picked = rng.choice(slots, size=min(CALIBRATION_PROBES, n), replace=False)
        stored = self._graph_vectors(picked)
        rows = stored / np.linalg.norm(stored, axis=1, keepdims=True)
        noise = rng.normal(size=rows.shape)
        noise -= np.einsum("ij,ij->i", noise, rows)[:, None] * rows
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        cos = CALIBRATION_COSINE
        probes = (cos * rows + math.sqrt(1 - cos * cos) * noise).astype(np.float32)
        # The source's similarity, re-scored as a search re-scores it (``_rescore``, one
        # row at a time: the same sums as in a search's batch); ``_SLACK`` covers the
        # last bits that another order of summation rounds differently.
        own = [float(self._rescore(picked[i : i + 1], probe)[0]) for i, probe in enumerate(probes)]
        before, before_for = self.calibrated, self.calibrated_for

        def passes(width: int) -> bool:
            """Do no more than ``CALIBRATION_MISSES`` probes miss at ``width``?"""
            self.calibrated = (n, width)  # the width the searches below use
            misses = 0
            for probe, floor in zip(probes, own, strict=True):
                found = self.search(probe, k, -1.0)
                if not found or found[0][1] < floor - _SLACK:
                    misses += 1
                    if misses > CALIBRATION_MISSES:
                        return False
            return True

        try:
            width = self.ef_search
            for step in range(CALIBRATION_STEPS):
                width = self.ef_search * 2**step
                if passes(width):
                    half_step = round(width / math.sqrt(2))
                    if step > 0 and passes(half_step):
                        width = half_step
                    break
        except BaseException:
            self.calibrated, self.calibrated_for = before, before_for
            raise
        self.calibrated = (n, width)
        self.calibrated_for = (k, self.ef_search)
        return width

    def search(self, query: Vector, k: int, threshold: float) -> list[tuple[str, float]]:
        n = len(self._slot)
        if n == 0 or k < 1:
            return []
        slots = self._graph_search(query, min(k * self._oversample, n))
        if slots.size == 0:
            return []
        # The few candidates in Python: a dozen numpy calls on arrays of ~16 cost more.
        sims = self._rescore(slots, query).tolist()
        kept = (i for i, sim in enumerate(sims) if sim >= threshold)
        best = sorted(kept, key=lambda i: -sims[i])[:k]
        if not best:
            return []
        sel = slots[best]
        return [
            (f"{hi:016x}{lo:016x}", sims[i])
            for hi, lo, i in zip(self._hi[sel].tolist(), self._lo[sel].tolist(), best, strict=True)
        ]

    def _rescore(self, slots: npt.NDArray[np.int64], query: Vector) -> npt.NDArray[np.float64]:
        """The similarity of ``query`` to the vectors at ``slots``, as the graph holds
        them: one float64 matrix-vector product (half the time of a multiply and a sum)."""
        return self._graph_vectors(slots) @ np.asarray(query, dtype=np.float64)

    def vector(self, entry_id: str) -> Vector | None:
        slot = self._slot.get(self._key(entry_id))
        if slot is None:
            return None
        vec: Vector = self._graph_vectors(np.array([slot]))[0].astype(np.float32)
        return vec

    def to_arrays(self) -> tuple[list[str], Vector]:
        slots = np.array(list(self._slot.values()), dtype=np.int64)
        vecs = self._graph_vectors(slots).astype(np.float32).reshape(-1, self.dim)
        return [self._id(int(s)) for s in slots], vecs

    def nbytes(self) -> int:
        """The graph's memory plus the id arrays and the id -> slot dict (~100 B each)."""
        return self._graph_nbytes() + self._cap * 16 + len(self._slot) * 100

    def _dump_slots(self) -> dict[str, Any]:
        used = np.array(sorted(self._slot.values()), dtype=np.int64)
        return {
            "slots": used.tobytes(),
            "hi": self._hi[used].tobytes(),
            "lo": self._lo[used].tobytes(),
            "next": self._next,
        }

    def _restore_slots(self, data: Mapping[str, Any]) -> npt.NDArray[np.int64]:
        """Restore the slot table ``_dump_slots`` made; returns the slots in use."""
        used = np.frombuffer(bytes(data["slots"]), dtype=np.int64)
        hi = np.frombuffer(bytes(data["hi"]), dtype=np.uint64)
        lo = np.frombuffer(bytes(data["lo"]), dtype=np.uint64)
        nxt = int(data["next"])
        if not (len(used) == len(hi) == len(lo)) or (len(used) and int(used.max()) >= nxt):
            raise ValueError("an ANN index dump whose slots do not agree")
        self._cap = max(nxt, 1)
        self._hi = np.zeros(self._cap, dtype=np.uint64)
        self._lo = np.zeros(self._cap, dtype=np.uint64)
        self._hi[used], self._lo[used] = hi, lo
        pairs = zip(used.tolist(), hi.tolist(), lo.tolist(), strict=True)
        self._slot = {(h << 64) | low: s for s, h, low in pairs}
        self._next = nxt
        taken = set(self._slot.values())
        self._free = [s for s in range(nxt) if s not in taken]
        return used


try:  # float16 dot products with SIMD, for re-scoring (``UsearchIndex._rescore``)
    import numkong as _numkong
except ImportError:  # an older usearch (it depended on simsimd): numpy's product
    _numkong = None  # type: ignore[assignment]
#: Whether numkong's float16 dot products are fit for re-scoring on this CPU: checked
#: once (``_numkong_fit``); None until then.
_NUMKONG_FIT: bool | None = None


def _numkong_fit() -> bool:
    """numkong picks its kernel by CPU. Re-scoring with it needs sums in float32 or wider
    (within 1e-4 of the float64 product here) that are the same for a row alone and in
    a batch (calibration re-scores one source row at a time, ``_SlottedAnn.calibrate``,
    and compares to 1e-9). Checked once on random unit vectors; if not, numpy's product."""
    global _NUMKONG_FIT
    if _NUMKONG_FIT is None:
        fit = False
        if _numkong is not None:
            rng = np.random.default_rng(0)
            rows = rng.normal(size=(24, 384))
            rows /= np.linalg.norm(rows, axis=1, keepdims=True)
            half, query = rows.astype(np.float16), rows[0].astype(np.float16)
            try:
                batch = np.asarray(_numkong.dot(half, query), dtype=np.float64)
                alone = [
                    float(np.asarray(_numkong.dot(half[i : i + 1], query))[0]) for i in range(24)
                ]
            except Exception as exc:  # any failure: numpy's product instead
                log.warning("numkong's float16 dot failed (%s): re-scoring with numpy", exc)
            else:
                exact = half.astype(np.float64) @ query.astype(np.float64)
                fit = bool(np.abs(batch - exact).max() < 1e-4) and batch.tolist() == alone
                if not fit:
                    log.warning("numkong's float16 dot is not exact enough here: numpy's instead")
        _NUMKONG_FIT = fit
    return _NUMKONG_FIT


def _import_usearch() -> Any:
    """``usearch.index``, imported after onnxruntime when that is installed.

    Creating an onnxruntime session after usearch's extension was loaded crashes the
    process (segfault; seen with usearch 2.26 and onnxruntime 1.32), and the other order
    works. A replica may well run an ONNX embedding model (``MiniLMEmbedder``) beside its
    index, so load onnxruntime first whenever it is there.
    """
    with contextlib.suppress(ImportError):
        import onnxruntime  # noqa: F401

    import usearch.index

    return usearch.index


#: Whether searches call usearch's compiled ``search_many`` themselves (``_search_one``);
#: cleared, for ``Index.search`` from then on, once a usearch refuses that call.
_COMPILED_SEARCH = True


def _search_one(graph: Any, query: Any, k: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """The keys and distances of ``graph``'s ``k`` nearest to one ``query``, nearest
    first: usearch's compiled search called as ``Index.search`` calls it (the same
    keywords), without the Python around it: its argument checks and its ``BatchMatches``
    and ``Matches`` objects, a sizeable share of a small graph's search
    (``bench_lookup``'s index-alone column measures whole searches)."""
    global _COMPILED_SEARCH
    refused: Exception | None = None
    if _COMPILED_SEARCH:
        try:
            keys, dists, counts = graph._compiled.search_many(
                query.reshape(1, -1),
                count=k,
                exact=False,
                threads=1,
                dtype=sys.modules["usearch.index"].ScalarKind.Unknown,
            )[:3]
        except (AttributeError, TypeError) as exc:  # another usearch, or a bad query
            refused = exc
        else:
            n = int(counts[0])
            return keys[0, :n], dists[0, :n]
    found = graph.search(query, k, threads=1)  # raises for a bad query: no fallback then
    if refused is not None:
        _COMPILED_SEARCH = False
        log.warning(
            "usearch's compiled search refused its call (%s): Index.search from now on", refused
        )
    return np.asarray(found.keys), np.asarray(found.distances)


class UsearchIndex(_SlottedAnn):
    """HNSW from usearch: the default ANN backend. usearch ships wheels, so installing it
    needs no compiler.

    ``dtype="i8"`` (the default): the graph holds int8 vectors, and a float16 copy of
    each vector sits beside it in a plain matrix (``_rows``, by slot). A search walks the
    int8 graph, and its few candidates are re-scored from the float16 rows, so the
    similarities a lookup sees are as exact as with a float16 graph. int8 distances are
    cheaper: at 100k clustered 384-d vectors on AVX2, a search takes about half the time
    it takes with float16 vectors in the graph, and so does a bulk build, with the same
    near-copy recall (bench_hnsw; docs/BENCHMARKS.md "hnsw-random-100k", and "Lookup,
    put and index memory" for MiniLM embeddings). The whole index is ~1.05x the raw
    float32 bytes instead of ~0.8x.

    ``dtype="f16"``: the graph holds float16 vectors and the candidates are re-scored
    from them (similarities accurate to ~1e-3 before that, ~1e-4 measured).

    ``dtype="b1"``: the graph holds one bit a dimension, the sign of each component less
    ``centre`` (the mean of the graph's first vectors, ``fit``; zero when they were
    fewer than ``CENTRE_FROM``), walked by Hamming distance; the candidates are re-scored
    from float16 rows as for ``i8``. A 384-d code is 48 bytes, one cache line: at 1M
    MiniLM embeddings, searches in 0.66x the time of ``i8`` at the same width, ~20% less
    memory (bench_hnsw; docs/BENCHMARKS.md, "hnsw-minilm-1000k-b1"). The centre is part of the
    graph: it is dumped with it and a restored graph codes queries and new vectors
    against it.

    ``quant`` (``i8``): the graph holds ``round(x * quant)`` of each unit vector ``x``,
    ``quant`` set once, from the first vectors the graph gets (``QUANT_HEADROOM``). Given
    floats, usearch would store ``127 * x`` truncated: a 384-d MiniLM embedding's
    components are ~0.04 on average and at most ~0.33, so its int8 values would be ~5
    and at most ~42, and the distances the graph is built and walked by would be that
    coarse. An inner product of vectors all scaled alike orders them as the unscaled
    one does. 0.0: usearch's own conversion (a graph restored from a format-3 dump,
    which has no scale: the worker builds it again, scaled, when it dumps it,
    ``_rescale``); None: not set yet (no
    vector added). An index whose first vectors are few (an ``ann_threshold`` far under
    the default 5,000) may get a scale under which later vectors' largest components are
    clipped: only the graph's walk is the coarser for it, not the similarities served.
    """

    def __init__(
        self,
        dim: int,
        *,
        m: int = 32,
        ef_construction: int = 128,
        ef_search: int = 16,
        capacity: int = 1024,
        dtype: str = "i8",
    ) -> None:
        if dtype not in USEARCH_DTYPES:
            raise ValueError(f"dtype must be one of {USEARCH_DTYPES}, got {dtype!r}")
        super().__init__(dim, capacity)
        self.dtype = dtype
        # int8 and Hamming distances can order near neighbours wrongly: re-score twice
        # as many (16 for the default top_k of 8, as many as the default width holds; 16
        # rows cost a few microseconds).
        self._oversample = 1 if dtype == "f16" else 2
        self.quant: float | None = None
        # b1: the centre subtracted before taking signs (None: not set yet; see CENTRE_FROM)
        self.centre: npt.NDArray[np.float32] | None = None
        self.ef_search = self._width = ef_search
        self._m, self._ef_construction = m, ef_construction
        self._graph = self._new_graph()
        # A restored index serves the snapshot's graph in place (``view``): read-only,
        # so what changes afterwards goes to ``_graph`` (new vectors) and ``_base_live``
        # (the snapshot's vectors removed or replaced since). None: no base.
        self._base: Any = None
        self._base_buffer: Any = None  # the memory the view reads; kept alive with it
        self._base_live: npt.NDArray[np.bool_] | None = None  # slot -> served from base
        self._base_dead = 0
        # i8 only: the float16 rows the candidates are re-scored from. Slots below
        # ``len(_base_rows)`` are a restored snapshot's rows, read where they lie (and
        # written there when such a slot is reused); ``_rows`` holds the slots from there
        # up to the capacity. Without a snapshot, ``_base_rows`` is empty.
        self._base_rows: npt.NDArray[np.float16] = np.zeros((0, dim), dtype=np.float16)
        self._rows: npt.NDArray[np.float16] | None = (
            np.zeros((capacity, dim), dtype=np.float16) if dtype in ROW_DTYPES else None
        )

    def _rows_at(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.float16]:
        assert self._rows is not None
        nb = len(self._base_rows)
        if nb == 0:
            return self._rows[slots]
        if not slots.size or int(slots.max()) < nb:  # the common case: all the snapshot's
            return self._base_rows[slots]
        low = slots < nb
        out = np.empty((len(slots), self.dim), dtype=np.float16)
        out[low] = self._base_rows[slots[low]]
        out[~low] = self._rows[slots[~low] - nb]
        return out

    def _set_rows(self, slots: npt.NDArray[np.int64], vectors: Vector) -> None:
        assert self._rows is not None
        nb = len(self._base_rows)
        half = np.asarray(vectors, dtype=np.float16).reshape(len(slots), self.dim)
        if nb == 0:
            self._rows[slots] = half
            return
        low = slots < nb
        self._base_rows[slots[low]] = half[low]
        self._rows[slots[~low] - nb] = half[~low]

    def _graph_add(self, slots: npt.NDArray[np.int64], vectors: Vector) -> None:
        # usearch's parallel insert races: a node added beside another may end up with no
        # way in, so that no search finds it (a few nodes a build, on 2 cores and M=32).
        # One thread loses none but builds more slowly (about the core count's factor),
        # so a graph is built on one thread up to ``PARALLEL_INSERT_FROM`` vectors, where
        # that costs a second or two (bench_hnsw times bulk builds).
        if self._rows is not None:
            self._set_rows(slots, vectors)
        self._insert(self._graph, slots.astype(np.uint64), vectors)

    def _insert(self, graph: Any, keys: npt.NDArray[np.uint64], vectors: Any) -> None:
        """Add ``vectors`` to ``graph`` as it holds them (``_to_graph``), on one thread
        up to ``PARALLEL_INSERT_FROM`` vectors (see ``_graph_add``)."""
        small = len(graph) + len(keys) < PARALLEL_INSERT_FROM
        graph.add(keys, self._to_graph(vectors, fit=True), threads=1 if small else 0)

    def _to_graph(self, vectors: Vector, fit: bool = False) -> Any:
        """``vectors`` as the graph holds them (``quant``, ``centre``); ``fit``: set
        ``quant`` or ``centre`` from them if it is not set yet (vectors about to be
        added)."""
        if fit:
            self.fit(vectors)
        if self.dtype == "b1":
            # the signs less the centre, packed 8 to a byte (usearch's b1: dim / 8 bytes)
            # (x - c > 0 exactly where x > c: IEEE subtraction of two floats is 0 only
            # where they are equal, so one comparison makes the same bits)
            vecs = np.asarray(vectors, dtype=np.float32)
            return np.packbits(vecs > (0 if self.centre is None else self.centre), axis=-1)
        q = self.quant
        if self.dtype != "i8" or not q:  # f16, not fitted yet, or usearch's own (0.0)
            return vectors
        return np.clip(np.rint(vectors * q), -127, 127).astype(np.int8)

    def fit(self, vectors: Vector) -> None:
        """Set ``quant`` (i8) or ``centre`` (b1) from ``vectors`` if it is not set yet:
        the graph's first vectors. ``ScopedIndex`` passes an exact scope's vectors and
        the batch that makes it HNSW together, so that a scope that held few vectors
        when a bulk load crossed ``ann_threshold`` is fitted on all of them."""
        if self.dtype == "f16" or (self.quant if self.dtype == "i8" else self.centre) is not None:
            return  # nothing to fit, or fitted once for the graph's life (its codes depend on it)
        vecs = np.asarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        if self.dtype == "i8" and len(vecs):
            top = float(np.max(np.abs(vecs)))
            self.quant = 127.0 / (QUANT_HEADROOM * top) if top > 0 else 0.0
        elif self.dtype == "b1" and len(vecs):
            self.centre = (
                vecs.mean(axis=0, dtype=np.float64).astype(np.float32)
                if len(vecs) >= CENTRE_FROM
                else np.zeros(self.dim, dtype=np.float32)
            )

    def _graph_grow(self, capacity: int) -> None:
        if self._rows is not None:  # usearch grows its graph itself; the rows, here
            rows = np.zeros((capacity - len(self._base_rows), self.dim), dtype=np.float16)
            rows[: len(self._rows)] = self._rows
            self._rows = rows

    def _in_base(self, slot: int) -> bool:
        live = self._base_live
        return live is not None and slot < len(live) and bool(live[slot])

    def _graph_remove(self, slot: int) -> None:
        # A slot served from the base is never also in ``_graph``: ``add`` removes the
        # old vector of a replaced id first, and a freed slot is dead in the base.
        if self._in_base(slot):
            assert self._base_live is not None
            self._base_live[slot] = False
            self._base_dead += 1
        else:
            self._graph.remove(slot)

    def _graph_search(self, query: Vector, k: int) -> npt.NDArray[np.int64]:
        query = self._to_graph(query)
        width = self.search_width()
        if width != self._width:
            self._graph.expansion_search = self._width = width
            if self._base is not None:
                self._base.expansion_search = width
        if self._base is None:
            keys, _ = _search_one(self._graph, query, k)
            return keys.astype(np.int64)
        assert self._base_live is not None
        # Vectors removed from the base still sit in its graph: ask it for more when
        # there are any, wider until k are left (the removed ones may be exactly the
        # query's nearest), drop them, and merge with the vectors added since. Each step
        # is skipped where it has nothing to do (a few numpy calls, ~10% of a search).
        live = None  # every vector of the base is served until one is removed
        if self._base_dead == 0:
            keys, dist = _search_one(self._base, query, k)
            keys = keys.astype(np.int64)
        else:
            size = len(self._base)
            wide = min(size, max(2 * k, k + 8))
            while True:
                keys, dist = _search_one(self._base, query, wide)
                keys = keys.astype(np.int64)
                live = self._base_live[keys]
                if int(live.sum()) >= k or wide >= size or len(keys) < wide:
                    break
                wide = min(size, wide * 4)
            keys = keys[live]
        if not len(self._graph):
            return keys  # in usearch's order, nearest first
        dist = dist.astype(np.float64)
        if live is not None:
            dist = dist[live]
        more_keys, more_dist = _search_one(self._graph, query, k)
        keys = np.concatenate([keys, more_keys.astype(np.int64)])
        dist = np.concatenate([dist, more_dist.astype(np.float64)])
        return keys[np.argsort(dist, kind="stable")[:k]]

    def _rescore(self, slots: npt.NDArray[np.int64], query: Vector) -> npt.NDArray[np.float64]:
        """From the float16 rows, where they are kept and numkong is installed (usearch
        depends on it): its float16 dot products, the query rounded to float16 too,
        summed in float32. That differs from the float64 product of the rows and the
        exact query by ~1e-5 on unit vectors (the rows' own rounding is ~1e-3 a
        component), and is faster than numpy's product, which converts float16 to
        float64 one element at a time (bench_lookup's index-alone column times whole
        searches)."""
        if self._rows is None or not _numkong_fit():
            return super()._rescore(slots, query)
        rows = self._rows_at(slots)
        return np.asarray(_numkong.dot(rows, np.asarray(query, dtype=np.float16)))

    def _graph_vectors(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        if self._rows is not None:
            return self._rows_at(slots).astype(np.float64)
        keys = slots.astype(np.uint64)
        if self._base is None:
            got = self._graph.get(keys)
            return np.asarray(got, dtype=np.float64).reshape(len(slots), self.dim)
        out = np.empty((len(slots), self.dim), dtype=np.float64)
        new = (
            np.asarray(self._graph.contains(keys), dtype=bool)
            if len(self._graph)
            else np.zeros(len(slots), dtype=bool)
        )
        for where, graph in ((new, self._graph), (~new, self._base)):
            if where.any():
                got = graph.get(keys[where])
                out[where] = np.asarray(got, dtype=np.float64).reshape(-1, self.dim)
        return out

    def _graph_nbytes(self) -> int:
        # usearch's memory_usage counts the arenas it reserved, touched or not (at 100k
        # entries, M=32, ~1.6x the RSS growth). What the graph holds is its serialised
        # length (vectors, links, keys), plus per slot of its capacity (a power of two)
        # the key table and node pointers: ~64 bytes, fitted to the RSS growth at 20k to
        # 200k entries (this account is within ~7% under it; bench_cold_start prints the
        # two side by side). A base view costs what it reads (its buffer) and ~75 bytes
        # a node of offsets and key table (fitted to the RSS growth of a 200k view).
        # The float16 rows (i8, b1) are counted whole (a restored snapshot's where they lie).
        own = int(self._graph.serialized_length) + 64 * int(self._graph.capacity)
        if self._rows is not None:
            own += self._rows.nbytes + self._base_rows.nbytes
        if self._base is not None:
            own += len(self._base_buffer) + 75 * len(self._base)
        return own

    @property
    def viewed(self) -> bool:
        """Serving a snapshot's graph in place (see ``restore``)."""
        return self._base is not None

    @property
    def base_size(self) -> int:
        """Vectors in the snapshot's graph served in place (removed ones included)."""
        return 0 if self._base is None else len(self._base)

    @property
    def moved(self) -> int:
        """Vectors added, replaced or removed since the snapshot served in place."""
        return 0 if self._base is None else len(self._graph) + self._base_dead

    def _materialize(self) -> None:
        """Fold the base view and what changed since into one mutable graph: usearch
        loads the base (holding the GIL for ~0.5 s a million vectors), drops the removed
        vectors and adds the new ones. Only ``dump`` needs it (the worker)."""
        if self._base is None:
            return
        assert self._base_live is not None
        full = self._new_graph()
        full.load(self._base_buffer)
        base_keys = np.asarray(self._base.keys, dtype=np.int64)
        dead = base_keys[~self._base_live[base_keys]]
        if len(dead):
            full.remove(dead.astype(np.uint64))
        if len(self._graph):
            keys = np.asarray(self._graph.keys, dtype=np.uint64)
            if self._rows is not None:
                vecs = self._rows_at(keys.astype(np.int64)).astype(np.float32)
            else:
                vecs = np.asarray(self._graph.get(keys), dtype=np.float16)
            self._insert(full, keys, vecs)
        self._replace_graph(full)

    def _replace_graph(self, graph: Any) -> None:
        """Serve ``graph`` alone from now on: the base view (if any) and what it was
        measured at are dropped, the rows made one matrix again."""
        graph.expansion_search = self._width
        self._graph = graph
        self.calibrated_for = None  # another graph than the one measured
        self._base = self._base_buffer = self._base_live = None
        self._base_dead = 0
        self._fold_rows()

    def _rescale(self) -> None:
        """Build the graph again from the float16 rows, its vectors scaled (``quant``): a
        graph of usearch's own int8 conversion, from a format-3 snapshot (no scale),
        is replaced on the worker's first dump of it, so that the tenant's next snapshot
        is scaled (a bulk build: minutes at a million vectors, once)."""
        assert self._rows is not None
        slots = np.fromiter(self._slot.values(), dtype=np.int64, count=len(self._slot))
        vecs = self._rows_at(slots).astype(np.float32)
        self.quant = None  # fitted again on these vectors
        graph = self._new_graph()
        if len(slots):
            self._insert(graph, slots.astype(np.uint64), vecs)
        self._replace_graph(graph)

    def _fold_rows(self) -> None:
        """Make the float16 rows (i8, b1) one matrix again (a copy of a snapshot's rows)."""
        if self._rows is not None and len(self._base_rows):
            self._rows = np.concatenate([self._base_rows, self._rows])
            self._base_rows = np.zeros((0, self.dim), dtype=np.float16)

    def _new_graph(self) -> Any:
        """An empty usearch graph with this index's parameters."""
        return _import_usearch().Index(
            ndim=self.dim,
            metric="hamming" if self.dtype == "b1" else "ip",
            dtype=self.dtype,
            connectivity=self._m,
            expansion_add=self._ef_construction,
            expansion_search=self._width,
        )

    def graph_bytes(self) -> Any:
        """usearch's serialisation of the graph (a buffer): the base's own memory when
        nothing changed since the snapshot it views, else the graph made whole first (or
        built again, scaled: ``_rescale``)."""
        if self.dtype == "i8" and self.quant == 0.0:
            self._rescale()
            return self._graph.save()
        if self._base is not None and self._base_dead == 0 and len(self._graph) == 0:
            return self._base_buffer
        self._materialize()
        return self._graph.save()

    def rows_bytes(self) -> Any:
        """The i8 or b1 index's float16 rows of slots ``[0, next)`` (a buffer, call it after
        ``graph_bytes``): a snapshot's own rows while nothing changed since, else the
        rows folded into one matrix."""
        assert self._rows is not None
        if len(self._base_rows) == self._next:
            return self._base_rows
        self._materialize()
        self._fold_rows()
        return self._rows[: self._next]

    def dump(self) -> dict[str, Any]:
        """The index as plain data: usearch's own serialisation and the slot table (and
        for ``i8`` and ``b1``, the float16 rows and how the codes were made)."""
        out: dict[str, Any] = {
            "kind": "usearch",
            "dtype": self.dtype,
            "graph": bytes(self.graph_bytes()),
        }
        if self._rows is not None:
            out["rows"] = np.asarray(self.rows_bytes()).tobytes()  # empty too
        return {**out, **self.coding(), **self._dump_slots()}

    def coding(self) -> dict[str, Any]:
        """How the graph's codes were made from vectors, for a dump's header: ``quant``
        (i8) or ``centre`` (b1, float32 bytes); ``_restore_coding`` reads it back."""
        if self.dtype == "i8":
            return {"quant": self.quant}
        if self.dtype == "b1":
            return {"centre": _centre_bytes(self.centre)}
        return {}

    def _restore_coding(self, data: Mapping[str, Any]) -> None:
        if self.dtype == "i8":
            self.quant = _restored_quant(data)
        elif self.dtype == "b1":
            self.centre = _restored_centre(data, self.dim)

    @classmethod
    def restore(
        cls,
        dim: int,
        data: Mapping[str, Any],
        policy: IndexPolicy,
        graph: Any = None,
        rows: Any = None,
    ) -> UsearchIndex:
        """The index ``dump`` made, with the dtype it was dumped with (``f16`` for dumps
        that name none). Given ``graph`` (a buffer holding usearch's serialisation, which
        must outlive the index), the graph is served in place as a read-only view: ~0.2 s
        a million vectors, and no copy. Loading it instead holds Python's GIL for the
        whole copy, ~0.5 s a million vectors, and so stalls every lookup of the replica
        (``bench_snapshot_load.py``). Without ``graph``, the graph in ``data`` (a
        format-1 snapshot) is loaded. An ``i8`` index's float16 rows come from ``rows``
        (a buffer: read where they lie, and written there when a slot is reused, if it is
        writable; copied if not) or else ``data["rows"]``.

        Raises ``ValueError`` when the header, the slot table, the rows or the graph's own
        header does not fit. usearch does not check a graph's links: a damaged graph may
        crash the process when searched, so the bytes must be checked first (the replica
        checks the snapshot's size and checksum before it restores it)."""
        dtype = str(data.get("dtype", "f16"))  # an unknown one: ValueError from __init__
        index = cls(
            dim,
            m=policy.m,
            ef_construction=policy.ef_construction,
            ef_search=policy.ef_search,
            capacity=1,
            dtype=dtype,
        )
        if graph is None:
            index._graph.load(bytes(data["graph"]))
            loaded = index._graph
        else:
            loaded = index._new_graph()
            kind = f"ScalarKind.{dtype.upper()}"
            try:
                meta = loaded.metadata(graph)
                if meta is None or (meta["dimensions"], str(meta["kind_scalar"])) != (dim, kind):
                    raise ValueError(f"a graph of another kind: {meta}")
                loaded.view(graph)
            except Exception as exc:  # usearch raises RuntimeError or ValueError
                raise ValueError(f"not a usearch graph of this index: {exc}") from exc
            index._base, index._base_buffer = loaded, graph
        if loaded.ndim != dim:
            raise ValueError(f"a usearch dump of dimension {loaded.ndim}, not {dim}")
        loaded.expansion_search = index._width = policy.ef_search
        used = index._restore_slots(data)
        if len(loaded) != len(index._slot):
            raise ValueError("a usearch dump whose graph and slots do not agree")
        if dtype in ROW_DTYPES:
            index._restore_rows(data["rows"] if rows is None else rows)
        index._restore_coding(data)
        if graph is not None:
            if not np.asarray(loaded.contains(used.astype(np.uint64)), dtype=bool).all():
                raise ValueError("a usearch dump whose graph and slots do not agree")
            index._base_live = np.zeros(index._cap, dtype=bool)
            index._base_live[used] = True
        index._restore_calibration(data.get("calibrated"), policy.ef_search)
        return index

    def _restore_calibration(self, calibrated: Any, floor: int) -> None:
        """Take the worker's calibrated width (``ScopedIndex.dump``'s ``calibrated``:
        entries, width, ``k``, ``ef_search``, method) if it was measured on this graph as
        this replica would measure it: from the same floor, by the same method, within
        the widths calibration tries. Otherwise the replica measures its own. Raises
        ``ValueError`` for a field of another shape (a damaged header)."""
        if calibrated is None:
            return
        if not (
            isinstance(calibrated, list | tuple)
            and len(calibrated) == 5
            and all(type(v) is int and v >= 1 for v in calibrated)
        ):
            raise ValueError(f"a usearch dump calibrated as {calibrated!r}")
        at, width, k, measured_from, method = calibrated
        if (
            method == CALIBRATION_METHOD
            and measured_from == floor
            and at == len(self._slot)
            and floor <= width <= floor * 2 ** (CALIBRATION_STEPS - 1)
        ):
            self.calibrated, self.calibrated_for = (at, width), (k, floor)

    def _restore_rows(self, rows: Any) -> None:
        """The i8 or b1 index's float16 rows of slots ``[0, next)``, as ``rows_bytes`` made
        them; the capacity is ``next`` (``_restore_slots``), so ``_rows`` starts empty."""
        mv = memoryview(rows).cast("B")
        if len(mv) != self._next * self.dim * 2:
            raise ValueError(f"a usearch dump with {len(mv)} bytes of rows for {self._next} slots")
        base = np.frombuffer(mv, dtype=np.float16).reshape(self._next, self.dim)
        self._base_rows = base if not mv.readonly else base.copy()
        self._rows = np.zeros((self._cap - self._next, self.dim), dtype=np.float16)


class HnswIndex(_SlottedAnn):
    """HNSW from hnswlib, storing float32 vectors: faster searches than usearch here,
    ~1.4x the raw float32 bytes (measured: hnswlib keeps a mutex and a hash-map node per
    element). Needs a C++ compiler to install (no wheels)."""

    def __init__(
        self,
        dim: int,
        *,
        m: int = 32,
        ef_construction: int = 128,
        ef_search: int = 16,
        capacity: int = 1024,
    ) -> None:
        import hnswlib

        super().__init__(dim, capacity)
        self.ef_search = ef_search
        self._m = m
        self._graph = hnswlib.Index(space="ip", dim=dim)
        self._graph.init_index(max_elements=capacity, ef_construction=ef_construction, M=m)
        self._graph.set_ef(ef_search)

    def _graph_add(self, slots: npt.NDArray[np.int64], vectors: Vector) -> None:
        # Re-adding a label marked deleted revives it with the new vector.
        self._graph.add_items(vectors, slots)

    def _graph_remove(self, slot: int) -> None:
        self._graph.mark_deleted(slot)

    def _graph_search(self, query: Vector, k: int) -> npt.NDArray[np.int64]:
        self._graph.set_ef(max(self.search_width(), k))
        try:
            labels, _ = self._graph.knn_query(query.reshape(1, -1), k=k)
        except RuntimeError:  # fewer than k reachable live nodes: ask for fewer
            labels, _ = self._graph.knn_query(query.reshape(1, -1), k=max(1, k // 2))
        return np.asarray(labels[0], dtype=np.int64)

    def _graph_vectors(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        return np.asarray(self._graph.get_items(slots), dtype=np.float64).reshape(
            len(slots), self.dim
        )

    def _graph_grow(self, capacity: int) -> None:
        self._graph.resize_index(capacity)

    def _graph_nbytes(self) -> int:
        # level-0 links (2M + 1 ints), vector, label, upper levels (1/(M-1) of a level of
        # M + 1 ints on average, plus a pointer), the per-element mutex and hash-map node.
        per = self.dim * 4 + (2 * self._m + 1) * 4 + 8 + 8 + (self._m + 1) * 4 // 15 + 40 + 56
        return self._cap * per


def ann_available(backend: str = "usearch") -> bool:
    """True when the library of ``backend`` is installed (usearch is a dependency;
    hnswlib is the ``ann-hnswlib`` extra)."""
    try:
        if backend == "usearch":
            _import_usearch()
        else:
            import hnswlib  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class IndexPolicy:
    """When a scope's index switches from exact search to HNSW, and HNSW's parameters.

    Attributes:
        ann_threshold: entries at which a sub-index becomes approximate; ``None`` keeps
            every index exact. It switches back below a quarter of this.
        backend: ``usearch`` (~1.0x the raw bytes with ``i8``) or ``hnswlib``
            (float32, ~1.4x).
        dtype: how a usearch graph holds its vectors (``USEARCH_DTYPES``): ``i8`` with
            float16 rows beside it for re-scoring (faster), ``f16`` (less memory), ``b1``
            (signs, float16 rows beside it as for ``i8``), or ``auto`` (``b1`` from
            ``AUTO_B1_FROM_DIM`` dimensions, else ``i8``: ``resolve_dtype``).
        m / ef_construction / ef_search: HNSW's M, construction and search widths (the
            search width grows with the size past ``WIDE_FROM``).
    """

    ann_threshold: int | None = 5_000
    backend: str = "usearch"
    dtype: str = "i8"
    m: int = 32
    ef_construction: int = 128
    ef_search: int = 16

    def __post_init__(self) -> None:
        if self.dtype not in POLICY_DTYPES:
            raise ValueError(f"dtype must be one of {POLICY_DTYPES}, got {self.dtype!r}")


SubIndex = ExactIndex | UsearchIndex | HnswIndex


class ScopedIndex:
    """One sub-index per scope; thread-safe.

    Tenants rarely have more than a handful of scopes, so removal asks each sub-index in
    turn instead of keeping a second id -> scope map (which would cost ~100 bytes per
    entry).

    Args:
        dim: vector dimension of the tenant.
        factory: builds the sub-index of a new scope (default ``ExactIndex``).
    """

    def __init__(self, dim: int, policy: IndexPolicy | None = None) -> None:
        self.dim = dim
        self.policy = policy if policy is not None else IndexPolicy()
        self._by_scope: dict[str, SubIndex] = {}
        self._lock = threading.RLock()
        self._ann_missing_warned = False

    def add(self, entry_id: str, vector: Vector, scope: str) -> None:
        with self._lock:
            for other, other_sub in list(self._by_scope.items()):
                if other != scope and entry_id in other_sub:
                    self._remove_from(other, entry_id)
            target = self._by_scope.get(scope)
            if target is None:
                target = self._by_scope[scope] = ExactIndex(self.dim)
            target.add(entry_id, vector)
            threshold = self.policy.ann_threshold
            if (
                threshold is not None
                and isinstance(target, ExactIndex)
                and len(target) >= threshold
            ):
                self._to_hnsw(scope, target)

    def add_many(self, vectors: Mapping[str, tuple[Vector, str]]) -> int:
        """Insert or replace many ``{id: (vector, scope)}`` at once, each scope's in one
        bulk insertion (a scope that reaches ``ann_threshold`` becomes HNSW once, before
        the rest is inserted). Vectors of another dimension are skipped; returns how many."""
        by_scope: dict[str, list[str]] = {}
        skipped = 0
        for eid, (vec, scope) in vectors.items():
            if vec.shape != (self.dim,):
                skipped += 1
                continue
            by_scope.setdefault(scope, []).append(eid)
        with self._lock:
            for scope, ids in by_scope.items():
                for other, other_sub in list(self._by_scope.items()):
                    if other != scope and any(eid in other_sub for eid in ids):
                        for eid in ids:
                            if eid in other_sub:
                                self._remove_from(other, eid)
                mat = np.stack([vectors[eid][0] for eid in ids]).astype(np.float32, copy=False)
                target = self._by_scope.get(scope)
                if target is None:
                    target = self._by_scope[scope] = ExactIndex(self.dim)
                threshold = self.policy.ann_threshold
                if (
                    isinstance(target, ExactIndex)
                    and threshold is not None
                    and len(target) + len(ids) >= threshold
                ):
                    self._to_hnsw(scope, target, extra=len(ids), incoming=mat)
                    target = self._by_scope[scope]
                target.add_many(ids, mat)
        return skipped

    def _to_hnsw(
        self, scope: str, exact: ExactIndex, extra: int = 0, incoming: Vector | None = None
    ) -> None:
        """Replace ``scope``'s exact index by an HNSW one with room for ``extra`` more
        (``incoming``, when given: the vectors about to be added, which its int8 scale
        or binary centre is fitted on too)."""
        p = self.policy
        if not ann_available(p.backend):
            if not self._ann_missing_warned:
                log.warning(
                    "an index reached %d entries but %s is not installed "
                    "(usearch is a dependency; hnswlib is the ann-hnswlib extra): "
                    "search stays exact and slow",
                    len(exact),
                    p.backend,
                )
                self._ann_missing_warned = True
            return
        shape: dict[str, Any] = {
            "m": p.m,
            "ef_construction": p.ef_construction,
            "ef_search": p.ef_search,
            "capacity": max(1024, int((len(exact) + extra) * _GROW_FACTOR)),
        }
        ann: UsearchIndex | HnswIndex
        if p.backend == "usearch":
            ann = UsearchIndex(self.dim, dtype=resolve_dtype(p.dtype, self.dim), **shape)
        else:
            ann = HnswIndex(self.dim, **shape)
        ids, vecs = exact.to_arrays()
        if isinstance(ann, UsearchIndex):
            ann.fit(vecs if incoming is None else np.concatenate([vecs, incoming]))
        ann.add_many(ids, vecs)
        self._by_scope[scope] = ann
        log.info(
            "scope %r: %d entries, switched to an HNSW index (%s)",
            scope,
            len(ann) + extra,
            p.backend,
        )

    def _maybe_to_exact(self, scope: str) -> None:
        sub = self._by_scope.get(scope)
        threshold = self.policy.ann_threshold
        if isinstance(sub, _SlottedAnn) and (threshold is None or len(sub) < threshold // 4):
            exact = ExactIndex(self.dim)
            ids, vecs = sub.to_arrays()
            for eid, vec in zip(ids, vecs, strict=True):
                exact.add(eid, vec)
            self._by_scope[scope] = exact

    def kind(self, scope: str) -> str:
        """``exact``, ``hnsw`` or ``none`` for the sub-index of ``scope``."""
        sub = self._by_scope.get(scope)
        return "none" if sub is None else ("exact" if isinstance(sub, ExactIndex) else "hnsw")

    def _remove_from(self, scope: str, entry_id: str) -> None:
        sub = self._by_scope[scope]
        sub.remove(entry_id)
        if len(sub) == 0:
            del self._by_scope[scope]
        else:
            self._maybe_to_exact(scope)

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

    def fold(self) -> None:
        """Make every HNSW scope served in place from a snapshot one graph again, as
        ``dump`` would (``UsearchIndex.graph_bytes``): the worker measures the search
        width of the graph it is about to dump, not of a view and its changes."""
        with self._lock:
            for sub in self._by_scope.values():
                if isinstance(sub, UsearchIndex) and sub.viewed and sub.moved:
                    sub._materialize()  # the rows too

    def calibrate(
        self, k: int, stop: Callable[[], bool] | None = None
    ) -> dict[str, tuple[int, float | None]]:
        """Calibrate the search width of every HNSW sub-index large enough
        (``_SlottedAnn.calibrate``, for lookups of ``k`` candidates, the replica's
        ``top_k``: a tenant's own differs little, the width being at least 2k): the
        width chosen and the seconds it took, by scope. A sub-index calibrated already,
        unchanged since, for the same ``k`` and configured width (by the worker,
        before it dumped the snapshot this index was restored from) keeps its width
        without measuring again: the graph is the same, so would be the width; its
        seconds are ``None``. ``stop``: asked before each scope, a true answer ends the
        calibration there (the manager is closing)."""
        with self._lock:
            subs = list(self._by_scope.items())
        widths: dict[str, tuple[int, float | None]] = {}
        for scope, sub in subs:
            if stop is not None and stop():
                break
            if isinstance(sub, _SlottedAnn):
                started = time.perf_counter()
                with self._lock:
                    done = sub.calibrated
                    if done is not None and sub.calibrated_for == (k, sub.ef_search):
                        widths[scope] = (done[1], None)  # the graph it was measured on
                        continue
                    width = sub.calibrate(k)
                if width is not None:
                    widths[scope] = (width, time.perf_counter() - started)
        return widths

    def __len__(self) -> int:
        with self._lock:
            return sum(len(sub) for sub in self._by_scope.values())

    def __contains__(self, entry_id: object) -> bool:
        with self._lock:
            return any(entry_id in sub for sub in self._by_scope.values())

    def ids(self) -> set[str]:
        with self._lock:
            return {eid for sub in self._by_scope.values() for eid in sub.ids()}

    def drift(self) -> float:
        """How far the index has moved from the snapshot it serves in place: vectors
        added, replaced or removed since, over the snapshot's (0 when it serves none)."""
        with self._lock:
            moved = base = 0
            for sub in self._by_scope.values():
                if isinstance(sub, UsearchIndex) and sub.viewed:
                    moved += sub.moved
                    base += sub.base_size
            return moved / base if base else 0.0

    def scopes(self) -> list[str]:
        with self._lock:
            return list(self._by_scope)

    def nbytes(self) -> int:
        with self._lock:
            return sum(sub.nbytes() for sub in self._by_scope.values())

    def dump(self) -> bytes | None:
        """The whole index as one blob (an index snapshot the worker stores in Redis for
        new replicas), or ``None`` when a sub-index cannot be dumped (the hnswlib
        backend, which serialises only to files).

        Format 3: ``SNAPSHOT_MAGIC``, the header's length (8 bytes, little-endian), a
        msgpack header (the slot tables, exact scopes whole, each HNSW scope's
        calibrated search width if it has one, ``calibrated``), then each HNSW scope's
        usearch graph and, for an ``i8`` scope, its float16 rows, each at a 64-byte
        aligned offset the header gives. These stay out of msgpack so that ``restore``
        can serve them where they lie, with no copy. Format 2 is the same with float16
        graphs only (no ``dtype``, no rows). Format 5 is format 3 with a ``b1`` graph (its
        ``centre`` in the header). Format 4 is format 3 with an ``i8`` graph
        whose vectors are scaled before int8 (``UsearchIndex.quant``, in the header):
        a replica that does not know ``quant`` would search such a graph with vectors
        converted another way, so it is given a format it refuses (it builds its
        index itself)."""
        import msgpack

        with self._lock:
            scopes: dict[str, Any] = {}
            parts: list[Any] = []
            at = 0
            version = 3

            def place(buf: Any) -> list[int]:
                nonlocal at
                mv = memoryview(buf).cast("B")
                pad = -len(mv) % 64
                parts.extend([mv, b"\0" * pad])
                where, at = [at, len(mv)], at + len(mv) + pad
                return where

            for scope, sub in self._by_scope.items():
                if isinstance(sub, HnswIndex):
                    return None
                if isinstance(sub, UsearchIndex):
                    entry: dict[str, Any] = {"kind": "usearch", "dtype": sub.dtype}
                    entry["graph"] = place(sub.graph_bytes())
                    # After the graph: a width measured on a view that graph_bytes just
                    # folded into another graph is not this graph's (calibrated_for).
                    if sub.calibrated is not None and sub.calibrated_for is not None:
                        entry["calibrated"] = [
                            *sub.calibrated,
                            *sub.calibrated_for,
                            CALIBRATION_METHOD,
                        ]
                    if sub.dtype in ROW_DTYPES:
                        entry["rows"] = place(sub.rows_bytes())
                    entry.update(sub.coding())
                    if sub.dtype == "b1":
                        version = 5
                    elif sub.dtype == "i8" and sub.quant:
                        version = max(version, 4)
                    scopes[scope] = {**entry, **sub._dump_slots()}
                else:
                    scopes[scope] = sub.dump()
            head = bytes(msgpack.packb({"v": version, "dim": self.dim, "scopes": scopes}))
            lead = SNAPSHOT_MAGIC + len(head).to_bytes(8, "little") + head
            return b"".join([lead, b"\0" * (-len(lead) % 64), *parts])

    @classmethod
    def restore(cls, blob: Any, policy: IndexPolicy | None = None) -> ScopedIndex:
        """The index ``dump`` made, from any buffer (``bytes``; a replica passes the
        memory it read the snapshot into). Sub-indexes are restored as they were dumped
        (exact or usearch, with their dtype), with this policy's search width. A format-2
        to 5 blob's HNSW graphs (and their float16 rows) are served in place
        (``UsearchIndex.restore``): the blob must not be changed afterwards, and one in
        private anonymous ``mmap`` memory (as ``read_snapshot`` returns it) is restored
        once: the pages before its graphs are given back. Format 1 (one msgpack
        document) is read too, with a copy.

        Raises:
            ValueError: not a dump of these formats, or one whose parts do not agree.
        """
        import msgpack

        mv = memoryview(blob).cast("B")
        graphs: memoryview | None = None
        try:
            if mv[: len(SNAPSHOT_MAGIC)] == SNAPSHOT_MAGIC:
                n = int.from_bytes(mv[len(SNAPSHOT_MAGIC) : len(SNAPSHOT_MAGIC) + 8], "little")
                lead = len(SNAPSHOT_MAGIC) + 8 + n
                if lead > len(mv):
                    raise ValueError("its header is cut short")
                body = msgpack.unpackb(mv[lead - n : lead], raw=False)
                graphs = mv[lead + (-lead % 64) :]
            else:
                body = msgpack.unpackb(mv, raw=False)
        except Exception as exc:  # msgpack raises several types for bad input
            raise ValueError(f"not an index dump: {exc}") from exc
        formats = (1,) if graphs is None else (2, 3, 4, 5)
        if not isinstance(body, dict) or body.get("v") not in formats:
            raise ValueError("not an index dump of format 1, 2, 3, 4 or 5")
        try:
            out = cls._restore_scopes(body, policy, graphs)
        except (KeyError, TypeError, AttributeError) as exc:  # a header of another shape
            raise ValueError(f"an index dump whose header does not fit: {exc!r}") from exc
        if graphs is not None:
            _release_lead(mv, len(mv) - len(graphs))
        return out

    @classmethod
    def _restore_scopes(
        cls, body: dict[str, Any], policy: IndexPolicy | None, graphs: memoryview | None
    ) -> ScopedIndex:
        dim = check_dim(body["dim"], "the index dump's dim")  # int(inf): an OverflowError
        out = cls(dim, policy)
        if graphs is not None:
            _check_sections(body["scopes"])
        for scope, data in body["scopes"].items():
            if data.get("kind") == "exact":
                out._by_scope[scope] = ExactIndex.restore(dim, data)
            elif data.get("kind") == "usearch":
                graph = rows = None
                if graphs is not None:
                    graph = _section(graphs, data["graph"], scope, "graph")
                    if data.get("dtype") in ROW_DTYPES:
                        rows = _section(graphs, data["rows"], scope, "rows")
                out._by_scope[scope] = UsearchIndex.restore(dim, data, out.policy, graph, rows)
            else:
                raise ValueError(f"unknown sub-index kind {data.get('kind')!r}")
        return out


def dump_format(blob: Any) -> str:
    """The format of a ``ScopedIndex.dump`` blob, as a snapshot's ``fmt`` names it: its
    header's ``v`` ("2" to "5"), or "1" (one msgpack document)."""
    import msgpack

    mv = memoryview(blob).cast("B")
    if mv[: len(SNAPSHOT_MAGIC)] != SNAPSHOT_MAGIC:
        return "1"
    head = len(SNAPSHOT_MAGIC) + 8
    # The header's first key is "v" (``dump``): read it, not the slot tables after it.
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(bytes(mv[head : head + 64]))
    unpacker.read_map_header()
    key, version = unpacker.unpack(), unpacker.unpack()
    if key != "v":
        raise ValueError(f"an index dump whose header starts with {key!r}")
    return str(version)


def _restored_quant(data: Mapping[str, Any]) -> float | None:
    """An ``i8`` dump's ``quant``: 0.0 (usearch's own conversion) for a dump without one
    (format 3), None for a graph that had no vector yet."""
    if "quant" not in data:
        return 0.0
    quant = data["quant"]
    if quant is None:
        if len(data.get("slots", b"")):
            raise ValueError("a usearch dump of vectors with no quant")
        return None
    if type(quant) is not float or not 0.0 <= quant < math.inf:
        raise ValueError(f"a usearch dump quantised by {quant!r}")
    return quant


def _centre_bytes(centre: npt.NDArray[np.float32] | None) -> bytes | None:
    """A ``b1`` index's centre as a dump holds it: float32 bytes, or None (not set)."""
    return None if centre is None else np.asarray(centre, dtype="<f4").tobytes()


def _restored_centre(data: Mapping[str, Any], dim: int) -> npt.NDArray[np.float32] | None:
    """A ``b1`` dump's centre (``_centre_bytes``); ValueError for one of another size or
    with values that are not finite."""
    raw = data.get("centre")
    if raw is None:
        if len(data.get("slots", b"")):
            raise ValueError("a b1 usearch dump of vectors with no centre")
        return None
    if not isinstance(raw, bytes) or len(raw) != 4 * dim:
        raise ValueError(f"a b1 usearch dump whose centre is not {dim} float32 values")
    centre = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.all(np.isfinite(centre)):
        raise ValueError("a b1 usearch dump whose centre is not finite")
    return centre


def _check_sections(scopes: Mapping[str, Any]) -> None:
    """Refuse a header whose graphs and rows overlap: a reused slot's row is written in
    place, and must never land in a graph (or in another scope's rows)."""
    spans = sorted(
        (int(data[what][0]), int(data[what][1]))
        for data in scopes.values()
        if data.get("kind") == "usearch"
        for what in ("graph", "rows")
        if what in data
    )
    for (at, size), (nxt, _) in itertools.pairwise(spans):
        if at + size > nxt:
            raise ValueError("an index dump whose sections overlap")


def _section(body: memoryview, where: Any, scope: str, what: str) -> memoryview:
    """The part of a dump's body that the header places at ``where`` (offset, length)."""
    at, size = (int(v) for v in where)
    if at < 0 or size < 0 or at + size > len(body) or (what == "graph" and size == 0):
        raise ValueError(f"scope {scope!r}: its {what} lies outside the dump")
    return body[at : at + size]


def _release_lead(mv: memoryview, lead: int) -> None:
    """Give back the pages of a restored dump before its graphs (the header, the slot
    tables and the exact scopes, all copied out by now), when it lies in private
    anonymous memory (``RedisStorage.read_snapshot``): the graphs' views keep the rest."""
    import mmap

    buf = mv.obj
    if isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        upto = lead - lead % mmap.PAGESIZE
        if upto > 0:
            buf.madvise(mmap.MADV_DONTNEED, 0, upto)
