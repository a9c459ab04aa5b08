"""What the approximate (HNSW) indexes share: ``IndexPolicy`` (when a scope switches from
exact search to HNSW, and HNSW's parameters), the search-width schedule and calibration
(``SlottedAnn``: entry ids <-> dense integer slots, growth, calibrated widths), and
``HnswIndex`` (hnswlib). The usearch backend, the default, is ``usearch_index.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zerda_cache.core.config import ANN_DTYPES as POLICY_DTYPES
from zerda_cache.replica.exact import GROW_FACTOR, MIN_GROW_ROWS, Vector

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
#: vectors (``SlottedAnn.calibrate``) instead of taking ``WIDE_FROM``'s schedule, which
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


#: How far under its source's similarity a probe's best may be and still count as found
#: (``SlottedAnn.calibrate``): float64 rounding, not a nearer miss.
SLACK = 1e-9


class SlottedAnn:
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
        self.slot_capacity = capacity
        self._hi = np.zeros(capacity, dtype=np.uint64)  # slot -> id, high 64 bits
        self._lo = np.zeros(capacity, dtype=np.uint64)  # slot -> id, low 64 bits
        self.slots: dict[int, int] = {}  # 128-bit id -> slot
        self._free: list[int] = []
        self.next_slot = 0

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
        return len(self.slots)

    def __contains__(self, entry_id: object) -> bool:
        if not isinstance(entry_id, str):
            return False
        try:
            return int(entry_id, 16) in self.slots
        except ValueError:
            return False

    def ids(self) -> Iterator[str]:
        return iter([self._id(slot) for slot in self.slots.values()])

    def _assign(self, key: int) -> tuple[int, bool]:
        """The slot of ``key``, allocating one if new; and whether it is new."""
        slot = self.slots.get(key)
        if slot is not None:
            return slot, False
        if self._free:
            slot = self._free.pop()
        else:
            if self.next_slot == self.slot_capacity:
                self._grow()
            slot = self.next_slot
            self.next_slot += 1
        self.slots[key] = slot
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
        new = [i for i, key in enumerate(keys) if key not in self.slots]
        for i, key in enumerate(keys):
            if key in self.slots:
                self.add(entry_ids[i], vectors[i])
        if not new:
            return
        need = self.next_slot + max(0, len(new) - len(self._free))
        if need > self.slot_capacity:
            self._grow(need)
        slots = np.array([self._assign(keys[i])[0] for i in new], dtype=np.int64)
        self._graph_add(slots, np.ascontiguousarray(vectors[new]))

    def _grow(self, at_least: int = 0) -> None:
        now = self.slot_capacity
        cap = max(now + MIN_GROW_ROWS, int(now * GROW_FACTOR), at_least)
        self._graph_grow(cap)
        self._hi = np.concatenate([self._hi, np.zeros(cap - self.slot_capacity, dtype=np.uint64)])
        self._lo = np.concatenate([self._lo, np.zeros(cap - self.slot_capacity, dtype=np.uint64)])
        self.slot_capacity = cap

    def remove(self, entry_id: str) -> bool:
        slot = self.slots.pop(self._key(entry_id), None)
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
        n = len(self.slots)
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
        n = len(self.slots)
        if n < CALIBRATE_FROM or k < 1:
            return None
        rng = np.random.default_rng(seed)
        slots = np.fromiter(self.slots.values(), dtype=np.int64, count=n)
        picked = rng.choice(slots, size=min(CALIBRATION_PROBES, n), replace=False)
        stored = self._graph_vectors(picked)
        rows = stored / np.linalg.norm(stored, axis=1, keepdims=True)
        noise = rng.normal(size=rows.shape)
        noise -= np.einsum("ij,ij->i", noise, rows)[:, None] * rows
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        cos = CALIBRATION_COSINE
        probes = (cos * rows + math.sqrt(1 - cos * cos) * noise).astype(np.float32)
        # The source's similarity, re-scored as a search re-scores it (``_rescore``, one
        # row at a time: the same sums as in a search's batch); ``SLACK`` covers the
        # last bits that another order of summation rounds differently.
        own = [float(self._rescore(picked[i : i + 1], probe)[0]) for i, probe in enumerate(probes)]
        before, before_for = self.calibrated, self.calibrated_for

        def passes(width: int) -> bool:
            """Do no more than ``CALIBRATION_MISSES`` probes miss at ``width``?"""
            self.calibrated = (n, width)  # the width the searches below use
            misses = 0
            for probe, floor in zip(probes, own, strict=True):
                found = self.search(probe, k, -1.0)
                if not found or found[0][1] < floor - SLACK:
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
        n = len(self.slots)
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
        slot = self.slots.get(self._key(entry_id))
        if slot is None:
            return None
        vec: Vector = self._graph_vectors(np.array([slot]))[0].astype(np.float32)
        return vec

    def to_arrays(self) -> tuple[list[str], Vector]:
        slots = np.array(list(self.slots.values()), dtype=np.int64)
        vecs = self._graph_vectors(slots).astype(np.float32).reshape(-1, self.dim)
        return [self._id(int(s)) for s in slots], vecs

    def nbytes(self) -> int:
        """The graph's memory plus the id arrays and the id -> slot dict (~100 B each)."""
        return self._graph_nbytes() + self.slot_capacity * 16 + len(self.slots) * 100

    def dump_slots(self) -> dict[str, Any]:
        used = np.array(sorted(self.slots.values()), dtype=np.int64)
        return {
            "slots": used.tobytes(),
            "hi": self._hi[used].tobytes(),
            "lo": self._lo[used].tobytes(),
            "next": self.next_slot,
        }

    def restore_slots(self, data: Mapping[str, Any]) -> npt.NDArray[np.int64]:
        """Restore the slot table ``dump_slots`` made; returns the slots in use."""
        used = np.frombuffer(bytes(data["slots"]), dtype=np.int64)
        hi = np.frombuffer(bytes(data["hi"]), dtype=np.uint64)
        lo = np.frombuffer(bytes(data["lo"]), dtype=np.uint64)
        nxt = int(data["next"])
        if not (len(used) == len(hi) == len(lo)) or (len(used) and int(used.max()) >= nxt):
            raise ValueError("an ANN index dump whose slots do not agree")
        self.slot_capacity = max(nxt, 1)
        self._hi = np.zeros(self.slot_capacity, dtype=np.uint64)
        self._lo = np.zeros(self.slot_capacity, dtype=np.uint64)
        self._hi[used], self._lo[used] = hi, lo
        pairs = zip(used.tolist(), hi.tolist(), lo.tolist(), strict=True)
        self.slots = {(h << 64) | low: s for s, h, low in pairs}
        self.next_slot = nxt
        taken = set(self.slots.values())
        self._free = [s for s in range(nxt) if s not in taken]
        return used


class HnswIndex(SlottedAnn):
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
        return self.slot_capacity * per
