"""What is amiss in a tenant's keys, found and mended by the worker: entries whose content
is corrupt (replicas' reports and the worker's own audit), removed entries' ids left in
tags' sets, and entries whose ids were lost."""

from __future__ import annotations

import logging
from collections.abc import Callable

from zerda_cache.core.errors import CorruptEntryError, EntryNotFoundError, SchemaVersionError
from zerda_cache.storage.store import READ_ENTRIES_BATCH
from zerda_cache.worker.cycle_context import LOGGER, CycleContext

log = logging.getLogger(LOGGER)


class ContentAudit:
    """Owns the corruption a scan of learning states cannot see, and the tag sweep:
    ``reported`` confirms what replicas reported, ``audit`` reads the next ``batch``
    entries whole, ``sweep_tags`` the next ``tag_sweep`` tags (each from where the last
    one stopped)."""

    def __init__(self, context: CycleContext, *, batch: int, tag_sweep: int) -> None:
        self.context = context
        self.batch = batch
        self.tag_sweep = tag_sweep
        #: Where the audit of each tenant's entries stands (a ZSCAN cursor).
        self._audits: dict[str, int] = {}
        #: Where the sweep of each tenant's tags stands (an SSCAN cursor).
        self._tag_sweeps: dict[str, int] = {}

    def reported(self, tenant: str) -> list[str]:
        """The ids replicas reported undecodable that are: each is read whole
        (``read_entries``: doc, vector, meta and state, 200 a round trip) before it is
        planned for eviction.
        A replica of another version can report an entry this one reads (zerda-cache 0.1
        takes an entry whose state is in the state hash for corrupt, during a rolling
        upgrade): its report is dropped, and the entry kept."""
        st = self.context.storage
        confirmed, unfounded = [], []
        suspects = st.suspects(tenant)
        step = READ_ENTRIES_BATCH  # entries held at once: each may be large
        for at in range(0, len(suspects), step):
            chunk = suspects[at : at + step]
            for eid, read in zip(chunk, st.read_entries(tenant, chunk), strict=True):
                # Another version's entry (a schema unknown here) is not corrupt: kept.
                bad = isinstance(read, (CorruptEntryError, EntryNotFoundError))
                if bad and not isinstance(read, SchemaVersionError):
                    confirmed.append(eid)
                else:
                    unfounded.append(eid)
        if unfounded:
            st.forget_suspects(tenant, unfounded)
            log.warning(
                "tenant %s: %d entries reported corrupt read fine here; kept (a replica "
                "of another version?)",
                tenant,
                len(unfounded),
            )
        return confirmed

    def audit(self, tenant: str, known: set[str]) -> list[str]:
        """The ids of the next ``batch`` of the tenant's entries (in ZSCAN order, from
        where the last audit stopped; a small tenant whole) whose content is corrupt
        (``StoragePlans.read_audit``), except those in ``known``."""
        st = self.context.storage
        cursor = self._audits.get(tenant, 0)
        ids: list[str] = []
        while len(ids) < self.batch and not self.context.halted():
            cursor, batch = st.scan_ids(tenant, cursor, min(self.batch, 1_000))
            ids += [eid for eid, _ in batch if eid not in known]
            if cursor == 0:
                break
        self._audits[tenant] = cursor
        bad: list[str] = []
        for at in range(0, len(ids), READ_ENTRIES_BATCH):
            bad += st.audit(tenant, ids[at : at + READ_ENTRIES_BATCH])
        if bad:
            log.warning("tenant %s: the audit found %d corrupt entries", tenant, len(bad))
        return list(dict.fromkeys(bad))  # a ZSCAN may return an id twice

    def sweep_tags(self, tenant: str) -> int:
        """Drop the ids of removed entries from the next ``tag_sweep`` tags' sets of the
        tenant (in SSCAN order of its tags, from where the last sweep stopped), and tags
        left with none: an eviction does not know an entry's tags, so their sets keep
        its id until this sweep (or the tag's invalidation). Returns the ids dropped."""
        st = self.context.storage
        cursor = self._tag_sweeps.get(tenant, 0)
        dropped = swept = 0
        while swept < self.tag_sweep and not self.context.halted():
            cursor, names = st.scan_tags(tenant, cursor, self.tag_sweep)
            for name in names:
                dropped += st.sweep_tag(tenant, name)
            swept += len(names)
            if cursor == 0:
                break
        self._tag_sweeps[tenant] = cursor
        return dropped


class Orphans:
    """Owns taking back entries whose ids were lost (an allkeys-* eviction of the ids
    zset, a DEL): ``recover`` one tenant whose zset is gone, ``sweep`` the keyspace.

    Args:
        context: the cycle's storage and brakes.
        rescan: called with each tenant the sweep took entries back for, whose next
            eviction must be a whole scan.
    """

    def __init__(self, context: CycleContext, *, rescan: Callable[[str], None]) -> None:
        self.context = context
        self.rescan = rescan

    def recover(self, tenant: str) -> int:
        """Take back the tenant's entries if its ids zset was lost while its entry hashes
        remain: the zset is empty but the tenant's stored bytes are not. Only then is the
        keyspace scanned for the tenant's entry hashes; each orphan gets its id, digest
        and index event back (``adopt.lua``). Returns how many were taken back."""
        st = self.context.storage
        count, size = st.size(tenant)
        if count > 0 or size <= 0:
            return 0
        adopted = 0
        for ids in st.iter_entry_keys(tenant):
            adopted += st.adopt(tenant, ids)
            if self.context.halted():
                break
        if adopted:
            log.warning(
                "tenant %s: its ids zset was lost (an allkeys-* maxmemory policy?); "
                "took back %d entries",
                tenant,
                adopted,
            )
        return adopted

    def sweep(self) -> int:
        """Take back every entry whose id is missing from its tenant's ids zset, found by
        one SCAN of the keyspace for all tenants (``adopt.lua`` skips the entries that are
        in their zset), and register the tenants it found. Under an allkeys-* policy
        Redis may evict a tenant's zset and the next puts re-create it, so orphans can
        sit beside a non-empty zset, where ``recover`` does not look (and the registry
        may be evicted too). Returns how many were taken back."""
        st = self.context.storage
        adopted = 0
        seen: set[str] = set()
        for batch in st.iter_all_entry_keys():
            by_tenant: dict[str, list[str]] = {}
            for tenant, eid in batch:
                by_tenant.setdefault(tenant, []).append(eid)
            for tenant, ids in by_tenant.items():
                try:
                    adopted += st.adopt(tenant, ids)
                except ValueError:  # a key of another shape: not a tenant of ours
                    continue
                seen.add(tenant)
            if self.context.halted():
                break
        # The registry may be gone too (another key of the same eviction).
        st.register_tenants(sorted(seen))
        # Redis evicts entries' hashes as well: a whole scan finds the ids and states
        # whose hash went.
        for tenant in seen:
            self.rescan(tenant)
        if adopted:
            log.warning("took back %d entries whose ids were lost (allkeys-* eviction?)", adopted)
        return adopted
