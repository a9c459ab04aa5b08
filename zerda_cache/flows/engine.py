"""The cache's flows, written once: lookup, put, feedback, invalidate, clear, stats.

``CacheEngine`` composes the pieces and owns none of their logic: storage (keys, codecs,
scripts), the lookup's steps (``lookup.py``: ``LookupSteps``, with ``lookup_trip.py`` and
``ranking.py``), the put's (``put.py``: ``PutSteps``), verifications and learning
(``verification.py``: ``Verifier``), the tenant policies (``tenant_state.PolicyCache``),
the lookup counts (``counting.py``), the replica's indexes (``replica/indexes.py``) and the
metrics. Its flows are generators that do no I/O (see ``zerda_cache/storage/driver.py``):
they yield storage's steps and the ``embed_fn`` call, and two thin drivers run them:
``CacheManager`` (``manager.py``) over ``redis.Redis`` and ``AsyncCacheManager``
(``aio.py``) over ``redis.asyncio``. So the two flavours run the same lines.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, Self

from zerda_cache.companions.context import (
    AdaptiveLearningSystem,
    ContextCache,
    ContextEngineConfig,
)
from zerda_cache.core.config import CacheConfig
from zerda_cache.core.entry import LLMUsage
from zerda_cache.core.errors import InvalidFeedbackError, StorageError
from zerda_cache.core.results import CacheHit, Decision, PutResult
from zerda_cache.core.savings import cost, from_stats, prices_of
from zerda_cache.core.validation import check_query, check_scope, validate_tenant
from zerda_cache.flows.admission import AdmissionCheck, default_admission
from zerda_cache.flows.counting import LookupCounts, record_window
from zerda_cache.flows.lookup import Found, LookupSteps
from zerda_cache.flows.put import PutSteps
from zerda_cache.flows.ranking import LocalClock, Ranking
from zerda_cache.flows.verification import (
    SameAnswer,
    Verifier,
    encode_ticket,
    same_text,
    ticket_key,
)
from zerda_cache.learning.bandit import CachePolicyLearner, FeedbackSignal
from zerda_cache.learning.calibration import check_error_rate
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.learning.tenant_state import PolicyCache
from zerda_cache.metrics import ReplicaMetrics, default_replica_metrics
from zerda_cache.replica.indexes import STOP_WAIT_S, ReplicaIndexes
from zerda_cache.storage import codec
from zerda_cache.storage.codec import Vector
from zerda_cache.storage.connect import connect
from zerda_cache.storage.driver import Flow, Job, Step, call, op, run_sync
from zerda_cache.storage.reports import SettingsReporter
from zerda_cache.storage.store import Storage

log = logging.getLogger(__name__)

#: ``query -> embedding``: a plain function (both flavours) or a coroutine function
#: (``AsyncCacheManager`` awaits its result).
EmbedFn = Callable[[str], Any] | Callable[[str], Awaitable[Any]]


class CacheEngine:
    """The semantic cache of one app replica, for either driver (use ``CacheManager`` or
    ``AsyncCacheManager``).

    Args:
        client: a redis-py client (``decode_responses=False``) of the driver's flavour:
            ``redis.Redis`` / ``RedisCluster`` for ``CacheManager``, their
            ``redis.asyncio`` counterparts for ``AsyncCacheManager``.
        config: the cache configuration.
        embed_fn: query -> embedding; optional when every call passes ``embedding=``.
            ``AsyncCacheManager`` also takes a coroutine function (an HTTP embedding API).
        admission: the put admission check (default: the seed's ``ContextGuard``, see
            ``default_admission``).
        learner: the bandit learner (default: one built from ``config.rl``).
        metrics: replica metrics (default: the process-wide ones).
        clock: inject "now" (tests); default: the Redis server's clock.
        same_answer: labels a verification: is the cached answer the same as the fresh
            one? (default ``same_text``).
    """

    #: The storage flavour of the driver (``RedisStorage`` or ``AsyncRedisStorage``).
    storage_class: type[Storage]
    lock_factory: Callable[[], Any]
    is_async: bool
    #: Runs a flow in the background: a daemon thread or an asyncio task (the driver's).
    spawn: Callable[[Flow[Any], str], Job]
    #: A step running CPU-bound work (off the event loop, for asyncio); a step sleeping.
    offload: Callable[..., Step]
    pause: Callable[[float], Step]
    semaphore_factory: Callable[[int], Any]

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
        same_answer: SameAnswer | None = None,
    ) -> None:
        self.storage = self.storage_class(client, config, clock=clock)
        self.client = client
        self.config: CacheConfig = self.storage.config
        #: The settings this replica applies, reported to each tenant it serves (with
        #: policy refreshes: ``storage/reports.py``) for ``zerda-cache tenant show``.
        self.storage.reporter = SettingsReporter(self.config, "replica")
        self.embed_fn = embed_fn
        self.admission = admission if admission is not None else default_admission(self.config)
        rl, eviction = self.config.rl, self.config.eviction
        self.learner = learner if learner is not None else CachePolicyLearner(rl, eviction)
        self.metrics = metrics if metrics is not None else default_replica_metrics()
        #: The replica's rolling windows (seed: AdaptiveLearningSystem): lookup latency,
        #: answer length, candidates, admission failures; exported as replica metrics.
        self.adaptive = AdaptiveLearningSystem(ContextEngineConfig())
        self.metrics.watch(self.adaptive)
        self.embeddings = ContextCache(
            max_size=self.config.embedding_cache_size,
            ttl_seconds=self.config.embedding_cache_ttl_s,
        )
        _engines.add(self)
        self._outage_since: float | None = None
        #: Misses and lookup traffic, written by a later lookup's round trip (counting.py).
        self.counts = LookupCounts(self.storage)
        #: US dollars per million tokens by model (``savings.prices_of``).
        self.prices = prices_of(self.config)
        #: Each tenant's policy (``learning/tenant_policy.py``), read again every
        #: ``policy_refresh_s``.
        self.policies = PolicyCache(self.storage)
        #: The verifications lookups ask for, and learning from every signal.
        judge = same_answer if same_answer is not None else same_text
        self.verifier = Verifier(self.storage, self.learner, self.policies, judge)
        #: This replica's vector indexes: builds, catch-up, readiness (``replica/indexes.py``).
        self.indexes = ReplicaIndexes(
            self.storage,
            self.config,
            self.metrics,
            self,
            outage=lambda: self._outage_since is not None,
        )
        local_clock = LocalClock(self.storage)
        #: The steps of a lookup (``lookup.py``) and of a put (``put.py``).
        self.lookup_steps = LookupSteps(
            self.storage,
            self.indexes,
            self.policies,
            self.counts,
            self.verifier,
            Ranking(self.learner),
            local_clock,
        )
        self.put_steps = PutSteps(
            self.storage,
            self.indexes,
            self.policies,
            self.verifier,
            local_clock,
            self.metrics,
            self.admission,
            self.adaptive,
            self.embedding_flow,
        )

    @property
    def same_answer(self) -> SameAnswer:
        """Labels a verification: is the cached answer the same as the fresh one?"""
        return self.verifier.same_answer

    @classmethod
    def from_url(
        cls,
        url: str,
        config: CacheConfig | None = None,
        *,
        cluster: bool | None = None,
        **kwargs: Any,
    ) -> Self:
        """Connect with a URL: ``redis://``, ``rediss://`` (TLS), ``unix://``, with an ACL
        user and password in the URL as usual. ``cluster=True`` (or a ``redis+cluster://``
        / ``rediss+cluster://`` scheme) connects to a Redis Cluster. The client has socket
        timeouts of ``config.redis_timeout_s``. Keyword arguments (``embed_fn``, ...) go to
        the manager."""
        cfg = config if config is not None else CacheConfig()
        return cls(connect(url, cfg, cluster=cluster, asyncio=cls.is_async), cfg, **kwargs)

    # -- lookup ----------------------------------------------------------------------------
    def lookup_flow(
        self,
        query: str,
        *,
        tenant: str,
        embedding: object | None = None,
        scope: str | None = None,
        max_error_rate: float | None = None,
    ) -> Flow[CacheHit | None]:
        """The best servable cached answer for ``query``, or ``None`` (a miss).

        With an error bound (``max_error_rate`` here, else the tenant's setting, else
        ``CacheConfig.max_error_rate``), a near match is served only where labelled
        outcomes and the tenant's lookup counts say that serving matches scored that
        high serves a wrong answer to at most that share of requests; the question asked
        exactly is served its own answer when the labels of exact repeats at its entry's
        level (its expected reward: one positive signal confirms it) prove them within
        half the bound, and until the tenant has such labels, once a positive signal
        confirmed it (see ``calibration.py``). A candidate that is not served is to be
        *verified*: this returns ``None`` as for a miss; ``decide`` tells the two apart
        and returns the token for the ``put`` that compares the answers.

        Fails open: if Redis is unreachable or slower than ``redis_timeout_s``, this
        returns ``None``, logs once per outage and counts it. Bad input still raises.

        Raises:
            InvalidTenantError: a bad tenant id.
            InvalidEntryError: a bad query or scope.
            InvalidEmbeddingError: a bad embedding (NaN, all zeros, not a vector).
            DimensionMismatchError: an embedding of another dimension than the tenant's.
            InvalidSettingError: a bound not in (0, 1).
        """
        found, _, _, _ = yield from self.found_flow(query, tenant, embedding, scope, max_error_rate)
        return found.hit if found is not None else None

    def decide_flow(
        self,
        query: str,
        *,
        tenant: str,
        embedding: object | None = None,
        scope: str | None = None,
        max_error_rate: float | None = None,
    ) -> Flow[Decision]:
        """What ``lookup`` does, told in full: a ``Decision`` whose ``kind`` is ``hit``
        (its ``hit`` is the answer), ``miss`` or ``verify``, with the ``reason`` and,
        under an error bound, what the bound serves from. A verify carries the
        ``verify_token`` to pass to the ``put`` of the LLM's answer: the put verifies
        the candidate held back on whichever replica it runs (without the token, only a
        put on this replica does). Fails open as ``lookup`` does: a miss whose reason is
        ``unavailable``. Raises what ``lookup`` raises."""
        asked = yield from self.found_flow(query, tenant, embedding, scope, max_error_rate)
        found, query, checked, override = asked
        policy = found.policy if found is not None else None  # the one it decided under
        if policy is None:
            cached = self.policies.cached.get(tenant)
            policy = cached[1] if cached is not None else TenantPolicy(tenant, self.config)
        bound = policy.bound(override)
        if found is None:  # failed open
            return Decision("miss", "unavailable", max_error_rate=bound)
        rule = policy.serving(override)  # the bars the lookup applies
        served: tuple[Any, ...] = (bound, None, None, None)  # (no rule without a bound)
        if rule is not None:
            served = (bound, rule.threshold, rule.exact_level, rule.estimated_error)
        ticket = found.ticket if found.verify else None
        if ticket is None:
            kind: Literal["hit", "miss"] = "hit" if found.hit is not None else "miss"
            return Decision(kind, found.reason, found.hit, None, None, None, *served)
        token = encode_ticket(tenant, query, checked, ticket)
        sim = ticket.similarity
        return Decision("verify", found.reason, None, ticket.entry_id, sim, token, *served)

    def found_flow(
        self,
        query: str,
        tenant: str,
        embedding: object | None,
        scope: str | None,
        max_error_rate: float | None,
    ) -> Flow[tuple[Found | None, str, str, float | None]]:
        """The lookup of ``lookup_flow`` and ``decide_flow``, counted: what it found
        (``None``: it failed open), with the query, scope and bound as checked."""
        keys = self.storage.keys(tenant)
        query = check_query(query, self.config.max_query_chars)
        checked = check_scope(scope)
        override = check_error_rate(max_error_rate)
        if embedding is not None:  # (as embedding_flow does, without a flow of its own)
            vec: Vector | None = codec.normalize_vector(embedding)
        else:
            vec = yield from self.embedding_flow(query, None)
        started = time.perf_counter()  # the latency metric excludes the embedding
        try:
            found = yield from self.lookup_steps.find_flow(keys, query, vec, checked, override)
        except StorageError as exc:
            self._fail_open(tenant, exc)
            return None, query, checked, override
        if self._outage_since is not None:
            self._recovered()
        if found.hit is not None and found.hit.usage is not None:
            self._count_savings(tenant, "saved", found.hit.usage)
        if found.level is not None:  # an exact repeat: counted at its entry's level
            sample = found.policy is not None and found.policy.bound(override) is not None
            self.counts.exact(tenant, found.level, time.monotonic(), sample)
        self._record_lookup(tenant, query, found, started)
        return found, query, checked, override

    def read_tenant_policy_flow(self, tenant: str) -> Flow[TenantPolicy]:
        """The tenant's policy as this manager applies it, read from Redis now."""
        return (yield from self.policies.policy_flow(tenant, fresh=True))

    def set_tenant_policy_flow(
        self, tenant: str, changes: Mapping[str, object]
    ) -> Flow[TenantPolicy]:
        """Change the tenant's policy in Redis for every replica and worker (see
        ``RedisStorage.set_tenant_policy``; ``None`` clears a setting) and return it as
        this manager now applies it. Other processes apply it within
        ``policy_refresh_s``.

        Raises:
            InvalidSettingError: an unknown setting or a refused value; nothing is written.
        """
        yield from self.storage.set_tenant_policy_flow(tenant, changes)
        return (yield from self.policies.policy_flow(tenant, fresh=True))

    # -- put -------------------------------------------------------------------------------
    def put_flow(
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
        tags: Sequence[str] | None = None,
        usage: LLMUsage | Mapping[str, Any] | None = None,
        verify_token: str | None = None,
    ) -> Flow[PutResult]:
        """Cache ``response`` as the answer to ``query``. ``tags``: labels to invalidate
        it by later (``invalidate_tag``): the document it was built on, its source.
        ``usage``: what the LLM call that made it cost (``LLMUsage``, or the OpenAI
        response's ``usage`` with its ``model``): each hit then counts as that call
        saved (``stats(tenant)["savings"]``, the ``zerda_cache_saved_*`` metrics).
        ``verify_token``: a verify's token (``Decision.verify_token``, from ``decide``
        on any replica): this put's answer is compared with the candidate that lookup
        held back (``PutResult.verified``). Without it, the put settles the
        verification a lookup on this replica left for the question, if any.

        The admission check runs first; a refused answer is not cached and the result
        says why. An earlier entry for the same normalised question and scope is replaced,
        and so is a near-duplicate when ``config.dedup_threshold`` is set.

        Raises:
            InvalidTenantError: a bad tenant id; nothing is written.
            InvalidEntryError: a bad query, answer, scope, TTL, metadata, tags or usage,
                or a ``verify_token`` that is not one, or is another tenant's or
                question's; nothing is written.
            InvalidEmbeddingError: a bad embedding, or none and no ``embed_fn``.
            DimensionMismatchError: an embedding of another dimension than the tenant's.
            StorageError: Redis failed.
        """
        where = (tenant, embedding, ttl_s, quality, metadata, scope, tags, usage)
        return self.put_steps.put_flow(query, response, *where, verify_token=verify_token)

    # -- feedback and management -----------------------------------------------------------
    def feedback_flow(self, signal: FeedbackSignal) -> Flow[None]:
        """Apply one feedback signal to the entry's arm, atomically in Redis (a
        ``DisputeSignal`` settles a dispute instead). A negative signal about a served hit
        (``CacheHit.feedback``, which names the hit) counts it wrong in the savings, once
        however often it is repeated.

        Raises:
            EntryNotFoundError: the entry does not exist in ``signal.tenant_id``.
            StorageError: Redis failed.
        """
        if not isinstance(signal, FeedbackSignal):
            raise InvalidFeedbackError(
                f"feedback expects a FeedbackSignal, got {type(signal).__name__}"
            )
        with self._counting("feedback"):
            outcome = yield from self.put_steps.feedback_flow(signal)
        if outcome is not None and outcome.wrong is not None:
            # A hit judged wrong (the first verdict on it; the script counted it): its
            # answer's call was bought after all.
            self._count_savings(signal.tenant_id, "wrong", outcome.wrong)
        polarity = "positive" if signal.positive else "negative"
        self.metrics.feedback.labels(self.metrics.tenant(signal.tenant_id), polarity).inc()

    def invalidate_flow(self, entry_id: str, *, tenant: str) -> Flow[bool]:
        """Remove one entry from every replica; False if it did not exist.

        Raises:
            InvalidEntryError: ``entry_id`` is not an id this library made.
        """
        return (yield from self.storage.invalidate_flow(tenant, entry_id))

    def invalidate_tag_flow(self, tag: str, *, tenant: str) -> Flow[int]:
        """Remove every entry of ``tenant`` put with ``tag`` (from every replica), through
        the tag's index in Redis: one call however large the tenant, touching only those
        entries. Returns how many were removed.

        Raises:
            InvalidEntryError: ``tag`` is not a valid tag.
            StorageError: Redis failed.
        """
        return (yield from self.storage.invalidate_tag_flow(tenant, tag))

    def stats_flow(self, tenant: str) -> Flow[dict[str, Any]]:
        """Shared counters of ``tenant`` (hits, misses, puts, feedback, evictions,
        entries, bytes), its hit rate, and this replica's index size."""
        yield from self.counts.flush(tenant)
        out: dict[str, Any] = dict((yield from self.storage.stats_flow(tenant)))
        saved = from_stats(out, self.prices)
        out = {k: v for k, v in out.items() if not k.startswith(("saved:", "wrong:"))}
        out["savings"] = {model: s.as_dict() for model, s in saved.items()}
        lookups = out.get("hits", 0) + out.get("misses", 0)
        out["hit_rate"] = out.get("hits", 0) / lookups if lookups else 0.0
        ti = self.indexes.get(tenant)
        out["replica_index_entries"] = len(ti) if ti is not None else 0
        out["replica_index_ready"] = ti is not None and ti.usable
        return out

    def clear_flow(self, tenant: str) -> Flow[int]:
        """Remove every entry of ``tenant`` (from every replica) and reset its counters,
        feedback log and dimension. Returns the number of entries removed.

        Not atomic with puts made to the same tenant while it runs.
        """
        st, removed = self.storage, 0
        while (yield from st.count_flow(tenant)) > 0:
            cursor: int | None = None
            while cursor != 0:
                cursor, items = yield from st.scan_ids_flow(tenant, cursor or 0)
                if items:
                    out = yield from st.evict_flow(
                        tenant, [(e, None) for e, _ in items], "invalidated"
                    )
                    removed += len(out.removed)
        yield from st.reset_tenant_flow(tenant)
        return removed

    # -- the replica's indexes (``ReplicaIndexes``) ------------------------------------------
    def sync_index_flow(self, tenant: str) -> Flow[int]:
        """Bring ``tenant``'s local index up to date now, waiting for its build (however
        long that takes); returns its size. Lookups never wait this long: use it where a
        replica should be ready before it takes traffic (a readiness probe, a warm-up).

        Raises:
            StorageError: Redis failed, or the manager is closed. A build that failed
                otherwise (a bug) raises its own error.
        """
        return (yield from self.indexes.sync(tenant))

    def index_ready(self, tenant: str) -> bool:
        """Is this replica's index of ``tenant`` built (lookups search all of it)? False
        before its first lookup and while a build runs; ``index_progress`` says how far."""
        return self.indexes.ready(tenant)

    def index_progress(self, tenant: str) -> tuple[int, int]:
        """The running build of ``tenant``'s index: (entries scanned, entries counted
        when it began); ``(n, n)`` once built."""
        return self.indexes.progress(tenant)

    def index_ids(self, tenant: str) -> set[str]:
        """The entry ids in this replica's index for ``tenant`` (as of its last sync)."""
        return self.indexes.ids(tenant)

    def stop_jobs(self) -> list[Job]:
        """Stop the index builds, and start no more (``close`` does this first; a manager
        whose client belongs to someone else, as the worker's snapshotter's, stops here).
        Returns the jobs that were running."""
        return self.indexes.stop()

    def close_flow(self) -> Flow[None]:
        """Stop the index builds, flush the pending miss counts, then close the client."""
        yield from self.indexes.stop_and_wait()
        for tenant in self.counts.pending_tenants():
            with contextlib.suppress(StorageError):  # closing while Redis is down
                yield from self.counts.flush(tenant)
        yield from self.storage.close_flow()

    lookup = op(lookup_flow)
    decide = op(decide_flow)
    put = op(put_flow)
    feedback = op(feedback_flow)
    invalidate = op(invalidate_flow)
    invalidate_tag = op(invalidate_tag_flow)
    stats = op(stats_flow)
    clear = op(clear_flow)
    sync_index = op(sync_index_flow)
    tenant_policy = op(read_tenant_policy_flow)
    set_tenant_policy = op(set_tenant_policy_flow)

    # -- helpers of the flows --------------------------------------------------------------
    def embedding_flow(self, query: str, embedding: object | None) -> Flow[Vector | None]:
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
        vec = codec.normalize_vector((yield call(self.embed_fn, query)))
        self.embeddings.put(key, vec)
        return vec

    def _count_savings(self, tenant: str, kind: str, usage: LLMUsage) -> None:
        """A hit's avoided call (``kind`` "saved") or a wrong hit's ("wrong"), in this
        replica's metrics. The tenant's shared counts are the scripts': the hit script
        counts the saved call as it serves, the feedback script the wrong one."""
        self.metrics.savings(tenant, kind, usage, cost(usage, self.prices))

    # -- metrics and fail-open -------------------------------------------------------------
    @contextlib.contextmanager
    def _counting(self, operation: str) -> Iterator[None]:
        """Count a ``StorageError`` of ``operation`` in the replica metrics, re-raised."""
        try:
            yield
        except StorageError:
            self.metrics.storage_errors.labels(operation).inc()
            raise

    def _fail_open(self, tenant: str, exc: BaseException) -> None:
        self.metrics.storage_errors.labels("lookup").inc()
        self.metrics.fail_open.labels(self.metrics.tenant(tenant)).inc()
        self.metrics.lookups.labels(self.metrics.tenant(tenant), "fail_open").inc()
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("zerda-cache: Redis failed, lookups fail open (miss): %s", exc)

    def _recovered(self) -> None:
        if self._outage_since is not None:  # (callers check first: the common case)
            log.warning(
                "zerda-cache: Redis is back after %.1f s; lookups served again",
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None

    def _record_lookup(self, tenant: str, query: str, found: Found, started: float) -> None:
        elapsed = time.perf_counter() - started
        self.metrics.lookup_done(tenant, found.decision, elapsed)
        hit = found.hit
        length = len(hit.response) if hit else 0
        record_window(self.adaptive, query, length, found.candidates, elapsed, True)

    # -- verification state (no Redis) -----------------------------------------------------
    def awaiting_verification(self, query: str, *, tenant: str, scope: str | None = None) -> bool:
        """Is a verification of ``query`` pending on this replica: did a lookup under an
        error bound hold a candidate back, so that the next ``put`` of this question (in
        the same scope, within 15 minutes) on this replica compares its answer with the
        candidate's? It reads this replica's memory only; ``decide`` says the same as part
        of the lookup, with a token that lets a put on any replica verify.

        Raises:
            InvalidTenantError, InvalidEntryError: bad input, as ``lookup`` would.
        """
        tenant = validate_tenant(tenant)
        query = check_query(query, self.config.max_query_chars)
        key = ticket_key(tenant, query, check_scope(scope))
        return self.verifier.tickets.get(key) is not None


#: Every engine of the process, for ``_reset_after_fork`` and ``_stop_at_exit``.
_engines: weakref.WeakSet[CacheEngine] = weakref.WeakSet()


def _reset_after_fork() -> None:
    """In a forked child (a pre-forking server that warmed the cache up in its master):
    the build threads did not survive the fork and their locks may be held for good.
    Fresh locks, and a tenant whose build was running is built again on first use."""
    for engine in list(_engines):
        # Counts pending in the parent are the parent's to write.
        engine.counts.reset()
        engine.indexes.after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


def _stop_at_exit() -> None:
    """At the interpreter's exit, stop the index builds of every sync manager (those
    never closed, and those whose jobs were only stopped, as the worker's snapshotter
    does) and wait for them all, ``STOP_WAIT_S`` in all. An asyncio manager's builds
    are tasks of a loop that is gone by now; their CPU work ran in the loop's executor,
    whose threads the interpreter joins itself."""
    # Every build is told to stop at its next step first, all at once; then waited for.
    stopped = [(e, e.stop_jobs()) for e in list(_engines) if not e.is_async]
    deadline = time.monotonic() + STOP_WAIT_S
    for engine, jobs in stopped:
        run_sync(engine.indexes.await_stopped(jobs, deadline))


atexit.register(_stop_at_exit)


__all__ = ["CacheEngine", "EmbedFn"]
