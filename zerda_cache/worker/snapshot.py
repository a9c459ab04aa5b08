"""Index snapshots: the worker publishes a large tenant's built index in Redis, so that a
new replica loads it in seconds instead of building it for minutes.

A replica builds a tenant's index from every vector in Redis: about 25 s for 100k
MiniLM embeddings on two cores, minutes at a million (``docs/BENCHMARKS.md``). The worker
(the lease holder) keeps an index of every tenant of ``snapshot_min_entries`` or more, as
a replica would (a ``CacheManager`` of its own, caught up through the tenant's log), and
publishes it with the log position it is at:

* ``ScopedIndex.dump`` serialises it (format 4: a msgpack header, then usearch's own
  format for each HNSW scope and the float16 rows beside an int8 graph, which a replica
  serves in place; 3 where no int8 graph is scaled, ``UsearchIndex.quant``; 5 with a
  binary graph, ``ann_dtype="b1"``) into one blob, stored in
  chunks of 16 MB (``p:{t}:snap:<gen>:<i>``, written with a TTL while unpublished);
* ``snapshot.lua`` publishes the generation in the tenant's ``p:{t}:snap`` hash and
  deletes the previous one, in one step;
* a new replica's build (``ReplicaIndexes._from_snapshot``) reads it, checks its size and
  checksum and that the log still holds every event since its position, installs it and
  replays the log from there: the same replay as after a scan, so nothing published
  after the snapshot is missed. Anything amiss (no snapshot, a stale or damaged one):
  the replica scans as before. A replica whose index has drifted by a tenth from the
  snapshot it serves loads a newer one (``ReplicaIndexes._rebase``).

A snapshot is made again once the tenant's log has moved on by a tenth of its entries or
by half the log's cap (``index_log_maxlen``), whichever comes first: a snapshot the log
no longer reaches is useless. Its cost is Redis memory, about the replica index's own
size (about 1.5 KB per 384-d entry with int8 graphs and their float16 rows), and the worker's memory
for the indexes it keeps; ``snapshot_min_entries = 0`` turns snapshots off, and
``CacheConfig.index_snapshots = False`` makes a replica ignore them. ``clear`` deletes a
tenant's snapshot. The hnswlib backend cannot be snapshotted (it serialises to files).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry

from zerda_cache.manager import CacheManager
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.replica.scoped import ScopedIndex, dump_format
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.driver import run_sync

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SnapshotReport:
    tenant: str
    entries: int
    bytes: int
    seconds: float
    published: bool


class Snapshotter:
    """Keeps and publishes index snapshots of a keyspace's large tenants (the worker's
    ``snapshot`` job). Not thread-safe: one job runs it."""

    def __init__(self, storage: RedisStorage) -> None:
        self.storage = storage
        self.config = storage.config
        self._manager: CacheManager | None = None

    def manager(self) -> CacheManager:
        """The worker's own replica: its indexes are the snapshots' source, their graphs
        built at ``EvictionConfig.snapshot_ef_construction``."""
        if self._manager is None:
            cfg = self.config
            efc = cfg.eviction.snapshot_ef_construction
            if efc is not None:
                cfg = replace(cfg, ann_ef_construction=efc)
            self._manager = CacheManager(
                self.storage.client, cfg, metrics=ReplicaMetrics(CollectorRegistry())
            )
            # Its indexes are dumped, not searched: they are calibrated when dumped
            # (``snapshot_tenant``), not when built.
            self._manager.indexes.calibrating = False
        return self._manager

    def due(self, moved: int | None, entries: int) -> bool:
        """Is a new snapshot due, the log having ``moved`` on since the last one (``None``:
        there is none)?"""
        if moved is None:
            return True
        cap = self.config.index_log_maxlen
        return moved >= max(1, min(entries // 10, cap // 2))

    def snapshot_tenant(self, tenant: str, *, force: bool = False) -> SnapshotReport | None:
        """Bring the tenant's index up to date and publish it if a snapshot is due (or
        ``force``); ``None`` when the tenant is too small or nothing was due."""
        st = self.storage
        entries = st.count(tenant)
        minimum = self.config.eviction.snapshot_min_entries
        if minimum <= 0 or entries < minimum:
            return None
        started = time.perf_counter()
        m = self.manager()
        m.sync_index(tenant)
        ti = m.indexes[tenant]
        info = st.snapshot_info(tenant)
        with ti.lock:  # no catch-up while the index is serialised
            moved = None if info is None else ti.consumed - info.added
            if not force and not self.due(moved, entries):
                return None
            index = ti.index
            if index is not None:
                self._calibrate(tenant, index)
            blob = index.dump() if index is not None else None
            last_id, added, count, dim = ti.last_id, ti.consumed, len(ti), ti.dim
        if blob is None or dim is None:
            return None
        published = st.write_snapshot(
            tenant,
            blob,
            fmt=dump_format(blob),
            last_id=last_id,
            added=added,
            entries=count,
            dim=dim,
        )
        report = SnapshotReport(tenant, count, len(blob), time.perf_counter() - started, published)
        log.info(
            "tenant %s: index snapshot of %d entries (%.1f MB) %s in %.1f s",
            tenant,
            count,
            len(blob) / 1e6,
            "published" if published else "superseded",
            report.seconds,
        )
        return report

    def _calibrate(self, tenant: str, index: ScopedIndex) -> None:
        """Measure the search width of the index about to be dumped, for the replicas
        that load it (``ScopedIndex.calibrate``, at the configuration's ``top_k``): a
        replica of the same ``top_k`` and ``ann_ef_search`` takes it from the snapshot
        instead of measuring it before it serves (~1.5 s at 1M entries). Skipped while
        the index has not changed since it was last measured; a failure only means that
        replicas measure it themselves."""
        try:
            index.fold()  # the graph the dump will hold, measured as a replica will use it
            widths = index.calibrate(self.config.top_k)
        except Exception as exc:
            log.warning(
                "tenant %s: calibrating the snapshot's search width failed (%s: %s): "
                "replicas will measure it themselves",
                tenant,
                type(exc).__name__,
                exc,
            )
            return
        for scope, (width, seconds) in widths.items():
            if seconds is not None:
                log.info(
                    "tenant %s: snapshot search width %d for scope %r (calibrated in %.1f s)",
                    tenant,
                    width,
                    scope,
                    seconds,
                )

    def close(self) -> None:
        """Stop the manager's index builds and wait for them (``replica.STOP_WAIT_S``)
        before the worker closes the client they use; the client is left open."""
        if self._manager is not None:
            run_sync(self._manager.indexes.stop_and_wait())


__all__ = ["SnapshotReport", "Snapshotter"]
