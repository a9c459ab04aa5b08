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

from collections.abc import AsyncIterator, Iterator

from zerda_cache.storage.driver import AsyncDriven, Flow, SyncDriven
from zerda_cache.storage.entry_store import READ_ENTRIES_BATCH, TAG_BATCH, EntryStore, IdBatch
from zerda_cache.storage.executor import is_cluster
from zerda_cache.storage.service_store import ServiceStore
from zerda_cache.storage.snapshots import SnapshotInfo, SnapshotStore
from zerda_cache.storage.tenant_store import TenantStore


class Storage(EntryStore, TenantStore, SnapshotStore, ServiceStore):
    """Every operation on one zerda-cache keyspace (arguments: ``StorageCore``); use
    ``RedisStorage`` or ``AsyncRedisStorage``."""

    def close_flow(self) -> Flow[None]:
        """Close the client (its connection pool), and a Sentinel group's own clients."""
        pool = getattr(self.client, "connection_pool", None)
        sentinels = getattr(getattr(pool, "sentinel_manager", None), "sentinels", ())
        for client in (self.client, *sentinels):
            yield client.aclose if self.is_async else client.close


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


__all__ = [
    "READ_ENTRIES_BATCH",
    "TAG_BATCH",
    "AsyncRedisStorage",
    "IdBatch",
    "RedisStorage",
    "SnapshotInfo",
    "Storage",
    "is_cluster",
]
