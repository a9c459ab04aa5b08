"""``CacheManager``: the facade app developers use in every replica.

``lookup`` before calling the LLM, ``put`` after it, ``feedback`` when the user reacts.
The manager composes the pieces and owns none of their logic: storage (keys, codecs,
scripts), the learner (bandit math), the replica index (log sync) and the metrics.

A lookup with a single candidate costs one round trip: one pipeline reads the log's new
events and the exact-match digest and runs the hit script on the candidate. With several
candidates it reads their learning state instead, ranks them, then runs the hit script
(two round trips; always two on Redis Cluster, whose pipelines cannot carry scripts).
Only when the log had news (a put or a removal by another replica) does it read the new
vectors and the new candidates' state. On that single-candidate path an exact-match entry
that the replica's index has not caught up with yet is not considered: the candidate the
index found is served (the next lookup sees both).

``AsyncCacheManager`` (``zerda_cache/aio.py``) has the same methods as coroutines and
shares everything here except the I/O.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis
import redis.exceptions

from zerda_cache import codec
from zerda_cache.codec import Vector
from zerda_cache.config import CacheConfig
from zerda_cache.context import (
    AdaptiveLearningSystem,
    ContextCache,
    ContextEngineConfig,
    ContextGuard,
    GuardConfig,
    QueryAnalysis,
    QueryComplexity,
)
from zerda_cache.entry import IntelligentCacheEntry
from zerda_cache.errors import (
    DimensionMismatchError,
    InvalidEmbeddingError,
    InvalidEntryError,
    StorageError,
)
from zerda_cache.index import IndexPolicy
from zerda_cache.keys import TenantKeys, validate_tenant
from zerda_cache.metrics import ReplicaMetrics, default_replica_metrics
from zerda_cache.policy_learner import CachePolicyLearner, FeedbackSignal
from zerda_cache.replica import LogDelta, TenantIndex
from zerda_cache.storage import (
    HitOutcome,
    PutOutcome,
    RedisStorage,
    StateBatch,
    StorageOps,
    is_cluster,
    wrap_errors,
)

log = logging.getLogger(__name__)

EmbedFn = Callable[[str], Any]

#: How often the manager re-reads the server's clock for its local estimate.
_CLOCK_RESYNC_S = 60.0


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A served answer.

    Attributes:
        entry_id: the entry to send feedback about.
        response: the cached answer.
        query: the cached question that matched.
        similarity: cosine similarity of the two questions (1.0 for an exact match).
        score: the composite ranking score (similarity, Thompson draw, confidence).
        expected_reward: the arm's posterior mean when it was served.
        confidence: the entry's composite confidence.
        exact: matched by the normalised-question digest rather than by vector search.
    """

    entry_id: str
    tenant: str
    response: str
    query: str
    similarity: float
    score: float
    expected_reward: float
    confidence: float
    metadata: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    exact: bool = False

    def feedback(
        self, positive: bool, *, magnitude: float = 1.0, source: str = "user"
    ) -> FeedbackSignal:
        """A ``FeedbackSignal`` about this hit, ready for ``CacheManager.feedback``."""
        return FeedbackSignal(
            entry_id=self.entry_id,
            tenant_id=self.tenant,
            positive=positive,
            magnitude=magnitude,
            source=source,
            similarity=min(1.0, max(-1.0, self.similarity)),
        )


@dataclass(frozen=True, slots=True)
class PutResult:
    """What ``put`` did. ``bool(result)`` is ``stored``.

    Attributes:
        stored: the answer is now cached.
        entry_id: its id when stored.
        reason: why it was not stored (the admission check's verdict).
        warnings: the admission check's warnings, stored or not.
        replaced_id: an entry this one replaced (same question, or a near-duplicate when
            ``dedup_threshold`` is set).
        tenant: the tenant it was put for.
    """

    stored: bool
    entry_id: str | None = None
    reason: str | None = None
    warnings: tuple[str, ...] = ()
    replaced_id: str | None = None
    tenant: str = ""

    def __bool__(self) -> bool:
        return self.stored

    def feedback(
        self, positive: bool, *, magnitude: float = 1.0, source: str = "user"
    ) -> FeedbackSignal:
        """A ``FeedbackSignal`` about the answer just cached, ready for
        ``CacheManager.feedback``: the user's reaction to the fresh answer judges it
        before it is ever served from the cache. It is about the entry's own question,
        so it carries similarity 1.0 (it never moves the entry's similarity bar).

        Raises:
            ValueError: nothing was stored.
        """
        if not self.stored or self.entry_id is None:
            raise ValueError(f"nothing was stored ({self.reason}): no entry to give feedback on")
        return FeedbackSignal(
            entry_id=self.entry_id,
            tenant_id=self.tenant,
            positive=positive,
            magnitude=magnitude,
            source=source,
            similarity=1.0,
        )


