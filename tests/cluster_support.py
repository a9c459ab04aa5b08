"""Local Redis Clusters and Sentinel groups for the test suite and the fault benchmark:
real ``redis-server``/``valkey-server`` processes, built on ``zerda_cache.testing``'s
throwaway servers (free ports, never 6379, stopped at exit). Not shipped with the package:
only the suite and ``benchmarks/bench_faults.py`` start them.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import redis
from redis.cluster import RedisCluster

from zerda_cache.testing import (
    FORBIDDEN_PORT,
    HOST,
    RedisServer,
    Throwaway,
    find_server_binary,
    free_port,
    ping,
    register,
    tail,
    unregister,
)

CLUSTER_BUS_OFFSET = 10000
_CLUSTER_SLOTS = 16384


def can_bind(port: int) -> bool:
    """Whether ``port`` on the loopback address can be bound right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(1000):
        port = free_port()
        bus = port + CLUSTER_BUS_OFFSET
        if bus <= 65535 and bus != FORBIDDEN_PORT and can_bind(bus):
            return port
    raise RuntimeError("could not find a free port pair (port, port + 10000) for a cluster node")


def _raw_command(conn: redis.Redis, *args: str | int) -> Any:
    """Run a command without redis-py's per-command response parsing."""
    return conn.execute_command(*args)  # type: ignore[no-untyped-call]


# --------------------------------------------------------------------------- cluster


class _ClusterNode(RedisServer):
    """A cluster-enabled :class:`RedisServer` whose bus port (port + 10000) is free."""

    def __init__(
        self,
        kind: str | None,
        extra_args: Sequence[str],
        *,
        node_timeout_ms: int,
        startup_timeout: float,
    ) -> None:
        super().__init__(kind, extra_args, startup_timeout=startup_timeout)
        self._node_timeout_ms = node_timeout_ms

    def pick_port(self) -> int:
        return free_cluster_port()

    def server_args(self, port: int) -> list[str]:
        return [
            "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", str(self._node_timeout_ms),
        ]  # fmt: skip


