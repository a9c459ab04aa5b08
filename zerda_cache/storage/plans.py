"""Storage plans: everything about Redis that does no I/O.

Keys, argument validation, the arguments of every script, the commands of every read,
and the parsing of every reply live here, as plans: a ``ScriptCall`` (one Lua script
invocation) or a ``ReadPlan`` (plain commands queued on one pipeline, one round trip).
``batch`` joins several plans into one pipeline. The flows of ``store.py`` execute plans
through a driver (``driver.py``), so the sync and asyncio flavours share every line here.
"""

from __future__ import annotations

from zerda_cache.storage.entry_plans import EntryPlans
from zerda_cache.storage.replies import (
    CATCHUP_BATCH,
    FEEDBACK_BATCH,
    PEEK_EVENTS,
    REASONS,
    DecayOutcome,
    DimensionLost,
    EvictOutcome,
    EvictReason,
    FeedbackOutcome,
    HitOutcome,
    HitStatus,
    LabelLogRows,
    LogDelta,
    LogInfo,
    PutFields,
    PutOutcome,
    ReadPlan,
    ScriptCall,
    StateArrays,
    StateBatch,
    StoredEntry,
    T,
    TenantHashes,
    batch,
    group_by_tenant,
    state_arrays_of,
)
from zerda_cache.storage.tenant_plans import TenantPlans


class StoragePlans(EntryPlans, TenantPlans):
    """The plans of one keyspace: keys, validation, script arguments and the parsing of
    replies. ``Storage`` (store.py) executes them.

    Args:
        config: key prefix, size limits and the bandit parameters the scripts apply.
        clock: returns "now" in unix seconds; default: the Redis server's clock, read
            inside each script (one clock for every replica).
    """


__all__ = [
    "CATCHUP_BATCH",
    "FEEDBACK_BATCH",
    "PEEK_EVENTS",
    "REASONS",
    "DecayOutcome",
    "DimensionLost",
    "EvictOutcome",
    "EvictReason",
    "FeedbackOutcome",
    "HitOutcome",
    "HitStatus",
    "LabelLogRows",
    "LogDelta",
    "LogInfo",
    "PutFields",
    "PutOutcome",
    "ReadPlan",
    "ScriptCall",
    "StateArrays",
    "StateBatch",
    "StoragePlans",
    "StoredEntry",
    "T",
    "TenantHashes",
    "batch",
    "group_by_tenant",
    "state_arrays_of",
]
