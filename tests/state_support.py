"""Reading and damaging entries' learning state by hand, as the tests do.

An entry's state is its field of the tenant's state hash: 15 little-endian float64
(``zerda_cache/storage/codec.py``, ``STATE_FIELDS``).
"""

from __future__ import annotations

import struct
from typing import Any

import redis

from zerda_cache.learning.tenant_state import AsyncTenantState, TenantState
from zerda_cache.storage.codec import STATE_FIELDS
from zerda_cache.storage.keys import tenant_keys

_STATE = struct.Struct("<" + "d" * len(STATE_FIELDS))
_ARM = ("a", "b", "n", "r", "t")
_USE = ("n", "la", "c", "v", "ss", "qs", "sb", "pm", "ns")  # "n" is the state's "un"


def read_state(client: redis.Redis, tenant: str, entry_id: str) -> dict[str, Any]:
    """The entry's stored state: ``{"arm": {a, b, n, r, t}, "use": {n, la, c, v, ss, qs,
    sb, pm, ns}, "sz": ...}``."""
    raw = client.hget(tenant_keys(tenant).st, entry_id)
    assert raw is not None, f"{entry_id} has no state"
    values = _STATE.unpack(raw)
    return {
        "arm": dict(zip(_ARM, values[:5], strict=True)),
        "use": dict(zip(_USE, values[5:14], strict=True)),
        "sz": values[14],
    }


def write_state(client: redis.Redis, tenant: str, entry_id: str, state: dict[str, Any]) -> None:
    """Store ``state`` (``read_state``'s shape) as the entry's state."""
    arm, use = state["arm"], state["use"]
    packed = _STATE.pack(*(arm[k] for k in _ARM), *(use.get(k, 0) for k in _USE), state["sz"])
    client.hset(tenant_keys(tenant).st, entry_id, packed)


def set_state_value(client: redis.Redis, tenant: str, entry_id: str, part: str, value: Any) -> None:
    """Replace one part of the entry's state (``arm`` or ``use``: a map; ``sz``: a
    number), leaving the others as they are."""
    state = read_state(client, tenant, entry_id)
    state[part] = value
    write_state(client, tenant, entry_id, state)


def set_raw_state(client: redis.Redis, tenant: str, entry_id: str, raw: bytes) -> None:
    """Store ``raw`` as the entry's state, whatever it is."""
    client.hset(tenant_keys(tenant).st, entry_id, raw)


def stored(client: redis.Redis, tenant: str, entry_id: str) -> tuple[Any, Any]:
    """Everything stored of one entry: its hash and its state, as they are."""
    k = tenant_keys(tenant)
    return client.hgetall(k.entry(entry_id)), client.hget(k.st, entry_id)


def tenant_state(storage: Any) -> Any:
    """``TenantState`` over ``storage``; over conftest's ``Blocking`` view of an
    ``AsyncRedisStorage``, an ``AsyncTenantState`` seen through the same blocking calls."""
    target = getattr(storage, "target", None)
    if target is not None:
        return type(storage)(AsyncTenantState(target), storage.loop)
    return TenantState(storage)
