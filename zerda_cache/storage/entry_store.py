"""Storage's operations on entries: the scripts that change them (put, feedback, decay,
evict, invalidate, a tag's upkeep) and the reads of entries, states, vectors and ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Unpack

from zerda_cache.core.config import RLConfig
from zerda_cache.core.entry import FeedbackSignal, IntelligentCacheEntry
from zerda_cache.core.errors import (
    CorruptEntryError,
    EntryNotFoundError,
    InvalidEntryError,
    ZerdaError,
)
from zerda_cache.core.validation import check_tag, validate_entry_id
from zerda_cache.storage import codec
from zerda_cache.storage.codec import text
from zerda_cache.storage.driver import Flow, op
from zerda_cache.storage.executor import StorageCore, scripted
from zerda_cache.storage.plans import (
    FEEDBACK_BATCH,
    DecayOutcome,
    DimensionLost,
    EvictOutcome,
    EvictReason,
    FeedbackOutcome,
    LogInfo,
    PutFields,
    PutOutcome,
    ReadPlan,
    ScriptCall,
    StateArrays,
    StateBatch,
    StoragePlans,
    StoredEntry,
    T,
    group_by_tenant,
    state_arrays_of,
)

log = logging.getLogger(__name__)

#: Entries ``read_entries`` reads per round trip (four commands each).
READ_ENTRIES_BATCH = 200
#: Entries whose vectors vote when a tenant's lost dimension is restored (``dim.lua``).
DIM_SAMPLE = 25
#: Entries of a tag removed per call of the evict script (``invalidate_tag``), and ids of
#: a tag's set checked per call of the sweep script.
TAG_BATCH = 200
IdBatch = list[tuple[str, float]]


class EntryStore(StorageCore):
    """Entries: every write of one is a Lua script; reads batch in one pipeline."""

    def put_flow(
        self,
        tenant: str,
        query: str,
        response: str,
        embedding: object,
        *,
        approves: tuple[str, str] | None = None,
        **fields: Unpack[PutFields],
    ) -> Flow[PutOutcome]:
        """Store a new entry atomically (hash, ids, exact-match map, log, counters).
        ``approves``: ``(entry id, nonce)`` of the dispute a reaction approved, this
        answer the one it recorded: stored only while that entry still carries that
        dispute (``plan_approve``).

        Raises:
            InvalidTenantError, InvalidEmbeddingError, DimensionMismatchError,
            InvalidEntryError: bad input; nothing is written.
            DisputeSettled: with ``approves``, the dispute was settled meanwhile.
            StorageError: Redis failed.
        """

        def plan(given: PutFields) -> ScriptCall[PutOutcome]:
            call = self.plan_put(tenant, query, response, embedding, **given)
            return call if approves is None else self.plan_approve(call, tenant, *approves)

        try:
            out = yield from self.run_flow(plan(fields))
        except DimensionLost as lost:
            # The cfg hash lost the dimension while entries remain: the entries' majority
            # decides it, never this put alone (nor one corrupt entry).
            dim = yield from self.restore_dim_flow(tenant)
            again: PutFields = {**fields, "index_dim": lost.dim if dim is None else dim}
            out = yield from self.run_flow(plan(again))
        if self.needs_registration(tenant):
            yield from self.command_flow("register tenant", "sadd", self.tenants_key, tenant)
            self.registered_tenants.add(tenant)
        return out

    def feedback_flow(
        self, signal: FeedbackSignal, *, rl: RLConfig | None = None
    ) -> Flow[FeedbackOutcome]:
        """Apply one signal atomically; return the entry's new learning state. ``rl``:
        the tenant's bandit parameters (default: the configuration's).

        Raises:
            EntryNotFoundError: no such entry in ``signal.tenant_id``.
            CorruptEntryError: the entry's state does not decode (nothing written).
        """
        (result,) = yield from self.run_flow(self.plan_feedback([signal], rl=rl))
        if isinstance(result, ZerdaError):
            raise result
        return result

    def feedback_many_flow(
        self,
        signals: Sequence[FeedbackSignal],
        *,
        batch: int = FEEDBACK_BATCH,
    ) -> Flow[list[FeedbackOutcome | ZerdaError]]:
        """Apply many signals; one script call per tenant and ``batch`` signals.

        Returns, per signal and in order, the new state or the error for it (unknown
        entry, corrupt state): one bad signal does not stop the others. Each call is
        atomic; signals of different calls are not applied together. Works unchanged on
        Redis Cluster (a call touches one tenant, so one slot). The bandit parameters are
        the configuration's (the manager's feedback applies each tenant's policy).
        """
        out: list[FeedbackOutcome | ZerdaError | None] = [None] * len(signals)
        for positions in group_by_tenant(signals).values():
            for i in range(0, len(positions), batch):
                chunk = positions[i : i + batch]
                sigs = [signals[j] for j in chunk]
                results = yield from self.run_flow(self.plan_feedback(sigs))
                for j, res in zip(chunk, results, strict=True):
                    out[j] = res
        return [r for r in out if r is not None]

    def decay_flow(
        self,
        tenant: str,
        entry_ids: Sequence[str],
        *,
        fence: int | None = None,
        rl: RLConfig | None = None,
        complete: bool = False,
        claim: bool = False,
    ) -> Flow[DecayOutcome]:
        """Bring the arms of ``entry_ids`` to now and persist them (one script call),
        with the tenant's bandit parameters ``rl`` (default: the configuration's).
        ``claim`` with no ids: only write ``fence`` into the tenant's fence (a new
        leader's first step).

        Raises:
            FencedError: ``fence`` (the worker's lease epoch) is older than one that
                already wrote to this tenant; nothing is written.
        """
        if not entry_ids and not complete and not claim:
            return DecayOutcome(0, 0, [])
        plan = self.plan_decay(tenant, entry_ids, fence=fence, rl=rl, complete=complete)
        return (yield from self.run_flow(plan))

    def evict_flow(
        self,
        tenant: str,
        candidates: Sequence[tuple[str, int | None]],
        reason: EvictReason,
        *,
        fence: int | None = None,
    ) -> Flow[EvictOutcome]:
        """Remove ``(entry_id, version)`` pairs from every structure, atomically per batch.

        An entry whose version is no longer ``version`` (it was served or got feedback
        since it was scored) is kept; ``None`` removes it whatever its version.

        Raises:
            FencedError: as for ``decay``.
        """
        plan = self.plan_evict(tenant, candidates, reason, fence=fence)
        if not candidates:
            return EvictOutcome([], [], [])
        return (yield from self.run_flow(plan))

    def invalidate_flow(self, tenant: str, entry_id: str) -> Flow[bool]:
        """Remove one entry now; False if it did not exist."""
        validate_entry_id(entry_id, InvalidEntryError)
        out = yield from self.evict_flow(tenant, [(entry_id, None)], "invalidated")
        return bool(out.removed)

    def invalidate_tag_flow(self, tenant: str, tag: str) -> Flow[int]:
        """Remove every entry put with ``tag`` now, from its set (the tag's index, never a
        scan of the tenant): ``TAG_BATCH`` entries a call of the evict script, each call
        atomic, and the tag's set emptied as they go. Returns the entries removed. An
        entry put with the tag while this runs may stay (it came after the invalidation).
        """
        k = self.keys(tenant)
        key = k.tag(check_tag(tag))
        removed, cursor = 0, None
        while cursor != 0:
            nxt, members = yield from self.command_flow(
                "invalidate tag", "sscan", key, cursor=cursor or 0, count=TAG_BATCH
            )
            cursor = int(nxt)
            ids = list(dict.fromkeys(text(m) for m in members))
            for at in range(0, len(ids), TAG_BATCH):
                chunk = ids[at : at + TAG_BATCH]
                out = yield from self.evict_flow(tenant, [(e, None) for e in chunk], "invalidated")
                removed += len(out.removed)
                yield from self.command_flow("invalidate tag", "srem", key, *chunk)
        yield from self.run_flow(self.plan_tag_sweep(tenant, tag, []))
        return removed

    def sweep_tag_flow(self, tenant: str, tag: str) -> Flow[int]:
        """Drop the ids of removed entries from ``tag``'s set (and the tag once none is
        left): the worker's upkeep of the tags index. Returns the ids dropped."""
        key = self.keys(tenant).tag(tag)
        dropped, cursor = 0, None
        while cursor != 0:
            nxt, members = yield from self.command_flow(
                "sweep tag", "sscan", key, cursor=cursor or 0, count=TAG_BATCH
            )
            cursor = int(nxt)
            ids = [text(m) for m in members]
            dropped += yield from self.run_flow(self.plan_tag_sweep(tenant, tag, ids))
        return dropped

    def export_batch_flow(self, tenant: str, entry_ids: Sequence[str]) -> Flow[list[StoredEntry]]:
        """The stored fields of ``entry_ids`` (``read_export``)."""
        if not entry_ids:
            return []
        return (yield from self.read_flow(self.read_export(tenant, entry_ids)))

    def scan_tags_flow(
        self, tenant: str, cursor: int = 0, batch: int | None = None
    ) -> Flow[tuple[int, list[str]]]:
        """One SSCAN step over the tenant's tag names."""
        nxt, names = yield from self.command_flow(
            "tags", "sscan", self.keys(tenant).tags, cursor=cursor, count=batch or TAG_BATCH
        )
        return int(nxt), [text(n) for n in names]

    def tags_flow(self, tenant: str) -> Flow[dict[str, int]]:
        """The tenant's tags and how many ids each one's set holds (removed entries among
        them until the worker's sweep)."""
        k = self.keys(tenant)
        names = sorted(text(m) for m in (yield from self.command_flow("tags", "smembers", k.tags)))
        if not names:
            return {}

        def queue(pipe: Any) -> None:
            for name in names:
                pipe.scard(k.tag(name))

        counts = yield from self.read_flow(ReadPlan("tags", queue, lambda res: res, len(names)))
        return {name: int(n) for name, n in zip(names, counts, strict=True)}

    def get_entry_flow(
        self, tenant: str, entry_id: str, *, with_vector: bool = True
    ) -> Flow[IntelligentCacheEntry]:
        """Load one whole entry.

        Raises:
            EntryNotFoundError: no such entry in ``tenant``.
            CorruptEntryError: a stored value does not decode.
        """
        return (
            yield from self.read_flow(self.read_entry(tenant, entry_id, with_vector=with_vector))
        )

    def read_entries_flow(
        self, tenant: str, entry_ids: Sequence[str], *, with_vector: bool = True
    ) -> Flow[list[IntelligentCacheEntry | EntryNotFoundError | CorruptEntryError]]:
        """Load many whole entries, ``READ_ENTRIES_BATCH`` a round trip: each one's entry,
        or the error ``get_entry`` would raise for it (not raised here)."""
        out: list[IntelligentCacheEntry | EntryNotFoundError | CorruptEntryError] = []
        ids = list(entry_ids)
        for at in range(0, len(ids), READ_ENTRIES_BATCH):
            plans = [
                _errors_returned(self.read_entry(tenant, eid, with_vector=with_vector))
                for eid in ids[at : at + READ_ENTRIES_BATCH]
            ]
            out += yield from self.read_flow(self.batch("read_entries", plans))
        return out

    def load_states_flow(self, tenant: str, entry_ids: Sequence[str]) -> Flow[StateBatch]:
        """Arms, usage and meta of many entries in one round trip.

        Missing entries (evicted meanwhile) and corrupt ones are listed, not raised.
        """
        if not entry_ids:
            return StateBatch()
        return (yield from self.read_flow(self.read_states(tenant, entry_ids)))

    def state_arrays_flow(
        self,
        tenant: str,
        entry_ids: Sequence[str],
        *,
        rl: RLConfig | None = None,
        check_hashes: bool = False,
    ) -> Flow[StateArrays]:
        """Learning state of many entries as columns (``plan_raw_states``). Without
        ``check_hashes``, one plain HMGET of the state hash, and the script only for the
        entries that have no state there (written by 0.1, their state lost, or gone):
        the plain read costs the server less than the script, which converts every value
        into Lua and back (bench_worker's commandstats show the HMGETs' and the scripts'
        time over a full cycle)."""
        ids = list(entry_ids)
        if not ids:
            return state_arrays_of(ids, [])
        if check_hashes:
            states = yield from self.run_flow(
                self.plan_raw_states(tenant, ids, rl=rl, check_hashes=check_hashes)
            )
        else:
            states = yield from self.command_flow("state", "hmget", self.keys(tenant).st, ids)
            missing = [i for i, raw in enumerate(states) if raw is None]
            if missing:
                found = yield from self.run_flow(
                    self.plan_raw_states(tenant, [ids[i] for i in missing], rl=rl)
                )
                for i, raw in zip(missing, found, strict=True):
                    states[i] = raw
        return state_arrays_of(ids, states)

    def vectors_flow(
        self, tenant: str, entry_ids: Sequence[str], dim: int | None = None
    ) -> Flow[dict[str, tuple[codec.Vector, str]]]:
        """``{id: (vector, scope)}`` of the entries that exist and decode (with ``dim``:
        and hold that many dimensions). The others are reported for the worker."""
        if not entry_ids:
            return {}
        return (yield from self.read_flow(self.read_vectors(tenant, entry_ids, dim)))

    def audit_flow(self, tenant: str, entry_ids: Sequence[str]) -> Flow[list[str]]:
        """The ids among ``entry_ids`` whose content is corrupt (``read_audit``)."""
        if not entry_ids:
            return []
        return (yield from self.read_flow(self.read_audit(tenant, entry_ids)))

    def tenant_dim_flow(self, tenant: str) -> Flow[int | None]:
        """The tenant's embedding dimension, fixed by its first put; when its cfg hash
        lost it while entries remain, restored from their majority (``restore_dim_flow``).
        ``None``: the tenant has no entries (or no majority)."""
        dim = yield from self.read_flow(self.read_dim(tenant))
        if dim is not None:
            return dim
        return (yield from self.restore_dim_flow(tenant))

    def restore_dim_flow(self, tenant: str) -> Flow[int | None]:
        """Restore a lost dimension from a random sample of the tenant's entries."""
        sample = yield from self.command_flow(
            "sample ids", "zrandmember", self.keys(tenant).ids, DIM_SAMPLE
        )
        ids = [text(member) for member in sample or ()]
        dim = yield from self.run_flow(self.plan_restore_dim(tenant, ids))
        if ids:
            log.warning(
                "tenant %s: its embedding dimension was missing from its cfg hash; %s",
                tenant,
                f"restored {dim} from {len(ids)} sampled entries"
                if dim is not None
                else f"{len(ids)} sampled entries hold no majority",
            )
        return dim

    def exact_match_flow(self, tenant: str, query: str, scope: str = "") -> Flow[str | None]:
        """The id the (normalised query, scope) digest points to, if any."""
        return (yield from self.read_flow(self.read_exact(tenant, query, scope)))

    def scan_ids_flow(
        self, tenant: str, cursor: int = 0, batch: int | None = None
    ) -> Flow[tuple[int, IdBatch]]:
        """One ZSCAN step over the live ids: the next cursor (0: done) and a batch of
        ``(entry_id, expires_at)``. An id present for a whole scan is returned at least
        once (never KEYS)."""
        count = batch or self.config.eviction.scan_batch
        nxt, items = yield from self.command_flow(
            "iter_ids", "zscan", self.keys(tenant).ids, cursor=cursor, count=count
        )
        return int(nxt), [(text(member), float(score)) for member, score in items]

    def scan_evidence_flow(
        self, tenant: str, cursor: int = 0, batch: int | None = None
    ) -> Flow[tuple[int, list[str]]]:
        """One SSCAN step over the ids of arms with evidence (the decay job's list)."""
        count = batch or self.config.eviction.scan_batch
        nxt, items = yield from self.command_flow(
            "iter_evidence", "sscan", self.keys(tenant).ev, cursor=cursor, count=count
        )
        return int(nxt), [text(member) for member in items]

    def scan_entry_keys_flow(self, tenant: str, cursor: int = 0) -> Flow[tuple[int, list[str]]]:
        """One SCAN step over the keyspace for the tenant's entry hashes (their ids):
        the way back to entries whose ids zset was lost. It walks every key of the
        server, so the worker runs it only when that zset is gone (``recover_orphans``)."""
        prefix = self.keys(tenant).entry_prefix
        nxt, keys = yield from self.command_flow(
            "scan entries", "scan", cursor=cursor, match=prefix + "*", count=1_000
        )
        return int(nxt), [text(key)[len(prefix) :] for key in keys]

    def scan_all_entry_keys_flow(self, cursor: int = 0) -> Flow[tuple[int, list[tuple[str, str]]]]:
        """One SCAN step over the keyspace for every tenant's entry hashes: ``(tenant,
        entry id)`` pairs (the worker's orphan sweep under an allkeys-* policy)."""
        prefix = self.config.key_prefix + ":{"
        nxt, keys = yield from self.command_flow(
            "scan entries", "scan", cursor=cursor, match=prefix + "*}:e:*", count=1_000
        )
        out = []
        for key in keys:
            tenant, sep, rest = text(key)[len(prefix) :].partition("}:e:")
            if sep:
                out.append((tenant, rest))
        return int(nxt), out

    def adopt_flow(self, tenant: str, entry_ids: Sequence[str]) -> Flow[int]:
        """Take back entries whose hash outlived the ids zset (see ``plan_adopt``)."""
        ids = [eid for eid in entry_ids if _is_entry_id(eid)]
        if not ids:
            return 0
        return int((yield from self.run_flow(self.plan_adopt(tenant, ids))))

    def evidence_count_flow(self, tenant: str) -> Flow[int]:
        """How many arms have evidence (the size of the decay job's list)."""
        return int((yield from self.command_flow("evidence", "scard", self.keys(tenant).ev)))

    def feedback_mark_flow(self, tenant: str) -> Flow[LogInfo]:
        """Where the tenant's feedback stream stands now (``changed_arms`` reads on
        from it)."""
        return (yield from self.stream_info_flow(self.keys(tenant).fb))

    def changed_arms_flow(
        self, tenant: str, mark: LogInfo | None, limit: int
    ) -> Flow[tuple[list[str] | None, LogInfo]]:
        """The ids of the arms that got a signal since ``mark`` (a ``feedback_mark``),
        and the mark to read on from. ``None`` instead of the ids when the stream cannot
        say: no mark, the stream was trimmed past it (more signals than
        ``feedback_log_maxlen`` since) or re-created, or more than ``limit`` signals
        came since (the caller then reads its whole evidence list). Every signal goes
        through the feedback script, which appends it to the stream, so these are all
        the arms that changed other than by the passing of time."""
        now = yield from self.stream_info_flow(self.keys(tenant).fb)
        if mark is None or not now.holds_since(mark.added) or now.added - mark.added > limit:
            return None, now
        fresh = now.added - mark.added
        if fresh == 0:
            return [], now
        items = yield from self.command_flow(
            "feedback stream",
            "xrange",
            self.keys(tenant).fb,
            f"({mark.last_id}",
            now.last_id,
            count=fresh,
        )
        if len(items) != fresh or text(items[-1][0]) != now.last_id:
            return None, now  # trimmed meanwhile, or not the stream the mark was taken of
        ids = dict.fromkeys(text(fields[b"id"]) for _, fields in items if b"id" in fields)
        return list(ids), now

    def expired_ids_flow(self, tenant: str, now: float, limit: int = 10_000) -> Flow[list[str]]:
        """Up to ``limit`` live ids whose expiry is at or before ``now`` (the ids zset is
        scored by expiry, so this is a range read, not a scan)."""
        items = yield from self.command_flow(
            "expired ids",
            "zrangebyscore",
            self.keys(tenant).ids,
            "-inf",
            repr(float(now)),
            start=0,
            num=limit,
        )
        return [text(i) for i in items]

    #: Serve ``entry_id``: count the use and return the entry (arm at now); see
    #: ``StoragePlans.plan_hit`` for the serving bar and the similarity bar.
    hit = op(scripted(StoragePlans.plan_hit))
    put = op(put_flow)
    feedback = op(feedback_flow)
    feedback_many = op(feedback_many_flow)
    decay = op(decay_flow)
    evict = op(evict_flow)
    invalidate = op(invalidate_flow)
    invalidate_tag = op(invalidate_tag_flow)
    sweep_tag = op(sweep_tag_flow)
    tags = op(tags_flow)
    export_batch = op(export_batch_flow)
    scan_tags = op(scan_tags_flow)
    get_entry = op(get_entry_flow)
    read_entries = op(read_entries_flow)
    load_states = op(load_states_flow)
    state_arrays = op(state_arrays_flow)
    vectors = op(vectors_flow)
    scan_ids = op(scan_ids_flow)
    audit = op(audit_flow)
    exact_match = op(exact_match_flow)
    evidence_count = op(evidence_count_flow)
    feedback_mark = op(feedback_mark_flow)
    changed_arms = op(changed_arms_flow)
    scan_evidence = op(scan_evidence_flow)
    expired_ids = op(expired_ids_flow)
    adopt = op(adopt_flow)
    tenant_dim = op(tenant_dim_flow)


def _errors_returned(plan: ReadPlan[T]) -> ReadPlan[T | EntryNotFoundError | CorruptEntryError]:
    """``plan``, whose parse returns an absent or corrupt entry's error instead of raising
    it (one entry of a batch must not fail the others)."""

    def parse(replies: list[Any]) -> T | EntryNotFoundError | CorruptEntryError:
        try:
            return plan.parse(replies)
        except (EntryNotFoundError, CorruptEntryError) as exc:
            return exc

    return ReadPlan(plan.name, plan.queue, parse, plan.size, plan.scripts, plan.tolerant)


def _is_entry_id(value: str) -> bool:
    try:
        validate_entry_id(value)
    except ValueError:
        return False
    return True
