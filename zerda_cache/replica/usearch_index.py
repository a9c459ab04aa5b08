"""``UsearchIndex``: HNSW from usearch, the default ANN backend (usearch ships wheels, so
installing it needs no compiler). Its search and re-scoring kernels are ``kernels.py``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from zerda_cache.core.config import USEARCH_DTYPES
from zerda_cache.replica.ann import (
    CALIBRATION_METHOD,
    CALIBRATION_STEPS,
    CENTRE_FROM,
    PARALLEL_INSERT_FROM,
    QUANT_HEADROOM,
    ROW_DTYPES,
    IndexPolicy,
    SlottedAnn,
)
from zerda_cache.replica.exact import Vector
from zerda_cache.replica.kernels import f16_dot, import_usearch, numkong_fit, search_one

log = logging.getLogger(__name__)


class UsearchIndex(SlottedAnn):
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
            keys, _ = search_one(self._graph, query, k)
            return keys.astype(np.int64)
        assert self._base_live is not None
        # Vectors removed from the base still sit in its graph: ask it for more when
        # there are any, wider until k are left (the removed ones may be exactly the
        # query's nearest), drop them, and merge with the vectors added since. Each step
        # is skipped where it has nothing to do (a few numpy calls, ~10% of a search).
        live = None  # every vector of the base is served until one is removed
        if self._base_dead == 0:
            keys, dist = search_one(self._base, query, k)
            keys = keys.astype(np.int64)
        else:
            size = len(self._base)
            wide = min(size, max(2 * k, k + 8))
            while True:
                keys, dist = search_one(self._base, query, wide)
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
        more_keys, more_dist = search_one(self._graph, query, k)
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
        if self._rows is None or not numkong_fit():
            return super()._rescore(slots, query)
        rows = self._rows_at(slots)
        return f16_dot(rows, np.asarray(query, dtype=np.float16))

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

    def materialize(self) -> None:
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
        slots = np.fromiter(self.slots.values(), dtype=np.int64, count=len(self.slots))
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
        return import_usearch().Index(
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
        self.materialize()
        return self._graph.save()

    def rows_bytes(self) -> Any:
        """The i8 or b1 index's float16 rows of slots ``[0, next)`` (a buffer, call it after
        ``graph_bytes``): a snapshot's own rows while nothing changed since, else the
        rows folded into one matrix."""
        assert self._rows is not None
        if len(self._base_rows) == self.next_slot:
            return self._base_rows
        self.materialize()
        self._fold_rows()
        return self._rows[: self.next_slot]

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
        return {**out, **self.coding(), **self.dump_slots()}

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
        used = index.restore_slots(data)
        if len(loaded) != len(index.slots):
            raise ValueError("a usearch dump whose graph and slots do not agree")
        if dtype in ROW_DTYPES:
            index._restore_rows(data["rows"] if rows is None else rows)
        index._restore_coding(data)
        if graph is not None:
            if not np.asarray(loaded.contains(used.astype(np.uint64)), dtype=bool).all():
                raise ValueError("a usearch dump whose graph and slots do not agree")
            index._base_live = np.zeros(index.slot_capacity, dtype=bool)
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
            and at == len(self.slots)
            and floor <= width <= floor * 2 ** (CALIBRATION_STEPS - 1)
        ):
            self.calibrated, self.calibrated_for = (at, width), (k, floor)

    def _restore_rows(self, rows: Any) -> None:
        """The i8 or b1 index's float16 rows of slots ``[0, next)``, as ``rows_bytes`` made
        them; the capacity is ``next`` (``restore_slots``), so ``_rows`` starts empty."""
        mv = memoryview(rows).cast("B")
        if len(mv) != self.next_slot * self.dim * 2:
            raise ValueError(
                f"a usearch dump with {len(mv)} bytes of rows for {self.next_slot} slots"
            )
        base = np.frombuffer(mv, dtype=np.float16).reshape(self.next_slot, self.dim)
        self._base_rows = base if not mv.readonly else base.copy()
        self._rows = np.zeros((self.slot_capacity - self.next_slot, self.dim), dtype=np.float16)


def ann_available(backend: str = "usearch") -> bool:
    """True when the library of ``backend`` is installed (usearch is a dependency;
    hnswlib is the ``ann-hnswlib`` extra)."""
    try:
        if backend == "usearch":
            import_usearch()
        else:
            import hnswlib  # noqa: F401
    except ImportError:
        return False
    return True


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
