"""The direct EVALSHA (``zerda_cache.storage.wire``): which clients take it, and that it
replies, fails, retries, times out and returns connections exactly as ``client.evalsha``
does. Every script call of the other tests goes this way too."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection
import redis.exceptions
from conftest import close_loop
from redis.cluster import RedisCluster

from zerda_cache import CacheConfig
from zerda_cache.learning.bandit import FeedbackSignal
from zerda_cache.storage import RedisStorage, wire
from zerda_cache.storage.connect import connect
from zerda_cache.testing import RedisServer

#: Replies of every RESP type a script returns, nested, with a nil inside.
MIXED = "return {1, 'two', {3, false, 'x'}, redis.status_reply('OK'), -5, ARGV[1], KEYS[1]}"
FAILS = "return redis.error_reply('BAD thing ' .. ARGV[1])"
#: Holds the server about ``ARGV[1]`` ms (longer than a client's socket timeout).
BUSY = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat
  t = redis.call('TIME')
until t[1] * 1000000 + t[2] - start > tonumber(ARGV[1]) * 1000
return 1
"""


def in_use(client: Any) -> int:
    return len(client.connection_pool._in_use_connections)


def both_ways(client: redis.Redis, script: str, keys: list[Any], args: list[Any]) -> list[Any]:
    """The reply (or the exception) of the direct path and of ``client.evalsha``."""
    sha = client.script_load(script)
    direct = wire.wire_for(client).send
    out: list[Any] = []
    for send in (direct, lambda s, k, a: client.evalsha(s, len(k), *k, *a)):
        try:
            out.append(send(sha, keys, args))
        except redis.exceptions.RedisError as exc:
            out.append((type(exc), str(exc)))
    return out