class RedisClusterServer(Throwaway):
    """A local Redis Cluster of ``masters`` master nodes (no replicas) on free ports.

    Each node is a :class:`RedisServer` with cluster mode on, in its own temporary
    directory. :meth:`start` assigns the 16384 slots evenly, joins the nodes with
    CLUSTER MEET and waits until every node reports ``cluster_state:ok``.

    Example::

        with RedisClusterServer() as cluster:
            client = cluster.client()
            client.set("{user:1}:a", "x")
            client.close()

    Attributes:
        nodes: The node servers, in slot order (node 0 owns the lowest slots).
    """

    def __init__(
        self,
        masters: int = 3,
        kind: str | None = None,
        extra_args: Sequence[str] = (),
        *,
        node_timeout_ms: int = 5000,
        startup_timeout: float = 30.0,
    ) -> None:
        """Configure the cluster; nothing is started until :meth:`start`.

        Args:
            masters: Number of master nodes (at least 1).
            kind: ``"redis"``, ``"valkey"``, ``"redis8"`` or ``None`` (see
                :func:`find_server_binary`).
            extra_args: Extra server arguments for every node.
            node_timeout_ms: ``cluster-node-timeout`` in milliseconds.
            startup_timeout: Seconds to wait for the cluster to become consistent.

        Raises:
            ValueError: ``masters`` < 1 or an unknown ``kind``.
            RuntimeError: The binary is not available.
        """
        if masters < 1:
            raise ValueError("a cluster needs at least one master")
        self.kind, self.binary = find_server_binary(kind)
        self.masters = masters
        self.extra_args: list[str] = list(extra_args)
        self.node_timeout_ms = node_timeout_ms
        self.startup_timeout = startup_timeout
        self.nodes: list[RedisServer] = []

    @property
    def host(self) -> str:
        """Always ``"127.0.0.1"``."""
        return HOST

    @property
    def port(self) -> int:
        """Port of the first node."""
        return self._first().port

    @property
    def url(self) -> str:
        """Connection URL of the first node, e.g. ``redis://127.0.0.1:40123/0``."""
        return self._first().url

    @property
    def version(self) -> str:
        """Server version of the nodes."""
        return self._first().version

    def is_running(self) -> bool:
        """Whether every node process is alive."""
        return bool(self.nodes) and all(node.is_running() for node in self.nodes)

    def start(self) -> Self:
        """Start the nodes, assign slots, join them and wait for ``cluster_state:ok``.

        Starting a running cluster is a no-op.

        Returns:
            ``self``.

        Raises:
            RuntimeError: A node failed to start or the cluster did not converge in time.
        """
        if self.is_running():
            return self
        self.stop()
        register(self)
        try:
            for _ in range(self.masters):
                node = _ClusterNode(
                    self.kind,
                    self.extra_args,
                    node_timeout_ms=self.node_timeout_ms,
                    startup_timeout=min(self.startup_timeout, 10.0),
                )
                self.nodes.append(node)
                node.start()
            self._form_cluster()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node and remove their directories. Safe to call repeatedly."""
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()
        self.nodes = []
        unregister(self)

    def client(self, **kwargs: Any) -> RedisCluster:
        """A new :class:`redis.cluster.RedisCluster`; the caller must close it.

        Args:
            **kwargs: Passed to :class:`~redis.cluster.RedisCluster`.

        Returns:
            The cluster client.
        """
        return RedisCluster(host=self.host, port=self.port, **kwargs)

    def node_clients(self, **kwargs: Any) -> list[redis.Redis]:
        """One plain :class:`redis.Redis` per node (callers must close them)."""
        return [node.client(**kwargs) for node in self.nodes]

    def __repr__(self) -> str:
        ports = [node.port for node in self.nodes]
        return f"<{type(self).__name__} {self.kind} ports={ports}>"

    # ----------------------------------------------------------------- internals

    def _first(self) -> RedisServer:
        if not self.nodes:
            raise RuntimeError("the cluster has not been started yet")
        return self.nodes[0]

    def _form_cluster(self) -> None:
        clients = self.node_clients(socket_timeout=5, decode_responses=True)
        try:
            count = len(clients)
            for index, conn in enumerate(clients):
                first = index * _CLUSTER_SLOTS // count
                last = (index + 1) * _CLUSTER_SLOTS // count - 1
                _raw_command(conn, "CLUSTER", "ADDSLOTSRANGE", first, last)
                # Distinct epochs up front: no epoch-collision round before convergence.
                _raw_command(conn, "CLUSTER", "SET-CONFIG-EPOCH", index + 1)
            for index, conn in enumerate(clients):
                for other, node in enumerate(self.nodes):
                    if other != index:
                        _raw_command(conn, "CLUSTER", "MEET", node.host, node.port)
            self._wait_until_consistent(clients)
        finally:
            for conn in clients:
                conn.close()

    def _wait_until_consistent(self, clients: list[redis.Redis]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last_problem = "not checked yet"
        while True:
            problem = self._consistency_problem(clients)
            if problem is None:
                return
            last_problem = problem
            if time.monotonic() > deadline:
                logs = "\n\n".join(
                    f"--- node {node.port} ---\n{tail(node.log(), 15)}" for node in self.nodes
                )
                raise RuntimeError(
                    f"the {self.kind} cluster did not converge within "
                    f"{self.startup_timeout:.0f}s: {last_problem}\n{logs}"
                )
            time.sleep(0.1)

    def _consistency_problem(self, clients: list[redis.Redis]) -> str | None:
        """Why the cluster is not ready yet, or ``None`` once every node agrees."""
        expected_ports = sorted(node.port for node in self.nodes)
        for node, conn in zip(self.nodes, clients, strict=True):
            if not node.is_running():
                return f"node {node.port} died"
            info_text = str(_raw_command(conn, "CLUSTER", "INFO"))
            info = dict(line.split(":", 1) for line in info_text.splitlines() if ":" in line)
            if info.get("cluster_state") != "ok":
                return f"node {node.port}: cluster_state={info.get('cluster_state')}"
            if info.get("cluster_slots_ok") != str(_CLUSTER_SLOTS):
                return f"node {node.port}: cluster_slots_ok={info.get('cluster_slots_ok')}"
            if info.get("cluster_known_nodes") != str(len(self.nodes)):
                return f"node {node.port}: knows {info.get('cluster_known_nodes')} nodes"
            ports: list[int] = []
            for line in str(_raw_command(conn, "CLUSTER", "NODES")).splitlines():
                fields = line.split()
                if len(fields) < 8:
                    continue
                flags = fields[2].split(",")
                if {"handshake", "noaddr", "fail", "fail?"} & set(flags):
                    return f"node {node.port} sees {fields[1]} as {fields[2]}"
                if fields[7] != "connected":
                    return f"node {node.port} sees {fields[1]} {fields[7]}"
                address = fields[1].split("@", 1)[0]  # ip:port@bus[,hostname]
                ports.append(int(address.rsplit(":", 1)[1]))
            if sorted(ports) != expected_ports:
                return f"node {node.port} sees ports {sorted(ports)}"
        return None


# --------------------------------------------------------------------------- sentinel


class RedisSentinelGroup(Throwaway):
    """A primary, one replica and ``sentinels`` Sentinel processes, all local throwaway
    processes on free ports, monitoring the service ``service``.

    Example::

        with RedisSentinelGroup() as group:
            manager = CacheManager.from_url(group.url)  # redis+sentinel://...
            group.primary.stop()                        # a failover follows
            group.wait_for_failover()

    Attributes:
        primary: The :class:`RedisServer` that is the primary at start.
        replica: Its replica (promoted by a failover).
        sentinel_ports: The Sentinel processes' ports.
    """

    host: str = HOST

    def __init__(
        self,
        kind: str | None = None,
        *,
        service: str = "zerda",
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        self.kind, self.binary = find_server_binary(kind)
        self.service = service
        self.n_sentinels = sentinels
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.primary: RedisServer | None = None
        self.replica: RedisServer | None = None
        self.sentinel_ports: list[int] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._tmpdir: Path | None = None

    @property
    def url(self) -> str:
        """``redis+sentinel://h:p,h:p,.../<service>/0``: what ``connect`` takes."""
        hosts = ",".join(f"{self.host}:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self) -> Self:
        """Start the primary, the replica and the sentinels; wait until the replica is
        in sync and every sentinel knows the replica and the other sentinels."""
        register(self)
        try:
            # No delay before the replica's first (diskless) sync: by default the primary
            # waits 5 s for more replicas, and writes made meanwhile exist on it alone.
            self.primary = RedisServer(self.kind, ["--repl-diskless-sync-delay", "0"]).start()
            self.replica = RedisServer(
                self.kind, ["--replicaof", self.host, str(self.primary.port)]
            ).start()
            self._wait(self._replicating, 30.0, "the replica did not sync with the primary")
            self._tmpdir = Path(tempfile.mkdtemp(prefix=f"zerda-{self.kind}-sentinel-"))
            for i in range(self.n_sentinels):
                self._start_sentinel(i)
            self._wait(self._converged, 30.0, "the sentinels did not see the whole group")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_sentinel(self, i: int) -> None:
        assert self._tmpdir is not None and self.primary is not None
        port = free_port()
        conf = self._tmpdir / f"sentinel-{i}.conf"
        conf.write_text(
            f"port {port}\nbind {self.host}\nprotected-mode no\n"
            f"dir {self._tmpdir}\n"
            f"sentinel monitor {self.service} {self.host} {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {self.service} 1\n"
        )
        log = open(self._tmpdir / f"sentinel-{i}.log", "ab")  # noqa: SIM115 - child keeps it
        self._procs.append(
            subprocess.Popen(
                [self.binary, str(conf), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._tmpdir,
            )
        )
        log.close()
        self.sentinel_ports.append(port)
        self._wait(lambda: ping(self.host, port), 10.0, f"sentinel {i} did not start")

    def _sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(host=self.host, port=port, socket_timeout=2, decode_responses=True)

    def _replicating(self) -> bool:
        assert self.replica is not None
        with self.replica.client(socket_timeout=2) as c:
            return str(c.info("replication").get("master_link_status")) == "up"

    def _converged(self) -> bool:
        for port in self.sentinel_ports:
            with self._sentinel(port) as s:
                state = s.sentinel_master(self.service)
                if int(state.get("num-slaves", 0)) < 1:
                    return False
                if int(state.get("num-other-sentinels", 0)) < self.n_sentinels - 1:
                    return False
        return True

    def primary_port(self) -> int:
        """The primary's port as the first sentinel sees it now."""
        with self._sentinel(self.sentinel_ports[0]) as s:
            _host, port = s.sentinel_get_master_addr_by_name(self.service)
        return int(port)

    def wait_for_failover(self, timeout: float = 30.0) -> int:
        """Wait until the sentinels promoted the replica; returns the new primary's port."""
        assert self.replica is not None
        replica = self.replica

        def promoted() -> bool:
            if self.primary_port() != replica.port:
                return False
            with replica.client(socket_timeout=2) as c:
                return str(c.info("replication").get("role")) == "master"

        self._wait(promoted, timeout, "no failover")
        return replica.port

    def _wait(self, done: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(redis.RedisError, OSError):
                if done():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:.0f}s")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop every process and remove the directories. Safe to call repeatedly."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._procs, self.sentinel_ports = [], []
        for server in (self.replica, self.primary):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        unregister(self)
