"""``ScopedIndex``: each replica's in-memory vector index of one tenant, one sub-index per
scope (answers put under different instructions never match each other), exact
(``exact.py``) or HNSW (``ann.py``, ``usearch_index.py``) by size, with its snapshot format
(``dump``/``restore``). What the replica's ``TenantIndex`` (``replica/indexes.py``) holds
per tenant.

The index knows nothing of Redis; keeping it current is the replica's job.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from zerda_cache.core.validation import check_dim
from zerda_cache.replica.ann import (
    CALIBRATION_METHOD,
    ROW_DTYPES,
    HnswIndex,
    IndexPolicy,
    SlottedAnn,
    resolve_dtype,
)
from zerda_cache.replica.exact import GROW_FACTOR, ExactIndex, Vector
from zerda_cache.replica.usearch_index import UsearchIndex, ann_available

log = logging.getLogger(__name__)

#: The first bytes of an index dump with its graphs beside the header (formats 2 and 3,
#: ``ScopedIndex.dump``; the header's ``v`` tells them apart).
SNAPSHOT_MAGIC = b"ZCIX\x02\0\0\0"

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
            "capacity": max(1024, int((len(exact) + extra) * GROW_FACTOR)),
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
        if isinstance(sub, SlottedAnn) and (threshold is None or len(sub) < threshold // 4):
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
                    sub.materialize()  # the rows too

    def calibrate(
        self, k: int, stop: Callable[[], bool] | None = None
    ) -> dict[str, tuple[int, float | None]]:
        """Calibrate the search width of every HNSW sub-index large enough
        (``SlottedAnn.calibrate``, for lookups of ``k`` candidates, the replica's
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
            if isinstance(sub, SlottedAnn):
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

    def sub(self, scope: str = "") -> SubIndex:
        """The sub-index of ``scope`` (``KeyError`` if it has none): to inspect what kind
        of index a scope holds and its state (the tests and benchmarks read it; the
        replica goes through this class's methods)."""
        with self._lock:
            return self._by_scope[scope]

    def subs(self) -> dict[str, SubIndex]:
        """Every scope's sub-index (a copy of the map)."""
        with self._lock:
            return dict(self._by_scope)

    def set_sub(self, scope: str, sub: SubIndex) -> None:
        """Put ``sub`` in place as ``scope``'s sub-index (tests: an index of an earlier
        format, made by hand)."""
        with self._lock:
            self._by_scope[scope] = sub

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
                    scopes[scope] = {**entry, **sub.dump_slots()}
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