class AdmissionCheck(Protocol):
    """Decides whether an answer may enter the cache: ``(passed, warnings)``.

    A failed check means the answer is not cached; the first warning is the reason.
    """

    def __call__(
        self, query: str, response: str, metadata: Mapping[str, Any]
    ) -> tuple[bool, list[str]]: ...


def basic_admission(
    query: str, response: str, metadata: Mapping[str, Any]
) -> tuple[bool, list[str]]:
    """The simplest check: refuse an empty (or whitespace-only) answer."""
    if not response.strip():
        return False, ["empty response"]
    return True, []


def default_admission(config: CacheConfig, embed_fn: EmbedFn | None) -> AdmissionCheck:
    """The seed's ``ContextGuard`` as the admission check of ``put``: the answer about to
    be cached is the context it validates (empty, too short, too long; the relevance of
    answer to question when ``check_relevance`` is turned on, with the manager's
    ``embed_fn``). A failed guard means the answer is not cached.

    For a cache, the guard's RAG-oriented defaults are loosened: any non-empty answer
    is long enough, source markers are not required, and relevance checking is off
    (turn it on with your own ``ContextGuard(..., embed_fn=...)``: question-answer
    similarity depends on the embedding model).
    """
    guard_config = GuardConfig(
        min_context_length=1,
        max_context_length=config.max_response_bytes,
        check_source_coverage=False,
        check_relevance=False,
    )
    return ContextGuard(ContextEngineConfig(guard=guard_config), embed_fn=embed_fn).as_admission()


