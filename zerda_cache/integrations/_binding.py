"""What every framework adapter needs from the cache, written once.

``CacheBinding`` holds the manager(s) and the tenant, and makes the three calls an
adapter makes (lookup, put, feedback) in both flavours. The framework's LLM call must
never fail because of the cache: a lookup or put that raises (Redis down, an embedding
API down, an answer the admission check cannot take) is logged and treated as a miss or
as not cached. The adapters' own logic (prompt -> query and scope, answer -> text and
metadata, hit -> answer) is plain functions that do no I/O, so the sync and async methods
of an adapter differ only in the one call they make here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from zerda_cache.aio import AsyncCacheManager
from zerda_cache.core.results import CacheHit, PutResult, feedback_signal
from zerda_cache.core.validation import validate_tenant
from zerda_cache.flows.engine import CacheEngine
from zerda_cache.learning.bandit import FeedbackSignal
from zerda_cache.manager import CacheManager

log = logging.getLogger("zerda_cache.integrations")

#: The key, in a served answer's metadata (LangChain ``generation_info`` and
#: ``response_metadata``, LlamaIndex ``additional_kwargs``), of the entry it came from:
#: ``{"entry_id", "tenant", "similarity", "hit"}``. ``feedback`` reads it.
INFO_KEY = "zerda_cache"


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Where an LLM call is looked up and stored: the query text the cache embeds and
    compares, and the scope that keeps other models' and parameters' answers apart."""

    query: str
    scope: str


