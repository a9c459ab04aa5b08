"""Keeping a replica's vector index in step with Redis through the tenant's log stream.

Every put and every removal appends an ``add`` or ``del`` event to ``zc:{t}:log`` inside
the same Lua script that changes the entry, so the log is a complete, ordered history.
A replica builds its index once (remember the log's last id, scan every live id, fetch
their vectors, then replay the log from the remembered id: events that raced the scan are
applied twice at worst, and both operations are idempotent) and afterwards applies only
the new events, read in the lookup's own round trip (by its hit script, or in its
pipeline). The
build runs in the background (``ReplicaIndexes._build``): a lookup waits for it at most
``redis_timeout_s`` after it began, and meanwhile the replica serves exact-question
matches (and near matches from the index it had before, on a rebuild).

If the log was trimmed past the replica's position (it fell more than
``index_log_maxlen`` events behind), events are lost and the replica rebuilds. The replica
counts the events it has consumed; ``XINFO STREAM`` says how many were ever added
(``entries-added``) and how many remain (``length``), so events were lost exactly when
``entries-added - length > consumed``. (``max-deleted-entry-id`` would not do: trimming
does not update it.) XINFO is asked only when the event at the position is no longer in
the log, which is rare.

``TenantIndex`` does no I/O and knows no Redis command: storage reads the log
(``StoragePlans.read_log``; for lookups ``peek_log``, or the hit script's own peek,
``plan_hit(peek=...)``; ``Storage._log_info``) and ``ReplicaIndexes``, the replica's
indexes, feeds what it read to a ``TenantIndex`` in flows that run on the manager's
driver (its builds are background jobs: a thread, or an asyncio task). Mutation is
serialised: every build and catch-up holds the tenant's flow lock (a ``threading.Lock``
or an ``asyncio.Lock``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from zerda_cache.core.config import CacheConfig
from zerda_cache.core.errors import DimensionMismatchError, StorageError
from zerda_cache.core.validation import validate_tenant
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.replica.ann import IndexPolicy
from zerda_cache.replica.exact import Vector
from zerda_cache.replica.scoped import ScopedIndex
from zerda_cache.storage.driver import Flow, Job, Step, locked
from zerda_cache.storage.keys import TenantKeys
from zerda_cache.storage.plans import LogDelta, LogInfo
from zerda_cache.storage.store import Storage

log = logging.getLogger(__name__)

#: Rebuilds ``ReplicaIndexes.sync`` waits for (a trimmed log, a changed dimension) before
#: it gives up.
MAX_REBUILDS = 3
#: Entries an index build reads per round trip (their vectors: ~1.5 kB each at 384-d).
BUILD_BATCH = 2000
#: How often a long index build logs its progress; when a failed one is retried (doubling
#: with each failure in a row); how often one tenant may rebuild; how many times a batch
#: of the scan is read before the build fails; how many builds of a manager run at once.
BUILD_LOG_EVERY_S = 5.0
BUILD_RETRY_S = 1.0
REBUILD_EVERY_S = 5.0
BATCH_ATTEMPTS = 3
BUILD_SLOTS = 2
#: A replica serving a snapshot's graph in place (``UsearchIndex.restore``) moves to a
#: newer snapshot once this share of the vectors changed since (the changes live in a
#: second graph and the removed vectors' memory is held until then); it looks for one at
#: most every ``REBASE_CHECK_S``.
REBASE_DRIFT = 0.1
REBASE_CHECK_S = 60.0
#: How long ``close`` (and the interpreter's exit, for a sync manager never closed) waits
#: for its running index builds to stop at their next step. A build thread still inside
#: the ANN library's C++ code when the interpreter finalizes is ended by pthread_exit,
#: whose unwinding through that code's noexcept frames calls std::terminate: the process
#: aborts (status 134, "terminate called without an active exception").
STOP_WAIT_S = 10.0


class Driver(Protocol):
    """What the index builds need of a manager's driver (``SyncDriven``, ``AsyncDriven``):
    a background job, CPU work off the event loop, a pause, and its locks."""

    is_async: bool

    def spawn(self, flow: Flow[Any], name: str) -> Job: ...
    def offload(self, fn: Callable[..., Any], *args: Any) -> Step: ...
    def pause(self, seconds: float) -> Step: ...
    def lock_factory(self) -> Any: ...
    def semaphore_factory(self, n: int) -> Any: ...


class TenantIndex:
    """One tenant's index on one replica, and its position in the tenant's log.

    Args:
        keys: the tenant's keys.
        policy: when a scope's index becomes HNSW, and its parameters.
        lock: the flow lock that serialises builds and catch-ups of this tenant.
    """

    def __init__(
        self, keys: TenantKeys, policy: IndexPolicy | None = None, lock: Any = None
    ) -> None:
        self.keys = keys
        self.policy = policy if policy is not None else IndexPolicy()
        self.lock = lock
        self.index: ScopedIndex | None = None
        self.last_id = "0-0"
        self.consumed = 0  # log events consumed since the log began
        #: The index is complete and positioned in the log: lookups search it and catch
        #: it up. While False a background build runs (``job``) and lookups search the
        #: previous index, if any, without catching it up.
        self.built = False
        self.job: Job | None = None
        self.build_started = 0.0  # monotonic time the current build started
        self.retry_at = 0.0  # after a failed build: not before this monotonic time
        self.progress = (0, 0)  # the current build: (entries scanned, entries counted)
        #: The current build has had a reply from Redis (a lookup that waited for a build
        #: that has not fails open at once: ``LookupSteps.await_build_flow``).
        self.answered = False
        self.finished_at = 0.0  # monotonic time the last build ended
        self.failures = 0  # builds failed in a row (the retry delay doubles)
        #: A new index is in use and the log since its scan is being replayed into it.
        self.replaying = False
        #: The generation of the index snapshot the index was loaded from (``None``:
        #: scanned), and when this replica last looked for a newer one
        #: (``ReplicaIndexes._rebase``).
        self.snapshot: str | None = None
        self.rebase_checked = 0.0
        #: A rebuild that lookups need not wait for (a move to a newer snapshot,
        #: ``ReplicaIndexes._rebase``): the index in use is whole and still caught up.
        self.rebasing = False
        self.snapshot_seen: str | None = None  # the generation a build last tried
        self.rebase_failed: str | None = None  # a generation that did not load: skipped

    # -- catch-up ------------------------------------------------------------------------
    def trimmed_past(self, info: LogInfo) -> bool:
        """Asked when the event at this replica's position is no longer in the log: were
        events it has not consumed trimmed away, or is the log another one?

        In the log this replica read, every event up to its position is then gone: the
        ``consumed`` it counted exactly, if it lost nothing; more were trimmed if it lost
        events. Fewer trimmed means another log (deleted and re-created: FLUSHALL, an
        empty restart), however many events the new one holds by now: its ids left in
        the index are ghosts, and only a rebuild finds them all.
        """
        return info.added - info.length != self.consumed

    def forget(self, entry_ids: set[str]) -> None:
        """Drop ids that Redis no longer has (the index's remove is idempotent)."""
        index = self.index
        if index is not None:
            for eid in entry_ids:
                index.remove(eid)

    def apply(self, delta: LogDelta, vectors: dict[str, tuple[Vector, str]]) -> bool:
        """Apply a delta (``vectors`` holds the added entries that still exist).

        Returns False if a vector does not fit the index (the tenant was cleared and
        re-created with another dimension): the caller must rebuild.
        """
        for eid in delta.dels:
            if self.index is not None:
                self.index.remove(eid)
        for eid in delta.adds:
            found = vectors.get(eid)
            if found is None:
                continue  # removed again since: its 'del' may be in a later batch
            vec, scope = found
            if self.index is None:
                self.index = ScopedIndex(len(vec), self.policy)
            elif len(vec) != self.index.dim:
                return False
            self.index.add(eid, vec, scope)
        if delta.last_id is not None:
            self.last_id = delta.last_id
        self.consumed += delta.count
        return True

    # -- build ---------------------------------------------------------------------------
    def scanned(
        self, index: ScopedIndex | None, vectors: dict[str, tuple[Vector, str]]
    ) -> ScopedIndex | None:
        """Add one scanned batch to ``index``, a new index being built beside the one in
        use (created at the first vector); returns it."""
        if not vectors:
            return index
        if index is None:
            index = ScopedIndex(len(next(iter(vectors.values()))[0]), self.policy)
        skipped = index.add_many(vectors)
        if skipped:
            log.warning(
                "tenant %s: %d entries have another dimension than the index (%d); skipped",
                self.keys.tenant,
                skipped,
                index.dim,
            )
        return index

    def install(self, index: ScopedIndex | None, info: LogInfo) -> None:
        """Put a newly built index in use, positioned at the log's event ``info`` read
        before its scan began (the caller replays the log from there)."""
        self.index = index
        self.last_id = info.last_id
        self.consumed = info.added
        self.built = True
        self.snapshot = None  # the caller sets it when the index came from one
        self.rebasing = False

    def drop(self) -> None:
        """Forget the index in use (its vectors no longer fit the tenant)."""
        self.index = None
        self.built = False

    # -- queries -------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        """The index in use is whole and followed: lookups search it and catch it up
        (built, or during a move to a newer snapshot)."""
        return self.built or self.rebasing

    @property
    def dim(self) -> int | None:
        index = self.index
        return None if index is None else index.dim

    def search(self, vec: Vector, scope: str, k: int, threshold: float) -> list[tuple[str, float]]:
        index = self.index
        if index is None or index.dim != len(vec):
            return []
        return index.search(vec, scope, k, threshold)

    def ids(self) -> set[str]:
        index = self.index
        return set() if index is None else index.ids()

    def __len__(self) -> int:
        index = self.index
        return 0 if index is None else len(index)


class ReplicaIndexes:
    """One replica's vector indexes, one ``TenantIndex`` per tenant it has looked up:
    their builds in the background (from the worker's snapshot, else a scan), their
    catch-up with each tenant's log, and their readiness. The manager's lookup searches
    them (``of``, ``await_index``, ``catch_up``); nothing else changes them.

    Methods that return a ``Flow`` are steps for the manager's driver: run them with
    ``yield from`` inside a flow, or ``run_sync`` (sync) / the manager's ``drive``.

    Args:
        storage: the manager's storage (its driver's flavour).
        config: the manager's configuration.
        metrics: the replica's metrics (index readiness, builds, rebuilds).
        driver: the manager, for its background jobs, offloading and locks.
        outage: whether Redis is failing as the manager sees it (lookups then do not
            wait for builds: they have their own timeout to spend).
    """

    def __init__(
        self,
        storage: Storage,
        config: CacheConfig,
        metrics: ReplicaMetrics,
        driver: Driver,
        outage: Callable[[], bool],
    ) -> None:
        self.storage = storage
        self.config = config
        self.metrics = metrics
        self.driver = driver
        #: When a scope's index becomes HNSW, and its parameters (``config``'s ``ann_*``).
        self.policy = IndexPolicy(
            ann_threshold=config.ann_threshold,
            backend=config.ann_backend,
            dtype=config.ann_dtype,
            m=config.ann_m,
            ef_construction=config.ann_ef_construction,
            ef_search=config.ann_ef_search,
        )
        self.outage = outage
        self._by_tenant: dict[str, TenantIndex] = {}
        self._jobs_lock = threading.Lock()
        self._jobs: weakref.WeakSet[Job] = weakref.WeakSet()  # to cancel them at close
        self._build_slots = driver.semaphore_factory(BUILD_SLOTS)
        #: No build starts once set (``stop``).
        self.closed = False
        #: Measure the search width of the indexes this replica builds or loads
        #: (``_calibrate``); off for the worker's snapshot source, which never searches.
        self.calibrating = True

    def __getitem__(self, tenant: str) -> TenantIndex:
        """The tenant's index (``KeyError`` before this replica's first lookup of it)."""
        return self._by_tenant[tenant]

    def get(self, tenant: str) -> TenantIndex | None:
        return self._by_tenant.get(tenant)

    def after_fork(self) -> None:
        """In a forked child: the build threads did not survive the fork and their locks
        may be held for good. Fresh locks, and a tenant whose build was running is built
        again on first use."""
        self._jobs_lock = threading.Lock()
        self._jobs = weakref.WeakSet()
        self._build_slots = self.driver.semaphore_factory(BUILD_SLOTS)
        for ti in self._by_tenant.values():
            ti.lock = self.driver.lock_factory()
            if ti.job is not None:  # mid-build (or mid-install): start over
                ti.job = None
                ti.built = False

    # -- keeping the indexes current ---------------------------------------------------------
    def catch_up(self, ti: TenantIndex, delta: LogDelta, position: str) -> Flow[bool]:
        """Apply ``delta`` (read at ``position``) and what follows; True if the index
        changed. The common case (no news) takes no lock."""
        if delta.empty and not (delta.maybe_trimmed or delta.partial) and ti.last_id == position:
            return False
        return (yield from locked(ti.lock, self._catch_up_locked(ti, delta, position)))

    def _catch_up_locked(self, ti: TenantIndex, delta: LogDelta, position: str) -> Flow[bool]:
        if not ti.usable:  # a rebuild began meanwhile: it replays the log itself
            return False
        changed = ti.last_id != position
        if changed or delta.partial:
            # Another thread or task applied events meanwhile, or more happened than a
            # lookup's peek returns: read on from where the index is.
            delta = yield from self.storage.read_log_flow(ti.keys.tenant, ti.last_id)
        return (yield from self._apply_locked(ti, delta)) or changed

    def _apply_locked(self, ti: TenantIndex, delta: LogDelta, paced: bool = False) -> Flow[bool]:
        """Apply ``delta`` and every later event; True if the index changed.

        Starts a background rebuild when the log was trimmed past this replica's
        position (events were lost; lookups go on searching the index as it is) or when a
        new vector does not fit the index (the tenant was cleared and re-created with
        another dimension; the index is dropped).
        """
        st, tenant = self.storage, ti.keys.tenant
        changed = False
        while True:
            if delta.maybe_trimmed and ti.trimmed_past((yield from st.log_info_flow(tenant))):
                reason = "its log was trimmed past this replica's position, or re-created"
                ti.built = False
            elif delta.empty:
                return changed
            else:
                vectors = (
                    (yield from st.vectors_flow(tenant, list(delta.adds))) if delta.adds else {}
                )
                if ti.apply(delta, vectors):
                    changed = True
                    if not delta.more:
                        yield from self._rebase(ti)
                        return True
                    delta = yield from st.read_log_flow(tenant, ti.last_id)
                    continue
                reason = "its embedding dimension changed"
                ti.drop()
            ti.rebasing = False  # a rebuild, not a move: the index in use is not whole
            log.info("tenant %s: %s; rebuilding this replica's index", tenant, reason)
            if paced:
                # Found by a build's own replay: not again before REBUILD_EVERY_S (the
                # new index is searched as it is meanwhile), or a log trimmed faster
                # than a build reads would rebuild back to back.
                ti.retry_at = time.monotonic() + REBUILD_EVERY_S
            self._start_build(ti)
            return True

    def build_wait(self, ti: TenantIndex, near: bool) -> float:
        """How long a lookup waits for ``ti``'s build: ``redis_timeout_s`` at most, none
        for a lookup that matches exactly only (no embedding) or during a move to a
        newer snapshot (the index in use is complete)."""
        return self.config.redis_timeout_s if near and not ti.rebasing else 0.0

    def _rebase(self, ti: TenantIndex) -> Flow[None]:
        """Move to a newer index snapshot once the one served in place has drifted by
        ``REBASE_DRIFT``: a rebuild from it in the background, during which lookups
        search the index in use without waiting (see ``TenantIndex.rebasing``). Only
        when the worker has published a newer one that the log still reaches: a scan
        instead would cost minutes at the sizes snapshots are made for."""
        index, now = ti.index, time.monotonic()
        if (
            ti.snapshot is None
            or index is None
            or now < ti.rebase_checked + REBASE_CHECK_S
            or index.drift() < REBASE_DRIFT
            or not self.config.index_snapshots
        ):
            return
        ti.rebase_checked = now
        st, tenant = self.storage, ti.keys.tenant
        snap = yield from st.snapshot_info_flow(tenant)
        if snap is None or snap.generation in (ti.snapshot, ti.rebase_failed):
            return
        if not (yield from st.log_info_flow(tenant)).holds_since(snap.added):
            return
        log.info(
            "tenant %s: %.0f%% of the index changed since snapshot %s: loading snapshot %s",
            tenant,
            100 * index.drift(),
            ti.snapshot,
            snap.generation,
        )
        ti.built, ti.rebasing = False, True
        self._start_build(ti)

    def _start_build(self, ti: TenantIndex) -> Job | None:
        """The running build of ``ti``, started if none runs (``None``: built already,
        closing, or waiting to retry a failed build)."""
        with self._jobs_lock:  # threads of a sync manager: one build at a time
            if ti.built or self.closed:
                return None
            job = ti.job
            if job is not None and not job.done():
                return job
            now = time.monotonic()
            if now < ti.retry_at:
                return None
            ti.build_started = now
            ti.progress = (0, 0)
            ti.answered = False
            ti.job = job = self.driver.spawn(self._build(ti), f"zerda-index-{ti.keys.tenant}")
            self._jobs.add(job)
            if not ti.rebasing:  # a move to a newer snapshot: the index in use is whole
                self.metrics.index_ready.labels(self.metrics.tenant(ti.keys.tenant)).set(0)
            return job

    def await_index(self, ti: TenantIndex, wait: float | None) -> Flow[None]:
        """Start ``ti``'s build if none runs, then wait for it: until ``wait`` seconds
        after it began (lookups: no lookup waits longer than ``redis_timeout_s``; none
        waits while Redis is failing, since the lookup has its own timeout to spend), or,
        with ``wait=None``, until it is done (``sync_index``)."""
        job = self._start_build(ti)
        if job is None or job.done():
            return
        if wait is None:
            while not job.done():
                yield job.wait(None)
            return
        left = ti.build_started + wait - time.monotonic()
        if left > 0 and not self.outage():
            yield job.wait(left)

    def _build(self, ti: TenantIndex) -> Flow[None]:
        """Build ``ti``'s index from Redis beside the one in use (a background job, at
        most ``BUILD_SLOTS`` of a manager at once), then put it in use and replay the
        log's events since the scan began (events that raced the scan are applied twice
        at worst, and both operations are idempotent)."""
        tenant = ti.keys.tenant
        started = time.monotonic()
        try:
            yield from locked(self._build_slots, self._scan_and_install(ti, started))
        except StorageError as exc:
            self._build_failed(ti, exc)
            raise
        except Exception as exc:  # a bug: logged with its traceback, retried later
            self._build_failed(ti, exc, unexpected=True)
            raise
        finally:
            ti.finished_at = time.monotonic()
            if not self.closed:  # a closed manager's registry may be another's now
                label = self.metrics.tenant(tenant)
                self.metrics.index_ready.labels(label).set(1 if ti.built else 0)
        if ti.built:
            elapsed = ti.finished_at - started
            ti.failures = 0
            self.metrics.index_build_seconds.observe(elapsed)
            slow = elapsed >= BUILD_LOG_EVERY_S or ti.progress[1] >= 10_000
            log.log(
                logging.INFO if slow else logging.DEBUG,
                "tenant %s: index ready, %d entries in %.1f s",
                tenant,
                len(ti),
                elapsed,
            )

    def _build_failed(self, ti: TenantIndex, exc: Exception, *, unexpected: bool = False) -> None:
        """Retry later, later still after each failure in a row (up to a minute)."""
        ti.failures += 1
        delay = min(BUILD_RETRY_S * 2 ** (ti.failures - 1), 60.0)
        ti.retry_at = time.monotonic() + delay
        tenant = ti.keys.tenant
        if unexpected:
            log.exception("tenant %s: index build crashed; retried in %.0f s", tenant, delay)
        else:
            log.warning(
                "tenant %s: index build failed, lookups serve exact matches until it is "
                "retried in %.0f s: %s",
                tenant,
                delay,
                exc,
            )

    def _from_snapshot(self, ti: TenantIndex) -> Flow[bool]:
        """Install the worker's index snapshot of the tenant, if one is published and the
        log still holds every event since its position, and replay the log from there:
        a large tenant's index in the time it takes to read it, not to build it. False
        (scan instead) when there is none, it is stale or it does not check out."""
        st, tenant = self.storage, ti.keys.tenant
        snap = yield from st.snapshot_info_flow(tenant)
        ti.answered = True
        ti.snapshot_seen = None if snap is None else snap.generation
        if snap is None:
            return False
        now = yield from st.log_info_flow(tenant)
        if not now.holds_since(snap.added):
            log.info(
                "tenant %s: index snapshot %s is older than the log (or the log is new): "
                "scanning instead",
                tenant,
                snap.generation,
            )
            return False
        try:
            blob = yield from st.read_snapshot_flow(tenant, snap)
            if blob is None:
                return False
            if self.closed:  # a restore is seconds of C++ at 1M: not past close
                return True
            # CPU work: off the event loop (asyncio)
            index = yield self.driver.offload(ScopedIndex.restore, blob, self.policy)
        except ValueError as exc:
            log.warning("tenant %s: index snapshot %s unusable: %s", tenant, snap.generation, exc)
            return False
        except Exception as exc:  # a snapshot is only a shortcut: scan instead
            if not ti.rebasing and isinstance(exc, StorageError):
                raise  # Redis is failing: the scan would too; the build is retried later
            log.warning(
                "tenant %s: loading the index snapshot failed (%s: %s)",
                tenant,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, StorageError | MemoryError | OSError),
            )
            return False
        ti.progress = (snap.entries, snap.entries)
        yield from self._calibrate(ti, index)
        if self.closed:
            return True  # nothing installed; nothing else to build either
        position = LogInfo(last_id=snap.last_id, added=snap.added, length=0)
        yield from locked(ti.lock, self._install_locked(ti, index, position, snap.generation))
        if ti.built:
            log.info(
                "tenant %s: index loaded from snapshot %s (%d entries, log %d events on)",
                tenant,
                snap.generation,
                len(ti),
                now.added - snap.added,
            )
        return True

    def _resume_locked(self, ti: TenantIndex) -> Flow[None]:
        """Go on with the index in use, from its own log position (a move to a newer
        snapshot that did not happen); lookups catch it up again."""
        ti.rebase_failed = ti.snapshot_seen
        ti.built, ti.rebasing = True, False
        ti.job = None
        return
        yield  # a flow

    def _scan_and_install(self, ti: TenantIndex, started: float) -> Flow[None]:
        st, tenant = self.storage, ti.keys.tenant
        if self.closed:  # closed while this build waited for a slot
            return
        if self.config.index_snapshots and (yield from self._from_snapshot(ti)):
            return
        if ti.rebasing:  # the newer snapshot did not load: keep the index in use
            yield from locked(ti.lock, self._resume_locked(ti))
            return
        info = yield from st.log_info_flow(tenant)
        ti.answered = True
        total = yield from st.count_flow(tenant)
        # The index takes the tenant's dimension (restored from the entries' majority if
        # its cfg hash lost it), never the first vector scanned: entries of another
        # dimension are corrupt, left out and reported for the worker to evict.
        dim = yield from st.tenant_dim_flow(tenant)
        ti.progress = (0, total)
        index: ScopedIndex | None = None
        scanned, told = 0, started
        cursor: int | None = None
        while cursor != 0:
            if self.closed:
                return
            cursor, vectors, n = yield from self._scan_batch(tenant, cursor or 0, dim)
            if vectors:  # the insertion is CPU work: off the event loop (asyncio)
                index = yield self.driver.offload(ti.scanned, index, vectors)
            scanned += n
            ti.progress = (scanned, total)
            if time.monotonic() - told >= BUILD_LOG_EVERY_S:
                told = time.monotonic()
                log.info(
                    "tenant %s: building this replica's index: %d of %d entries, %.0f s",
                    tenant,
                    scanned,
                    total,
                    told - started,
                )
        if index is not None:
            yield from self._calibrate(ti, index)
        if self.closed:
            return
        yield from locked(ti.lock, self._install_locked(ti, index, info))

    def _calibrate(self, ti: TenantIndex, index: ScopedIndex) -> Flow[None]:
        """Measure the search width a newly built index needs on its own vectors, before
        it is in use (``ScopedIndex.calibrate``; CPU work, off the event loop), unless
        the snapshot it was restored from carries the worker's measure of it. A failure
        leaves the size schedule's width: the index is sound without it."""
        if not self.calibrating or self.closed:
            return
        try:
            widths = yield self.driver.offload(index.calibrate, self.config.top_k, self._is_closed)
        except Exception as exc:
            log.warning(
                "tenant %s: calibrating the index's search width failed (%s: %s): "
                "searching at the configured width",
                ti.keys.tenant,
                type(exc).__name__,
                exc,
                exc_info=True,
            )
            return
        for scope, (width, seconds) in widths.items():
            log.info(
                "tenant %s: HNSW search width %d for scope %r (%s)",
                ti.keys.tenant,
                width,
                scope,
                "calibrated by the worker" if seconds is None else f"calibrated in {seconds:.1f} s",
            )

    def _scan_batch(
        self, tenant: str, cursor: int, dim: int | None = None
    ) -> Flow[tuple[int, dict[str, tuple[Vector, str]], int]]:
        """One batch of the build's scan: the next cursor, the vectors, the ids scanned.
        A failed batch is tried again (a build of a million entries reads 500 batches:
        one socket timeout should not throw the rest away)."""
        st = self.storage
        for attempt in range(BATCH_ATTEMPTS):
            try:
                nxt, items = yield from st.scan_ids_flow(tenant, cursor, BUILD_BATCH)
                ids = [e for e, _ in items]
                vectors = (yield from st.vectors_flow(tenant, ids, dim)) if items else {}
                return nxt, vectors, len(items)
            except StorageError:
                if attempt == BATCH_ATTEMPTS - 1:
                    raise
                yield self.driver.pause(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def _install_locked(
        self,
        ti: TenantIndex,
        index: ScopedIndex | None,
        info: LogInfo,
        snapshot: str | None = None,
    ) -> Flow[None]:
        """Put the new index in use and replay the log from the position read before the
        scan (or the position of ``snapshot``, the generation it was loaded from). If
        events the replay needs were trimmed away meanwhile (the log is capped at
        ``index_log_maxlen``), the replay finds out and starts another build."""
        tenant = ti.keys.tenant
        ti.install(index, info)
        ti.snapshot = snapshot
        ti.rebase_checked = time.monotonic()
        ti.job = None  # done: a rebuild the replay finds necessary starts a new job
        self.metrics.index_rebuilds.labels(self.metrics.tenant(tenant)).inc()
        ti.replaying = True  # not "ready" before the events that raced the build are in
        try:
            delta = yield from self.storage.read_log_flow(tenant, ti.last_id)
            yield from self._apply_locked(ti, delta, paced=True)
        finally:
            ti.replaying = False
        if not ti.built:
            log.warning(
                "tenant %s: the log was trimmed during the build; raise index_log_maxlen "
                "(now %d) if this repeats",
                tenant,
                self.config.index_log_maxlen,
            )

    def sync(self, tenant: str) -> Flow[int]:
        """``CacheEngine.sync_index``: build ``tenant``'s index if need be, wait for the
        build however long it takes, then apply the log's news; returns its size."""
        ti = self.of(self.storage.keys(tenant))
        for _ in range(MAX_REBUILDS):
            if self.closed:
                raise StorageError("the cache manager is closed")
            ti.retry_at = 0.0  # asked for explicitly: build now
            job = self._start_build(ti)
            yield from self.await_index(ti, None)
            error = job.error() if job is not None else None
            if error is not None and not ti.built:
                raise error
            yield from locked(ti.lock, self._sync_locked(ti))
            if ti.built:
                return len(ti)
        raise StorageError(f"tenant {tenant}: still changing after {MAX_REBUILDS} rebuilds")

    def refresh(self, ti: TenantIndex) -> Flow[None]:
        """Apply every log event ``ti`` has not seen, now (under its lock): a put's
        near-duplicate check reads the index as Redis has it."""
        yield from locked(ti.lock, self._sync_locked(ti))

    def _sync_locked(self, ti: TenantIndex) -> Flow[None]:
        if ti.usable:
            delta = yield from self.storage.read_log_flow(ti.keys.tenant, ti.last_id)
            yield from self._apply_locked(ti, delta)

    def ready(self, tenant: str) -> bool:
        """Is this replica's index of ``tenant`` built (lookups search all of it)? False
        before its first lookup and while a build runs; ``index_progress`` says how far.
        A move to a newer snapshot (``_rebase``) keeps it True: the index in use is whole."""
        ti = self._by_tenant.get(validate_tenant(tenant))
        return ti is not None and ti.usable and not ti.replaying

    def progress(self, tenant: str) -> tuple[int, int]:
        """The running build of ``tenant``'s index: (entries scanned, entries counted
        when it began); ``(n, n)`` once built."""
        ti = self._by_tenant.get(validate_tenant(tenant))
        if ti is None:
            return (0, 0)
        return (len(ti), len(ti)) if ti.usable else ti.progress

    def ids(self, tenant: str) -> set[str]:
        """The entry ids in this replica's index for ``tenant`` (as of its last sync)."""
        ti = self._by_tenant.get(validate_tenant(tenant))
        return set() if ti is None else ti.ids()

    def stop(self) -> list[Job]:
        """Stop the index builds, and start no more (``close`` does this first; a manager
        whose client belongs to someone else, as the worker's snapshotter's, stops here).
        Returns the jobs that were running."""
        self.closed = True
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()  # a task; a thread stops at its next batch
        return jobs

    def _is_closed(self) -> bool:
        return self.closed

    def stop_and_wait(self) -> Flow[None]:
        """Stop the index builds and wait until they have, up to ``STOP_WAIT_S``: a
        build thread must
        not outlive the interpreter (see ``STOP_WAIT_S``), and a cancelled task runs
        its cleanup (its connection back to the pool) only when the loop runs it,
        before the client closes. An asyncio build's CPU work already in a thread of
        the loop's executor goes on there; the interpreter joins those threads itself."""
        return self.await_stopped(self.stop())

    def await_stopped(self, jobs: list[Job], deadline: float | None = None) -> Flow[None]:
        """Wait for ``jobs``, stopped already, up to ``deadline`` (a ``time.monotonic()``;
        default ``STOP_WAIT_S`` from now)."""
        if deadline is None:
            deadline = time.monotonic() + STOP_WAIT_S
        for job in jobs:
            left = deadline - time.monotonic()
            if not job.done() and left > 0:
                yield job.wait(left)
        running = sum(not job.done() for job in jobs)
        if running:
            log.warning(
                "%d index builds still running %.0f s after close: a process that exits "
                "now may abort",
                running,
                STOP_WAIT_S,
            )

    def of(self, keys: TenantKeys) -> TenantIndex:
        ti = self._by_tenant.get(keys.tenant)
        if ti is None:
            new = TenantIndex(keys, self.policy, lock=self.driver.lock_factory())
            ti = self._by_tenant.setdefault(keys.tenant, new)
        return ti

    @staticmethod
    def check_dim(tenant: str, ti: TenantIndex, vec: Vector | None) -> None:
        if vec is not None and ti.usable and ti.dim is not None and ti.dim != len(vec):
            raise DimensionMismatchError(tenant, ti.dim, len(vec))