class _ManagerCore:
    """State and pure logic shared by the sync and asyncio managers."""

    storage: StorageOps

    def __init__(
        self,
        storage: StorageOps,
        *,
        embed_fn: EmbedFn | None,
        admission: AdmissionCheck | None,
        learner: CachePolicyLearner | None,
        metrics: ReplicaMetrics | None,
    ) -> None:
        self.config: CacheConfig = storage.config
        self.embed_fn = embed_fn
        self.admission: AdmissionCheck = (
            admission if admission is not None else default_admission(self.config, embed_fn)
        )
        self.learner = (
            learner
            if learner is not None
            else CachePolicyLearner(self.config.rl, self.config.eviction)
        )
        self.metrics = metrics if metrics is not None else default_replica_metrics()
        #: The replica's rolling windows (seed: AdaptiveLearningSystem): lookup latency,
        #: answer length, candidates, admission failures; exported as replica metrics.
        self.adaptive = AdaptiveLearningSystem(ContextEngineConfig())
        self.metrics.watch(self.adaptive)
        self.embeddings = ContextCache(
            max_size=self.config.embedding_cache_size,
            ttl_seconds=self.config.embedding_cache_ttl_s,
        )
        self._indexes: dict[str, TenantIndex] = {}
        self._outage_since: float | None = None
        # Misses are counted in Redis by the tenant's next lookup pipeline (no round trip
        # of their own); at most one is pending per tenant, and stats() flushes it.
        self._pending_misses: dict[str, int] = {}
        cfg = self.config
        self._index_policy = IndexPolicy(
            ann_threshold=cfg.ann_threshold,
            backend=cfg.ann_backend,
            m=cfg.ann_m,
            ef_construction=cfg.ann_ef_construction,
            ef_search=cfg.ann_ef_search,
        )

    # -- input -------------------------------------------------------------------------------
    def _check_query(self, query: object) -> str:
        if not isinstance(query, str) or not query.strip():
            raise InvalidEntryError("query must be a non-empty str")
        if len(query) > self.config.max_query_chars:
            raise InvalidEntryError(
                f"query has {len(query)} characters, over max_query_chars="
                f"{self.config.max_query_chars}"
            )
        return query

    @staticmethod
    def _check_scope(scope: object) -> str:
        if scope is None:
            return ""
        if not isinstance(scope, str) or len(scope) > 256:
            raise InvalidEntryError("scope must be a str of at most 256 characters")
        return scope

    def _embedding(self, query: str, embedding: object | None) -> Vector | None:
        """The caller's embedding, else the memoised ``embed_fn(query)``, else None."""
        if embedding is not None:
            return codec.normalize_vector(embedding)
        if self.embed_fn is None:
            return None
        key = hashlib.blake2b(query.encode("utf-8"), digest_size=16).hexdigest()
        cached = self.embeddings.get(key)
        if cached is not None:
            vec: Vector = cached
            return vec
        vec = codec.normalize_vector(self.embed_fn(query))
        self.embeddings.put(key, vec)
        return vec

    def _require_embedding(self, query: str, embedding: object | None) -> Vector:
        vec = self._embedding(query, embedding)
        if vec is None:
            raise InvalidEmbeddingError(
                "no embedding: pass embedding=... or create the manager with an embed_fn"
            )
        return vec

    def _tenant_index(self, keys: TenantKeys) -> TenantIndex:
        ti = self._indexes.get(keys.tenant)
        if ti is None:
            ti = self._indexes.setdefault(keys.tenant, TenantIndex(keys, self._index_policy))
        return ti

    def _check_dim(self, tenant: str, ti: TenantIndex, vec: Vector | None) -> None:
        if vec is not None and ti.index is not None and ti.index.dim != len(vec):
            raise DimensionMismatchError(tenant, ti.index.dim, len(vec))

    # -- ranking -------------------------------------------------------------------------------
    def _candidates(
        self,
        found: Sequence[tuple[str, float]],
        exact_id: str | None,
        states: StateBatch,
        now: float,
    ) -> list[tuple[tuple[str, float, IntelligentCacheEntry], float, bool]]:
        """Rank the servable candidates: ``((id, similarity, entry), score, exact)``."""
        sims = dict(found)
        if exact_id is not None:
            sims[exact_id] = 1.0
        cands = []
        for eid, sim in sims.items():
            entry = states.entries.get(eid)
            if entry is None or entry.is_expired(now):
                continue
            entry.bandit_arm = entry.bandit_arm.at(now, self.config.rl)
            if not self.learner.is_servable(entry) or sim < entry.similarity_bar:
                continue
            cands.append((eid, sim, entry))
        # A canonical order before the draws, so that a seeded learner reproduces its
        # choices whatever order the index or Redis returned the candidates in.
        cands.sort(key=lambda c: (-c[1], c[2].created_at, c[0]))
        scored = self.learner.score_candidates(cands)
        return [(cand, score, cand[0] == exact_id) for cand, score in scored]

    @staticmethod
    def _hit(
        tenant: str,
        cand: tuple[str, float, IntelligentCacheEntry],
        score: float,
        exact: bool,
        served: IntelligentCacheEntry,
    ) -> CacheHit:
        return CacheHit(
            entry_id=cand[0],
            tenant=tenant,
            response=served.response,
            query=served.query,
            similarity=cand[1],
            score=score,
            expected_reward=served.expected_reward,
            confidence=served.confidence_score,
            metadata=served.metadata,
            scope=served.scope,
            exact=exact,
        )

    # -- the first round trip of a lookup ---------------------------------------------------------
    def _queue_first_read(
        self,
        pipe: Any,
        ti: TenantIndex,
        query: str,
        scope: str,
        found: Sequence[tuple[str, float]],
        speculate: bool,
    ) -> Callable[[list[Any]], _FirstRead]:
        """Queue the lookup's first pipeline and return the parser of its replies.

        It reads the log's new events, the exact-match digest and the candidates' state,
        and flushes this replica's pending miss count. With ``speculate`` and a single
        candidate, it also runs the hit script on that candidate in the same round trip
        (by EVALSHA: redis-py's pipeline would first send SCRIPT EXISTS, a round trip of
        its own), so the common lookup costs one round trip.
        """
        keys, st = ti.keys, self.storage
        tenant = keys.tenant
        ti.queue_catchup(pipe)
        pipe.hget(keys.q, codec.query_digest(query, scope))
        n_fixed = 3
        pending = self._pending_misses.pop(tenant, 0)
        if pending:
            pipe.hincrby(keys.stats, "misses", pending)
            n_fixed += 1
        spec_call = None
        if speculate and len(found) == 1:
            spec_call = st.plan_hit(
                tenant,
                found[0][0],
                refresh_ttl=self.config.refresh_ttl_on_hit,
                min_reward=self.config.rl.serve_bar,
                similarity=found[0][1],
            )
            pipe.evalsha(st.scripts.hit.sha, len(spec_call.keys), *spec_call.keys, *spec_call.args)
            states_plan = None
        else:
            states_plan = st.read_states(tenant, [eid for eid, _ in found]) if found else None
            if states_plan is not None:
                states_plan.queue(pipe)

        def parse(res: list[Any]) -> _FirstRead:
            fixed = res[:n_fixed]
            for item in fixed:
                if isinstance(item, Exception):
                    raise StorageError(f"lookup failed: {item}") from item
            out = _FirstRead(first=fixed[0], new=fixed[1])
            out.exact_id = fixed[2].decode() if fixed[2] is not None else None
            rest = res[n_fixed:]
            if spec_call is not None:
                out.spec_id = found[0][0]
                reply = rest[0]
                if isinstance(reply, redis.exceptions.NoScriptError):
                    out.spec_noscript = True
                elif isinstance(reply, Exception):
                    raise StorageError(f"lookup failed: {reply}") from reply
                else:
                    out.spec_outcome = spec_call.parse(reply)
            elif states_plan is not None:
                for item in rest:
                    if isinstance(item, Exception):
                        raise StorageError(f"lookup failed: {item}") from item
                out.states = states_plan.parse(rest)
            return out

        return parse

    def _spec_hit(
        self, tenant: str, eid: str, sim: float, served: IntelligentCacheEntry
    ) -> CacheHit:
        """The hit of a speculatively served single candidate (its score for the record)."""
        ((cand, score),) = self.learner.score_candidates([(eid, sim, served)])
        return self._hit(tenant, cand, score, False, served)

    @contextlib.contextmanager
    def _counting(self, operation: str) -> Iterator[None]:
        """Count a ``StorageError`` of ``operation`` in the replica metrics, re-raised."""
        try:
            yield
        except StorageError:
            self.metrics.storage_errors.labels(operation).inc()
            raise

    # -- put and stats, shared -------------------------------------------------------------------
    def _plan_put(
        self,
        query: str,
        response: str,
        tenant: str,
        embedding: object | None,
        metadata: Mapping[str, Any] | None,
        scope: str | None,
    ) -> _PutPlan | PutResult:
        """Validate a put and run the admission check; a ``PutResult`` if refused."""
        keys = self.storage.keys(tenant)
        query = self._check_query(query)
        scope = self._check_scope(scope)
        vec = self._require_embedding(query, embedding)
        passed, warnings = self._admit(tenant, query, response, metadata)
        if not passed:
            return PutResult(
                False,
                reason=warnings[0] if warnings else "admission check failed",
                warnings=tuple(warnings),
                tenant=tenant,
            )
        return _PutPlan(keys, query, scope, vec, warnings)

    def _near_duplicate(self, ti: TenantIndex, plan: _PutPlan) -> str | None:
        assert self.config.dedup_threshold is not None
        self._check_dim(plan.keys.tenant, ti, plan.vec)
        best = ti.search(plan.vec, plan.scope, 1, self.config.dedup_threshold)
        return best[0][0] if best else None

    def _put_done(
        self, plan: _PutPlan, out: PutOutcome, near: str | None
    ) -> tuple[list[str], PutResult]:
        """The entries the new one replaces (to evict), and the result."""
        replaced = list(
            dict.fromkeys(e for e in (out.displaced_id, near) if e and e != out.entry_id)
        )
        self.metrics.puts.labels(self.metrics.tenant(plan.keys.tenant), "stored").inc()
        result = PutResult(
            True,
            out.entry_id,
            warnings=tuple(plan.warnings),
            replaced_id=replaced[0] if replaced else None,
            tenant=plan.keys.tenant,
        )
        return replaced, result

    def _stats_view(self, tenant: str, raw: Mapping[str, int]) -> dict[str, Any]:
        out: dict[str, Any] = dict(raw)
        lookups = out.get("hits", 0) + out.get("misses", 0)
        out["hit_rate"] = out.get("hits", 0) / lookups if lookups else 0.0
        ti = self._indexes.get(tenant)
        out["replica_index_entries"] = len(ti) if ti is not None else 0
        return out

    # -- fail-open ------------------------------------------------------------------------------
    def _fail_open(self, tenant: str, exc: BaseException) -> None:
        self.metrics.storage_errors.labels("lookup").inc()
        self.metrics.fail_open.labels(self.metrics.tenant(tenant)).inc()
        self.metrics.lookups.labels(self.metrics.tenant(tenant), "fail_open").inc()
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("zerda-cache: Redis failed, lookups fail open (miss): %s", exc)

    def _recovered(self) -> None:
        if self._outage_since is not None:
            log.warning(
                "zerda-cache: Redis is back after %.1f s; lookups served again",
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None

    def _record_lookup(
        self, tenant: str, query: str, hit: CacheHit | None, started: float, candidates: int
    ) -> None:
        result = "hit" if hit is not None else "miss"
        elapsed = time.perf_counter() - started
        self.metrics.lookups.labels(self.metrics.tenant(tenant), result).inc()
        self.metrics.lookup_latency.labels(result).observe(elapsed)
        self._adapt(query, len(hit.response) if hit else 0, candidates, elapsed, True)

    def _adapt(
        self, query: str, length: int, candidates: int, seconds: float, passed: bool
    ) -> None:
        analysis = QueryAnalysis(query=query, complexity=QueryComplexity.LOW, context_budget=0)
        self.adaptive.record(query, analysis, length, candidates, seconds * 1000.0, passed)

    def _admit(
        self, tenant: str, query: str, response: object, metadata: Mapping[str, Any] | None
    ) -> tuple[bool, list[str]]:
        if not isinstance(response, str):
            raise InvalidEntryError(f"response must be a str, got {type(response).__name__}")
        size = len(response.encode("utf-8"))
        if size > self.config.max_response_bytes:
            raise InvalidEntryError(
                f"response has {size} bytes, over max_response_bytes="
                f"{self.config.max_response_bytes}"
            )
        started = time.perf_counter()
        passed, warnings = self.admission(query, response, metadata or {})
        self._adapt(query, len(response), 0, time.perf_counter() - started, passed)
        label = self.metrics.tenant(tenant)
        if not passed:
            reason = warnings[0] if warnings else "admission check failed"
            self.metrics.puts.labels(label, "rejected").inc()
            self.metrics.puts_rejected.labels(_reason_label(reason)).inc()
        return passed, list(warnings)


@dataclass(slots=True)
class _PutPlan:
    """A validated, admitted put, ready for the put script."""

    keys: TenantKeys
    query: str
    scope: str
    vec: Vector
    warnings: list[str]


@dataclass(slots=True)
class _FirstRead:
    """What the first round trip of a lookup returned."""

    first: Any
    new: Any
    exact_id: str | None = None
    states: StateBatch = field(default_factory=StateBatch)
    spec_id: str | None = None
    spec_outcome: HitOutcome | None = None
    spec_noscript: bool = False


def _reason_label(reason: str) -> str:
    """A bounded metric label from a free-form reason: its first few words."""
    words = "".join(c if c.isalnum() else " " for c in reason.lower()).split()
    return "_".join(words[:4]) or "unknown"


class CacheManager(_ManagerCore):
    """The synchronous semantic cache of one app replica.

    Args:
        client: a ``redis.Redis`` or ``RedisCluster`` (``decode_responses=False``).
        config: the cache configuration.
        embed_fn: query -> embedding; optional when every call passes ``embedding=``.
        admission: the put admission check (default: the seed's ``ContextGuard``, see
            ``default_admission``).
        learner: the bandit learner (default: one built from ``config.rl``).
        metrics: replica metrics (default: the process-wide ones).
        clock: inject "now" (tests); default: the Redis server's clock.
    """

    storage: RedisStorage

    def __init__(
        self,
        client: Any,
        config: CacheConfig | None = None,
        *,
        embed_fn: EmbedFn | None = None,
        admission: AdmissionCheck | None = None,
        learner: CachePolicyLearner | None = None,
        metrics: ReplicaMetrics | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.storage = RedisStorage(client, config, clock=clock)
        self.client = client
        self._clock_sync: tuple[float, float] | None = None
        # Scripts cannot run inside Redis Cluster pipelines: there, two round trips.
        self._speculate = not is_cluster(client)
        super().__init__(
            self.storage, embed_fn=embed_fn, admission=admission, learner=learner, metrics=metrics
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        config: CacheConfig | None = None,
        *,
        embed_fn: EmbedFn | None = None,
        cluster: bool | None = None,
        **kwargs: Any,
    ) -> CacheManager:
        """Connect with a URL: ``redis://``, ``rediss://`` (TLS), ``unix://``, with an ACL
        user and password in the URL as usual. ``cluster=True`` (or a ``redis+cluster://``
        / ``rediss+cluster://`` scheme) connects to a Redis Cluster. Remaining keyword
        arguments go to the manager."""
        cfg = config if config is not None else CacheConfig()
        client = connect(url, cfg, cluster=cluster)
        return cls(client, cfg, embed_fn=embed_fn, **kwargs)

    def close(self) -> None:
        for tenant in list(self._pending_misses):
            # Closing while Redis is down: a miss count is not worth an error.
            with contextlib.suppress(StorageError):
                self._flush_misses(tenant)
        self.client.close()

    def _flush_misses(self, tenant: str) -> None:
        pending = self._pending_misses.pop(tenant, 0)
        if pending:
            with wrap_errors("count misses"):
                self.client.hincrby(self.storage.keys(tenant).stats, "misses", pending)

    def _now(self) -> float:
        """The storage clock, estimated locally: the server's time, measured once a
        minute, plus the local time elapsed since (ranking needs no more precision; the
        scripts read the server's clock themselves)."""
        if self.storage.clock is not None:
            return float(self.storage.clock())
        mono = time.monotonic()
        if self._clock_sync is None or mono - self._clock_sync[0] > _CLOCK_RESYNC_S:
            self._clock_sync = (mono, self.storage.now())
        return self._clock_sync[1] + (mono - self._clock_sync[0])

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lookup ----------------------------------------------------------------------------------
    def lookup(
        self,
        query: str,
        *,
        tenant: str,
        embedding: object | None = None,
        scope: str | None = None,
    ) -> CacheHit | None:
        """The best servable cached answer for ``query``, or ``None`` (a miss).

        Fails open: if Redis is unreachable or slower than ``redis_timeout_s``, this
        returns ``None``, logs once per outage and counts it. Bad input still raises.

        Raises:
            InvalidTenantError, InvalidEntryError, InvalidEmbeddingError,
            DimensionMismatchError: bad input.
        """
        keys = self.storage.keys(tenant)
        query = self._check_query(query)
        scope = self._check_scope(scope)
        vec = self._embedding(query, embedding)
        started = time.perf_counter()  # the latency metric excludes the embedding
        try:
            hit, candidates = self._lookup(keys, query, vec, scope)
        except StorageError as exc:
            self._fail_open(tenant, exc)
            return None
        self._recovered()
        self._record_lookup(tenant, query, hit, started, candidates)
        return hit

    def _lookup(
        self, keys: TenantKeys, query: str, vec: Vector | None, scope: str
    ) -> tuple[CacheHit | None, int]:
        """The hit (or None) and how many candidates the index found."""
        tenant, cfg, st = keys.tenant, self.config, self.storage
        ti = self._tenant_index(keys)
        if not ti.built:
            with ti.lock:  # one thread builds; the others wait and use its index
                if not ti.built:
                    self._build(ti)
        self._check_dim(tenant, ti, vec)

        def search() -> list[tuple[str, float]]:
            if vec is None:
                return []
            return ti.search(vec, scope, cfg.top_k, cfg.similarity_threshold)

        found = search()
        n_found = len(found)
        position = ti.last_id
        with wrap_errors("lookup"):
            pipe = self.client.pipeline(transaction=False)
            parse = self._queue_first_read(pipe, ti, query, scope, found, self._speculate)
            got = parse(pipe.execute(raise_on_error=False))
        changed = self._catch_up(ti, ti.parse_catchup(got.first, got.new), position)
        if got.spec_id is not None:
            outcome = got.spec_outcome
            if got.spec_noscript:  # first use on this server: the script object loads it
                outcome = st.hit(
                    tenant,
                    got.spec_id,
                    refresh_ttl=cfg.refresh_ttl_on_hit,
                    min_reward=cfg.rl.serve_bar,
                    similarity=found[0][1],
                )
            if outcome is not None and outcome.status == "served" and outcome.entry:
                return self._spec_hit(tenant, got.spec_id, found[0][1], outcome.entry), n_found
        if changed:
            self._check_dim(tenant, ti, vec)
            found = search()
        found = [(eid, sim) for eid, sim in found if eid != got.spec_id]
        exact_id = got.exact_id if got.exact_id != got.spec_id else None
        now = self._now()
        states = got.states
        missing = [eid for eid, _ in found if eid not in states.entries]
        if exact_id is not None and exact_id not in states.entries:
            missing.append(exact_id)
        if missing:
            states.entries.update(st.load_states(tenant, missing).entries)
        for cand, score, exact in self._candidates(found, exact_id, states, now):
            outcome = st.hit(
                tenant,
                cand[0],
                refresh_ttl=cfg.refresh_ttl_on_hit,
                min_reward=cfg.rl.serve_bar,
                similarity=cand[1],
            )
            if outcome.status == "served" and outcome.entry is not None:
                return self._hit(tenant, cand, score, exact, outcome.entry), n_found
        self._pending_misses[tenant] = self._pending_misses.get(tenant, 0) + 1
        return None, n_found

    # -- keeping the index current ---------------------------------------------------------------
    def _catch_up(self, ti: TenantIndex, delta: LogDelta, position: str) -> bool:
        """Apply ``delta`` (read at ``position``) and any further events; True if the index
        changed. Rebuilds when the log was trimmed past the position."""
        st = self.storage
        changed = False
        with ti.lock:
            if ti.last_id != position:
                # Another thread applied events meanwhile; read again from where it is.
                delta = self._read_delta(ti)
                changed = True
            while True:
                if delta.maybe_trimmed and ti.trimmed_past(self._xinfo(ti)):
                    log.info("tenant %s: log trimmed past this replica; rebuilding", ti.keys.tenant)
                    self._build(ti)
                    return True
                if not delta.adds and not delta.dels and delta.last_id is None:
                    return changed
                vectors = st.vectors(ti.keys.tenant, list(delta.adds)) if delta.adds else {}
                if not ti.apply(delta, vectors):
                    self._build(ti)
                    return True
                changed = True
                if not delta.more:
                    return changed
                delta = self._read_delta(ti)

    def _xinfo(self, ti: TenantIndex) -> Any:
        """``XINFO STREAM`` of the tenant's log, ``None`` if it does not exist yet."""
        try:
            with wrap_errors("xinfo"):
                return self.client.xinfo_stream(ti.keys.log)
        except StorageError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise

    def _read_delta(self, ti: TenantIndex) -> LogDelta:
        with wrap_errors("catch-up"):
            pipe = self.client.pipeline(transaction=False)
            ti.queue_catchup(pipe)
            first, new = pipe.execute()
        return ti.parse_catchup(first, new)

    def _build(self, ti: TenantIndex) -> None:
        """(Re)build a tenant's index from Redis, then replay the log from where the
        scan started."""
        st, tenant = self.storage, ti.keys.tenant
        with ti.lock:
            ti.start_build(self._xinfo(ti))
            for batch in st.iter_ids(tenant):
                ti.add_scanned(st.vectors(tenant, [eid for eid, _ in batch]))
            delta = self._read_delta(ti)
            delta.maybe_trimmed = False  # a trim during the build shows up next time
            ti.finish_build()
            self.metrics.index_rebuilds.labels(self.metrics.tenant(tenant)).inc()
            self._catch_up(ti, delta, ti.last_id)

    def sync_index(self, tenant: str) -> int:
        """Bring ``tenant``'s local index up to date now; returns its size."""
        keys = self.storage.keys(tenant)
        ti = self._tenant_index(keys)
        if not ti.built:
            self._build(ti)
        else:
            self._catch_up(ti, self._read_delta(ti), ti.last_id)
        return len(ti)

    def index_ids(self, tenant: str) -> set[str]:
        """The entry ids in this replica's index for ``tenant`` (as of its last sync)."""
        ti = self._indexes.get(validate_tenant(tenant))
        return set() if ti is None else ti.ids()

    # -- put ----------------------------------------------------------------------------------
    def put(
        self,
        query: str,
        response: str,
        *,
        tenant: str,
        embedding: object | None = None,
        ttl_s: float | None = None,
        quality: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        scope: str | None = None,
    ) -> PutResult:
        """Cache ``response`` as the answer to ``query``.

        The admission check runs first; a refused answer is not cached and the result
        says why. An earlier entry for the same normalised question and scope is replaced,
        and so is a near-duplicate when ``config.dedup_threshold`` is set.

        Raises:
            InvalidTenantError, InvalidEntryError, InvalidEmbeddingError,
            DimensionMismatchError: bad input; nothing is written.
            StorageError: Redis failed.
        """
        with self._counting("put"):
            return self._put(query, response, tenant, embedding, ttl_s, quality, metadata, scope)

    def _put(
        self,
        query: str,
        response: str,
        tenant: str,
        embedding: object | None,
        ttl_s: float | None,
        quality: float | None,
        metadata: Mapping[str, Any] | None,
        scope: str | None,
    ) -> PutResult:
        plan = self._plan_put(query, response, tenant, embedding, metadata, scope)
        if isinstance(plan, PutResult):
            return plan
        near: str | None = None
        if self.config.dedup_threshold is not None:
            ti = self._tenant_index(plan.keys)
            if not ti.built:
                self._build(ti)
            else:
                self._catch_up(ti, self._read_delta(ti), ti.last_id)
            near = self._near_duplicate(ti, plan)
        out = self.storage.put(
            tenant,
            plan.query,
            response,
            plan.vec,
            scope=plan.scope,
            ttl_s=ttl_s,
            quality=quality,
            metadata=metadata,
        )
        replaced, result = self._put_done(plan, out, near)
        if replaced:
            self.storage.evict(tenant, [(eid, None) for eid in replaced], "replaced")
        return result

    # -- feedback and management ------------------------------------------------------------------
    def feedback(self, signal: FeedbackSignal) -> None:
        """Apply one feedback signal to the entry's arm, atomically in Redis.

        Raises:
            EntryNotFoundError: the entry does not exist in ``signal.tenant_id``.
            StorageError: Redis failed.
        """
        if not isinstance(signal, FeedbackSignal):
            raise TypeError(f"feedback expects a FeedbackSignal, got {type(signal).__name__}")
        with self._counting("feedback"):
            self.storage.feedback(signal)
        self.learner.note_feedback(signal)
        polarity = "positive" if signal.positive else "negative"
        self.metrics.feedback.labels(self.metrics.tenant(signal.tenant_id), polarity).inc()

    def invalidate(self, entry_id: str, *, tenant: str) -> bool:
        """Remove one entry from every replica; False if it did not exist."""
        return self.storage.invalidate(tenant, entry_id)

    def stats(self, tenant: str) -> dict[str, Any]:
        """Shared counters of ``tenant`` (hits, misses, puts, feedback, evictions,
        entries, bytes), its hit rate, and this replica's index size."""
        self._flush_misses(tenant)
        return self._stats_view(tenant, self.storage.stats(tenant))

    def clear(self, tenant: str) -> int:
        """Remove every entry of ``tenant`` (from every replica) and reset its counters,
        feedback log and dimension. Returns the number of entries removed.

        Not atomic with puts made to the same tenant while it runs.
        """
        removed = 0
        batch = self.config.eviction.scan_batch
        while True:
            ids = [eid for chunk in self.storage.iter_ids(tenant, batch) for eid, _ in chunk]
            if not ids:
                break
            for i in range(0, len(ids), batch):
                chunk = [(eid, None) for eid in ids[i : i + batch]]
                removed += len(self.storage.evict(tenant, chunk, "invalidated").removed)
        self.storage.reset_tenant(tenant)
        return removed


def client_options(
    url: str, config: CacheConfig, cluster: bool | None
) -> tuple[str, bool, dict[str, Any]]:
    """The URL (a ``+cluster`` scheme suffix removed), whether it is a Redis Cluster, and
    zerda-cache's client options: socket timeouts of ``redis_timeout_s``, and one quick
    retry without backoff, so that a lookup fails open within the timeout."""
    scheme, sep, rest = url.partition("://")
    if scheme.endswith("+cluster"):
        cluster = True
        url = scheme.removesuffix("+cluster") + sep + rest
    timeout = config.redis_timeout_s
    options: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    return url, bool(cluster), options


def connect(url: str, config: CacheConfig, *, cluster: bool | None = None) -> Any:
    """A redis-py client for ``url`` with zerda-cache's timeouts (see ``from_url``)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    url, is_cluster_url, options = client_options(url, config, cluster)
    options.update(retry=Retry(NoBackoff(), 1), health_check_interval=30)
    if is_cluster_url:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


__all__ = [
    "AdmissionCheck",
    "CacheHit",
    "CacheManager",
    "EmbedFn",
    "PutResult",
    "basic_admission",
    "connect",
]
