"""How storage executes its plans: one script call (EVALSHA, loading the script on its
first use on a server), one pipeline of reads, or a plain command, each a step of a flow
(``driver.py``) that the sync and asyncio flavours run alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import redis
import redis.exceptions

from zerda_cache.core.config import CacheConfig
from zerda_cache.core.errors import (
    StorageError,
)
from zerda_cache.storage.driver import Flow, call, op, storage_error, wrap_errors
from zerda_cache.storage.plans import (
    ReadPlan,
    ScriptCall,
    StoragePlans,
    T,
)
from zerda_cache.storage.replies import LogInfo
from zerda_cache.storage.replies import batch as join_plans
from zerda_cache.storage.scripts import Scripts
from zerda_cache.storage.wire import wire_for

log = logging.getLogger(__name__)

S = TypeVar("S", bound="StorageCore")
P = ParamSpec("P")


def scripted(
    plan: Callable[Concatenate[S, P], ScriptCall[T]],
) -> Callable[Concatenate[S, P], Flow[T]]:
    """The flow that plans one script call with ``plan`` and runs it."""

    def flow(self: S, /, *args: P.args, **kwargs: P.kwargs) -> Flow[T]:
        return (yield from self.run_flow(plan(self, *args, **kwargs)))

    flow.__name__ = plan.__name__.removeprefix("plan")
    flow.__doc__ = plan.__doc__
    return flow


class StorageCore(StoragePlans):
    """One zerda-cache keyspace: its plans (``plans.py``) and how they run. ``Storage``
    (store.py) adds every operation; use ``RedisStorage`` or ``AsyncRedisStorage``.

    Args:
        client: a redis-py client with ``decode_responses=False``: ``redis.Redis`` or
            ``RedisCluster`` for ``RedisStorage``, their ``redis.asyncio`` counterparts
            for ``AsyncRedisStorage``.
        config: key prefix, size limits and the bandit parameters the scripts apply.
        clock: returns "now" in unix seconds; default: the Redis server's clock.
    """

    is_async: bool

    def __init__(
        self,
        client: Any,
        config: CacheConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(config, clock=clock)
        self.client = client
        # register_script returns the flavour of the client: sync or asyncio scripts.
        self.scripts = Scripts.register(client)
        self.cluster = is_cluster(client)
        self.wire = wire_for(client)  # how commands reach the server (wire.py)

    def run_flow(self, plan: ScriptCall[T]) -> Flow[T]:
        """Execute one planned script call: EVALSHA (sent directly where the client
        allows it: ``wire.py``), and on NOSCRIPT (its first use on this server, or after
        SCRIPT FLUSH) the ``Script`` object, which tries EVALSHA once more, loads the
        script and runs it (once per server, so the extra round trip is left in).
        redis-py's ``Script`` call alone would do the same, but it imports two classes at
        every call."""
        script = getattr(self.scripts, plan.script)
        with wrap_errors(plan.script):
            try:
                res = yield call(self.wire.send, script.sha, plan.keys, plan.args)
            except redis.exceptions.NoScriptError:
                res = yield call(script, keys=plan.keys, args=plan.args)
        return plan.parse(res)

    def read_flow(self, plan: ReadPlan[T]) -> Flow[T]:
        """Execute one read plan in a single pipeline round trip (sent directly where
        the client allows it: ``wire.py``)."""
        with wrap_errors(plan.name):
            pipe = self.client.pipeline(transaction=False)
            plan.queue(pipe)
            replies = yield call(self.wire.execute, pipe)
            for pos, script_call in plan.scripts:
                if isinstance(replies[pos], redis.exceptions.NoScriptError):
                    # First use on this server: the Script object loads it and runs it.
                    script = getattr(self.scripts, script_call.script)
                    replies[pos] = yield call(script, keys=script_call.keys, args=script_call.args)
            for pos, reply in enumerate(replies):
                if isinstance(reply, Exception) and pos not in plan.tolerant:
                    raise storage_error(plan.name, reply) from reply
        return plan.parse(replies)

    def send_flow(
        self, name: str, parts: Sequence[ReadPlan[Any] | ScriptCall[Any]]
    ) -> Flow[list[Any]]:
        """Several plans in one round trip, their results in order: a lone script call
        as its own EVALSHA (``run_flow``), anything else as one pipeline (``batch``)."""
        if len(parts) == 1 and isinstance(parts[0], ScriptCall):
            return [(yield from self.run_flow(parts[0]))]
        return (yield from self.read_flow(self.batch(name, parts)))

    def batch(
        self, name: str, parts: Sequence[ReadPlan[Any] | ScriptCall[Any]]
    ) -> ReadPlan[list[Any]]:
        """Several plans in one pipeline round trip (see ``plans.batch``)."""
        return join_plans(name, parts, lambda script: getattr(self.scripts, script).sha)

    def command_flow(self, what: str, method: str, *args: Any, **kwargs: Any) -> Flow[Any]:
        """One plain client command."""
        with wrap_errors(what):
            return (yield call(getattr(self.client, method), *args, **kwargs))

    def now_flow(self) -> Flow[float]:
        """Current time on the storage clock (the server's, unless one was injected)."""
        if self.clock is not None:
            return float(self.clock())
        sec, usec = yield from self.command_flow("TIME", "time")
        return float(sec) + float(usec) / 1_000_000

    def stream_info_flow(self, key: str) -> Flow[LogInfo]:
        """``XINFO STREAM`` of one of the tenant's streams (zeros before it exists)."""
        try:
            reply = yield from self.command_flow("xinfo", "xinfo_stream", key)
        except StorageError as exc:
            if "no such key" in str(exc).lower():
                return LogInfo()
            raise
        return LogInfo.parse(reply)

    run = op(run_flow)
    read = op(read_flow)
    now = op(now_flow)


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (sync or asyncio)."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster | AsyncRedisCluster)
