"""Everything the library says to Redis, and nothing of ranking.

=================  ===========================================================================
module             holds
=================  ===========================================================================
``keys``           the only place key strings are built
``codec``          msgpack maps and vectors (by default ``h`` then float16 bytes, or float32
                   bytes): every value stored or read
``scripts``        the Lua scripts (``lua/*.lua``), registered once per client
``plan_base``      what every plan shares: configuration, keys, the bandit's script arguments
``entry_plans``    the plans that write entries (put, hit, feedback, decay, evict, restore)
``tenant_plans``   the plans that read a tenant (entries, states, log, labels, settings)
``plans``          ``StoragePlans``: both, without I/O
``replies``        what plans return (``ScriptCall``, ``ReadPlan``) and reply parsing
``driver``         runs flows over sync or asyncio clients; error wrapping
``executor``       how a plan is sent: one script call, one pipeline, one command
``wire``           the lookup's round trip on the wire, without redis-py's per-command layers
``store``          ``RedisStorage`` / ``AsyncRedisStorage``: every command, written once
``entry_store``    storage's operations on entries
``tenant_store``   storage's operations on a tenant as a whole, and the worker's keys
``snapshots``      the worker's index snapshots, written in chunks and published at once
``service_store``  the HTTP service's API keys, completion ids and coalescing leases
``reports``        the settings each replica and worker applies, reported to each tenant
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
