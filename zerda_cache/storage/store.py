"""Redis storage: every command the library sends, written once for both client flavours.

``Storage`` executes the plans of ``plans.py`` as flows (``driver.py``): every method
``x_flow`` is a generator that yields the client calls it needs (other flows compose it
with ``yield from``), and ``x = op(x_flow)`` is its driven form. ``RedisStorage`` runs
them over ``redis.Redis`` / ``RedisCluster``; ``AsyncRedisStorage`` over
``redis.asyncio`` clients. Every change to shared state is one Lua script (put, hit,
feedback, decay, evict); reads are plain commands, batched in pipelines so that a batch
costs one round trip (or inside a script a lookup sends anyway: the hit script reads the
digest and the log's new events). Arm arithmetic uses one clock, the Redis server's
``TIME``, unless a ``clock`` is injected (tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack

import redis
import redis.exceptions

from zerda_cache.apikeys import ApiKey
from zerda_cache.config import CacheConfig, RLConfig
from zerda_cache.entry import FeedbackSignal, IntelligentCacheEntry
from zerda_cache.errors import (
    CorruptEntryError,
    EntryNotFoundError,
    InvalidEntryError,
    InvalidSettingError,
    StorageError,
    ZerdaError,
)
from zerda_cache.settings import POLICY_FIELDS, RESERVED, check_changes
from zerda_cache.storage import codec
from zerda_cache.storage.codec import text
from zerda_cache.storage.driver import AsyncDriven, Flow, SyncDriven, call, op, wrap_errors
from zerda_cache.storage.keys import TenantKeys, api_keys_key, cycles_key, leader_key
from zerda_cache.storage.plans import (
    FEEDBACK_BATCH,
    DecayOutcome,
    DimensionLost,
    EvictOutcome,
    EvictReason,
    FeedbackOutcome,
    LogDelta,
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
from zerda_cache.storage.plans import batch as join_plans
from zerda_cache.storage.scripts import Scripts
from zerda_cache.storage.wire import wire_for
from zerda_cache.validation import check_tag, validate_entry_id, validate_tenant

log = logging.getLogger(__name__)

#: Entries ``read_entries`` reads per round trip (four commands each).
READ_ENTRIES_BATCH = 200
#: Entries whose vectors vote when a tenant's lost dimension is restored (``dim.lua``).
DIM_SAMPLE = 25
#: Entries of a tag removed per call of the evict script (``invalidate_tag``), and ids of
#: a tag's set checked per call of the sweep script.
TAG_BATCH = 200
#: The worker's cycle log keeps about this many records.
CYCLE_LOG_MAXLEN = 1_000
#: An index snapshot is stored in strings of at most this many bytes (Redis caps a
#: string at 512 MB; smaller chunks keep each GET from holding the server long).
SNAPSHOT_CHUNK = 16 * 1024 * 1024
#: Chunks of a snapshot not published within this long are garbage (a worker died).
SNAPSHOT_UNPUBLISHED_TTL_MS = 3_600_000
#: The snapshot formats a replica reads (``fmt`` in the ``snap`` hash: the dump's own,
#: ``index.dump_format``, given by the writer). A replica whose list lacks "5" (binary
#: graphs, ``ann_dtype="b1"``), "4" (int8 graphs of vectors scaled before int8,
#: ``UsearchIndex.quant``) or "3" (int8 graphs with float16 rows beside them) scans
#: instead of loading a snapshot of that format.
SNAPSHOT_FORMATS_READ = ("1", "2", "3", "4", "5")
#: A snapshot chunk is copied into the replica's buffer this many bytes at a time.
_COPY_STEP = 4 * 1024 * 1024


def _advise_huge_pages(buf: Any) -> bool:
    """Ask Linux to back ``buf`` (an anonymous ``mmap``, before it is written) with
    transparent huge pages, where the kernel offers them (``enabled`` set to ``always``
    or ``madvise`` under /sys/kernel/mm/transparent_hugepage; Debian's default is
    ``madvise``). A snapshot's graph is searched in place, one random node after another:
    with 4 KB pages nearly every node visited costs a TLB miss and a page walk, with 2 MB
    pages a few hundred entries cover a million-entry graph. At 1M MiniLM embeddings a
    search takes 0.81x as long as in 4 KB pages (p99 0.85x; bench_hnsw --pages;
    docs/BENCHMARKS.md, "hnsw-minilm-1000k-pages"). False where the advice is not
    available (another OS, a kernel without THP); the memory works the same."""
    import mmap

    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        buf.madvise(advice)
    except OSError:  # EINVAL: a kernel built without transparent huge pages
        return False
    return True


#: Tenant settings that ``set_tenant_settings`` accepts (``dim`` is fixed by the first put).
TENANT_SETTINGS = tuple(POLICY_FIELDS)

IdBatch = list[tuple[str, float]]


S = TypeVar("S", bound="Storage")
P = ParamSpec("P")


def scripted(
    plan: Callable[Concatenate[S, P], ScriptCall[T]],
) -> Callable[Concatenate[S, P], Flow[T]]:
    """The flow that plans one script call with ``plan`` and runs it."""

    def flow(self: S, /, *args: P.args, **kwargs: P.kwargs) -> Flow[T]:
        return (yield from self.run_flow(plan(self, *args, **kwargs)))

    flow.__name__ = plan.__name__.removeprefix("plan")
    flow.__doc__ = plan.__doc__
    return flow


class Storage(StoragePlans):
    """Access to one zerda-cache keyspace; use ``RedisStorage`` or ``AsyncRedisStorage``.

    Args:
        client: a redis-py client with ``decode_responses=False``: ``redis.Redis`` or
            ``RedisCluster`` for ``RedisStorage``, their ``redis.asyncio`` counterparts
            for ``AsyncRedisStorage``.
        config: key prefix, size limits and the bandit parameters the scripts apply.
        clock: returns "now" in unix seconds; default: the Redis server's clock.
    """

    is_async: bool

    def __init__(
        self,
        client: Any,
        config: CacheConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(config, clock=clock)
        self.client = client
        # register_script returns the flavour of the client: sync or asyncio scripts.
        self.scripts = Scripts.register(client)
        self.cluster = is_cluster(client)
        self.wire = wire_for(client)  # how commands reach the server (wire.py)

    # -- executing plans ---------------------------------------------------------------------
    def run_flow(self, plan: ScriptCall[T]) -> Flow[T]:
        """Execute one planned script call: EVALSHA (sent directly where the client
        allows it: ``wire.py``), and on NOSCRIPT (its first use on this server, or after
        SCRIPT FLUSH) the ``Script`` object, which tries EVALSHA once more, loads the
        script and runs it (once per server, so the extra round trip is left in).
        redis-py's ``Script`` call alone would do the same, but it imports two classes at
        every call."""
        script = getattr(self.scripts, plan.script)
        with wrap_errors(plan.script):
            try:
                res = yield call(self.wire.send, script.sha, plan.keys, plan.args)
            except redis.exceptions.NoScriptError:
                res = yield call(script, keys=plan.keys, args=plan.args)
        return plan.parse(res)

    def read_flow(self, plan: ReadPlan[T]) -> Flow[T]:
        """Execute one read plan in a single pipeline round trip (sent directly where
        the client allows it: ``wire.py``)."""
        with wrap_errors(plan.name):
            pipe = self.client.pipeline(transaction=False)
            plan.queue(pipe)
            replies = yield call(self.wire.execute, pipe)
            for pos, script_call in plan.scripts:
                if isinstance(replies[pos], redis.exceptions.NoScriptError):
                    # First use on this server: the Script object loads it and runs it.
                    script = getattr(self.scripts, script_call.script)
                    replies[pos] = yield call(script, keys=script_call.keys, args=script_call.args)
            for pos, reply in enumerate(replies):
                if isinstance(reply, Exception) and pos not in plan.tolerant:
                    raise StorageError(f"{plan.name} failed: {reply}") from reply
        return plan.parse(replies)

    def send_flow(
        self, name: str, parts: Sequence[ReadPlan[Any] | ScriptCall[Any]]
    ) -> Flow[list[Any]]:
        """Several plans in one round trip, their results in order: a lone script call
        as its own EVALSHA (``run_flow``), anything else as one pipeline (``batch``)."""
        if len(parts) == 1 and isinstance(parts[0], ScriptCall):
            return [(yield from self.run_flow(parts[0]))]
        return (yield from self.read_flow(self.batch(name, parts)))

    def batch(
        self, name: str, parts: Sequence[ReadPlan[Any] | ScriptCall[Any]]
    ) -> ReadPlan[list[Any]]:
        """Several plans in one pipeline round trip (see ``plans.batch``)."""
        return join_plans(name, parts, lambda script: getattr(self.scripts, script).sha)

    def command_flow(self, what: str, method: str, *args: Any, **kwargs: Any) -> Flow[Any]:
        """One plain client command."""
        with wrap_errors(what):
            return (yield call(getattr(self.client, method), *args, **kwargs))

    run = op(run_flow)
    read = op(read_flow)

    def now_flow(self) -> Flow[float]:
        """Current time on the storage clock (the server's, unless one was injected)."""
        if self.clock is not None:
            return float(self.clock())
        sec, usec = yield from self.command_flow("TIME", "time")
        return float(sec) + float(usec) / 1_000_000

    now = op(now_flow)

    # -- scripts -----------------------------------------------------------------------------
    def put_flow(
        self, tenant: str, query: str, response: str, embedding: object, **fields: Unpack[PutFields]
    ) -> Flow[PutOutcome]:
        """Store a new entry atomically (hash, ids, exact-match map, log, counters).

        Raises:
            InvalidTenantError, InvalidEmbeddingError, DimensionMismatchError,
            InvalidEntryError: bad input; nothing is written.
            StorageError: Redis failed.
        """
        plan = self.plan_put(tenant, query, response, embedding, **fields)
        try:
            out = yield from self.run_flow(plan)
        except DimensionLost as lost:
            # The cfg hash lost the dimension while entries remain: the entries' majority
            # decides it, never this put alone (nor one corrupt entry).
            dim = yield from self.restore_dim_flow(tenant)
            again: PutFields = {**fields, "index_dim": lost.dim if dim is None else dim}
            out = yield from self.run_flow(
                self.plan_put(tenant, query, response, embedding, **again)
            )
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

    # -- the proxy's shared state (service/coordination.py) ----------------------------------
    def remember_completion_flow(
        self, tenant: str, completion_id: str, value: str, ttl_s: float
    ) -> Flow[None]:
        """Map a completion id the proxy answered with to ``value`` (expires)."""
        key = self.keys(tenant).completion(completion_id)
        yield from self.command_flow("completion id", "set", key, value, ex=max(1, int(ttl_s)))

    def recall_completion_flow(self, tenant: str, completion_id: str) -> Flow[bytes | None]:
        """What a completion id maps to (``None``: unknown or expired)."""
        key = self.keys(tenant).completion(completion_id)
        raw = yield from self.command_flow("completion id", "get", key)
        return None if raw is None else bytes(raw)

    def take_flight_flow(self, tenant: str, digest: str, token: str, ms: int) -> Flow[bool]:
        """Take the lease on the upstream call of request ``digest`` if it is free."""
        key = self.keys(tenant).in_flight(digest)
        taken = yield from self.command_flow("lease", "set", key, token, nx=True, px=ms)
        return bool(taken)

    def read_flight_flow(self, tenant: str, digest: str) -> Flow[bytes | None]:
        """The lease's value: a holder's token, a finished holder's marker, or ``None``."""
        raw = yield from self.command_flow("lease", "get", self.keys(tenant).in_flight(digest))
        return None if raw is None else bytes(raw)

    def renew_flight_flow(self, tenant: str, digest: str, token: str, ms: int) -> Flow[bool]:
        """Extend the lease if it is still ``token``'s (``lua/lease_renew.lua``)."""
        key = self.keys(tenant).in_flight(digest)
        plan = ScriptCall("lease_renew", [key], [token, ms], lambda res: bool(res))
        return (yield from self.run_flow(plan))

    def finish_flight_flow(
        self, tenant: str, digest: str, token: str, marker: str, ms: int
    ) -> Flow[bool]:
        """Replace the lease by ``marker`` for ``ms`` if it is still ``token``'s
        (``lua/lease_finish.lua``)."""
        key = self.keys(tenant).in_flight(digest)
        plan = ScriptCall("lease_finish", [key], [token, marker, ms], lambda res: bool(res))
        return (yield from self.run_flow(plan))

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
    remember_completion = op(remember_completion_flow)
    recall_completion = op(recall_completion_flow)
    take_flight = op(take_flight_flow)
    read_flight = op(read_flight_flow)
    renew_flight = op(renew_flight_flow)
    finish_flight = op(finish_flight_flow)

    # -- reads -------------------------------------------------------------------------------
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

    def stats_flow(self, tenant: str) -> Flow[dict[str, int]]:
        """The tenant's counters plus ``entries`` (live ids)."""
        return (yield from self.read_flow(self.read_stats(tenant)))

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

    def register_tenants_flow(self, tenants: Sequence[str]) -> Flow[None]:
        """Add tenants to the global registry (idempotent): the worker's sweep re-creates
        a registry an allkeys-* policy evicted."""
        if tenants:
            for tenant in tenants:
                validate_tenant(tenant)
            yield from self.command_flow("register tenant", "sadd", self.tenants_key, *tenants)

    def adopt_flow(self, tenant: str, entry_ids: Sequence[str]) -> Flow[int]:
        """Take back entries whose hash outlived the ids zset (see ``plan_adopt``)."""
        ids = [eid for eid in entry_ids if _is_entry_id(eid)]
        if not ids:
            return 0
        return int((yield from self.run_flow(self.plan_adopt(tenant, ids))))

    # -- index snapshots (zerda_cache/snapshot.py) -------------------------------------------
    def snapshot_info_flow(self, tenant: str) -> Flow[SnapshotInfo | None]:
        """The tenant's published index snapshot, or ``None`` (none, or another format)."""
        raw = yield from self.command_flow("snapshot", "hgetall", self.keys(tenant).snap)
        return SnapshotInfo.parse(raw)

    def read_snapshot_flow(self, tenant: str, info: SnapshotInfo) -> Flow[memoryview | None]:
        """The snapshot's bytes, or ``None`` if a chunk is gone (a newer snapshot replaced
        it meanwhile) or they do not match the published size and checksum.

        They are gathered in anonymous memory (``mmap``: its pages are zero until
        written) a few MB at a time, and hashed as they come: no step holds Python's
        GIL for long, where joining a gigabyte of chunks would stall every other thread
        (a lookup) for a large part of a second."""
        import mmap

        k = self.keys(tenant)
        if info.size <= 0:
            return None
        # Private: pages given back with MADV_DONTNEED are freed (see index._release_lead).
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", 0))
        buf = mmap.mmap(-1, info.size, flags=flags)
        _advise_huge_pages(buf)
        view = memoryview(buf)
        digest = _digester()
        at = 0
        for i in range(info.chunks):
            chunk = yield from self.command_flow(
                "snapshot", "get", k.snap_chunk(info.generation, i)
            )
            if chunk is None:
                return None
            if at + len(chunk) > info.size:
                break  # more than was published: the size and checksum below decide
            src = memoryview(chunk)
            for lo in range(0, len(src), _COPY_STEP):  # GIL-holding copies stay short
                part = src[lo : lo + _COPY_STEP]
                view[at : at + len(part)] = part
                digest.update(part)  # hashlib lets go of the GIL for large updates
                at += len(part)
            del src, chunk
        if at != info.size or digest.hexdigest() != info.checksum:
            log.warning("tenant %s: index snapshot %s does not check out", tenant, info.generation)
            return None
        return view

    def write_snapshot_flow(
        self,
        tenant: str,
        blob: bytes,
        *,
        fmt: str,
        last_id: str,
        added: int,
        entries: int,
        dim: int,
    ) -> Flow[bool]:
        """Store ``blob``, an index dump of format ``fmt`` (``index.dump_format``), as
        the tenant's index snapshot at log position ``(last_id, added)``: the chunks
        first (unreferenced, with a TTL), then ``snapshot.lua`` publishes them and
        deletes the previous generation. False if another snapshot was published
        meanwhile (this one's chunks expire)."""
        import secrets

        k = self.keys(tenant)
        old = yield from self.snapshot_info_flow(tenant)
        gen = secrets.token_hex(6)
        n = max(1, -(-len(blob) // SNAPSHOT_CHUNK))
        new_keys = [k.snap_chunk(gen, i) for i in range(n)]
        for i, key in enumerate(new_keys):
            part = blob[i * SNAPSHOT_CHUNK : (i + 1) * SNAPSHOT_CHUNK]
            yield from self.command_flow(
                "snapshot", "set", key, part, px=SNAPSHOT_UNPUBLISHED_TTL_MS
            )
        old_keys = [] if old is None else _chunk_keys(k, old)
        fields = {
            "fmt": fmt,
            "last_id": last_id,
            "added": str(int(added)),
            "entries": str(int(entries)),
            "dim": str(int(dim)),
            "size": str(len(blob)),
            "chunks": str(n),
            "sum": _digest(blob),
            "at": repr(time.time()),
        }
        args: list[Any] = ["commit", "" if old is None else old.generation, gen, n]
        for name, value in fields.items():
            args += [name, value]
        plan = ScriptCall("snapshot", [k.snap, *new_keys, *old_keys], args, lambda r: int(r))
        return bool((yield from self.run_flow(plan)))

    def drop_snapshot_flow(self, tenant: str) -> Flow[None]:
        """Delete the tenant's index snapshot (``clear`` does: its vectors may not fit
        the tenant any more)."""
        k = self.keys(tenant)
        info = yield from self.snapshot_info_flow(tenant)
        chunks = [] if info is None else _chunk_keys(k, info)
        yield from self.run_flow(
            ScriptCall("snapshot", [k.snap, *chunks], ["drop"], lambda r: None)
        )

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

    def size_flow(self, tenant: str) -> Flow[tuple[int, int]]:
        """The tenant's live entries and stored bytes, in one round trip."""
        k = self.keys(tenant)

        def queue(pipe: Any) -> None:
            pipe.zcard(k.ids)
            pipe.hget(k.stats, "bytes")

        def parse(res: list[Any]) -> tuple[int, int]:
            try:
                size = int(res[1] or 0)
            except ValueError:
                size = 0
            return int(res[0]), size

        return (yield from self.read_flow(ReadPlan("size", queue, parse, 2)))

    def evidence_complete_flow(self, tenant: str) -> Flow[bool]:
        """True once a full decay scan has filled the tenant's evidence set (the set is
        then kept by the scripts); False for data written without it, or after the
        settings hash was lost."""
        flag = yield from self.command_flow("evidence", "hget", self.keys(tenant).cfg, "evx")
        return flag is not None

    def count_flow(self, tenant: str) -> Flow[int]:
        """Live entries of ``tenant``."""
        return int((yield from self.command_flow("count", "zcard", self.keys(tenant).ids)))

    def tenants_flow(self) -> Flow[list[str]]:
        """Every tenant that was ever put to or configured (sorted)."""
        members = yield from self.command_flow("tenants", "smembers", self.tenants_key)
        return sorted(text(t) for t in members)

    def tenant_settings_flow(self, tenant: str) -> Flow[dict[str, float]]:
        """The tenant's numeric settings stored in Redis (``policy.POLICY_FIELDS``, by
        their stored names; booleans as 1.0 / 0.0), and ``dim``, fixed by its first put.
        ``tenant_policy`` gives them applied, with their version."""
        raw = yield from self.command_flow("tenant_settings", "hgetall", self.keys(tenant).cfg)
        out: dict[str, float] = {}
        for name, value in raw.items():
            key = text(name)
            if key in RESERVED and key != "dim":
                continue
            try:
                f = POLICY_FIELDS.get(key)
                out[key] = float(f.parse(value) if f is not None else float(value))
            except ValueError:
                log.warning("tenant %s: ignoring bad setting %r=%r", tenant, name, value)
        return out

    def set_tenant_settings_flow(self, /, tenant: str, **settings: float | None) -> Flow[int]:
        """Set (a number) or clear (``None``) settings by keyword: max_entries,
        max_bytes, ttl, max_error_rate, similarity_threshold, top_k, ... (names without a
        dot; ``set_tenant_policy`` takes every name). Returns the new policy version."""
        return (yield from self.set_tenant_policy_flow(tenant, settings))

    def set_tenant_policy_flow(self, tenant: str, changes: Mapping[str, object]) -> Flow[int]:
        """Change a tenant's policy in one step (``settings.lua``): ``changes`` maps
        setting names (``policy.POLICY_FIELDS``: ``similarity_threshold``,
        ``rl.min_reward_to_serve``, ``eviction.reward_weight``, ...) to a value, or to
        ``None`` to fall back to each process's own configuration. Every replica and
        worker applies it within ``policy_refresh_s``. Returns the new version.

        Raises:
            InvalidSettingError: an unknown name or a value the configuration refuses, validated
                with what is stored on top of this storage's configuration; nothing is
                written.
        """
        k = self.keys(tenant)
        if not changes:
            raise InvalidSettingError("no settings to change")
        raw = yield from self.command_flow("tenant_settings", "hgetall", k.cfg)
        stored = {text(n): text(v) for n, v in raw.items()}
        encoded = check_changes(self.config, stored, changes)
        version = yield from self.run_flow(self.plan_settings(tenant, encoded))
        # A full server (noeviction) refuses the SADD, but must take the change itself:
        # lowering max_entries is how an operator makes the worker free memory. A tenant
        # with entries is registered already (each replica re-registers it too).
        registered = yield from self.read_flow(self.register(tenant))
        if isinstance(registered, Exception):
            log.warning("tenant %s: policy changed, not registered: %s", tenant, registered)
        return int(version)

    def reset_tenant_flow(self, tenant: str) -> Flow[None]:
        """Drop a tenant's counters, feedback log, dimension, labelled outcomes and corrupt
        reports (``clear`` calls this once its entries are gone): a tenant re-created with
        another embedding model must not inherit similarity thresholds learned on the old
        one. The index log stays: replicas still need its events."""
        k = self.keys(tenant)
        tags = [text(m) for m in (yield from self.command_flow("tags", "smembers", k.tags))]

        def queue(pipe: Any) -> None:
            pipe.unlink(k.stats, k.fb, k.cal, k.lab, k.seen, k.bad, k.ev, k.tags)
            pipe.hdel(k.cfg, "dim")
            for at in range(0, len(tags), 500):
                pipe.unlink(*(k.tag(t) for t in tags[at : at + 500]))

        size = 2 + (len(tags) + 499) // 500
        yield from self.read_flow(ReadPlan("reset_tenant", queue, _ignore, size))
        yield from self.drop_snapshot_flow(tenant)

    def feedback_log_flow(self, tenant: str, count: int = 100) -> Flow[list[dict[str, str]]]:
        """The most recent feedback signals of ``tenant``, newest first."""
        rows = yield from self.command_flow(
            "feedback_log", "xrevrange", self.keys(tenant).fb, count=count
        )
        return [{text(f): text(v) for f, v in fields.items()} for _, fields in rows]

    def log_info_flow(self, tenant: str) -> Flow[LogInfo]:
        """``XINFO STREAM`` of the tenant's index log (zeros before its first event)."""
        return (yield from self.stream_info_flow(self.keys(tenant).log))

    def stream_info_flow(self, key: str) -> Flow[LogInfo]:
        """``XINFO STREAM`` of one of the tenant's streams (zeros before it exists)."""
        try:
            reply = yield from self.command_flow("xinfo", "xinfo_stream", key)
        except StorageError as exc:
            if "no such key" in str(exc).lower():
                return LogInfo()
            raise
        return LogInfo.parse(reply)

    def read_log_flow(self, tenant: str, after: str) -> Flow[LogDelta]:
        """The tenant's log events after ``after`` (see ``read_log``)."""
        return (yield from self.read_flow(self.read_log(tenant, after)))

    def suspects_flow(self, tenant: str, count: int = 10_000) -> Flow[list[str]]:
        """Up to ``count`` ids replicas reported undecodable in ``tenant`` (read only)."""
        ids = yield from self.command_flow(
            "corrupt ids", "srandmember", self.keys(tenant).bad, count
        )
        return sorted(text(i) for i in ids or ())

    def forget_suspects_flow(self, tenant: str, entry_ids: Sequence[str]) -> Flow[None]:
        """Drop reported ids once they are evicted."""
        if entry_ids:
            yield from self.command_flow("corrupt ids", "srem", self.keys(tenant).bad, *entry_ids)

    def count_misses_flow(self, tenant: str, n: int) -> Flow[None]:
        """Add ``n`` to the tenant's miss counter."""
        yield from self.read_flow(self.count_misses(tenant, n))

    get_entry = op(get_entry_flow)
    read_entries = op(read_entries_flow)
    load_states = op(load_states_flow)
    state_arrays = op(state_arrays_flow)
    vectors = op(vectors_flow)
    scan_ids = op(scan_ids_flow)
    audit = op(audit_flow)
    stats = op(stats_flow)
    exact_match = op(exact_match_flow)
    count = op(count_flow)
    evidence_complete = op(evidence_complete_flow)
    evidence_count = op(evidence_count_flow)
    feedback_mark = op(feedback_mark_flow)
    changed_arms = op(changed_arms_flow)
    scan_evidence = op(scan_evidence_flow)
    expired_ids = op(expired_ids_flow)
    snapshot_info = op(snapshot_info_flow)
    read_snapshot = op(read_snapshot_flow)
    write_snapshot = op(write_snapshot_flow)
    drop_snapshot = op(drop_snapshot_flow)
    adopt = op(adopt_flow)
    register_tenants = op(register_tenants_flow)
    size = op(size_flow)
    tenant_dim = op(tenant_dim_flow)
    tenants = op(tenants_flow)
    tenant_settings = op(tenant_settings_flow)
    set_tenant_settings = op(set_tenant_settings_flow)
    set_tenant_policy = op(set_tenant_policy_flow)
    reset_tenant = op(reset_tenant_flow)
    feedback_log = op(feedback_log_flow)
    log_info = op(log_info_flow)
    suspects = op(suspects_flow)
    forget_suspects = op(forget_suspects_flow)

    # -- the worker's keys -------------------------------------------------------------------
    def record_cycle_flow(self, fields: dict[str, str]) -> Flow[None]:
        """Append a record to the worker's cycle log (capped at ~``CYCLE_LOG_MAXLEN``)."""
        yield from self.command_flow(
            "cycle log",
            "xadd",
            cycles_key(self.config.key_prefix),
            fields,
            maxlen=CYCLE_LOG_MAXLEN,
            approximate=True,
        )

    def recent_cycles_flow(self, count: int = 50) -> Flow[list[dict[str, str]]]:
        """The newest records of the worker's cycle log, newest first."""
        rows = yield from self.command_flow(
            "cycle log", "xrevrange", cycles_key(self.config.key_prefix), count=count
        )
        return [{"id": text(i), **{text(k): text(v) for k, v in f.items()}} for i, f in rows]

    def leader_flow(self) -> Flow[str | None]:
        """Who holds the worker lease now, if anyone."""
        raw = yield from self.command_flow("leader", "get", leader_key(self.config.key_prefix))
        return text(raw) if raw is not None else None

    def eviction_policy_flow(self) -> Flow[str | None]:
        """The server's ``maxmemory-policy`` (``None`` when CONFIG is not allowed)."""
        try:
            reply = yield from self.command_flow("config", "config_get", "maxmemory-policy")
        except StorageError:
            return None
        value = reply.get("maxmemory-policy") or reply.get(b"maxmemory-policy")
        return text(value) if value is not None else None

    def close_flow(self) -> Flow[None]:
        """Close the client (its connection pool), and a Sentinel group's own clients."""
        pool = getattr(self.client, "connection_pool", None)
        sentinels = getattr(getattr(pool, "sentinel_manager", None), "sentinels", ())
        for client in (self.client, *sentinels):
            yield client.aclose if self.is_async else client.close

    eviction_policy = op(eviction_policy_flow)
    record_cycle = op(record_cycle_flow)
    recent_cycles = op(recent_cycles_flow)
    leader = op(leader_flow)

    # -- the HTTP service: API keys and probes -----------------------------------------------
    def add_api_key_flow(self, digest: str, record: ApiKey) -> Flow[bool]:
        """Store a new key's record under its token's digest; False if that digest exists."""
        key = api_keys_key(self.config.key_prefix)
        with wrap_errors("apikey_add"):
            res = yield call(self.scripts.apikey_add, keys=[key], args=[digest, record.encode()])
        return bool(int(res))

    def api_key_flow(self, digest: str) -> Flow[ApiKey | None]:
        """The record of the key whose token has this digest (revoked ones included).

        Raises:
            CorruptEntryError: the stored record does not decode.
        """
        key = api_keys_key(self.config.key_prefix)
        raw = yield from self.command_flow("api key", "hget", key, digest)
        if raw is None:
            return None
        try:
            return ApiKey.decode(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptEntryError(key, f"record of {digest[:12]}: {exc}") from exc

    def api_keys_flow(self) -> Flow[list[ApiKey]]:
        """Every key's record (undecodable ones are logged and skipped), by tenant."""
        key = api_keys_key(self.config.key_prefix)
        raw = yield from self.command_flow("api keys", "hgetall", key)
        out = []
        for digest, value in raw.items():
            try:
                out.append(ApiKey.decode(value))
            except (ValueError, KeyError, TypeError):
                log.warning("%s: skipping an undecodable record %s", key, text(digest)[:12])
        return sorted(out, key=lambda k: (k.tenant, k.created, k.id))

    def revoke_api_keys_flow(
        self, *, key_id: str | None = None, tenant: str | None = None
    ) -> Flow[list[str]]:
        """Revoke one key (by id) or every key of a tenant; returns the ids revoked now."""
        if (key_id is None) == (tenant is None):
            raise ValueError("revoke by key_id or by tenant (exactly one)")
        field, value = ("id", key_id) if key_id is not None else ("tenant", tenant)
        now = yield from self.now_flow()
        key = api_keys_key(self.config.key_prefix)
        with wrap_errors("apikey_revoke"):
            res = yield call(self.scripts.apikey_revoke, keys=[key], args=[field, value, repr(now)])
        return [text(i) for i in res or ()]

    def ping_flow(self) -> Flow[bool]:
        """True when the server answers PING (raises ``StorageError`` when it does not)."""
        return bool((yield from self.command_flow("ping", "ping")))

    add_api_key = op(add_api_key_flow)
    api_key = op(api_key_flow)
    api_keys = op(api_keys_flow)
    revoke_api_keys = op(revoke_api_keys_flow)
    ping = op(ping_flow)


class RedisStorage(SyncDriven, Storage):
    """Typed, synchronous access to one zerda-cache keyspace (see ``Storage``)."""

    def iter_ids(self, tenant: str, batch: int | None = None) -> Iterator[IdBatch]:
        """Batches of ``(entry_id, expires_at)`` of every live id, by ZSCAN."""
        cursor: int | None = None
        while cursor != 0:
            cursor, items = self.drive(self.scan_ids_flow(tenant, cursor or 0, batch))
            if items:
                yield items

    def iter_entry_keys(self, tenant: str) -> Iterator[list[str]]:
        """Batches of the ids of the tenant's entry hashes, by a SCAN of the keyspace."""
        cursor: int | None = None
        while cursor != 0:
            cursor, items = self.drive(self.scan_entry_keys_flow(tenant, cursor or 0))
            if items:
                yield items

    def iter_all_entry_keys(self) -> Iterator[list[tuple[str, str]]]:
        """Batches of ``(tenant, entry id)`` of every entry hash, by a SCAN of the keyspace."""
        cursor: int | None = None
        while cursor != 0:
            cursor, items = self.drive(self.scan_all_entry_keys_flow(cursor or 0))
            if items:
                yield items

    def iter_evidence(self, tenant: str, batch: int | None = None) -> Iterator[list[str]]:
        """Batches of the ids of arms with evidence, by SSCAN (each at least once)."""
        cursor: int | None = None
        while cursor != 0:
            cursor, items = self.drive(self.scan_evidence_flow(tenant, cursor or 0, batch))
            if items:
                yield items

    def close(self) -> None:
        self.drive(self.close_flow())


class AsyncRedisStorage(AsyncDriven, Storage):
    """``RedisStorage`` for ``redis.asyncio`` clients (plain or cluster): the same
    methods, awaited."""

    async def iter_ids(self, tenant: str, batch: int | None = None) -> AsyncIterator[IdBatch]:
        """``RedisStorage.iter_ids``, as an async iterator."""
        cursor: int | None = None
        while cursor != 0:
            cursor, items = await self.drive(self.scan_ids_flow(tenant, cursor or 0, batch))
            if items:
                yield items

    async def iter_entry_keys(self, tenant: str) -> AsyncIterator[list[str]]:
        """``RedisStorage.iter_entry_keys``, as an async iterator."""
        cursor: int | None = None
        while cursor != 0:
            cursor, items = await self.drive(self.scan_entry_keys_flow(tenant, cursor or 0))
            if items:
                yield items

    async def iter_all_entry_keys(self) -> AsyncIterator[list[tuple[str, str]]]:
        """``RedisStorage.iter_all_entry_keys``, as an async iterator."""
        cursor: int | None = None
        while cursor != 0:
            cursor, items = await self.drive(self.scan_all_entry_keys_flow(cursor or 0))
            if items:
                yield items

    async def iter_evidence(
        self, tenant: str, batch: int | None = None
    ) -> AsyncIterator[list[str]]:
        """``RedisStorage.iter_evidence``, as an async iterator."""
        cursor: int | None = None
        while cursor != 0:
            cursor, items = await self.drive(self.scan_evidence_flow(tenant, cursor or 0, batch))
            if items:
                yield items

    async def aclose(self) -> None:
        await self.drive(self.close_flow())


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (sync or asyncio)."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster | AsyncRedisCluster)


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A published index snapshot: its generation, the log position its index is at, and
    what checks its bytes."""

    generation: str
    last_id: str
    added: int
    entries: int
    dim: int
    size: int
    chunks: int
    checksum: str
    created_at: float

    @classmethod
    def parse(cls, raw: Mapping[Any, Any]) -> SnapshotInfo | None:
        f = {text(k): text(v) for k, v in raw.items()}
        if not f or f.get("fmt") not in SNAPSHOT_FORMATS_READ:
            return None
        try:
            return cls(
                generation=f["gen"],
                last_id=f["last_id"],
                added=int(f["added"]),
                entries=int(f["entries"]),
                dim=int(f["dim"]),
                size=int(f["size"]),
                chunks=int(f["chunks"]),
                checksum=f["sum"],
                created_at=float(f["at"]),
            )
        except (KeyError, ValueError):
            return None


def _chunk_keys(k: TenantKeys, info: SnapshotInfo) -> list[str]:
    return [k.snap_chunk(info.generation, i) for i in range(info.chunks)]


def _digester() -> Any:
    """The snapshot checksum's hash, to be fed (``update``) a part at a time."""
    import hashlib

    return hashlib.blake2b(digest_size=16)


def _digest(blob: bytes) -> str:
    digest = _digester()
    digest.update(blob)
    return str(digest.hexdigest())


def _is_entry_id(value: str) -> bool:
    try:
        validate_entry_id(value)
    except ValueError:
        return False
    return True


def _errors_returned(plan: ReadPlan[T]) -> ReadPlan[T | EntryNotFoundError | CorruptEntryError]:
    """``plan``, whose parse returns an absent or corrupt entry's error instead of raising
    it (one entry of a batch must not fail the others)."""

    def parse(replies: list[Any]) -> T | EntryNotFoundError | CorruptEntryError:
        try:
            return plan.parse(replies)
        except (EntryNotFoundError, CorruptEntryError) as exc:
            return exc

    return ReadPlan(plan.name, plan.queue, parse, plan.size, plan.scripts, plan.tolerant)


def _ignore(replies: list[Any]) -> None:
    return None