def test_a_plain_client_sends_directly_and_the_others_through_the_client(
    redis_url: str, cluster_client: RedisCluster
) -> None:
    """The direct path skips ``execute_command``, so it is taken only where that skips
    nothing: not on a cluster, a single-connection client, a subclass or a tracer that
    wraps ``execute_command``, or an encoding hiredis does not pack."""

    class Counting(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            return super().execute_command(*args, **options)

    class Traced(redis.Redis):  # what functools.wraps-style tracers leave behind
        execute_command = functools.wraps(redis.Redis.execute_command)(
            lambda self, *a, **k: redis.Redis.execute_command(self, *a, **k)
        )

    plain = connect(redis_url, CacheConfig())
    loop = asyncio.new_event_loop()
    aclient = connect(redis_url, CacheConfig(), asyncio=True)
    others = [
        redis.Redis.from_url(redis_url, single_connection_client=True),
        Counting.from_url(redis_url),
        Traced.from_url(redis_url),
        redis.Redis.from_url(redis_url, encoding="latin-1"),
        redis.Redis.from_url(redis_url, encoding_errors="replace"),
    ]
    try:
        assert wire.direct_ok(plain) and wire.direct_ok(redis.Redis.from_url(redis_url))
        assert wire.direct_ok(aclient)
        assert not wire.direct_ok(cluster_client)
        single = redis.asyncio.Redis.from_url(redis_url, single_connection_client=True)
        assert not wire.direct_ok(single)
        for other in others:
            assert not wire.direct_ok(other), other
        assert isinstance(wire.wire_for(plain), wire._Direct)
        assert isinstance(wire.wire_for(aclient), wire._AsyncDirect)
        assert isinstance(wire.wire_for(cluster_client), wire._Through)
    finally:
        for client in [plain, *others]:
            client.close()
        loop.run_until_complete(aclient.aclose())
        close_loop(loop)


def test_the_direct_path_replies_and_fails_as_the_client_does(redis_client: redis.Redis) -> None:
    key = "wire:k"
    direct, through = both_ways(redis_client, MIXED, [key], ["é", 7])
    assert direct == through == [1, b"two", [3, None, b"x"], b"OK", -5, "é".encode(), key.encode()]
    direct, through = both_ways(redis_client, FAILS, [], [3.5])
    assert direct == through and direct[0] is redis.exceptions.ResponseError
    assert "BAD thing 3.5" in direct[1]
    send = wire.wire_for(redis_client).send
    with pytest.raises(redis.exceptions.NoScriptError):
        send("0" * 40, [], [])
    # an argument hiredis does not pack: the client's encoder takes it
    sha = redis_client.script_load("return ARGV[1]")
    assert send(sha, [], [memoryview(b"view")]) == b"view"
    assert in_use(redis_client) == 0  # every connection went back, errors included


def test_the_direct_path_retries_a_dropped_connection_once_and_never_a_timeout(
    redis_server_factory: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``connect``'s one quick retry after a dropped connection, and none after a
    timeout (it would double the fail-open bound), as ``execute_command`` applies them."""
    server = redis_server_factory()
    client = connect(server.url, CacheConfig(redis_timeout_s=0.2))
    send = wire.wire_for(client).send
    sha = client.script_load("return 'up'")
    busy = client.script_load(BUSY)
    assert send(sha, [], []) == b"up"
    sends: list[int] = []
    sent = redis.connection.Connection.send_packed_command

    def drop_once(conn: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        if b"EVALSHA" in b"".join(command):  # not the handshake of a new connection
            sends.append(1)
            if len(sends) == 1:
                conn.disconnect()
                raise redis.exceptions.ConnectionError("dropped")
        return sent(conn, command, *args, **kwargs)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", drop_once)
    assert send(sha, [], []) == b"up" and len(sends) == 2
    sends.clear()
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", drop_once)
    sends.append(1)  # no drop this time: count the sends of a timed-out call
    with pytest.raises(redis.exceptions.TimeoutError):
        send(busy, [], [600])
    assert len(sends) == 2  # one send: the timeout was not retried
    assert in_use(client) == 0
    waiting = server.client()
    deadline = time.monotonic() + 10
    while True:  # (no timeout) answered once the script ends; Valkey may say BUSY first
        try:
            assert waiting.ping()
            break
        except redis.exceptions.ResponseError as exc:
            if "BUSY" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    waiting.close()
    assert send(sha, [], []) == b"up"  # a fresh connection, no stale reply read
    client.close()


def test_an_async_direct_call_cancelled_mid_reply_leaves_nothing_behind(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """A script call cancelled while the server is paused (an app's request timeout):
    its connection goes back to the pool and the next command does not read its reply."""
    loop = asyncio.new_event_loop()
    client = connect(redis_url, CacheConfig(), asyncio=True)
    send = wire.wire_for(client).send
    sha = redis_client.script_load("return ARGV[1]")

    async def scenario() -> None:
        assert await send(sha, [], ["first"]) == b"first"
        redis_client.execute_command("CLIENT", "PAUSE", 300, "ALL")
        task = asyncio.ensure_future(send(sha, [], ["lost"]))
        await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert in_use(client) == 0
        assert await send(sha, [], ["next"]) == b"next"
        with pytest.raises(redis.exceptions.ResponseError, match="BAD"):
            await send(redis_client.script_load(FAILS), [], [1])
        with pytest.raises(redis.exceptions.NoScriptError):
            await send("0" * 40, [], [])
        assert await client.evalsha(sha, 0, "again") == b"again" and in_use(client) == 0

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.run_until_complete(client.aclose())
        close_loop(loop)


def test_a_tracer_wrapping_execute_command_sees_every_script_call(redis_url: str) -> None:
    seen: list[str] = []

    class Traced(redis.Redis):
        @functools.wraps(redis.Redis.execute_command)
        def execute_command(self, *args: Any, **options: Any) -> Any:
            seen.append(str(args[0]))
            return super().execute_command(*args, **options)

    st = RedisStorage(Traced.from_url(redis_url))
    eid = st.put("wire-traced", "q", "r", [1.0, 0.0, 0.0, 0.0]).entry_id
    st.feedback(FeedbackSignal(eid, "wire-traced", True))  # (loads it, on a new server)
    seen.clear()
    st.feedback(FeedbackSignal(eid, "wire-traced", False))
    assert seen == ["EVALSHA"]
    st.client.close()


def test_redis_py_metrics_record_the_direct_calls(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py's own OpenTelemetry metrics (enabled by the app) count the direct calls
    as they count ``execute_command``'s: a duration per call, an error count per failure."""
    if wire._recorder is None:
        pytest.skip("redis-py before 7.1 has no metrics of its own")
    recorded: list[tuple[str, dict[str, Any]]] = []

    class Recorder:
        enabled = True

        def is_enabled(self) -> bool:
            return self.enabled

        def record_operation_duration(self, **kw: Any) -> None:
            recorded.append(("duration", kw))

        def record_error_count(self, **kw: Any) -> None:
            recorded.append(("error", kw))

    recorder = Recorder()
    monkeypatch.setattr(wire, "_recorder", recorder)
    send = wire.wire_for(redis_client).send
    one = redis_client.script_load("return 1")
    recorder.enabled = False  # not enabled by the app: nothing recorded, nothing paid
    send(one, [], [])
    assert recorded == []
    recorder.enabled = True
    send(one, [], [])
    with pytest.raises(redis.exceptions.ResponseError):
        send(redis_client.script_load(FAILS), [], [2])
    (what, ok), (err, failed) = recorded
    assert what == "duration" and ok["command_name"] == "EVALSHA" and ok["duration_seconds"] >= 0
    assert err == "error" and isinstance(failed["error_type"], redis.exceptions.ResponseError)
    assert failed["retry_attempts"] == 0 and failed["is_internal"] is False


def queue_mixed(pipe: Any, sha: str) -> None:
    """Commands whose replies redis-py's callbacks parse, and two error replies."""
    pipe.hgetall("wire:h")
    pipe.xrevrange("wire:log", "+", "-", count=2)
    pipe.zscore("wire:z", "m")
    pipe.get("wire:h")  # WRONGTYPE
    pipe.evalsha("0" * 40, 0)  # NOSCRIPT
    pipe.evalsha(sha, 1, "wire:k", "é", 2.5)
    pipe.script_exists(sha)  # "SCRIPT EXISTS": a command name of two words
    pipe.hmget("wire:h", ["a", "missing"])


def same_replies(direct: list[Any], through: list[Any]) -> None:
    assert len(direct) == len(through)
    for d, t in zip(direct, through, strict=True):
        if isinstance(t, Exception):
            assert type(d) is type(t) and str(d) == str(t)
        else:
            assert d == t


def fill(client: redis.Redis) -> str:
    client.delete("wire:h", "wire:log", "wire:z")
    client.hset("wire:h", mapping={"a": "1", "b": "2"})
    client.xadd("wire:log", {"e": "1"}, id="1-1")
    client.xadd("wire:log", {"e": "2"}, id="1-2")
    client.zadd("wire:z", {"m": 1.5})
    return str(client.script_load(MIXED))


def test_a_pipeline_sent_directly_replies_as_pipeline_execute(redis_client: redis.Redis) -> None:
    sha = fill(redis_client)
    direct = wire.wire_for(redis_client)
    assert isinstance(direct, wire._Direct) and direct.pipe_own is not None
    execute = direct.execute
    pipe, ref = redis_client.pipeline(transaction=False), redis_client.pipeline(False)
    queue_mixed(pipe, sha)
    queue_mixed(ref, sha)
    direct, through = execute(pipe), ref.execute(False)
    assert direct[0] == {b"a": b"1", b"b": b"2"} and direct[2] == 1.5
    assert isinstance(direct[4], redis.exceptions.NoScriptError)
    same_replies(direct, through)
    views = redis_client.pipeline(transaction=False)
    views.set("wire:v", memoryview(b"view"))  # hiredis does not pack it: Pipeline.execute
    views.get("wire:v")
    assert execute(views) == [True, b"view"]
    assert execute(redis_client.pipeline(transaction=False)) == []
    assert in_use(redis_client) == 0


def test_an_async_pipeline_sent_directly_replies_as_pipeline_execute(
    redis_client: redis.Redis, redis_url: str
) -> None:
    sha = fill(redis_client)
    loop = asyncio.new_event_loop()
    client = connect(redis_url, CacheConfig(), asyncio=True)
    direct = wire.wire_for(client)
    assert isinstance(direct, wire._AsyncDirect) and direct.pipe_own is not None
    execute = direct.execute

    async def scenario() -> None:
        pipe, ref = client.pipeline(transaction=False), client.pipeline(transaction=False)
        queue_mixed(pipe, sha)
        queue_mixed(ref, sha)
        same_replies(await execute(pipe), await ref.execute(False))
        assert in_use(client) == 0

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.run_until_complete(client.aclose())
        close_loop(loop)


def test_a_reply_that_fails_to_parse_drops_the_connection_with_the_unread_replies(
    redis_url: str,
) -> None:
    """A response callback that raises leaves the pipeline's later replies on the socket:
    the connection is closed, so the next command reads its own reply."""
    client = connect(redis_url, CacheConfig())
    client.set("wire:a", "1")
    client.set("wire:b", "2")

    def broken(response: Any, **options: Any) -> Any:
        raise ValueError("a callback failed")

    client.set_response_callback("STRLEN", broken)
    execute = wire.wire_for(client).execute
    pipe = client.pipeline(transaction=False)
    pipe.strlen("wire:a")
    pipe.get("wire:b")
    with pytest.raises(ValueError, match="callback failed"):
        execute(pipe)
    assert in_use(client) == 0
    assert client.get("wire:a") == b"1" and client.get("wire:b") == b"2"
    client.close()


def test_pipelines_of_traced_or_overridden_clients_go_through_pipeline_execute(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Listing(redis.Redis):
        def pipeline(self, *args: Any, **kwargs: Any) -> Any:
            return super().pipeline(*args, **kwargs)

    client = Listing.from_url(redis_url)
    listing = wire.wire_for(client)
    assert isinstance(listing, wire._Direct) and listing.pipe_own is None
    client.close()
    plain = redis.Redis.from_url(redis_url)
    direct = wire.wire_for(plain)
    assert isinstance(direct, wire._Direct) and direct.pipe_own is not None
    execute = direct.execute
    seen: list[str] = []
    original = redis.client.Pipeline.execute

    def traced(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append("pipeline")
        return original(pipe, *args, **kwargs)

    # a tracer that patches the class after the cache was created is seen at the call
    monkeypatch.setattr(redis.client.Pipeline, "execute", functools.wraps(original)(traced))
    pipe = plain.pipeline(transaction=False)
    pipe.ping()
    assert execute(pipe) == [True] and seen == ["pipeline"]
    plain.close()


def test_a_client_instrumented_after_the_cache_was_created_is_seen_at_each_call(
    redis_url: str,
) -> None:
    """OpenTelemetry's ``instrument_client(client)`` wraps the client's own
    ``execute_command`` and ``pipeline`` (wrapt, on the instance), whenever the app
    calls it: the next calls go through them."""
    import wrapt

    client = connect(redis_url, CacheConfig())
    direct = wire.wire_for(client)
    send, execute = direct.send, direct.execute
    sha = client.script_load("return 'x'")
    assert send(sha, [], []) == b"x"
    seen: list[str] = []

    def on_command(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.append(str(args[0]))
        return wrapped(*args, **kwargs)

    def on_pipeline(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        pipe = wrapped(*args, **kwargs)

        def on_execute(run: Any, _pipe: Any, a: Any, k: Any) -> Any:
            seen.append("pipeline")
            return run(*a, **k)

        wrapt.wrap_function_wrapper(pipe, "execute", on_execute)
        return pipe

    wrapt.wrap_function_wrapper(client, "execute_command", on_command)
    assert send(sha, [], []) == b"x" and seen == ["EVALSHA"]
    wrapt.wrap_function_wrapper(client, "pipeline", on_pipeline)
    pipe = client.pipeline(transaction=False)
    pipe.ping()
    assert execute(pipe) == [True] and seen == ["EVALSHA", "pipeline"]
    client.close()


def test_what_pipeline_execute_does_beyond_sending_is_kept(redis_client: redis.Redis) -> None:
    """A response callback set for EVALSHA, a command name of two words given as bytes,
    a transaction, and a pipeline executed twice: as redis-py does them."""
    direct = wire.wire_for(redis_client)
    execute, send = direct.execute, direct.send
    sha = redis_client.script_load("return 1")
    pipe = redis_client.pipeline(transaction=False)
    pipe.execute_command(b"CONFIG GET", "maxmemory")
    assert list(execute(pipe)[0]) == [b"maxmemory"]
    assert execute(pipe) == []  # reset: nothing sent twice
    multi = redis_client.pipeline(transaction=True)
    multi.set("wire:t", "1")
    multi.incr("wire:t")
    redis_client.config_resetstat()
    assert execute(multi) == [True, 2]  # MULTI/EXEC through Pipeline.execute
    assert "cmdstat_exec" in redis_client.info("commandstats")
    watched = redis_client.pipeline(transaction=True)
    watched.watch("wire:w")
    watched.multi()
    watched.set("wire:w", "mine")
    redis_client.set("wire:w", "theirs")
    with pytest.raises(redis.exceptions.WatchError):
        execute(watched)
    assert redis_client.get("wire:w") == b"theirs"
    redis_client.set_response_callback("EVALSHA", lambda r, **o: ("parsed", r))
    try:
        assert send(sha, [], []) == ("parsed", 1)
    finally:
        del redis_client.response_callbacks["EVALSHA"]
    assert send(sha, [], []) == 1
