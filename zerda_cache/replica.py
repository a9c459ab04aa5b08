"""Keeping a replica's vector index in step with Redis through the tenant's log stream.

Every put and every removal appends an ``add`` or ``del`` event to ``zc:{t}:log`` inside
the same Lua script that changes the entry, so the log is a complete, ordered history.
A replica builds its index once (remember the log's last id, scan every live id, fetch
their vectors, then replay the log from the remembered id: events that raced the scan are
applied twice at worst, and both operations are idempotent) and afterwards applies only
the new events, read in the lookup's own round trip (by its hit script, or in its
pipeline). The
build runs in the background (``CacheEngine._build``): a lookup waits for it at most
``redis_timeout_s`` after it began, and meanwhile the replica serves exact-question
matches (and near matches from the index it had before, on a rebuild).

If the log was trimmed past the replica's position (it fell more than
``index_log_maxlen`` events behind), events are lost and the replica rebuilds. The replica
counts the events it has consumed; ``XINFO STREAM`` says how many were ever added
(``entries-added``) and how many remain (``length``), so events were lost exactly when
``entries-added - length > consumed``. (``max-deleted-entry-id`` would not do: trimming
does not update it.) XINFO is asked only when the event at the position is no longer in
the log, which is rare.

This module does no I/O and knows no Redis command: storage reads the log
(``StoragePlans.read_log``; for lookups ``peek_log``, or the hit script's own peek,
``plan_hit(peek=...)``; ``Storage._log_info``) and the
manager's flows feed what it read to a ``TenantIndex``. Mutation is serialised by the
caller: the manager holds the tenant's flow lock (a ``threading.Lock`` or an
``asyncio.Lock``) around every build and catch-up.
"""

from __future__ import annotations

import logging
from typing import Any

from zerda_cache.index import IndexPolicy, ScopedIndex, Vector
from zerda_cache.storage.driver import Job
from zerda_cache.storage.keys import TenantKeys
from zerda_cache.storage.plans import LogDelta, LogInfo

log = logging.getLogger(__name__)


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
        #: that has not fails open at once: ``CacheEngine._find``).
        self.answered = False
        self.finished_at = 0.0  # monotonic time the last build ended
        self.failures = 0  # builds failed in a row (the retry delay doubles)
        #: A new index is in use and the log since its scan is being replayed into it.
        self.replaying = False
        #: The generation of the index snapshot the index was loaded from (``None``:
        #: scanned), and when the engine last looked for a newer one (``rebase_due``).
        self.snapshot: str | None = None
        self.rebase_checked = 0.0
        #: A rebuild that lookups need not wait for (a move to a newer snapshot,
        #: ``CacheEngine._rebase``): the index in use is whole and still caught up.
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
