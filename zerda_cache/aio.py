"""asyncio flavour: ``AsyncRedisStorage`` and ``AsyncCacheManager`` over ``redis.asyncio``.

Same methods, same results, as coroutines. Everything that does no I/O (validation, script
arguments, reply parsing, log deltas, ranking) is shared with the sync classes, so the two
cannot drift apart; ``tests/test_manager.py`` runs one sequence through both and compares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio
import redis.exceptions

from zerda_cache import codec
from zerda_cache.codec import Vector
from zerda_cache.config import CacheConfig
from zerda_cache.entry import IntelligentCacheEntry
from zerda_cache.errors import StorageError, ZerdaError
from zerda_cache.keys import TenantKeys, validate_tenant
from zerda_cache.manager import (
    _CLOCK_RESYNC_S,
    AdmissionCheck,
    CacheHit,
    EmbedFn,
    PutResult,
    _ManagerCore,
    client_options,
)
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.policy_learner import CachePolicyLearner, FeedbackSignal
from zerda_cache.replica import LogDelta, TenantIndex
from zerda_cache.storage import (
    DecayOutcome,
    EvictOutcome,
    FeedbackOutcome,
    HitOutcome,
    PutOutcome,
    ReadPlan,
    ScriptCall,
    StateBatch,
    StorageOps,
    is_cluster,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@contextlib.asynccontextmanager
async def _wrap(what: str) -> AsyncIterator[None]:
    try:
        yield
    except ZerdaError:
        raise
    except (TimeoutError, redis.exceptions.RedisError) as exc:
        raise StorageError(f"{what} failed: {exc}") from exc


class AsyncRedisStorage(StorageOps):
    """``RedisStorage`` for ``redis.asyncio`` clients (plain or cluster)."""

    def __init__(
        self,
        client: Any,
        config: CacheConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(client, config, clock=clock)

    async def run(self, call: ScriptCall[T]) -> T:
        async with _wrap(call.script):
            res = await getattr(self.scripts, call.script)(keys=call.keys, args=call.args)
        return call.parse(res)

    async def read(self, plan: ReadPlan[T]) -> T:
        async with _wrap(plan.name):
            pipe = self.client.pipeline(transaction=False)
            plan.queue(pipe)
            res = await pipe.execute()
        return plan.parse(res)

    async def now(self) -> float:
        if self.clock is not None:
            return float(self.clock())
        async with _wrap("TIME"):
            sec, usec = await self.client.time()
        return float(sec) + float(usec) / 1_000_000

    async def put(
        self, tenant: str, query: str, response: str, embedding: object, **kw: Any
    ) -> PutOutcome:
        out = await self.run(self.plan_put(tenant, query, response, embedding, **kw))
        if self.needs_registration(tenant):
            async with _wrap("register tenant"):
                await self.client.sadd(self.tenants_key, tenant)
            self._registered_tenants.add(tenant)
        return out

    async def hit(
        self,
        tenant: str,
        entry_id: str,
        *,
        refresh_ttl: bool = False,
        min_reward: float | None = None,
        similarity: float | None = None,
    ) -> HitOutcome:
        return await self.run(
            self.plan_hit(
                tenant,
                entry_id,
                refresh_ttl=refresh_ttl,
                min_reward=min_reward,
                similarity=similarity,
            )
        )

    async def feedback(self, signal: FeedbackSignal) -> FeedbackOutcome:
        (result,) = await self.run(self.plan_feedback([signal]))
        if isinstance(result, ZerdaError):
            raise result
        return result

    async def decay(self, tenant: str, entry_ids: Sequence[str]) -> DecayOutcome:
        if not entry_ids:
            return DecayOutcome(0, 0, [])
        return await self.run(self.plan_decay(tenant, entry_ids))

    async def evict(
        self, tenant: str, candidates: Sequence[tuple[str, int | None]], reason: str
    ) -> EvictOutcome:
        call = self.plan_evict(tenant, candidates, reason)
        if not candidates:
            return EvictOutcome([], [], [])
        return await self.run(call)

    async def invalidate(self, tenant: str, entry_id: str) -> bool:
        return bool((await self.evict(tenant, [(entry_id, None)], "invalidated")).removed)

    async def get_entry(
        self, tenant: str, entry_id: str, *, with_vector: bool = True
    ) -> IntelligentCacheEntry:
        return await self.read(self.read_entry(tenant, entry_id, with_vector=with_vector))

    async def load_states(self, tenant: str, entry_ids: Sequence[str]) -> StateBatch:
        if not entry_ids:
            return StateBatch()
        return await self.read(self.read_states(tenant, entry_ids))

    async def vectors(
        self, tenant: str, entry_ids: Sequence[str]
    ) -> dict[str, tuple[codec.Vector, str]]:
        if not entry_ids:
            return {}
        return await self.read(self.read_vectors(tenant, entry_ids))

    async def stats(self, tenant: str) -> dict[str, int]:
        return await self.read(self.read_stats(tenant))

    async def iter_ids(
        self, tenant: str, batch: int | None = None
    ) -> AsyncIterator[list[tuple[str, float]]]:
        k = self.keys(tenant)
        count = batch or self.config.eviction.scan_batch
        cursor = 0
        while True:
            async with _wrap("iter_ids"):
                cursor, items = await self.client.zscan(k.ids, cursor=cursor, count=count)
            if items:
                yield [(_s(member), float(score)) for member, score in items]
            if int(cursor) == 0:
                return

    async def reset_tenant(self, tenant: str) -> None:
        k = self.keys(tenant)
        async with _wrap("reset_tenant"):
            pipe = self.client.pipeline(transaction=False)
            pipe.unlink(k.stats, k.fb)
            pipe.hdel(k.cfg, "dim")
            await pipe.execute()


def _s(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


class AsyncCacheManager(_ManagerCore):
    """``CacheManager`` for asyncio apps: the same methods, awaited.

    Args are those of ``CacheManager``; ``client`` is a ``redis.asyncio`` client.
    """

    storage: AsyncRedisStorage

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
        self.storage = AsyncRedisStorage(client, config, clock=clock)
        self.client = client
        self._clock_sync: tuple[float, float] | None = None
        self._locks: dict[str, asyncio.Lock] = {}
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
    ) -> AsyncCacheManager:
        """As ``CacheManager.from_url``, with a ``redis.asyncio`` client."""
        cfg = config if config is not None else CacheConfig()
        url, is_cluster_url, options = client_options(url, cfg, cluster)
        client: Any
        if is_cluster_url:
            from redis.asyncio.cluster import RedisCluster

            client = RedisCluster.from_url(url, **options)
        else:
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            client = redis.asyncio.Redis.from_url(url, retry=Retry(NoBackoff(), 1), **options)
        return cls(client, cfg, embed_fn=embed_fn, **kwargs)

    async def aclose(self) -> None:
        for tenant in list(self._pending_misses):
            with contextlib.suppress(StorageError):
                await self._flush_misses(tenant)
        await self.client.aclose()

    async def _flush_misses(self, tenant: str) -> None:
        pending = self._pending_misses.pop(tenant, 0)
        if pending:
            async with _wrap("count misses"):
                await self.client.hincrby(self.storage.keys(tenant).stats, "misses", pending)

    async def __aenter__(self) -> AsyncCacheManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _now(self) -> float:
        if self.storage.clock is not None:
            return float(self.storage.clock())
        mono = time.monotonic()
        if self._clock_sync is None or mono - self._clock_sync[0] > _CLOCK_RESYNC_S:
            self._clock_sync = (mono, await self.storage.now())
        return self._clock_sync[1] + (mono - self._clock_sync[0])

    def _lock(self, tenant: str) -> asyncio.Lock:
        lock = self._locks.get(tenant)
        if lock is None:
            lock = self._locks[tenant] = asyncio.Lock()
        return lock

    # -- lookup ----------------------------------------------------------------------------------
    async def lookup(
        self,
        query: str,
        *,
        tenant: str,
        embedding: object | None = None,
        scope: str | None = None,
    ) -> CacheHit | None:
        """See ``CacheManager.lookup``."""
        keys = self.storage.keys(tenant)
        query = self._check_query(query)
        scope = self._check_scope(scope)
        vec = self._embedding(query, embedding)
        started = time.perf_counter()  # the latency metric excludes the embedding
        try:
            hit, candidates = await self._lookup(keys, query, vec, scope)
        except StorageError as exc:
            self._fail_open(tenant, exc)
            return None
        self._recovered()
        self._record_lookup(tenant, query, hit, started, candidates)
        return hit

    async def _lookup(
        self, keys: TenantKeys, query: str, vec: Vector | None, scope: str
    ) -> tuple[CacheHit | None, int]:
        """The hit (or None) and how many candidates the index found."""
        tenant, cfg, st = keys.tenant, self.config, self.storage
        ti = self._tenant_index(keys)
        if not ti.built:
            await self._build(ti)
        self._check_dim(tenant, ti, vec)

        def search() -> list[tuple[str, float]]:
            if vec is None:
                return []
            return ti.search(vec, scope, cfg.top_k, cfg.similarity_threshold)

        found = search()
        n_found = len(found)
        position = ti.last_id
        async with _wrap("lookup"):
            pipe = self.client.pipeline(transaction=False)
            parse = self._queue_first_read(pipe, ti, query, scope, found, self._speculate)
            got = parse(await pipe.execute(raise_on_error=False))
        changed = await self._catch_up(ti, ti.parse_catchup(got.first, got.new), position)
        if got.spec_id is not None:
            outcome = got.spec_outcome
            if got.spec_noscript:
                outcome = await st.hit(
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
        now = await self._now()
        states = got.states
        missing = [eid for eid, _ in found if eid not in states.entries]
        if exact_id is not None and exact_id not in states.entries:
            missing.append(exact_id)
        if missing:
            states.entries.update((await st.load_states(tenant, missing)).entries)
        for cand, score, exact in self._candidates(found, exact_id, states, now):
            outcome = await st.hit(
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

    async def _catch_up(self, ti: TenantIndex, delta: LogDelta, position: str) -> bool:
        st = self.storage
        changed = False
        async with self._lock(ti.keys.tenant):
            if ti.last_id != position:
                delta = await self._read_delta(ti)
                changed = True
            while True:
                if delta.maybe_trimmed and ti.trimmed_past(await self._xinfo(ti)):
                    await self._build_locked(ti)
                    return True
                if not delta.adds and not delta.dels and delta.last_id is None:
                    return changed
                vectors = await st.vectors(ti.keys.tenant, list(delta.adds)) if delta.adds else {}
                if not ti.apply(delta, vectors):
                    await self._build_locked(ti)
                    return True
                changed = True
                if not delta.more:
                    return changed
                delta = await self._read_delta(ti)

    async def _xinfo(self, ti: TenantIndex) -> Any:
        try:
            async with _wrap("xinfo"):
                return await self.client.xinfo_stream(ti.keys.log)
        except StorageError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise

    async def _read_delta(self, ti: TenantIndex) -> LogDelta:
        async with _wrap("catch-up"):
            pipe = self.client.pipeline(transaction=False)
            ti.queue_catchup(pipe)
            first, new = await pipe.execute()
        return ti.parse_catchup(first, new)

    async def _build(self, ti: TenantIndex) -> None:
        async with self._lock(ti.keys.tenant):
            if not ti.built:
                await self._build_locked(ti)

    async def _build_locked(self, ti: TenantIndex) -> None:
        st, tenant = self.storage, ti.keys.tenant
        ti.start_build(await self._xinfo(ti))
        async for batch in st.iter_ids(tenant):
            ti.add_scanned(await st.vectors(tenant, [eid for eid, _ in batch]))
        while True:  # replay what happened during the scan
            delta = await self._read_delta(ti)
            if not delta.adds and not delta.dels and delta.last_id is None:
                break
            vectors = await st.vectors(tenant, list(delta.adds)) if delta.adds else {}
            if not ti.apply(delta, vectors):
                return  # cleared and re-created meanwhile: stays unbuilt, rebuilt next time
            if not delta.more:
                break
        ti.finish_build()
        self.metrics.index_rebuilds.labels(self.metrics.tenant(tenant)).inc()

    async def sync_index(self, tenant: str) -> int:
        keys = self.storage.keys(tenant)
        ti = self._tenant_index(keys)
        if not ti.built:
            await self._build(ti)
        else:
            await self._catch_up(ti, await self._read_delta(ti), ti.last_id)
        return len(ti)

    def index_ids(self, tenant: str) -> set[str]:
        ti = self._indexes.get(validate_tenant(tenant))
        return set() if ti is None else ti.ids()

    # -- put, feedback, management ---------------------------------------------------------------
    async def put(
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
        """See ``CacheManager.put``."""
        with self._counting("put"):
            return await self._put(
                query, response, tenant, embedding, ttl_s, quality, metadata, scope
            )

    async def _put(
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
            await self.sync_index(tenant)
            near = self._near_duplicate(self._tenant_index(plan.keys), plan)
        out = await self.storage.put(
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
            await self.storage.evict(tenant, [(eid, None) for eid in replaced], "replaced")
        return result

    async def feedback(self, signal: FeedbackSignal) -> None:
        """See ``CacheManager.feedback``."""
        if not isinstance(signal, FeedbackSignal):
            raise TypeError(f"feedback expects a FeedbackSignal, got {type(signal).__name__}")
        with self._counting("feedback"):
            await self.storage.feedback(signal)
        self.learner.note_feedback(signal)
        polarity = "positive" if signal.positive else "negative"
        self.metrics.feedback.labels(self.metrics.tenant(signal.tenant_id), polarity).inc()

    async def invalidate(self, entry_id: str, *, tenant: str) -> bool:
        return await self.storage.invalidate(tenant, entry_id)

    async def stats(self, tenant: str) -> dict[str, Any]:
        await self._flush_misses(tenant)
        return self._stats_view(tenant, await self.storage.stats(tenant))

    async def clear(self, tenant: str) -> int:
        removed = 0
        batch = self.config.eviction.scan_batch
        while True:
            ids = [eid async for chunk in self.storage.iter_ids(tenant, batch) for eid, _ in chunk]
            if not ids:
                break
            for i in range(0, len(ids), batch):
                chunk = [(eid, None) for eid in ids[i : i + batch]]
                removed += len((await self.storage.evict(tenant, chunk, "invalidated")).removed)
        await self.storage.reset_tenant(tenant)
        return removed


__all__ = ["AsyncCacheManager", "AsyncRedisStorage"]
