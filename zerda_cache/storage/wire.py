"""The lookup's round trip on the wire, without redis-py's per-command layers.

Every change to shared state is a script call, and the common lookup is one EVALSHA of
about 20 arguments; the others send a small pipeline. redis-py spends more client CPU
on either than on anything but the index search: each argument goes through two
generator steps and an ``Encoder.encode`` of four ``isinstance`` checks
(``HiredisRespSerializer.pack``), then ``execute_command`` or ``Pipeline.execute`` adds
its observability bookkeeping, closures and the retry wrapper. ``bench_ab.py
--callgrind`` counts what this saves per call (docs/BENCHMARKS.md, "client instructions
per call"): a feedback, one EVALSHA, costs about 4 PINGs' worth of client instructions
through redis-py and 2 this way.

A storage keeps one ``wire_for(client)``, whose ``send`` sends a lone script call and
whose ``execute`` a pipeline, each one of two ways:

* **direct** (a plain ``redis.Redis`` or ``redis.asyncio.Redis``, with hiredis): the
  commands packed by ``hiredis.pack_command``, sent and read on a connection of the
  client's own pool under the client's own retry object, as redis-py does: a retried
  error disconnects the connection first; a timeout, a cancellation or any error while
  reading leaves it disconnected (redis-py's ``read_response`` does that; here too for
  an error of a reply's parsing, with replies still unread); it goes back to the pool
  whatever happened. A lone EVALSHA's error reply raises (``NoScriptError`` included); a
  pipeline's replies are parsed by the pipeline's own ``parse_response`` (the client's
  response callbacks), an error reply kept in its place. redis-py's own OpenTelemetry
  metrics record each call, when the app enabled them.
* **through the client** (``client.evalsha``, ``Pipeline.execute``) everywhere the direct
  path would skip something the client does: a Redis Cluster client (slots,
  redirections), a client with one dedicated connection, an encoding other than UTF-8
  (hiredis packs text as UTF-8), no hiredis, a client, pipeline or connection class
  whose methods on the way (``execute_command``, ``parse_response``, ``pipeline``,
  ``execute``, ``send_command``...) are not redis-py's own (a subclass that counts
  commands); and checked at every call, so that instrumenting later is seen too: a
  tracer's wrapper of the class's or the client's own ``execute_command``,
  ``pipeline`` or ``execute`` (OpenTelemetry's ``instrument()`` and
  ``instrument_client()``, ddtrace, Sentry: they see every call), a response callback
  set for EVALSHA, an argument hiredis cannot pack (a ``memoryview``), a transaction
  or a WATCH, a pipeline with Lua ``Script`` objects or of more than
  ``DIRECT_PIPELINE_MAX`` commands (the worker's batches: redis-py's asyncio pipeline
  yields to the loop as it reads those).
"""

from __future__ import annotations

import codecs
import inspect
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.client
import redis.asyncio.connection
import redis.client
from redis.exceptions import ResponseError

hiredis: Any
try:
    import hiredis
except ImportError:  # pragma: no cover - redis[hiredis] is a core dependency
    hiredis = None

# redis-py's own OpenTelemetry metrics (no-ops until an app enables them): the sync
# recorder from 7.2, the asyncio one from 7.3
_recorder: Any
_arecorder: Any
try:
    from redis.observability import recorder as _recorder
except ImportError:  # pragma: no cover - redis-py before 7.2
    _recorder = None
try:
    from redis.asyncio.observability import recorder as _arecorder
except ImportError:  # pragma: no cover - redis-py before 7.3
    _arecorder = None

#: Does an asyncio connection's ``disconnect`` take the error that caused it (for the
#: connection-closed metric, redis-py 8)?
_DISCONNECT_ERROR = (
    "error" in inspect.signature(redis.asyncio.connection.AbstractConnection.disconnect).parameters
)

#: Pipelines of more commands than this go through ``Pipeline.execute``.
DIRECT_PIPELINE_MAX = 32

