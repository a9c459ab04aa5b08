"""The cache's flows, written once: lookup, put, feedback, invalidate, clear, stats.

``CacheEngine`` composes the pieces and owns none of their logic: storage (keys, codecs,
scripts), the learner (bandit math), the replica index (log sync) and the metrics. Its
flows are generators that do no I/O (see ``zerda_cache/storage/driver.py``): they yield
storage's steps and the ``embed_fn`` call, and two thin drivers run them:
``CacheManager`` (``manager.py``) over ``redis.Redis`` and ``AsyncCacheManager``
(``aio.py``) over ``redis.asyncio``. So the two flavours run the same lines.

A lookup whose best candidate leads the rest (or ties with rivals that no Thompson draw
could rank first) costs one round trip, usually one command: the hit script on that
candidate, which also reads the question's exact-match digest and peeks at the log's new
events (``_find``). Otherwise it ranks the candidates on the states that script returned
and runs the hit script of the best (two round trips; on Redis Cluster, whose pipelines
cannot carry scripts, it reads the states first). Only when the log had news (a put or a
removal by another replica) does it read the new vectors.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Self

import numpy as np

from zerda_cache.admission import AdmissionCheck, default_admission
from zerda_cache.calibration import NEVER, check_error_rate, exact_level
from zerda_cache.config import CacheConfig
from zerda_cache.context import (
    AdaptiveLearningSystem,
    ContextCache,
    ContextEngineConfig,
    QueryAnalysis,
    QueryComplexity,
)
from zerda_cache.counting import LookupCounts
from zerda_cache.entry import IntelligentCacheEntry, LLMUsage
from zerda_cache.errors import (
    CorruptEntryError,
    DimensionMismatchError,
    EntryNotFoundError,
    InvalidEmbeddingError,
    InvalidFeedbackError,
    StorageError,
)
from zerda_cache.index import IndexPolicy
from zerda_cache.match_model import Features, candidate_features, score_of
from zerda_cache.metrics import ReplicaMetrics, default_replica_metrics
from zerda_cache.policy import TenantPolicy
from zerda_cache.policy_learner import CachePolicyLearner, FeedbackSignal
from zerda_cache.replica import STOP_WAIT_S, ReplicaIndexes, TenantIndex
from zerda_cache.results import CacheHit, PutResult
from zerda_cache.savings import cost, from_stats, price_table, stat_fields
from zerda_cache.storage import codec
from zerda_cache.storage.codec import Vector
from zerda_cache.storage.connect import connect
from zerda_cache.storage.driver import Flow, Job, Step, call, op, run_sync
from zerda_cache.storage.keys import TenantKeys
from zerda_cache.storage.plans import (
    HitOutcome,
    HitStatus,
    PutOutcome,
    ReadPlan,
    ScriptCall,
    StateBatch,
)
from zerda_cache.storage.store import Storage
from zerda_cache.tenant_state import plan_label, read_policy
from zerda_cache.validation import (
    check_query,
    check_response,
    check_scope,
    check_tags,
    validate_tenant,
)
from zerda_cache.verification import SameAnswer, Ticket, same_text, ticket_key

log = logging.getLogger(__name__)

#: ``query -> embedding``: a plain function (both flavours) or a coroutine function
#: (``AsyncCacheManager`` awaits its result).
EmbedFn = Callable[[str], Any] | Callable[[str], Awaitable[Any]]

#: How often the manager re-reads the server's clock for its local estimate.
_CLOCK_RESYNC_S = 60.0


#: The most candidates a tie passes to the hit script (Lua's unpack has a limit); a
#: larger top_k ranks its ties after reading their states, as a cluster does.
_TIE_MAX = 512


def clear_leader(found: Sequence[tuple[str, float]], margin: float) -> bool:
    """Whether the first of a search's candidates (best first) is the only one, or ahead
    of the next by more than ``margin`` (``similarity_tie_margin``): then ranking puts
    it first whatever the arms say, and a lookup serves it in its first round trip."""
    return len(found) == 1 or (len(found) > 1 and found[1][1] < found[0][1] - margin)


class Found(NamedTuple):
    """What ``_find`` decided for one lookup."""

    hit: CacheHit | None  #: the answer served, or None (a miss, or a verification)
    candidates: int  #: how many near candidates the index found
    verify: bool  #: a candidate was held back: the app's next put verifies it
    #: for an exact repeat, its entry's level at this lookup as far as it is known
    #: (``calibration.exact_level``; 0 when it is not); None: not an exact repeat
    level: int | None


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
        self.embed_fn = embed_fn
        self.admission: AdmissionCheck = (
            admission if admission is not None else default_admission(self.config)
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
        _engines.add(self)
        self._outage_since: float | None = None
        self._clock_sync: tuple[float, float] | None = None
        #: Misses and lookup traffic, written by a later lookup's round trip (counting.py).
        self.counts = LookupCounts(self.storage)
        #: US dollars per million tokens by model (``savings.price_table``).
        self.prices = price_table({m: (p, c) for m, p, c in self.config.token_prices})
        # Scripts cannot run inside Redis Cluster pipelines: there, two round trips.
        self._speculate = not self.storage.cluster
        self.same_answer: SameAnswer = same_answer if same_answer is not None else same_text
        #: Each tenant's policy (``policy.py``), with the monotonic time it was read.
        self._policies: dict[str, tuple[float, TenantPolicy]] = {}
        #: Verifications asked for, by (tenant, query digest): (entry id, similarity).
        self._tickets = ContextCache(max_size=10_000, ttl_seconds=900.0)
        self._explore = np.random.default_rng(self.config.rl.seed)
        cfg = self.config
        index_policy = IndexPolicy(
            ann_threshold=cfg.ann_threshold,
            backend=cfg.ann_backend,
            dtype=cfg.ann_dtype,
            m=cfg.ann_m,
            ef_construction=cfg.ann_ef_construction,
            ef_search=cfg.ann_ef_search,
        )
        #: This replica's vector indexes: builds, catch-up, readiness (``replica.py``).
        self.indexes = ReplicaIndexes(
            self.storage,
            cfg,
            self.metrics,
            self,
            index_policy,
            outage=lambda: self._outage_since is not None,
        )

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
        *verified*: this returns ``None`` as for a miss, and the next ``put`` of this
        question (the fresh answer of the app's LLM) is compared with the candidate's
        answer (``same_answer``), which teaches the cache (``PutResult.verified``).

        Fails open: if Redis is unreachable or slower than ``redis_timeout_s``, this
        returns ``None``, logs once per outage and counts it. Bad input still raises.

        Raises:
            InvalidTenantError: a bad tenant id.
            InvalidEntryError: a bad query or scope.
            InvalidEmbeddingError: a bad embedding (NaN, all zeros, not a vector).
            DimensionMismatchError: an embedding of another dimension than the tenant's.
            InvalidSettingError: a bound not in (0, 1).
        """
        keys = self.storage.keys(tenant)
        query = check_query(query, self.config.max_query_chars)
        scope = check_scope(scope)
        override = check_error_rate(max_error_rate)
        vec = yield from self._embedding(query, embedding)
        started = time.perf_counter()  # the latency metric excludes the embedding
        try:
            found = yield from self._find(keys, query, vec, scope, override)
        except StorageError as exc:
            self._fail_open(tenant, exc)
            return None
        self._recovered()
        if found.hit is not None and found.hit.usage is not None:
            self._count_savings(tenant, "saved", found.hit.usage)
        if found.level is not None:  # an exact repeat: counted at its entry's level
            cached = self._policies.get(tenant)
            sample = cached is not None and cached[1].bound(override) is not None
            self.counts.exact(tenant, found.level, time.monotonic(), sample)
        self._record_lookup(tenant, query, found.hit, started, found.candidates, found.verify)
        return found.hit

    def _find(
        self,
        keys: TenantKeys,
        query: str,
        vec: Vector | None,
        scope: str,
        override: float | None,
    ) -> Flow[Found]:
        """Decide one lookup: the answer to serve, or a miss, or a verification."""
        tenant, st = keys.tenant, self.storage
        ti = self.indexes.of(keys)
        if not ti.built:  # built in the background: wait a bounded time for it
            # (a lookup without an embedding matches exactly only: it starts the build)
            wait = self.indexes.build_wait(ti, vec is not None)
            waits = wait > 0 and self._outage_since is None  # (no wait during an outage)
            yield from self.indexes.await_index(ti, wait)
            job = ti.job
            if waits and not ti.built and not ti.answered and job and not job.done():
                # The build is still waiting for its first reply from Redis: the lookup's
                # own commands would wait as long again. Fail open now, within one
                # redis_timeout_s in all. (A build that failed already is retried later;
                # meanwhile lookups go on as usual.)
                raise StorageError(f"tenant {tenant}: Redis did not answer within {wait:g} s")
        policy, refresh = yield from self._lookup_policy(tenant)
        # Until it is built, search the index this replica had before, if any (a rebuild),
        # without catching it up, and check the dimension against Redis instead.
        live = ti.usable
        found = self._search(ti, vec, scope, policy)
        n_found = len(found)
        position = ti.last_id
        # The question's exact-match digest: the entry it names is read by a speculative
        # hit's script (which checks it), else by a command of this pipeline.
        digest = codec.query_digest(query, scope)
        explore = self._explore.random() < policy.config.verify_rate
        bound, threshold = policy.bound(override), policy.threshold(override)
        model = policy.calibration.model
        # Each candidate's features and score (its similarity without a match model).
        feats = self._features(found, policy)
        # Under a bound, an exact repeat is served only an entry whose level the labels
        # prove safe enough (``Calibration.exact_plan``): the bar its arm's expected
        # reward must reach, and an exact repeat refused is verified, never served
        # another question's answer instead. None: no bound, or any servable entry.
        bar = None if bound is None else (NEVER if explore else policy.exact_bar(override))
        exact_bar = bar if bar else None
        spec: tuple[str, float] | None = None

        def servable(cands: list[tuple[str, float]]) -> list[tuple[str, float]]:
            """Near matches the bound lets this lookup serve (all of them without one)."""
            if bound is None:
                return cands
            if threshold is None or explore:
                return []
            return [c for c in cands if c[0] in feats and score_of(model, feats[c[0]]) >= threshold]

        safe = bound is None or (
            threshold is not None
            and not explore
            and bool(found)
            and score_of(model, feats[found[0][0]]) >= threshold
        )
        # The common lookup: serve the most similar candidate in the same round trip.
        # When it is the only one, or the only one within ``similarity_tie_margin`` of
        # the top, the ranking would put it first whatever the arms say; the hit script
        # refuses it for what ranking would skip it for (gone, expired, under the
        # serving bar or its similarity bar) and for the one thing ranking puts before
        # it: the question's own entry, when that is another (the digest, checked in the
        # script). If it is this one, it is served as such, under its own bar. With
        # rivals within the margin, the script also reads their arms and serves it only
        # if the bandit would rank it first whatever it drew (arms without evidence
        # score their mean, so entries without feedback rank by similarity and
        # confidence); if not, or refused, it returns every candidate's state and they
        # are ranked here as usual, one round trip later.
        tie = bool(found) and not clear_leader(found, policy.rl.similarity_tie_margin)
        if self._speculate and safe and found and not (tie and len(found) > _TIE_MAX):
            spec = found[0]
            rivals: list[tuple[str, float]] = []
            if tie:
                floor = spec[1] - policy.rl.similarity_tie_margin
                rivals = servable([c for c in found[1:] if c[1] >= floor])
            # every candidate's id, the leader first and its rivals next (plan_hit)
            tied = [eid for eid, _ in rivals]
            ids = [spec[0], *tied, *(e for e, _ in found[1:] if e not in tied)] if tied else []
            # the script also peeks at the log: the lookup's one command, usually
            plan = self._plan_hit(
                tenant,
                *spec,
                policy,
                exact_bar,
                asked=digest,
                rivals=rivals,
                candidates=ids,
                peek=position if live else None,
            )
        folded = spec is not None and live
        parts: list[ReadPlan[Any] | ScriptCall[Any]] = []
        if not folded:
            parts.append(st.peek_log(tenant, position) if live else st.read_dim(tenant))
        misses = self.counts.send_misses(tenant)
        if misses is not None:
            parts.append(misses)
        report = st.report_suspects(tenant)  # corrupt ids found here: for the worker
        if report is not None:
            parts.append(report)
        mono = time.monotonic()
        traffic = self.counts.due(tenant, mono)
        if traffic is not None:
            traffic_at = len(parts)
            parts.append(st.count_traffic(tenant, *traffic))
            savings = self.counts.send_savings(tenant)  # sent as often as the traffic
            if savings is not None:
                parts.append(savings)
        if refresh:  # read the policy again for the next lookups, in this round trip
            policy_at = len(parts)
            parts.append(read_policy(st, tenant))
            parts.append(st.register(tenant))
        digest_at = len(parts)
        if spec is None:
            parts.append(st.read_digest(tenant, digest))
            if found:
                parts.append(st.read_states(tenant, [eid for eid, _ in found]))
        else:
            parts.append(plan)
        replies = yield from st.send_flow("lookup", parts)  # a lone script: its EVALSHA alone
        # the log's news (or without the index, the tenant's dimension)
        head = replies[-1].log if folded else replies[0]
        exact_id: str | None = replies[-1].own if spec is not None else replies[digest_at]
        if refresh:
            self._policies[tenant] = (mono, replies[policy_at])
        if exact_id is None:  # an exact repeat is counted once its level is known
            self.counts.near(tenant, found, feats, mono, policy, bound is not None)
        if traffic is not None and self.counts.over_window(replies[traffic_at], policy):
            yield from self.counts.halve(tenant, policy)
        changed = False
        if live:
            changed = yield from self.indexes.catch_up(ti, head, position)
            if not ti.built:  # the catch-up found a rebuild necessary: a bounded wait
                yield from self.indexes.await_index(ti, self.indexes.build_wait(ti, True))
        elif vec is not None and head is not None and head != len(vec):
            raise DimensionMismatchError(tenant, head, len(vec))
        states = StateBatch()
        ghosts: set[str] = set()  # ids this replica indexes that Redis no longer has
        asked = exact_id  # the question's own entry, if cached
        if spec is not None:
            outcome: HitOutcome = replies[-1]
            if outcome.served is not None:
                if spec[0] == exact_id:  # the question itself: an exact hit, similarity 1
                    spec = (spec[0], 1.0)
                exact = spec[0] == exact_id
                served = self._spec_hit(tenant, spec, outcome, exact, policy)
                return Found(served, n_found, False, self._asked(exact_id, served))
            if outcome.states is not None:  # a tie's (or a refused leader's) candidates
                states = outcome.states
                ghosts.update(states.missing)
            if outcome.status is HitStatus.GONE:
                ghosts.add(spec[0])
            elif exact_bar is not None and spec[0] == exact_id:  # under its bar: verify
                level = exact_level(outcome.reward) if outcome.reward is not None else 0
                return self._verify_exact(tenant, query, scope, exact_id, n_found, level)
        elif found:
            states = replies[-1]
            ghosts.update(states.missing)
        self.indexes.check_dim(tenant, ti, vec)
        if changed:
            found = self._search(ti, vec, scope, policy)
            feats = self._features(found, policy)
        # A near match that gave way to the question's own entry, or to the bandit's
        # ranking of a tie, stays a candidate.
        tried = (
            {spec[0]}
            if spec is not None and replies[-1].status not in (HitStatus.NOT_OWN, HitStatus.TIED)
            else set()
        )
        found = [(eid, sim) for eid, sim in found if eid not in tried]
        if exact_id in tried:
            exact_id = None
        now = yield from self._now()

        near = servable(found)
        hit = None
        if exact_id is not None and not near and exact_id not in states.entries:
            # The question itself and no near match (an index still building, or an
            # embedding far from the cached question's): nothing to rank, so the hit
            # script alone decides, without reading the entry's state first.
            tried.add(exact_id)
            plan = self._plan_hit(tenant, exact_id, 1.0, policy, exact_bar)
            outcome = yield from st.run_flow(plan)
            if outcome.served is not None:
                hit = self._spec_hit(tenant, (exact_id, 1.0), outcome, True, policy)
            elif outcome.status is HitStatus.GONE:
                ghosts.add(exact_id)
            elif exact_bar is not None:
                level = exact_level(outcome.reward) if outcome.reward is not None else 0
                return self._verify_exact(tenant, query, scope, exact_id, n_found, level)
            exact_id = None
        if hit is None:
            refused: dict[str, int] = {}
            hit = yield from self._serve_best(
                tenant, near, exact_id, states, now, ghosts, tried, policy, exact_bar, refused
            )
            if asked is not None and asked in refused:
                level = refused[asked]
                return self._verify_exact(tenant, query, scope, asked, n_found, level)
        if hit is None and ghosts:
            # Ghosts (left by a FLUSHALL, an empty restart, a lost log event) take places
            # in the top-k that live entries should have: forget them and search again.
            log.debug("tenant %s: %d ids gone from Redis left the index", tenant, len(ghosts))
            ti.forget(ghosts)
            again = self._search(ti, vec, scope, policy)
            feats = self._features(again, policy)
            found = [f for f in again if f[0] not in tried]
            if found:
                hit = yield from self._serve_best(
                    tenant, servable(found), None, states, now, ghosts, tried, policy
                )
        if hit is None and vec is not None:
            hit = yield from self._serve_wider(
                ti, vec, scope, policy, n_found, states, now, ghosts, tried, servable, feats
            )
        if hit is not None:
            return Found(hit, n_found, False, self._asked(asked, hit))
        self.counts.miss(tenant)
        verify = False
        if bound is not None and found:
            rest = [f for f in found if f[0] not in ghosts]
            verify = yield from self._ask_verification(
                tenant, query, scope, rest, states, now, policy, feats
            )
        return Found(None, n_found, verify, self._asked(asked, None))

    def _ask_verification(
        self,
        tenant: str,
        query: str,
        scope: str,
        found: list[tuple[str, float]],
        states: StateBatch,
        now: float,
        policy: TenantPolicy,
        feats: dict[str, Features],
    ) -> Flow[bool]:
        """A miss under a bound: ask the app's next put of this question to verify the
        best candidate (a ticket, ``verification.py``). False when none is servable."""
        missing = [eid for eid, _ in found if eid not in states.entries]
        if missing:
            states.entries.update(
                (yield from self.storage.load_states_flow(tenant, missing)).entries
            )
        ranked = self._candidates(found, None, states, now, policy)
        if not ranked:
            return False
        (eid, sim, _), _, _ = ranked[0]
        self._tickets.put(ticket_key(tenant, query, scope), Ticket(eid, sim, feats.get(eid)))
        return True

    def _lookup_policy(self, tenant: str) -> Flow[tuple[TenantPolicy, bool]]:
        """The tenant's policy for a lookup, and whether the lookup should read it again
        in its own pipeline. A policy is used at most ``policy_refresh_s`` after it was
        read: older (or none yet), it is read first, a round trip of its own; past half
        that age, the lookup's pipeline reads it for the next lookups, so that a replica
        with steady traffic never pays the round trip."""
        cached = self._policies.get(tenant)
        refresh_s = self.config.policy_refresh_s
        age = time.monotonic() - cached[0] if cached is not None else math.inf
        if cached is None or age > refresh_s:
            policy = yield from self._tenant_policy(tenant, fresh=True, register=True)
            return policy, False
        return cached[1], age > refresh_s / 2

    def _tenant_policy(
        self, tenant: str, *, fresh: bool = False, register: bool = False
    ) -> Flow[TenantPolicy]:
        """The tenant's policy: this manager's configuration with the tenant's stored
        settings on top (``zerda_cache.policy``), read from Redis when the cached one is
        older than ``policy_refresh_s`` (or ``fresh``). ``register``: add the tenant to
        the registry in the same round trip (lookups do; a refused put must not)."""
        validate_tenant(tenant)
        cached = self._policies.get(tenant)
        mono = time.monotonic()
        if not fresh and cached is not None and mono - cached[0] <= self.config.policy_refresh_s:
            return cached[1]
        st = self.storage
        parts: list[ReadPlan[Any]] = [read_policy(st, tenant)]
        if register:
            parts.append(st.register(tenant))
        replies = yield from st.read_flow(st.batch("policy", parts))
        policy: TenantPolicy = replies[0]
        self._policies[tenant] = (mono, policy)
        return policy

    def read_tenant_policy_flow(self, tenant: str) -> Flow[TenantPolicy]:
        """The tenant's policy as this manager applies it, read from Redis now."""
        return (yield from self._tenant_policy(tenant, fresh=True))

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
        return (yield from self._tenant_policy(tenant, fresh=True))

    def _serve_best(
        self,
        tenant: str,
        found: list[tuple[str, float]],
        exact_id: str | None,
        states: StateBatch,
        now: float,
        ghosts: set[str],
        tried: set[str],
        policy: TenantPolicy,
        exact_bar: float | None = None,
        refused: dict[str, int] | None = None,
    ) -> Flow[CacheHit | None]:
        """Rank the candidates and serve the best one the hit script accepts; ids found
        gone from Redis are added to ``ghosts``, every id tried to ``tried``. With
        ``exact_bar``, the question's own entry is served only if its expected reward
        reaches it; if it does not (or the entry is not servable), nothing else is tried
        and its id goes to ``refused`` with its level: an exact repeat is never served
        another question's answer instead."""
        missing = [eid for eid, _ in found if eid not in states.entries]
        if exact_id is not None and exact_id not in states.entries:
            missing.append(exact_id)
        if missing:
            more = yield from self.storage.load_states_flow(tenant, missing)
            states.entries.update(more.entries)
            ghosts.update(more.missing)
        ranked = self._candidates(found, exact_id, states, now, policy)
        own_first = bool(ranked) and ranked[0][2]

        def refuse(eid: str) -> None:
            entry = states.entries.get(eid)
            if refused is not None:
                arm = entry.bandit_arm.at(now, policy.rl) if entry is not None else None
                refused[eid] = exact_level(arm.expected_reward) if arm is not None else 0

        exact_asked = exact_bar is not None and exact_id is not None and exact_id not in ghosts
        if exact_asked and not own_first and exact_id is not None:
            # the question's own entry is not servable: nothing else is served instead
            refuse(exact_id)
            return None
        for cand, score, exact in ranked:
            tried.add(cand[0])
            plan = self._plan_hit(tenant, cand[0], cand[1], policy, exact_bar if exact else None)
            outcome = yield from self.storage.run_flow(plan)
            if outcome.served is not None:
                return self._hit(tenant, cand, score, exact, outcome.served)
            if outcome.status is HitStatus.GONE:
                ghosts.add(cand[0])
            elif exact_bar is not None and exact:
                refuse(cand[0])
                return None
        return None

    def _serve_wider(
        self,
        ti: TenantIndex,
        vec: Vector,
        scope: str,
        policy: TenantPolicy,
        n_found: int,
        states: StateBatch,
        now: float,
        ghosts: set[str],
        tried: set[str],
        servable: Callable[[list[tuple[str, float]]], list[tuple[str, float]]],
        feats: dict[str, Features],
    ) -> Flow[CacheHit | None]:
        """A miss whose window of ``top_k`` candidates was full: the nearest ones may all
        be unservable (expired until the worker's next cycle, marked wrong under
        ``min_reward_to_serve``, under their own similarity bar) and hide a servable
        match further out. Search ever wider (``_WIDEN_FACTOR`` times, up to
        ``_WIDEST_WINDOW`` candidates) and serve the best of the new ones. A miss with a
        window that was not full has no candidate further out: nothing is searched."""
        window = policy.config.top_k
        seen = set(states.entries) | tried | ghosts  # every candidate read or tried
        full = n_found >= window
        while full and window < _WIDEST_WINDOW:
            window = min(window * _WIDEN_FACTOR, _WIDEST_WINDOW)
            wider = ti.search(vec, scope, window, policy.config.similarity_threshold)
            new = [c for c in wider if c[0] not in seen]
            seen.update(eid for eid, _ in new)
            feats.update(self._features(new, policy))
            if new:
                hit = yield from self._serve_best(
                    ti.keys.tenant, servable(new), None, states, now, ghosts, tried, policy
                )
                if hit is not None:
                    return hit
            full = len(wider) >= window
        return None

    def _plan_hit(
        self,
        tenant: str,
        entry_id: str,
        similarity: float,
        policy: TenantPolicy,
        exact_bar: float | None = None,
        asked: str | None = None,
        rivals: Sequence[tuple[str, float]] = (),
        candidates: Sequence[str] = (),
        peek: str | None = None,
    ) -> ScriptCall[HitOutcome]:
        """The hit script's call; ``exact_bar``: the expected reward the question's own
        entry needs under a bound (``Calibration.exact_plan``), over the serving bar.
        ``asked``: the question's exact-match digest, for a speculative near match, which
        the script serves as the question's own entry (under ``exact_bar``) only if it is
        that, and not at all if the question has another. ``rivals``, ``candidates``: a
        speculative near match's tie, and ``peek``, the lookup's position in the log
        (``StoragePlans.plan_hit``)."""
        bar = policy.rl.serve_bar
        if exact_bar is not None and asked is None:
            bar = max(bar if bar is not None else 0.0, exact_bar)
        return self.storage.plan_hit(
            tenant,
            entry_id,
            refresh_ttl=policy.config.refresh_ttl_on_hit,
            min_reward=bar,
            similarity=similarity,
            rl=policy.rl,
            asked=asked,
            own_bar=exact_bar if asked is not None else None,
            rivals=rivals,
            candidates=candidates,
            peek=peek,
        )

    def _verify_exact(
        self, tenant: str, query: str, scope: str, entry_id: str, n_found: int, level: int
    ) -> Found:
        """Not served: the question's own entry is under its bar under a bound (its
        ``level`` is not proven safe enough, or this lookup explores). The app's next
        put of the question verifies it (``_verify``: an exact label at that level)."""
        self.counts.miss(tenant)
        ticket = Ticket(entry_id, 1.0, None, level, exact=True)
        self._tickets.put(ticket_key(tenant, query, scope), ticket)
        return Found(None, n_found, True, level)

    @staticmethod
    def _asked(exact_id: str | None, hit: CacheHit | None) -> int | None:
        """The level of an exact repeat's entry (``None``: the lookup was not one),
        known when it was served; 0 when not (a near match served instead)."""
        if exact_id is None:
            return None
        if hit is not None and hit.exact:
            return exact_level(hit.expected_reward)
        return 0

    @staticmethod
    def _search(
        ti: TenantIndex, vec: Vector | None, scope: str, policy: TenantPolicy
    ) -> list[tuple[str, float]]:
        if vec is None:
            return []
        cfg = policy.config
        return ti.search(vec, scope, cfg.top_k, cfg.similarity_threshold)

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
    ) -> Flow[PutResult]:
        """Cache ``response`` as the answer to ``query``. ``tags``: labels to invalidate
        it by later (``invalidate_tag``): the document it was built on, its source.
        ``usage``: what the LLM call that made it cost (``LLMUsage``, or the OpenAI
        response's ``usage`` with its ``model``): each hit then counts as that call
        saved (``stats(tenant)["savings"]``, the ``zerda_cache_saved_*`` metrics).

        The admission check runs first; a refused answer is not cached and the result
        says why. An earlier entry for the same normalised question and scope is replaced,
        and so is a near-duplicate when ``config.dedup_threshold`` is set.

        Raises:
            InvalidTenantError: a bad tenant id; nothing is written.
            InvalidEntryError: a bad query, answer, scope, TTL, metadata, tags or usage;
                nothing is written.
            InvalidEmbeddingError: a bad embedding, or none and no ``embed_fn``.
            DimensionMismatchError: an embedding of another dimension than the tenant's.
            StorageError: Redis failed.
        """
        with self._counting("put"):
            keys = self.storage.keys(tenant)
            query = check_query(query, self.config.max_query_chars)
            scope = check_scope(scope)
            # checked before anything is written (a verification below writes labels)
            tag_names = check_tags(tags) if tags is not None else ()
            cost_of = LLMUsage.of(usage)
            vec = yield from self._embedding(query, embedding)
            if vec is None:
                raise InvalidEmbeddingError(
                    "no embedding: pass embedding=... or create the manager with an embed_fn"
                )
            passed, warnings = self._admit(tenant, query, response, metadata)
            policy = yield from self._tenant_policy(tenant)
            dedup = policy.config.dedup_threshold
            if not passed:
                return PutResult(
                    False,
                    reason=warnings[0] if warnings else "admission check failed",
                    warnings=tuple(warnings),
                    tenant=tenant,
                )
            held_key = ticket_key(tenant, query, scope)
            held = self._tickets.get(held_key)
            own: bool | None = None
            replaced_answer: str | None = None
            if held is not None and held.exact:
                self._tickets.pop(held_key)
                plain = (ttl_s, quality, metadata, cost_of) == (None,) * 4 and not tag_names
                own, replaced_answer, kept = yield from self._settle_own(
                    tenant, held, response, plain
                )
                if kept:
                    self.metrics.puts.labels(self.metrics.tenant(tenant), "kept").inc()
                    return PutResult(
                        True, held.entry_id, warnings=tuple(warnings), tenant=tenant, verified=True
                    )
            near: str | None = None
            if dedup is not None:
                near = yield from self._near_duplicate(keys, vec, scope, dedup)
            indexed = self.indexes.get(tenant)
            out = yield from self.storage.put_flow(
                tenant,
                query,
                response,
                vec,
                scope=scope,
                ttl_s=ttl_s,
                quality=quality,
                metadata=metadata,
                index_dim=indexed.dim if indexed is not None and indexed.usable else None,
                rl=policy.rl,
                tags=tag_names,
                usage=cost_of,
            )
            replaced, result = self._put_done(tenant, warnings, out, near)
            if own is not None:
                result = dataclasses.replace(result, verified=own)
            if own is False and held is not None and replaced_answer is not None:
                yield from self._dispute(tenant, out.entry_id, held.level, replaced_answer)
            elif own and out.entry_id != (held.entry_id if held is not None else None):
                # The same answer, stored anew (the old entry had expired, or this put
                # sets its own TTL or metadata): the fresh entry is confirmed too.
                yield from self._confirm(tenant, out.entry_id, policy)
            # Verify before the replaced entries go: the candidate may be one of them.
            ticket = self._tickets.pop(held_key)
            if ticket is not None:
                verified, _ = yield from self._verify(tenant, ticket, response)
                result = dataclasses.replace(result, verified=verified)
                if verified and out.entry_id != ticket[0]:
                    # Two answers agree: the fresh one is confirmed too (under a bound,
                    # its exact repeats are then served without another verification).
                    yield from self._confirm(tenant, out.entry_id, policy)
            if replaced:
                yield from self.storage.evict_flow(
                    tenant, [(e, None) for e in replaced], "replaced"
                )
            return result

    def _settle_own(
        self, tenant: str, held: Ticket, response: str, plain: bool
    ) -> Flow[tuple[bool | None, str | None, bool]]:
        """Verify the question's own entry, which the lookup before held back, against
        the fresh answer: ``(same, the cached answer, kept)``. When they are the same,
        the entry stays (``kept``), with this verification's positive signal on top of
        its evidence (replaced by the fresh entry, its arm would start again from one
        signal, and its exact repeats' level with it), unless it has expired or the put
        sets a TTL, quality, metadata, tags or usage of its own (not ``plain``)."""
        own, cached = yield from self._verify(tenant, held, response)
        replaced_answer = cached.response if cached is not None else None
        if not (own and plain and cached is not None):
            return own, replaced_answer, False
        now = yield from self._now()
        return own, replaced_answer, not cached.is_expired(now)

    def _near_duplicate(
        self, keys: TenantKeys, vec: Vector, scope: str, dedup: float
    ) -> Flow[str | None]:
        """The entry a put replaces as a near duplicate (``dedup_threshold``), found in
        the replica's index: while it is being built (past the bounded wait) only the
        same question is replaced."""
        ti = self.indexes.of(keys)
        if not ti.built:
            yield from self.indexes.await_index(ti, self.indexes.build_wait(ti, True))
        if not ti.usable:
            return None
        yield from self.indexes.refresh(ti)
        self.indexes.check_dim(keys.tenant, ti, vec)
        best = ti.search(vec, scope, 1, dedup)
        return best[0][0] if best else None

    def _confirm(self, tenant: str, entry_id: str, policy: TenantPolicy) -> Flow[None]:
        """A fresh answer two verifications agree on: a positive signal on its entry."""
        agree = FeedbackSignal(entry_id, tenant, True, source="verify")
        yield from self.storage.feedback_flow(agree, rl=policy.rl)

    def _verify(
        self, tenant: str, ticket: Ticket, fresh: str
    ) -> Flow[tuple[bool | None, IntelligentCacheEntry | None]]:
        """Compare the fresh answer with the candidate a lookup held back, and learn from
        it: one label of the tenant's calibration (with the match's features), one signal
        on the entry's arm (at the similarity it was matched at). Returns whether they
        were the same (``None`` when the candidate is gone meanwhile or the judge
        failed) and the candidate as read.

        The question's own entry may carry a dispute (``_dispute``): its answer replaced
        one it disagreed with, counted wrong. This verification's answer breaks the tie:
        the same as the entry's, the replaced answer stays wrong; the same as the
        replaced one, its label turns right."""
        entry_id, similarity, features, level, exact = ticket
        st = self.storage
        try:
            parts: list[ReadPlan[Any]] = [st.read_entry(tenant, entry_id, with_vector=False)]
            if exact:  # in the same round trip
                parts.append(st.read_dispute(tenant, entry_id))
            replies = yield from st.read_flow(st.batch("verify", parts))
            cached: IntelligentCacheEntry = replies[0]
            dispute: tuple[int, str] | None = replies[1] if exact else None
        except (EntryNotFoundError, CorruptEntryError) as exc:  # gone or unreadable: no label
            log.debug("tenant %s: verification of %s dropped: %s", tenant, entry_id, exc)
            return None, None
        try:  # a step: an async judge (an LLM call) is awaited by the async driver
            right = bool((yield call(self.same_answer, cached.response, fresh)))
            replaced_right = False
            if dispute is not None and not right:
                replaced_right = bool((yield call(self.same_answer, dispute[1], fresh)))
        except Exception as exc:  # the answer is stored: a failing judge labels nothing
            log.warning("tenant %s: same_answer failed, no label: %r", tenant, exc)
            return None, cached
        # An HNSW index re-scores from float16 vectors: a match can come out a hair over 1.
        sim = min(1.0, max(-1.0, similarity))
        signal = FeedbackSignal(entry_id, tenant, right, source="verify", similarity=sim)
        if features is not None:
            features = (sim, *features[1:])
        yield from self._learn(signal, label=True, features=features, level=level)
        if dispute is not None:
            yield from st.run_flow(st.plan_resolve(tenant, entry_id, dispute[0], replaced_right))
        return right, cached

    def _dispute(self, tenant: str, entry_id: str, level: int, replaced: str) -> Flow[None]:
        """Record on the fresh entry ``entry_id`` the answer it disagreed with (counted
        wrong at ``level``), for its next verification to settle (``_verify``). A
        refusal (a full server) leaves the label as it is: wrong, the safe side."""
        plan = self.storage.plan_dispute(tenant, entry_id, level, replaced)
        try:
            yield from self.storage.run_flow(plan)
        except StorageError as exc:
            log.debug("tenant %s: dispute not recorded: %s", tenant, exc)

    def _put_done(
        self, tenant: str, warnings: list[str], out: PutOutcome, near: str | None
    ) -> tuple[list[str], PutResult]:
        """The entries the new one replaces (to evict), and the result."""
        replaced = list(
            dict.fromkeys(e for e in (out.displaced_id, near) if e and e != out.entry_id)
        )
        self.metrics.puts.labels(self.metrics.tenant(tenant), "stored").inc()
        result = PutResult(
            True,
            out.entry_id,
            warnings=tuple(warnings),
            replaced_id=replaced[0] if replaced else None,
            tenant=tenant,
        )
        return replaced, result

    # -- feedback and management -----------------------------------------------------------
    def feedback_flow(self, signal: FeedbackSignal) -> Flow[None]:
        """Apply one feedback signal to the entry's arm, atomically in Redis.

        Raises:
            EntryNotFoundError: the entry does not exist in ``signal.tenant_id``.
            StorageError: Redis failed.
        """
        if not isinstance(signal, FeedbackSignal):
            raise InvalidFeedbackError(
                f"feedback expects a FeedbackSignal, got {type(signal).__name__}"
            )
        with self._counting("feedback"):
            yield from self._learn(signal)
            if signal.served and not signal.positive:
                # A hit judged wrong: its answer's call was bought after all.
                st = self.storage
                usage = yield from st.read_flow(st.read_usage(signal.tenant_id, signal.entry_id))
                if usage is not None:
                    self._count_savings(signal.tenant_id, "wrong", usage)
                    increments = stat_fields("wrong", usage)
                    yield from st.read_flow(st.count_stats(signal.tenant_id, increments))
        polarity = "positive" if signal.positive else "negative"
        self.metrics.feedback.labels(self.metrics.tenant(signal.tenant_id), polarity).inc()

    def _learn(
        self,
        signal: FeedbackSignal,
        *,
        label: bool = False,
        features: Features | None = None,
        level: int = 0,
    ) -> Flow[None]:
        """Apply a signal to the entry's arm and count it as a labelled outcome of a near
        match (at the similarity it carries, below 1) when ``label`` (a verification) or
        when an error bound is known for the tenant (this replica's cached policy or the
        config). The label is counted only once the signal was applied. ``level``: a
        verified exact repeat's entry's level at its lookup."""
        tenant, sim = signal.tenant_id, signal.similarity
        policy = yield from self._tenant_policy(tenant)
        label = label or policy.bound() is not None
        yield from self.storage.feedback_flow(signal, rl=policy.rl)
        # A label of a near match (below similarity 1); at 1, only a verification of an
        # exact repeat is one, counted apart at its entry's level.
        exact = sim is not None and sim >= 1.0
        if label and sim is not None and (not exact or signal.source == "verify"):
            plan = plan_label(
                self.storage,
                tenant,
                sim,
                signal.positive,
                window=policy.config.label_window,
                features=features,
                model=policy.calibration.model,
                exact=exact,
                level=level,
            )
            yield from self.storage.run_flow(plan)
        self.learner.note_feedback(signal)

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
    def _embedding(self, query: str, embedding: object | None) -> Flow[Vector | None]:
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

    @staticmethod
    def _features(found: list[tuple[str, float]], policy: TenantPolicy) -> dict[str, Features]:
        """The match features of every candidate of a search (``match_model.py``)."""
        floor = policy.config.similarity_threshold
        return {eid: f for (eid, _), f in zip(found, candidate_features(found, floor), strict=True)}

    def _now(self) -> Flow[float]:
        """The storage clock, estimated locally: the server's time, measured once a
        minute, plus the local time elapsed since (ranking needs no more precision; the
        scripts read the server's clock themselves)."""
        if self.storage.clock is not None:
            return float(self.storage.clock())
        mono = time.monotonic()
        if self._clock_sync is None or mono - self._clock_sync[0] > _CLOCK_RESYNC_S:
            self._clock_sync = (mono, (yield from self.storage.now_flow()))
        return self._clock_sync[1] + (mono - self._clock_sync[0])

    # -- ranking ---------------------------------------------------------------------------
    def _candidates(
        self,
        found: Sequence[tuple[str, float]],
        exact_id: str | None,
        states: StateBatch,
        now: float,
        policy: TenantPolicy,
    ) -> list[tuple[tuple[str, float, IntelligentCacheEntry], float, bool]]:
        """Rank the servable candidates: ``((id, similarity, entry), score, exact)``."""
        sims, rl = dict(found), policy.rl
        if exact_id is not None:
            sims[exact_id] = 1.0
        cands = []
        for eid, sim in sims.items():
            entry = states.entries.get(eid)
            if entry is None or entry.is_expired(now):
                continue
            entry.bandit_arm = entry.bandit_arm.at(now, rl)
            if not self.learner.is_servable(entry, rl) or sim < entry.similarity_bar:
                continue
            cands.append((eid, sim, entry))
        # A canonical order before the draws, so that a seeded learner reproduces its
        # choices whatever order the index or Redis returned the candidates in.
        cands.sort(key=lambda c: (-c[1], c[2].created_at, c[0]))
        scored = self.learner.score_candidates(cands, rl)
        # The question asked exactly is served its own answer while that is servable.
        scored.sort(key=lambda item: item[0][0] != exact_id)
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
            usage=served.usage,
        )

    def _spec_hit(
        self,
        tenant: str,
        cand: tuple[str, float],
        outcome: HitOutcome,
        exact: bool,
        policy: TenantPolicy,
    ) -> CacheHit:
        """The hit of a candidate served without ranking, scored as ranking scores it: on
        its confidence before this use (the hit script recomputes it), so that its score
        is the same whichever way it was served."""
        served = outcome.served
        assert served is not None
        after = served.confidence_score
        if outcome.ranked_confidence is not None:
            served.confidence_score = outcome.ranked_confidence
        ((scored, score),) = self.learner.score_candidates([(cand[0], cand[1], served)], policy.rl)
        served.confidence_score = after
        return self._hit(tenant, scored, score, exact, served)

    def _count_savings(self, tenant: str, kind: str, usage: LLMUsage) -> None:
        """A hit's avoided call (``kind`` "saved": counted in Redis with the next traffic
        flush) or a wrong hit's (written by the feedback), in this replica's metrics."""
        if kind == "saved":
            self.counts.saved(tenant, usage)
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
        if self._outage_since is not None:
            log.warning(
                "zerda-cache: Redis is back after %.1f s; lookups served again",
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None

    def _record_lookup(
        self,
        tenant: str,
        query: str,
        hit: CacheHit | None,
        started: float,
        candidates: int,
        verify: bool = False,
    ) -> None:
        result = "hit" if hit is not None else ("verify" if verify else "miss")
        elapsed = time.perf_counter() - started
        self.metrics.lookup_done(tenant, result, elapsed)
        self._adapt(query, len(hit.response) if hit else 0, candidates, elapsed, True)

    def _adapt(
        self, query: str, length: int, candidates: int, seconds: float, passed: bool
    ) -> None:
        self.adaptive.record(query, _UNANALYSED, length, candidates, seconds * 1000.0, passed)

    def _admit(
        self, tenant: str, query: str, response: object, metadata: Mapping[str, Any] | None
    ) -> tuple[bool, list[str]]:
        response = check_response(response, self.config.max_response_bytes)
        started = time.perf_counter()
        passed, warnings = self.admission(query, response, metadata or {})
        self._adapt(query, len(response), 0, time.perf_counter() - started, passed)
        label = self.metrics.tenant(tenant)
        if not passed:
            reason = warnings[0] if warnings else "admission check failed"
            self.metrics.puts.labels(label, "rejected").inc()
            self.metrics.puts_rejected.labels(_reason_label(reason)).inc()
        return passed, list(warnings)

    # -- verification state (no Redis) -----------------------------------------------------
    def awaiting_verification(self, query: str, *, tenant: str, scope: str | None = None) -> bool:
        """Is a verification of ``query`` pending on this replica: did a lookup under an
        error bound hold a candidate back, so that the next ``put`` of this question (in
        the same scope, within 15 minutes) compares its answer with the candidate's?

        ``lookup`` returns ``None`` both for a miss and for such a verify; call this right
        after a ``None`` to tell them apart (the HTTP service's ``decision``). It reads this
        replica's memory only, as ``put`` does, so a put sent to another replica verifies
        nothing. A lookup that leaves a ticket makes this true until that put; a put of
        the question, or 15 minutes, makes it false again.

        Raises:
            InvalidTenantError, InvalidEntryError: bad input, as ``lookup`` would.
        """
        tenant = validate_tenant(tenant)
        query = check_query(query, self.config.max_query_chars)
        key = ticket_key(tenant, query, check_scope(scope))
        return self._tickets.get(key) is not None


#: What the engine tells the adaptive windows of a query it does not analyse (``record``
#: keeps the numbers, not the analysis): one frozen value, not a checked dataclass made
#: per lookup.
_UNANALYSED = QueryAnalysis(query="", complexity=QueryComplexity.LOW, context_budget=0)


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


#: A miss whose ``top_k`` nearest candidates were all unservable searches this many
#: times wider, again and again, up to ``_WIDEST_WINDOW`` candidates (``_serve_wider``).
_WIDEN_FACTOR = 4
_WIDEST_WINDOW = 256


def _reason_label(reason: str) -> str:
    """A bounded metric label from a free-form reason: its first few words."""
    words = "".join(c if c.isalnum() else " " for c in reason.lower()).split()
    return "_".join(words[:4]) or "unknown"


__all__ = ["CacheEngine", "EmbedFn"]
