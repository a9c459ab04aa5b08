"""EVALSHA on the wire: the scripts' one command, without redis-py's per-command layers.

Every change to shared state is a script call, and the common lookup is one EVALSHA of
about 20 arguments. Through ``client.evalsha`` redis-py spends more client CPU on it than
on anything but the index search: each argument goes through two generator steps and an
``Encoder.encode`` of four ``isinstance`` checks (``HiredisRespSerializer.pack``), then
``execute_command`` adds its observability bookkeeping, a closure and the retry wrapper.
Counted by callgrind on redis-py 8.2 (``bench_ab.py --callgrind`` measures the lookups):
an EVALSHA of the hit script's shape took 377k client instructions that way, 116k here,
about one sync PING (120k); the asyncio flavour 565k against 363k.

``evalsha_sender`` gives a storage its way of sending one EVALSHA:

* **direct** (a plain ``redis.Redis`` or ``redis.asyncio.Redis`` with hiredis): the
  command packed in one ``hiredis.pack_command`` call, sent and read on a connection of
  the client's own pool, with the client's own retry object, as ``execute_command`` does:
  a retried error disconnects the connection first; a timeout or any error while reading
  leaves it disconnected (redis-py's ``read_response`` does that); it goes back to the
  pool whatever happened; a reply that is an error raises it (``NoScriptError``
  included); redis-py's own OpenTelemetry metrics record it, when they are enabled.
* **through the client** (``client.evalsha``) everywhere the direct path would skip
  something the client does: a Redis Cluster client (slots, redirections), a client with
  one dedicated connection, a client class whose ``execute_command`` is not redis-py's
  own (a tracer's wrapper, a subclass that counts commands: they see every script call),
  an encoding other than UTF-8 (hiredis packs text as UTF-8), no hiredis, and an argument
  hiredis cannot pack (a ``memoryview``).
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

_EVALSHA = "EVALSHA"


def evalsha_sender(client: Any) -> Sender:
    """The way to send one EVALSHA over ``client`` (see the module's docstring)."""
    if direct_ok(client):
        if isinstance(client, redis.asyncio.Redis):
            return _AsyncDirect(client).send
        return _Direct(client).send
    return _through(client)


def direct_ok(client: Any) -> bool:
    """Can EVALSHA skip ``client.execute_command`` without skipping anything it does?"""
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


def _through(client: Any) -> Sender:
    def send(sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        return client.evalsha(sha, len(keys), *keys, *args)

    return send


def _pack(sha: str, keys: Sequence[Any], args: Sequence[Any]) -> list[bytes] | None:
    """The command in RESP, as ``send_packed_command`` takes it; None if an argument is
    of a type hiredis does not pack (the client's encoder takes those)."""
    try:
        return [hiredis.pack_command((_EVALSHA, sha, len(keys), *keys, *args))]
    except TypeError:
        return None


class _Direct:
    """The direct path of a sync ``redis.Redis`` (``Redis._execute_command`` without the
    layers it has for other commands)."""

    __slots__ = ("client", "pool")

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.pool = client.connection_pool

    def send(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        packed = _pack(sha, keys, args)
        if packed is None:
            return self.client.evalsha(sha, len(keys), *keys, *args)
        pool: Any = self.pool
        conn = pool.get_connection()
        started = time.monotonic()
        failures = [0]

        def failed(_: Exception) -> None:  # a retried error: a fresh connection next
            failures[0] += 1
            conn.disconnect()

        try:
            reply = conn.retry.call_with_retry(lambda: _roundtrip(conn, packed), failed)
        except Exception as exc:
            if _recorder is not None:
                _recorder.record_error_count(
                    server_address=getattr(conn, "host", None),
                    server_port=getattr(conn, "port", None),
                    network_peer_address=getattr(conn, "host", None),
                    network_peer_port=getattr(conn, "port", None),
                    error_type=exc,
                    retry_attempts=failures[0],
                    is_internal=False,
                )
            raise
        finally:
            pool.release(conn)
        if _recorder is not None:
            _recorder.record_operation_duration(
                command_name=_EVALSHA,
                duration_seconds=time.monotonic() - started,
                server_address=getattr(conn, "host", None),
                server_port=getattr(conn, "port", None),
                db_namespace=str(conn.db),
            )
        return reply


def _roundtrip(conn: Any, packed: list[bytes]) -> Any:
    conn.send_packed_command(packed)
    return conn.read_response()


class _AsyncDirect:
    """The direct path of a ``redis.asyncio.Redis``."""

    __slots__ = ("client", "pool")

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self.pool = client.connection_pool

    async def send(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        packed = _pack(sha, keys, args)
        if packed is None:
            return await self.client.evalsha(sha, len(keys), *keys, *args)
        pool: Any = self.pool
        conn = await pool.get_connection()
        started = time.monotonic()
        failures = [0]

        async def failed(_: Exception) -> None:
            failures[0] += 1
            await conn.disconnect()

        try:
            reply = await conn.retry.call_with_retry(lambda: _aroundtrip(conn, packed), failed)
        except Exception as exc:
            if _arecorder is not None:
                await _arecorder.record_error_count(
                    server_address=getattr(conn, "host", None),
                    server_port=getattr(conn, "port", None),
                    network_peer_address=getattr(conn, "host", None),
                    network_peer_port=getattr(conn, "port", None),
                    error_type=exc,
                    retry_attempts=failures[0],
                    is_internal=False,
                )
            raise
        finally:
            await pool.release(conn)
        if _arecorder is not None:
            await _arecorder.record_operation_duration(
                command_name=_EVALSHA,
                duration_seconds=time.monotonic() - started,
                server_address=getattr(conn, "host", None),
                server_port=getattr(conn, "port", None),
                db_namespace=str(conn.db),
            )
        return reply


async def _aroundtrip(conn: Any, packed: list[bytes]) -> Any:
    await conn.send_packed_command(packed)
    return await conn.read_response()


__all__ = ["Sender", "direct_ok", "evalsha_sender"]