_EVALSHA = "EVALSHA"
_PIPELINE = "PIPELINE"
#: The methods on the way of a command that the direct path does itself.
_CLIENT_OWN = ("execute_command", "_execute_command", "parse_response", "evalsha")
_CONNECTION_OWN = ("send_command", "pack_command")
_PIPELINE_OWN = ("execute", "_execute_pipeline", "parse_response", "reset")


def wire_for(client: Any) -> _Through | _Direct | _AsyncDirect:
    """How a storage sends over ``client`` (see the module's docstring). Each way has
    ``send(sha, keys, args)``, one EVALSHA's reply (an awaitable of it for an asyncio
    client) or what ``client.evalsha`` raises, and ``execute(pipe)``, what
    ``pipe.execute(False)`` returns: the replies in order, an error reply in its place."""
    if not direct_ok(client):
        return _Through(client)
    if isinstance(client, redis.asyncio.Redis):
        return _AsyncDirect(client)
    return _Direct(client)


class _Through:
    """Everything through the client's own calls."""

    __slots__ = ("client",)

    def __init__(self, client: Any) -> None:
        self.client = client

    def send(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        return self.client.evalsha(sha, len(keys), *keys, *args)

    @staticmethod
    def execute(pipe: Any) -> Any:
        return pipe.execute(False)


def direct_ok(client: Any) -> bool:
    """Can a command skip ``client.execute_command`` without skipping anything it does
    (as far as the client's classes go; a later tracer is checked at each call)?"""
    if hiredis is None or not isinstance(client, redis.Redis | redis.asyncio.Redis):
        return False
    # single_connection_client (the asyncio client opens its connection on first use)
    if getattr(client, "connection", None) is not None or getattr(
        client, "single_connection_client", getattr(client, "_single_connection_client", False)
    ):
        return False
    pool = client.connection_pool
    if not all(_redis_own(type(client), name) for name in _CLIENT_OWN):
        return False
    if not all(_redis_own(pool.connection_class, name) for name in _CONNECTION_OWN):
        return False
    kwargs = pool.connection_kwargs
    try:
        utf8 = codecs.lookup(kwargs.get("encoding", "utf-8")).name == "utf-8"
    except LookupError:
        return False
    return utf8 and kwargs.get("encoding_errors", "strict") == "strict"


def _redis_own(cls: type, name: str) -> bool:
    """Is ``cls.name`` redis-py's own function, not a wrapper or an override? A tracer
    patches ``Redis.execute_command``: with ``wrapt`` (not a plain function; OpenTelemetry,
    ddtrace), ``functools.wraps`` (``__wrapped__``) or a function of its own module
    (Sentry). A method redis-py does not have is its own (older versions)."""
    fn = inspect.getattr_static(cls, name, None)
    if fn is None:
        return True
    return (
        isinstance(fn, types.FunctionType)
        and fn.__module__.startswith("redis.")
        and not hasattr(fn, "__wrapped__")
    )


def _pack_stack(stack: Sequence[tuple[tuple[Any, ...], Any]]) -> list[bytes] | None:
    """A pipeline's commands in RESP, as ``send_packed_command`` takes them; None if an
    argument is of a type hiredis does not pack (the client's encoder takes those)."""
    pack = hiredis.pack_command
    try:
        return [b"".join([pack(_split(args)) for args, _ in stack])]
    except TypeError:
        return None


def _split(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A command name of two words (``"SCRIPT LOAD"``) as two arguments, as redis-py
    sends it."""
    name = args[0]
    if isinstance(name, str):
        if " " in name:
            return (*name.split(), *args[1:])
    elif isinstance(name, bytes) and b" " in name:
        return (*name.split(), *args[1:])
    return args


def _record(recorder: Any, name: str, conn: Any, started: float, **error: Any) -> Any:
    return recorder.record_operation_duration(
        command_name=name,
        duration_seconds=time.monotonic() - started,
        server_address=getattr(conn, "host", None),
        server_port=getattr(conn, "port", None),
        db_namespace=str(conn.db),
        **error,
    )


def _record_error(recorder: Any, conn: Any, exc: Exception, failures: int) -> Any:
    return recorder.record_error_count(
        server_address=getattr(conn, "host", None),
        server_port=getattr(conn, "port", None),
        network_peer_address=getattr(conn, "host", None),
        network_peer_port=getattr(conn, "port", None),
        error_type=exc,
        retry_attempts=failures,
        is_internal=False,
    )


class _Wire:
    """What both direct paths keep of their client, to notice a later patch at a call."""

    __slots__ = ("callbacks", "client", "cls", "own", "pipe_cls", "pipe_own", "pool")

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pool: Any = client.connection_pool
        self.cls = type(client)
        self.own = self.cls.execute_command  # what a later patch of the class replaces
        self.callbacks = client.response_callbacks
        self.pipe_cls, self.pipe_own = _pipeline_class(client)

    def _evalsha(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> list[bytes] | None:
        """The EVALSHA packed for the direct path; None if it goes through the client (a
        tracer since, an EVALSHA callback, an argument hiredis does not pack)."""
        if _watched(self):
            return None
        try:
            return [hiredis.pack_command((_EVALSHA, sha, len(keys), *keys, *args))]
        except TypeError:
            return None


class _Direct(_Wire):
    """The direct path of a sync ``redis.Redis``."""

    __slots__ = ()

    def send(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        packed = self._evalsha(sha, keys, args)
        if packed is not None:
            return self._roundtrip(_EVALSHA, lambda conn: _one(conn, packed))
        return self.client.evalsha(sha, len(keys), *keys, *args)

    def execute(self, pipe: Any) -> Any:
        if not _pipe_direct(self, pipe):
            return pipe.execute(False)
        stack = pipe.command_stack
        packed = _pack_stack(stack)
        if packed is None:
            return pipe.execute(False)
        try:
            return self._roundtrip(_PIPELINE, lambda conn: _many(pipe, conn, packed, stack))
        finally:
            pipe.reset()

    def _roundtrip(self, name: str, exchange: Callable[[Any], Any]) -> Any:
        """``exchange`` on a pooled connection, under the connection's retry object."""
        pool = self.pool
        conn = pool.get_connection()
        started = time.monotonic()
        failures = 0

        def failed(error: Exception) -> None:  # a retried error: a fresh connection next
            nonlocal failures
            failures += 1
            if _recorder is not None and failures <= conn.retry.get_retries():
                _record(_recorder, name, conn, started, error=error, retry_attempts=failures)
            conn.disconnect()

        try:
            reply = conn.retry.call_with_retry(lambda: exchange(conn), failed)
        except Exception as exc:
            if _recorder is not None:
                _record_error(_recorder, conn, exc, failures)
            raise
        finally:
            pool.release(conn)
        if _recorder is not None and _recorder.is_enabled():  # (its call alone costs more)
            _record(_recorder, name, conn, started)
        return reply


def _watched(direct: _Wire) -> bool:
    """Is the client instrumented (or patched, or given an EVALSHA callback) since it was
    checked? Then its own call sees the command."""
    d = direct.client.__dict__
    return (
        "execute_command" in d
        or "evalsha" in d
        or direct.cls.execute_command is not direct.own
        or _EVALSHA in direct.callbacks
    )


def _pipeline_class(client: Any) -> tuple[Any, Any]:
    """The class of the client's pipelines and its ``execute`` (None: the client's
    ``pipeline`` or that class is not redis-py's own, so pipelines go through it)."""
    pipe_cls = (
        redis.asyncio.client.Pipeline
        if isinstance(client, redis.asyncio.Redis)
        else redis.client.Pipeline
    )
    if not _redis_own(type(client), "pipeline") or not all(
        _redis_own(pipe_cls, name) for name in _PIPELINE_OWN
    ):
        return pipe_cls, None
    return pipe_cls, pipe_cls.execute


def _pipe_direct(direct: _Wire, pipe: Any) -> bool:
    """Can this pipeline go to the wire directly (not a tracer's, a transaction's, a
    WATCH's, a Script's or too long)?"""
    return (
        type(pipe) is direct.pipe_cls
        and direct.pipe_own is not None
        and direct.pipe_cls.execute is direct.pipe_own
        and "pipeline" not in direct.client.__dict__
        and "execute" not in pipe.__dict__
        and not (pipe.transaction or pipe.explicit_transaction or pipe.watching)
        and not pipe.scripts
        and 0 < len(pipe.command_stack) <= DIRECT_PIPELINE_MAX
    )


def _one(conn: Any, packed: list[bytes]) -> Any:
    conn.send_packed_command(packed)
    return conn.read_response()


def _many(pipe: Any, conn: Any, packed: list[bytes], stack: Any) -> list[Any]:
    conn.send_packed_command(packed)
    replies: list[Any] = []
    try:
        for args, options in stack:
            try:
                replies.append(pipe.parse_response(conn, args[0], **options))
            except ResponseError as exc:
                replies.append(exc)
    except BaseException:
        conn.disconnect()  # replies may still be on their way: never for the next user
        raise
    return replies


class _AsyncDirect(_Wire):
    """The direct path of a ``redis.asyncio.Redis``."""

    __slots__ = ()

    async def send(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        packed = self._evalsha(sha, keys, args)
        if packed is not None:
            return await self._roundtrip(_EVALSHA, lambda conn: _aone(conn, packed))
        return await self.client.evalsha(sha, len(keys), *keys, *args)

    async def execute(self, pipe: Any) -> Any:
        if not _pipe_direct(self, pipe):
            return await pipe.execute(False)
        stack = pipe.command_stack
        packed = _pack_stack(stack)
        if packed is None:
            return await pipe.execute(False)
        try:
            return await self._roundtrip(_PIPELINE, lambda conn: _amany(pipe, conn, packed, stack))
        finally:
            await pipe.reset()

    async def _roundtrip(self, name: str, exchange: Callable[[Any], Any]) -> Any:
        pool = self.pool
        conn = await pool.get_connection()
        started = time.monotonic()
        failures = 0

        async def failed(error: Exception) -> None:
            nonlocal failures
            failures += 1
            if _arecorder is not None and failures <= conn.retry.get_retries():
                await _record(_arecorder, name, conn, started, error=error, retry_attempts=failures)
            if _DISCONNECT_ERROR:
                await conn.disconnect(error=error, failure_count=failures)
            else:  # pragma: no cover - redis-py before 8
                await conn.disconnect()

        try:
            reply = await conn.retry.call_with_retry(lambda: exchange(conn), failed)
        except Exception as exc:
            if _arecorder is not None:
                await _record_error(_arecorder, conn, exc, failures)
            raise
        finally:
            await pool.release(conn)
        if _arecorder is not None and await _arecorder.is_enabled():
            await _record(_arecorder, name, conn, started)
        return reply


async def _aone(conn: Any, packed: list[bytes]) -> Any:
    await conn.send_packed_command(packed)
    return await conn.read_response()


async def _amany(pipe: Any, conn: Any, packed: list[bytes], stack: Any) -> list[Any]:
    await conn.send_packed_command(packed)
    replies: list[Any] = []
    try:
        for args, options in stack:
            try:
                replies.append(await pipe.parse_response(conn, args[0], **options))
            except ResponseError as exc:
                replies.append(exc)
    except BaseException:
        await conn.disconnect(nowait=True)  # cancelled or a callback raised: replies unread
        raise
    return replies


__all__ = ["DIRECT_PIPELINE_MAX", "direct_ok", "wire_for"]
