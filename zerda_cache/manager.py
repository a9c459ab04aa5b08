"""``CacheManager``: the facade app developers use in every replica (sync driver).

``lookup`` (or ``decide``, which also tells a miss from a verification under an error
bound) before calling the LLM, ``put`` after it, ``feedback`` when the user reacts.
Every method runs a flow of ``CacheEngine`` (``engine.py``) over a ``redis.Redis`` or
``RedisCluster`` client; ``AsyncCacheManager`` (``aio.py``) runs the same flows over
``redis.asyncio``.
"""

from __future__ import annotations

from zerda_cache.core.results import CacheHit, Decision, PutResult
from zerda_cache.flows.admission import AdmissionCheck, basic_admission, default_admission
from zerda_cache.flows.engine import CacheEngine, EmbedFn
from zerda_cache.storage.connect import connect
from zerda_cache.storage.driver import SyncDriven
from zerda_cache.storage.store import RedisStorage


class CacheManager(SyncDriven, CacheEngine):
    """The synchronous semantic cache of one app replica (see ``CacheEngine`` for the
    arguments; ``client`` is a ``redis.Redis`` or ``RedisCluster``). Thread-safe: one
    manager serves every thread of a replica."""

    storage_class = RedisStorage
    storage: RedisStorage

    def close(self) -> None:
        """Stop the index builds (waiting up to 10 s for them to stop), flush the
        pending miss counts and close the client."""
        self.drive(self.close_flow())

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "AdmissionCheck",
    "CacheHit",
    "CacheManager",
    "Decision",
    "EmbedFn",
    "PutResult",
    "basic_admission",
    "connect",
    "default_admission",
]
