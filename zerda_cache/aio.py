"""``AsyncCacheManager``: the facade for asyncio apps (async driver).

The same flows as ``CacheManager`` (``engine.py``), awaited, over ``redis.asyncio``
clients. ``embed_fn`` may be a plain function or a coroutine function (an HTTP embedding
API): a returned awaitable is awaited.
"""

from __future__ import annotations

from zerda_cache.flows.engine import CacheEngine
from zerda_cache.storage.driver import AsyncDriven
from zerda_cache.storage.store import AsyncRedisStorage


class AsyncCacheManager(AsyncDriven, CacheEngine):
    """``CacheManager`` for asyncio apps: the same methods, awaited.

    Args are those of ``CacheEngine``; ``client`` is a ``redis.asyncio`` client (plain or
    cluster). One manager serves every task of a replica.
    """

    storage_class = AsyncRedisStorage
    storage: AsyncRedisStorage

    async def aclose(self) -> None:
        """Stop the index builds (cancelled tasks, waited for up to 10 s), flush the
        pending miss counts and close the client."""
        await self.drive(self.close_flow())

    async def __aenter__(self) -> AsyncCacheManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["AsyncCacheManager", "AsyncRedisStorage"]