def digest_scope(prefix: str, *parts: str) -> str:
    """A short stable scope from ``parts`` (well under ``MAX_SCOPE_CHARS``): the
    framework's model identity can be kilobytes of parameters, and the scope is stored in
    every entry and hashed into every exact-match key."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no ambiguous joins
        h.update(data)
    return f"{prefix}-{h.hexdigest()}"


def hit_info(hit: CacheHit) -> dict[str, Any]:
    """What a served answer carries so that feedback can find its entry."""
    return {
        "entry_id": hit.entry_id,
        "tenant": hit.tenant,
        "similarity": float(hit.similarity),
        "hit": True,
    }


def put_info(result: PutResult) -> dict[str, Any]:
    """What a fresh answer that was just cached carries (its own question: similarity 1)."""
    return {"entry_id": result.entry_id, "tenant": result.tenant, "similarity": 1.0, "hit": False}


class CacheBinding:
    """A tenant of a cache, as an adapter uses it.

    Args:
        manager: a ``CacheManager`` or an ``AsyncCacheManager``.
        tenant: the tenant every entry goes to.
        async_manager: an ``AsyncCacheManager`` for the async calls, when ``manager`` is a
            ``CacheManager`` (without one, async calls run the sync manager in a worker
            thread: it is thread-safe).

    Sync calls need a sync manager: with only an ``AsyncCacheManager`` they raise
    ``TypeError`` (a redis.asyncio client is tied to its event loop and cannot be driven
    from a blocking call).
    """

    def __init__(
        self,
        manager: CacheManager | AsyncCacheManager,
        *,
        tenant: str,
        async_manager: AsyncCacheManager | None = None,
    ) -> None:
        self.tenant = validate_tenant(tenant)
        if isinstance(manager, AsyncCacheManager):
            if async_manager is not None:
                raise TypeError("manager is already an AsyncCacheManager: drop async_manager")
            self.sync: CacheManager | None = None
            self.aio: AsyncCacheManager | None = manager
        elif isinstance(manager, CacheManager):
            if async_manager is not None and not isinstance(async_manager, AsyncCacheManager):
                raise TypeError("async_manager must be an AsyncCacheManager")
            self.sync, self.aio = manager, async_manager
        else:
            raise TypeError(
                f"manager must be a CacheManager or AsyncCacheManager, got {type(manager)!r}"
            )
        engine: CacheEngine = manager
        self.config = engine.config
        #: Operations failing now (their first failure was logged as a warning).
        self._failing: set[str] = set()

    # -- what may be cached -------------------------------------------------------------
    def fits(self, key: CacheKey) -> bool:
        """Whether the cache can take this query at all (an over-long prompt goes to the
        LLM uncached instead of raising inside the framework)."""
        return len(key.query) <= self.config.max_query_chars and bool(key.query.strip())

    def metadata(self, base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
        """``base`` plus ``extra`` when the whole fits under ``max_metadata_bytes`` (the
        put would refuse it otherwise), else ``base`` alone: the answer is then cached as
        text only, which every adapter can still serve."""
        full = {**base, **extra}
        if len(msgpack.packb(full, use_bin_type=True)) <= self.config.max_metadata_bytes:
            return full
        log.debug("zerda-cache: answer metadata over max_metadata_bytes, caching text only")
        return dict(base)

    # -- the calls, fail-open -------------------------------------------------------------
    def lookup(self, key: CacheKey) -> CacheHit | None:
        manager = self._sync_manager()
        hit = None
        with self._fail_open("lookup"):  # the LLM call goes on as a miss
            hit = manager.lookup(key.query, tenant=self.tenant, scope=key.scope)
        return hit

    async def alookup(self, key: CacheKey) -> CacheHit | None:
        if self.aio is None:
            return await asyncio.to_thread(self.lookup, key)
        hit = None
        with self._fail_open("lookup"):
            hit = await self.aio.lookup(key.query, tenant=self.tenant, scope=key.scope)
        return hit

    def put(self, key: CacheKey, response: str, metadata: Mapping[str, Any]) -> PutResult | None:
        """The put's result, or ``None`` if it failed (logged; the LLM's answer is
        returned to the app all the same)."""
        manager = self._sync_manager()
        if not self._admissible(response):
            return None
        result = None
        with self._fail_open("put"):
            result = manager.put(
                key.query, response, tenant=self.tenant, scope=key.scope, metadata=metadata
            )
        return result

    async def aput(
        self, key: CacheKey, response: str, metadata: Mapping[str, Any]
    ) -> PutResult | None:
        if not self._admissible(response):
            return None
        if self.aio is None:  # the sync manager in a worker thread (it fails open itself)
            return await asyncio.to_thread(self.put, key, response, metadata)
        result = None
        with self._fail_open("put"):
            result = await self.aio.put(
                key.query, response, tenant=self.tenant, scope=key.scope, metadata=metadata
            )
        return result

    def feedback(self, signal: FeedbackSignal) -> None:
        self._sync_manager().feedback(signal)

    async def afeedback(self, signal: FeedbackSignal) -> None:
        if self.aio is not None:
            await self.aio.feedback(signal)
        else:
            await asyncio.to_thread(self.feedback, signal)

    def feedback_about(
        self, info: object, positive: bool, *, magnitude: float, source: str
    ) -> bool:
        """Send feedback about the entry ``info`` (an answer's ``INFO_KEY`` value)
        names; ``False`` when it names none (the answer did not come through the cache).
        Unlike lookups and puts, feedback raises: the app asked for it."""
        signal = signal_from_info(info, positive, magnitude=magnitude, source=source)
        if signal is None:
            return False
        self.feedback(signal)
        return True

    async def afeedback_about(
        self, info: object, positive: bool, *, magnitude: float, source: str
    ) -> bool:
        signal = signal_from_info(info, positive, magnitude=magnitude, source=source)
        if signal is None:
            return False
        await self.afeedback(signal)
        return True

    def clear(self) -> int:
        return self._sync_manager().clear(self.tenant)

    async def aclear(self) -> int:
        if self.aio is not None:
            return await self.aio.clear(self.tenant)
        return await asyncio.to_thread(self.clear)

    # -- helpers --------------------------------------------------------------------------
    def _sync_manager(self) -> CacheManager:
        if self.sync is None:
            raise TypeError(
                "this adapter was given only an AsyncCacheManager: use the framework's async "
                "calls (ainvoke, achat, ...) or pass a CacheManager as well"
            )
        return self.sync

    def _admissible(self, response: str) -> bool:
        """Answers the put would refuse for their size or emptiness are skipped quietly:
        that is not a failure of the cache."""
        size = len(response.encode("utf-8", "surrogatepass"))
        return bool(response.strip()) and size <= self.config.max_response_bytes

    @contextlib.contextmanager
    def _fail_open(self, what: str) -> Iterator[None]:
        """The call in the block fails open: an exception is logged (``_failed``) and
        swallowed, so the caller's result stays ``None``; a success is noted (``_ok``)."""
        try:
            yield
        except Exception as exc:
            self._failed(what, exc)
        else:
            self._ok(what)

    def _failed(self, what: str, exc: BaseException) -> None:
        """Log the first failure of a run of them as a warning, the rest at debug (a Redis
        outage would otherwise log once per LLM call). Lookups and puts are tracked apart:
        the manager's lookup fails open by itself (it returns ``None`` during an outage
        and logs that), so a lookup returning is no sign that Redis is back."""
        if what not in self._failing:
            self._failing.add(what)
            log.warning("zerda-cache: %s failed, the LLM call goes on uncached: %r", what, exc)
        else:
            log.debug("zerda-cache: %s failed: %r", what, exc)

    def _ok(self, what: str) -> None:
        if what in self._failing:
            self._failing.discard(what)
            log.warning("zerda-cache: %s succeeds again", what)


def signal_from_info(
    info: object, positive: bool, *, magnitude: float, source: str
) -> FeedbackSignal | None:
    """The feedback signal about the entry ``info`` (``INFO_KEY``'s value) names, or
    ``None`` when there is none (the answer was not cached: Redis was down, the answer
    was refused, or streaming)."""
    if not isinstance(info, Mapping):
        return None
    entry_id, tenant = info.get("entry_id"), info.get("tenant")
    if not isinstance(entry_id, str) or not isinstance(tenant, str):
        return None
    similarity = info.get("similarity")
    sim = float(similarity) if isinstance(similarity, int | float) else None
    return feedback_signal(entry_id, tenant, positive, magnitude, source, sim)


__all__ = [
    "INFO_KEY",
    "CacheBinding",
    "CacheKey",
    "digest_scope",
    "hit_info",
    "put_info",
    "signal_from_info",
]
