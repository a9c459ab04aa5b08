"""Everything the library says to Redis, and nothing of ranking.

=================  ===========================================================================
module             holds
=================  ===========================================================================
``keys``           the only place key strings are built
``codec``          msgpack maps and raw float32 vectors: every value stored or read
``scripts``        the Lua scripts (``lua/*.lua``), registered once per client
``plans``          script arguments, read commands and reply parsing, without I/O
``driver``         runs flows over sync or asyncio clients; error wrapping
``store``          ``RedisStorage`` / ``AsyncRedisStorage``: every command, written once
``connect``        clients for a URL with zerda-cache's timeouts
``lease``          the worker's token-checked lease
=================  ===========================================================================

Outside this package no module calls a Redis client method.
"""

from zerda_cache.storage.connect import client_options, connect
from zerda_cache.storage.driver import Flow, op, run_async, run_sync, wrap_errors
from zerda_cache.storage.plans import (
    FEEDBACK_BATCH,
    REASONS,
    DecayOutcome,
    EvictOutcome,
    EvictReason,
    FeedbackOutcome,
    HitOutcome,
    HitStatus,
    LogDelta,
    LogInfo,
    PutOutcome,
    ReadPlan,
    ScriptCall,
    StateArrays,
    StateBatch,
    StoragePlans,
)
from zerda_cache.storage.store import AsyncRedisStorage, RedisStorage, Storage, is_cluster

__all__ = [
    "FEEDBACK_BATCH",
    "REASONS",
    "AsyncRedisStorage",
    "DecayOutcome",
    "EvictOutcome",
    "EvictReason",
    "FeedbackOutcome",
    "Flow",
    "HitOutcome",
    "HitStatus",
    "LogDelta",
    "LogInfo",
    "PutOutcome",
    "ReadPlan",
    "RedisStorage",
    "ScriptCall",
    "StateArrays",
    "StateBatch",
    "Storage",
    "StoragePlans",
    "client_options",
    "connect",
    "is_cluster",
    "op",
    "run_async",
    "run_sync",
    "wrap_errors",
]
