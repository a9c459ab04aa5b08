"""Redis storage: keys, codecs and scripts, and nothing of ranking.

``RedisStorage`` wraps a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client. Every
change to shared state is one Lua script (put, hit, feedback, decay, evict); reads are
plain commands, batched in pipelines so that a batch costs one round trip. Arm arithmetic
uses one clock, the Redis server's ``TIME``, unless a ``clock`` is injected (tests).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgpack
import numpy as np
import redis
import redis.exceptions

from zerda_cache import codec
from zerda_cache.config import CacheConfig
from zerda_cache.entry import (
    DEFAULT_QUALITY,
    DEFAULT_SIMILARITY,
    BanditArm,
    IntelligentCacheEntry,
)
from zerda_cache.errors import (
    CorruptEntryError,
    DimensionMismatchError,
    EntryNotFoundError,
    InvalidEntryError,
    StorageError,
    ZerdaError,
)
from zerda_cache.keys import TenantKeys, new_entry_id, tenant_keys, tenants_key, validate_entry_id
from zerda_cache.policy_learner import FeedbackSignal
from zerda_cache.scripts import Scripts

log = logging.getLogger(__name__)

#: Signals per feedback script call in ``feedback_many`` (bounds the time one call blocks
#: the server: a few milliseconds).
FEEDBACK_BATCH = 200
#: Eviction reasons, as counted in the stats hash (``evicted:<reason>``).
REASONS = ("expired", "low_reward", "capacity", "invalidated", "replaced", "corrupt")


@contextlib.contextmanager
def wrap_errors(what: str) -> Iterator[None]:
    """Turn client errors into ``StorageError`` (the cause stays chained)."""
    try:
        yield
    except ZerdaError:
        raise
    except redis.exceptions.RedisError as exc:
        raise StorageError(f"{what} failed: {exc}") from exc


@dataclass(frozen=True, slots=True)
class PutOutcome:
    entry_id: str
    created_at: float
    #: The entry that the same (query, scope) pointed to before, if any: it is no longer
    #: reachable by exact match and is usually removed with reason "replaced".
    displaced_id: str | None


@dataclass(frozen=True, slots=True)
class HitOutcome:
    """Result of the hit script: ``entry`` (full content, arm at now) when served."""

    status: str  # "served" | "gone" | "expired" | "corrupt" | "unservable" | "below_bar"
    entry: IntelligentCacheEntry | None = None


@dataclass(slots=True)
class StateArrays:
    """The learning state of a batch of entries as columns (the worker's fast path).

    ``ids[i]`` has ``alpha[i]``, ``beta[i]``, ... Entries gone meanwhile are left out;
    undecodable ones are listed in ``corrupt``.
    """

    ids: list[str]
    alpha: np.ndarray
    beta: np.ndarray
    decayed_at: np.ndarray
    usage_count: np.ndarray
    last_access: np.ndarray
    confidence: np.ndarray
    version: np.ndarray
    size: np.ndarray
    corrupt: list[str] = field(default_factory=list)


class FeedbackOutcome:
    """An entry's learning state right after a feedback signal, decoded on first use
    (feedback is a hot path and most callers never look)."""

    __slots__ = ("_arm", "_raw_arm", "_raw_use", "_use", "entry_id")

    def __init__(self, entry_id: str, raw_arm: bytes, raw_use: bytes) -> None:
        self.entry_id = entry_id
        self._raw_arm, self._raw_use = raw_arm, raw_use
        self._arm: BanditArm | None = None
        self._use: codec.Use | None = None

    @property
    def bandit_arm(self) -> BanditArm:
        if self._arm is None:
            self._arm = codec.trusted_arm(self._raw_arm)
        return self._arm

    @property
    def use(self) -> codec.Use:
        if self._use is None:
            self._use = codec.trusted_use(self._raw_use)
        return self._use

    @property
    def expected_reward(self) -> float:
        return self.bandit_arm.expected_reward

    @property
    def confidence_score(self) -> float:
        return self.use.confidence

    @property
    def version(self) -> int:
        return self.use.version

    def __repr__(self) -> str:
        return f"FeedbackOutcome({self.entry_id!r}, {self.bandit_arm!r}, {self.use!r})"


@dataclass(slots=True)
class StateBatch:
    """Learning state of many entries, read in one round trip (no query/response)."""

    entries: dict[str, IntelligentCacheEntry] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DecayOutcome:
    decayed: int
    missing: int
    corrupt: list[str]


@dataclass(frozen=True, slots=True)
class EvictOutcome:
    removed: list[str]
    gone: list[str]
    changed: list[str]


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ScriptCall(Generic[T]):
    """One script invocation, planned without I/O: run it with any client flavour."""

    script: str
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], T]


@dataclass(frozen=True, slots=True)
class ReadPlan(Generic[T]):
    """Plain read commands queued on one pipeline (one round trip), then parsed."""

    name: str
    queue: Callable[[Any], None]
    parse: Callable[[list[Any]], T]


_STATE_FIELDS = ("arm", "use", "meta", "sz")


class StorageOps:
    """Everything about storage that does no I/O: keys, validation, script arguments and
    the parsing of replies. ``RedisStorage`` (sync) and ``AsyncRedisStorage`` (asyncio)
    execute the same plans, so the two flavours cannot drift apart.

    Args:
        client: the redis-py client (sync or asyncio) the subclass executes with.
        config: key prefix, size limits and the bandit parameters the scripts apply.
        clock: returns "now" in unix seconds; default: the Redis server's clock, read
            inside each script (one clock for every replica).
    """

    def __init__(
        self,
        client: Any,
        config: CacheConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.client = client
        # register_script returns the flavour of the client: sync or asyncio scripts.
        self.scripts = Scripts.register(client)
        self.config = config if config is not None else CacheConfig()
        self.clock = clock
        self._keys: dict[str, TenantKeys] = {}
        self._registered_tenants: set[str] = set()
        rl = self.config.rl
        # Script arguments that never change, formatted once (repr round-trips floats).
        self._rl_static = [
            repr(rl.prior_alpha),
            repr(rl.prior_beta),
            repr(rl.usage_decay),
            repr(rl.decay_interval_s),
        ]
        self._feedback_static = [
            repr(rl.positive_feedback_reward),
            repr(rl.negative_feedback_penalty),
            *self._rl_static,
            str(self.config.feedback_log_maxlen),
            repr(rl.similarity_bar_margin),
            repr(rl.near_miss_penalty_share),
            repr(rl.negative_streak_forget),
        ]

    def keys(self, tenant: str) -> TenantKeys:
        """The (validated) keys of ``tenant``."""
        k = self._keys.get(tenant)
        if k is None:
            k = tenant_keys(tenant, self.config.key_prefix)
            if len(self._keys) < 10_000:
                self._keys[tenant] = k
        return k

    @property
    def tenants_key(self) -> str:
        return tenants_key(self.config.key_prefix)

    def _now_arg(self) -> str:
        return "" if self.clock is None else repr(float(self.clock()))

    def _rl_args(self) -> list[str]:
        return self._rl_static

    # -- script plans ----------------------------------------------------------------------
    def plan_put(
        self,
        tenant: str,
        query: str,
        response: str,
        embedding: object,
        *,
        scope: str = "",
        ttl_s: float | None = None,
        quality: float | None = None,
        similarity: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        entry_id: str | None = None,
    ) -> ScriptCall[PutOutcome]:
        k = self.keys(tenant)
        cfg = self.config
        if not isinstance(query, str) or not query.strip():
            raise InvalidEntryError("query must be a non-empty str")
        if len(query) > cfg.max_query_chars:
            raise InvalidEntryError(
                f"query has {len(query)} characters, over max_query_chars={cfg.max_query_chars}"
            )
        if not isinstance(response, str):
            raise InvalidEntryError(f"response must be a str, got {type(response).__name__}")
        size = len(response.encode("utf-8"))
        if size > cfg.max_response_bytes:
            raise InvalidEntryError(
                f"response has {size} bytes, over max_response_bytes={cfg.max_response_bytes}"
            )
        if not isinstance(scope, str) or len(scope) > 256:
            raise InvalidEntryError("scope must be a str of at most 256 characters")
        ttl = ttl_s
        if ttl is not None and (
            isinstance(ttl, bool)
            or not isinstance(ttl, int | float)
            or not math.isfinite(ttl)
            or ttl <= 0
        ):
            raise InvalidEntryError(f"ttl_s must be a finite number > 0, got {ttl!r}")
        q = _unit_score("quality", DEFAULT_QUALITY if quality is None else quality)
        s = _unit_score("similarity", DEFAULT_SIMILARITY if similarity is None else similarity)
        vec = codec.encode_vector(embedding)
        dim = len(vec) // 4
        doc = codec.pack_doc(query, response, metadata, max_metadata_bytes=cfg.max_metadata_bytes)
        eid = new_entry_id() if entry_id is None else validate_entry_id(entry_id)
        args: list[Any] = [
            self._now_arg(),
            eid,
            doc,
            vec,
            dim,
            codec.query_digest(query, scope),
            scope,
            "" if ttl is None else repr(float(ttl)),
            repr(s),
            repr(q),
            repr(cfg.rl.prior_alpha),
            repr(cfg.rl.prior_beta),
            cfg.index_log_maxlen,
            repr(float(cfg.default_ttl_s or 0)),
        ]

        def parse(res: Any) -> PutOutcome:
            code = int(res[0])
            if code == -1:
                raise DimensionMismatchError(tenant, int(res[1]), dim)
            if code == -2:
                raise InvalidEntryError(f"entry id {eid} already exists in tenant {tenant!r}")
            displaced = _s(res[1]) or None
            return PutOutcome(entry_id=eid, created_at=float(res[2]), displaced_id=displaced)

        return ScriptCall("put", [k.entry(eid), k.ids, k.q, k.log, k.stats, k.cfg], args, parse)

    def needs_registration(self, tenant: str) -> bool:
        """True until this process has added ``tenant`` to the global tenant set.

        The set lives in another slot, so it cannot be part of the put script; SADD is
        idempotent and the worker tolerates a tenant without entries.
        """
        return tenant not in self._registered_tenants

    def plan_hit(
        self,
        tenant: str,
        entry_id: str,
        *,
        refresh_ttl: bool = False,
        min_reward: float | None = None,
        similarity: float | None = None,
    ) -> ScriptCall[HitOutcome]:
        """Plan serving ``entry_id``; with ``min_reward`` an arm whose expected reward (at
        now) is below it is not served (status ``unservable``); with ``similarity`` a
        match below the entry's own learned bar is not served (``below_bar``)."""
        k = self.keys(tenant)
        key = k.entry(entry_id)
        args = [
            self._now_arg(),
            entry_id,
            *self._rl_args(),
            "1" if refresh_ttl else "0",
            "" if min_reward is None else repr(float(min_reward)),
            "" if similarity is None else repr(float(similarity)),
        ]

        def parse(res: Any) -> HitOutcome:
            code = int(res[0])
            if code == 0:
                return HitOutcome("gone")
            if code == -1:
                return HitOutcome("expired")
            if code == -3:
                log.warning("corrupt entry %s not served", key)
                return HitOutcome("corrupt")
            if code == -4:
                return HitOutcome("unservable")
            if code == -5:
                return HitOutcome("below_bar")
            try:
                query, response, metadata = codec.unpack_doc(res[3], key=key)
                meta = codec.unpack_meta(res[4], key=key)
            except CorruptEntryError as exc:
                log.warning("corrupt entry not served: %s", exc)
                return HitOutcome("corrupt")
            use = codec.trusted_use(res[2])
            entry = IntelligentCacheEntry(
                entry_id=entry_id,
                tenant=tenant,
                query=query,
                response=response,
                metadata=metadata,
                scope=meta["sc"],
                created_at=meta["ct"],
                ttl_s=meta["ttl"] or None,
                quality_score=use.quality,
                similarity_score=use.similarity,
                usage_count=use.count,
                last_access=use.last_access,
                confidence_score=use.confidence,
                bandit_arm=codec.trusted_arm(res[1]),
                version=use.version,
                similarity_bar=use.similarity_bar,
                min_positive_similarity=use.min_positive_similarity,
                negative_streak=use.negative_streak,
            )
            return HitOutcome("served", entry)

        return ScriptCall("hit", [key, k.ids, k.stats], args, parse)

    def plan_feedback(
        self, signals: Sequence[FeedbackSignal]
    ) -> ScriptCall[list[FeedbackOutcome | ZerdaError]]:
        """Plan one script call applying ``signals`` (all of one tenant), in order.

        The reply holds, per signal, the entry's new learning state or the error for it
        (``EntryNotFoundError``, ``CorruptEntryError``).
        """
        sigs = list(signals)
        tenant = sigs[0].tenant_id
        k = self.keys(tenant)
        keys = [k.stats, k.fb]
        args: list[Any] = [self._now_arg(), *self._feedback_static]
        for sig in sigs:
            if sig.tenant_id != tenant:
                raise ValueError("plan_feedback takes signals of one tenant")
            keys.append(k.entry(sig.entry_id))
            args += [
                sig.entry_id,
                "1" if sig.positive else "0",
                repr(float(sig.magnitude)),
                sig.source,
                repr(float(sig.timestamp)),
                "" if sig.similarity is None else repr(float(sig.similarity)),
            ]

        def parse(res: Any) -> list[FeedbackOutcome | ZerdaError]:
            out: list[FeedbackOutcome | ZerdaError] = []
            for sig, reply in zip(sigs, res, strict=True):
                code = reply[0]
                if code == 1:
                    out.append(FeedbackOutcome(sig.entry_id, reply[1], reply[2]))
                elif code == 0:
                    out.append(EntryNotFoundError(tenant, sig.entry_id))
                else:
                    out.append(
                        CorruptEntryError(
                            k.entry(sig.entry_id), "arm or use does not decode; not applied"
                        )
                    )
            return out

        return ScriptCall("feedback", keys, args, parse)

    def plan_decay(self, tenant: str, entry_ids: Sequence[str]) -> ScriptCall[DecayOutcome]:
        k = self.keys(tenant)
        ids = list(entry_ids)

        def parse(res: Any) -> DecayOutcome:
            decayed, missing, corrupt = res
            bad = [ids[int(i) - 1] for i in corrupt]
            for eid in bad:
                log.warning("decay skipped corrupt entry %s", k.entry(eid))
            return DecayOutcome(int(decayed), int(missing), bad)

        keys = [k.entry(eid) for eid in ids]
        return ScriptCall("decay", keys, [self._now_arg(), *self._rl_args()], parse)

    def plan_evict(
        self, tenant: str, candidates: Sequence[tuple[str, int | None]], reason: str
    ) -> ScriptCall[EvictOutcome]:
        if reason not in REASONS:
            raise ValueError(f"unknown eviction reason {reason!r}; use one of {REASONS}")
        k = self.keys(tenant)
        cands = list(candidates)
        keys = [k.ids, k.q, k.log, k.stats, *(k.entry(eid) for eid, _ in cands)]
        args: list[Any] = [reason, self.config.index_log_maxlen]
        for eid, ver in cands:
            args += [eid, "" if ver is None else str(int(ver))]

        def parse(res: Any) -> EvictOutcome:
            out = EvictOutcome([], [], [])
            for (eid, _), status in zip(cands, res, strict=True):
                {1: out.removed, 0: out.gone, -1: out.changed}[int(status)].append(eid)
            return out

        return ScriptCall("evict", keys, args, parse)

    # -- read plans ----------------------------------------------------------------------------
    def read_entry(
        self, tenant: str, entry_id: str, *, with_vector: bool = True
    ) -> ReadPlan[IntelligentCacheEntry]:
        k = self.keys(tenant)
        key = k.entry(entry_id)
        fields = ("doc", "vec", *_STATE_FIELDS) if with_vector else ("doc", *_STATE_FIELDS)

        def queue(pipe: Any) -> None:
            pipe.hmget(key, fields)
            pipe.zscore(k.ids, entry_id)

        def parse(res: list[Any]) -> IntelligentCacheEntry:
            raw, score = res
            values = dict(zip(fields, raw, strict=True))
            if values["doc"] is None:
                raise EntryNotFoundError(tenant, entry_id)
            entry = _state_entry(tenant, entry_id, key, values, score)
            entry.query, entry.response, entry.metadata = codec.unpack_doc(values["doc"], key=key)
            if with_vector:
                entry.embedding = codec.decode_vector(values["vec"], key=key)
            return entry

        return ReadPlan("get_entry", queue, parse)

    def read_states(self, tenant: str, entry_ids: Sequence[str]) -> ReadPlan[StateBatch]:
        k = self.keys(tenant)
        ids = list(entry_ids)

        def queue(pipe: Any) -> None:
            for eid in ids:
                pipe.hmget(k.entry(eid), _STATE_FIELDS)
            pipe.zmscore(k.ids, ids)

        def parse(res: list[Any]) -> StateBatch:
            out = StateBatch()
            *rows, scores = res
            for eid, raw, score in zip(ids, rows, scores, strict=True):
                if raw[0] is None:
                    out.missing.append(eid)
                    continue
                key = k.entry(eid)
                try:
                    values = dict(zip(_STATE_FIELDS, raw, strict=True))
                    out.entries[eid] = _state_entry(tenant, eid, key, values, score)
                except CorruptEntryError as exc:
                    log.warning("skipping corrupt entry: %s", exc)
                    out.corrupt.append(eid)
            return out

        return ReadPlan("load_states", queue, parse)

    def plan_state_arrays(self, tenant: str, entry_ids: Sequence[str]) -> ScriptCall[StateArrays]:
        """Plan reading ``arm``, ``use`` and ``sz`` of many entries into columns, in one
        command (the read-only ``state`` script)."""
        k = self.keys(tenant)
        ids = list(entry_ids)

        def parse(packed: Any) -> StateArrays:
            values = msgpack.unpackb(packed) if packed else []
            arr = np.asarray(values, dtype=np.float64).reshape(-1, 9)
            ok = arr[:, 0] == 1
            bad = np.flatnonzero(arr[:, 0] == -1).tolist()
            rows = arr[ok]
            return StateArrays(
                ids=[ids[i] for i in np.flatnonzero(ok).tolist()],
                alpha=rows[:, 1],
                beta=rows[:, 2],
                decayed_at=rows[:, 3],
                usage_count=rows[:, 4],
                last_access=rows[:, 5],
                confidence=rows[:, 6],
                version=rows[:, 7].astype(np.int64),
                size=rows[:, 8].astype(np.int64),
                corrupt=[ids[i] for i in bad],
            )

        return ScriptCall("state", [k.entry(eid) for eid in ids], [], parse)

    def read_vectors(
        self, tenant: str, entry_ids: Sequence[str]
    ) -> ReadPlan[dict[str, tuple[codec.Vector, str]]]:
        k = self.keys(tenant)
        ids = list(entry_ids)

        def queue(pipe: Any) -> None:
            for eid in ids:
                pipe.hmget(k.entry(eid), ("vec", "meta"))

        def parse(rows: list[Any]) -> dict[str, tuple[codec.Vector, str]]:
            out: dict[str, tuple[codec.Vector, str]] = {}
            for eid, (vec, meta) in zip(ids, rows, strict=True):
                if vec is None:
                    continue
                key = k.entry(eid)
                try:
                    scope = codec.unpack_meta(meta, key=key)["sc"]
                    out[eid] = (codec.decode_vector(vec, key=key), scope)
                except CorruptEntryError as exc:
                    log.warning("skipping corrupt entry: %s", exc)
            return out

        return ReadPlan("vectors", queue, parse)

    def read_stats(self, tenant: str) -> ReadPlan[dict[str, int]]:
        k = self.keys(tenant)

        def queue(pipe: Any) -> None:
            pipe.hgetall(k.stats)
            pipe.zcard(k.ids)

        def parse(res: list[Any]) -> dict[str, int]:
            raw, n = res
            out = {_s(f): int(v) for f, v in raw.items()}
            out["entries"] = int(n)
            return out

        return ReadPlan("stats", queue, parse)


class RedisStorage(StorageOps):
    """Typed, synchronous access to one zerda-cache keyspace.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster`` with ``decode_responses=False``.
        config: key prefix, size limits and the bandit parameters the scripts apply.
        clock: returns "now" in unix seconds; default: the Redis server's clock.
    """

    def __init__(
        self,
        client: Any,
        config: CacheConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(client, config, clock=clock)

    def run(self, call: ScriptCall[T]) -> T:
        """Execute one planned script call."""
        with wrap_errors(call.script):
            res = getattr(self.scripts, call.script)(keys=call.keys, args=call.args)
        return call.parse(res)

    def read(self, plan: ReadPlan[T]) -> T:
        """Execute one read plan in a single pipeline round trip."""
        with wrap_errors(plan.name):
            pipe = self.client.pipeline(transaction=False)
            plan.queue(pipe)
            res = pipe.execute()
        return plan.parse(res)

    def now(self) -> float:
        """Current time on the storage clock (the server's, unless one was injected)."""
        if self.clock is not None:
            return float(self.clock())
        with wrap_errors("TIME"):
            sec, usec = self.client.time()
        return float(sec) + float(usec) / 1_000_000

    # -- scripts ----------------------------------------------------------------------------
    def put(
        self, tenant: str, query: str, response: str, embedding: object, **kw: Any
    ) -> PutOutcome:
        """Store a new entry atomically (hash, ids, exact-match map, log, counters).

        Keyword arguments: ``scope``, ``ttl_s``, ``quality``, ``similarity``, ``metadata``,
        ``entry_id`` (see ``StorageOps.plan_put``).

        Raises:
            InvalidTenantError, InvalidEmbeddingError, DimensionMismatchError,
            InvalidEntryError: bad input; nothing is written.
            StorageError: Redis failed.
        """
        out = self.run(self.plan_put(tenant, query, response, embedding, **kw))
        if self.needs_registration(tenant):
            with wrap_errors("register tenant"):
                self.client.sadd(self.tenants_key, tenant)
            self._registered_tenants.add(tenant)
        return out

    def hit(
        self,
        tenant: str,
        entry_id: str,
        *,
        refresh_ttl: bool = False,
        min_reward: float | None = None,
        similarity: float | None = None,
    ) -> HitOutcome:
        """Serve ``entry_id``: count the use and return the entry (arm at now)."""
        return self.run(
            self.plan_hit(
                tenant,
                entry_id,
                refresh_ttl=refresh_ttl,
                min_reward=min_reward,
                similarity=similarity,
            )
        )

    def feedback(self, signal: FeedbackSignal) -> FeedbackOutcome:
        """Apply one signal atomically; return the entry's new learning state.

        Raises:
            EntryNotFoundError: no such entry in ``signal.tenant_id``.
            CorruptEntryError: the entry's state does not decode (nothing written).
        """
        (result,) = self.run(self.plan_feedback([signal]))
        if isinstance(result, ZerdaError):
            raise result
        return result

    def feedback_many(
        self, signals: Sequence[FeedbackSignal], *, batch: int = FEEDBACK_BATCH
    ) -> list[FeedbackOutcome | ZerdaError]:
        """Apply many signals; one script call per tenant and ``batch`` signals.

        Returns, per signal and in order, the new state or the error for it (unknown
        entry, corrupt state): one bad signal does not stop the others. Each call is
        atomic; signals of different calls are not applied together. Works unchanged on
        Redis Cluster (a call touches one tenant, so one slot).
        """
        out: list[FeedbackOutcome | ZerdaError | None] = [None] * len(signals)
        for tenant_positions in _group_by_tenant(signals).values():
            for i in range(0, len(tenant_positions), batch):
                chunk = tenant_positions[i : i + batch]
                results = self.run(self.plan_feedback([signals[j] for j in chunk]))
                for j, res in zip(chunk, results, strict=True):
                    out[j] = res
        return [r for r in out if r is not None]

    def decay(self, tenant: str, entry_ids: Sequence[str]) -> DecayOutcome:
        """Bring the arms of ``entry_ids`` to now and persist them (one script call)."""
        if not entry_ids:
            return DecayOutcome(0, 0, [])
        return self.run(self.plan_decay(tenant, entry_ids))

    def evict(
        self, tenant: str, candidates: Sequence[tuple[str, int | None]], reason: str
    ) -> EvictOutcome:
        """Remove ``(entry_id, version)`` pairs from every structure, atomically per batch.

        An entry whose version is no longer ``version`` (it was served or got feedback
        since it was scored) is kept; ``None`` removes it whatever its version.
        """
        call = self.plan_evict(tenant, candidates, reason)
        if not candidates:
            return EvictOutcome([], [], [])
        return self.run(call)

    def invalidate(self, tenant: str, entry_id: str) -> bool:
        """Remove one entry now; False if it did not exist."""
        return bool(self.evict(tenant, [(entry_id, None)], "invalidated").removed)

    # -- reads ------------------------------------------------------------------------------
    def get_entry(
        self, tenant: str, entry_id: str, *, with_vector: bool = True
    ) -> IntelligentCacheEntry:
        """Load one whole entry.

        Raises:
            EntryNotFoundError: no such entry in ``tenant``.
            CorruptEntryError: a stored value does not decode.
        """
        return self.read(self.read_entry(tenant, entry_id, with_vector=with_vector))

    def load_states(self, tenant: str, entry_ids: Sequence[str]) -> StateBatch:
        """Arms, usage and meta of many entries in one round trip.

        Missing entries (evicted meanwhile) and corrupt ones are listed, not raised.
        """
        if not entry_ids:
            return StateBatch()
        return self.read(self.read_states(tenant, entry_ids))

    def state_arrays(self, tenant: str, entry_ids: Sequence[str]) -> StateArrays:
        """Learning state of many entries as columns, in one command."""
        if not entry_ids:
            return self.plan_state_arrays(tenant, []).parse(None)
        return self.run(self.plan_state_arrays(tenant, entry_ids))

    def vectors(self, tenant: str, entry_ids: Sequence[str]) -> dict[str, tuple[codec.Vector, str]]:
        """``{id: (vector, scope)}`` of the entries that exist and decode."""
        if not entry_ids:
            return {}
        return self.read(self.read_vectors(tenant, entry_ids))

    def stats(self, tenant: str) -> dict[str, int]:
        """The tenant's counters plus ``entries`` (live ids)."""
        return self.read(self.read_stats(tenant))

    def exact_match(self, tenant: str, query: str, scope: str = "") -> str | None:
        """The id the (normalised query, scope) digest points to, if any."""
        k = self.keys(tenant)
        with wrap_errors("exact_match"):
            found = self.client.hget(k.q, codec.query_digest(query, scope))
        return _s(found) if found is not None else None

    def iter_ids(self, tenant: str, batch: int | None = None) -> Iterator[list[tuple[str, float]]]:
        """Batches of ``(entry_id, expires_at)`` of every live id, by ZSCAN (never KEYS).

        An id present for the whole scan is returned at least once.
        """
        k = self.keys(tenant)
        count = batch or self.config.eviction.scan_batch
        cursor = 0
        while True:
            with wrap_errors("iter_ids"):
                cursor, items = self.client.zscan(k.ids, cursor=cursor, count=count)
            if items:
                yield [(_s(member), float(score)) for member, score in items]
            if int(cursor) == 0:
                return

    def count(self, tenant: str) -> int:
        with wrap_errors("count"):
            return int(self.client.zcard(self.keys(tenant).ids))

    def tenant_dim(self, tenant: str) -> int | None:
        with wrap_errors("tenant_dim"):
            raw = self.client.hget(self.keys(tenant).cfg, "dim")
        return int(raw) if raw is not None else None

    def tenants(self) -> list[str]:
        with wrap_errors("tenants"):
            return sorted(_s(t) for t in self.client.smembers(self.tenants_key))

    def tenant_settings(self, tenant: str) -> dict[str, float]:
        """Per-tenant overrides stored in Redis: ``max_entries``, ``max_bytes``, ``ttl``
        (and ``dim``, fixed by the first put)."""
        with wrap_errors("tenant_settings"):
            raw = self.client.hgetall(self.keys(tenant).cfg)
        out: dict[str, float] = {}
        for field_, value in raw.items():
            try:
                out[_s(field_)] = float(value)
            except ValueError:
                log.warning("tenant %s: ignoring bad setting %r=%r", tenant, field_, value)
        return out

    def set_tenant_settings(self, tenant: str, **settings: float | None) -> None:
        """Set (a number) or clear (``None``) overrides: max_entries, max_bytes, ttl."""
        allowed = {"max_entries", "max_bytes", "ttl"}
        unknown = set(settings) - allowed
        if unknown:
            raise ValueError(f"unknown tenant settings {sorted(unknown)}; use {sorted(allowed)}")
        k = self.keys(tenant)
        for name, value in settings.items():
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
        with wrap_errors("set_tenant_settings"):
            pipe = self.client.pipeline(transaction=False)
            for name, value in settings.items():
                if value is None:
                    pipe.hdel(k.cfg, name)
                else:
                    pipe.hset(k.cfg, name, repr(value))
            pipe.sadd(self.tenants_key, tenant)
            pipe.execute()

    def reset_tenant(self, tenant: str) -> None:
        """Drop a tenant's counters, feedback log and dimension (``clear`` calls this once
        its entries are gone). The index log stays: replicas still need its events."""
        k = self.keys(tenant)
        with wrap_errors("reset_tenant"):
            pipe = self.client.pipeline(transaction=False)
            pipe.unlink(k.stats, k.fb)
            pipe.hdel(k.cfg, "dim")
            pipe.execute()

    def feedback_log(self, tenant: str, count: int = 100) -> list[dict[str, str]]:
        """The most recent feedback signals of ``tenant``, newest first."""
        with wrap_errors("feedback_log"):
            rows = self.client.xrevrange(self.keys(tenant).fb, count=count)
        return [{_s(f): _s(v) for f, v in fields.items()} for _, fields in rows]


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (sync or asyncio)."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster | AsyncRedisCluster)


def _group_by_tenant(signals: Sequence[FeedbackSignal]) -> dict[str, list[int]]:
    """Positions of ``signals`` grouped by tenant, in order."""
    groups: dict[str, list[int]] = {}
    for i, sig in enumerate(signals):
        groups.setdefault(sig.tenant_id, []).append(i)
    return groups


def _s(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _unit_score(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise InvalidEntryError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _state_entry(
    tenant: str, entry_id: str, key: str, values: Mapping[str, Any], score: float | None
) -> IntelligentCacheEntry:
    meta = codec.unpack_meta(values["meta"], key=key)
    use = codec.unpack_use(values["use"], key=key)
    try:
        size = int(values["sz"])
    except (TypeError, ValueError) as exc:
        raise CorruptEntryError(key, "sz is not an integer") from exc
    return IntelligentCacheEntry(
        entry_id=entry_id,
        tenant=tenant,
        query="",
        response="",
        scope=meta["sc"],
        created_at=meta["ct"],
        ttl_s=meta["ttl"] or None,
        expires_at=float(score) if score is not None else -math.inf,
        quality_score=use.quality,
        similarity_score=use.similarity,
        usage_count=use.count,
        last_access=use.last_access,
        confidence_score=use.confidence,
        bandit_arm=codec.unpack_arm(values["arm"], key=key),
        version=use.version,
        size_bytes=size,
        similarity_bar=use.similarity_bar,
        min_positive_similarity=use.min_positive_similarity,
        negative_streak=use.negative_streak,
    )
