"""The lookup's round trip on the wire, without redis-py's per-command layers.

Every change to shared state is a script call, and the common lookup is one EVALSHA of
about 20 arguments; the others send a small pipeline. redis-py spends more client CPU
on either than on anything but the index search: each argument goes through two
generator steps and an ``Encoder.encode`` of four ``isinstance`` checks
(``HiredisRespSerializer.pack``), then ``execute_command`` or ``Pipeline.execute`` adds
its observability bookkeeping, closures and the retry wrapper. Counted by callgrind on
redis-py 8.2, with a sync PING at 120k instructions: an EVALSHA of the hit script's
shape took 377k client instructions through ``client.evalsha`` and 116k here (asyncio:
565k against 363k); a pipeline of a lookup's XREVRANGE and HGET 321k through
``Pipeline.execute`` and 143k here. ``bench_ab.py --callgrind`` counts whole calls.

A storage sends its lone script calls with ``evalsha_sender(client)`` and its pipelines
with ``pipeline_executor(client)``, each one of two ways:

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
  redirections), a client with one dedicated connection, a client or pipeline class
  whose ``execute_command``, ``pipeline`` or ``execute`` is not redis-py's own (a
  tracer's wrapper: OpenTelemetry, ddtrace, Sentry; a subclass that counts commands:
  they see every call), an encoding other than UTF-8 (hiredis packs text as UTF-8), no
  hiredis; and per call, an argument hiredis cannot pack (a ``memoryview``), a pipeline
  with Lua ``Script`` objects or of more than ``DIRECT_PIPELINE_MAX`` commands (the
  worker's batches: redis-py's asyncio pipeline yields to the loop as it reads those).
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
import redis.client
from redis.exceptions import ResponseError

hiredis: Any
try:
    import hiredis
except ImportError:  # pragma: no cover - redis[hiredis] is a core dependency
    hiredis = None

_recorder: Any
_arecorder: Any
try:  # redis-py 7.1+: its own OpenTelemetry metrics (no-ops until they are enabled)
    from redis.asyncio.observability import recorder as _arecorder
    from redis.observability import recorder as _recorder
except ImportError:  # pragma: no cover - redis-py 6.x / 7.0
    _recorder = _arecorder = None

#: Sends one EVALSHA: ``send(sha, keys, args)`` returns the reply (an awaitable of it for
#: an asyncio client) or raises what ``client.evalsha`` would.
Sender = Callable[[str, Sequence[Any], Sequence[Any]], Any]
#: Executes a queued pipeline (``transaction=False``) as ``pipe.execute(False)`` would:
#: the replies in order, an error reply in its place (awaitable for an asyncio client).
Executor = Callable[[Any], Any]

#: Pipelines of more commands than this go through ``Pipeline.execute``.
DIRECT_PIPELINE_MAX = 32

_EVALSHA = "EVALSHA"
_PIPELINE = "PIPELINE"


def evalsha_sender(client: Any) -> Sender:
    """The way to send one EVALSHA over ``client`` (see the module's docstring)."""
    if direct_ok(client):
        if isinstance(client, redis.asyncio.Redis):
            return _AsyncDirect(client).send
        return _Direct(client).send

    def send(sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        return client.evalsha(sha, len(keys), *keys, *args)

    return send


def pipeline_executor(client: Any) -> Executor:
    """The way to execute a pipeline made by ``client.pipeline(transaction=False)``."""
    if direct_ok(client) and _redis_own(type(client), "pipeline"):
        if isinstance(client, redis.asyncio.Redis):
            if _pipeline_own(redis.asyncio.client.Pipeline):
                return _AsyncDirect(client).execute
        elif _pipeline_own(redis.client.Pipeline):
            return _Direct(client).execute
    return _execute_through


def _execute_through(pipe: Any) -> Any:
    return pipe.execute(False)


def direct_ok(client: Any) -> bool:
    """Can a command skip ``client.execute_command`` without skipping anything it does?"""
    if hiredis is None or not isinstance(client, redis.Redis | redis.asyncio.Redis):
        return False
    # single_connection_client (the asyncio client opens its connection on first use)
    if getattr(client, "connection", None) is not None or getattr(
        client, "single_connection_client", getattr(client, "_single_connection_client", False)
    ):
        return False
    if not _redis_own(type(client), "execute_command"):
        return False
    kwargs = client.connection_pool.connection_kwargs
    try:
        utf8 = codecs.lookup(kwargs.get("encoding", "utf-8")).name == "utf-8"
    except LookupError:
        return False
    return utf8 and kwargs.get("encoding_errors", "strict") == "strict"


def _pipeline_own(cls: type) -> bool:
    return all(_redis_own(cls, name) for name in ("execute", "parse_response"))


def _redis_own(cls: type, name: str) -> bool:
    """Is ``cls.name`` redis-py's own function, not a wrapper or an override? A tracer
    (OpenTelemetry, ddtrace, Sentry) patches ``Redis.execute_command``: with ``wrapt``
    (not a plain function), ``functools.wraps`` (``__wrapped__``) or a function of its own
    module."""
    fn = inspect.getattr_static(cls, name, None)
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
    if isinstance(name, str) and " " in name:
        return (*name.split(), *args[1:])
    return args


def _record(recorder: Any, name: str, conn: Any, started: float) -> Any:
    return recorder.record_operation_duration(
        command_name=name,
        duration_seconds=time.monotonic() - started,
        server_address=getattr(conn, "host", None),
        server_port=getattr(conn, "port", None),
        db_namespace=str(conn.db),
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


class _Direct:
    """The direct path of a sync ``redis.Redis``."""

    __slots__ = ("client", "pool")

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.pool: Any = client.connection_pool

    def send(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            packed = [hiredis.pack_command((_EVALSHA, sha, len(keys), *keys, *args))]
        except TypeError:
            return self.client.evalsha(sha, len(keys), *keys, *args)
        return self._roundtrip(_EVALSHA, lambda conn: _one(conn, packed))

    def execute(self, pipe: Any) -> Any:
        stack = pipe.command_stack
        if not stack or pipe.scripts or len(stack) > DIRECT_PIPELINE_MAX:
            return pipe.execute(False)
        packed = _pack_stack(stack)
        if packed is None:
            return pipe.execute(False)
        return self._roundtrip(_PIPELINE, lambda conn: _many(pipe, conn, packed, stack))

    def _roundtrip(self, name: str, exchange: Callable[[Any], Any]) -> Any:
        """``exchange`` on a pooled connection, under the connection's retry object."""
        pool = self.pool
        conn = pool.get_connection()
        started = time.monotonic()
        failures = 0

        def failed(_: Exception) -> None:  # a retried error: a fresh connection next
            nonlocal failures
            failures += 1
            conn.disconnect()

        try:
            reply = conn.retry.call_with_retry(lambda: exchange(conn), failed)
        except Exception as exc:
            if _recorder is not None:
                _record_error(_recorder, conn, exc, failures)
            raise
        finally:
            pool.release(conn)
        if _recorder is not None:
            _record(_recorder, name, conn, started)
        return reply


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


class _AsyncDirect:
    """The direct path of a ``redis.asyncio.Redis``."""

    __slots__ = ("client", "pool")

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self.pool: Any = client.connection_pool

    async def send(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            packed = [hiredis.pack_command((_EVALSHA, sha, len(keys), *keys, *args))]
        except TypeError:
            return await self.client.evalsha(sha, len(keys), *keys, *args)
        return await self._roundtrip(_EVALSHA, lambda conn: _aone(conn, packed))

    async def execute(self, pipe: Any) -> Any:
        stack = pipe.command_stack
        if not stack or pipe.scripts or len(stack) > DIRECT_PIPELINE_MAX:
            return await pipe.execute(False)
        packed = _pack_stack(stack)
        if packed is None:
            return await pipe.execute(False)
        return await self._roundtrip(_PIPELINE, lambda conn: _amany(pipe, conn, packed, stack))

    async def _roundtrip(self, name: str, exchange: Callable[[Any], Any]) -> Any:
        pool = self.pool
        conn = await pool.get_connection()
        started = time.monotonic()
        failures = 0

        async def failed(_: Exception) -> None:
            nonlocal failures
            failures += 1
            await conn.disconnect()

        try:
            reply = await conn.retry.call_with_retry(lambda: exchange(conn), failed)
        except Exception as exc:
            if _arecorder is not None:
                await _record_error(_arecorder, conn, exc, failures)
            raise
        finally:
            await pool.release(conn)
        if _arecorder is not None:
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


__all__ = [
    "DIRECT_PIPELINE_MAX",
    "Executor",
    "Sender",
    "direct_ok",
    "evalsha_sender",
    "pipeline_executor",
]
