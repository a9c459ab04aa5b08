"""Reading and damaging entries' learning state by hand, as the tests do.

An entry's state is its field of the tenant's state hash: msgpack ``[arm, use, sz]``
(``zerda_cache/storage/codec.py``).
"""

from __future__ import annotations

from typing import Any

import msgpack
import redis

from zerda_cache.storage.keys import tenant_keys

PARTS = ("arm", "use", "sz")


def read_state(client: redis.Redis, tenant: str, entry_id: str) -> dict[str, Any]:
    """The entry's stored state, decoded: ``{"arm": ..., "use": ..., "sz": ...}``."""
    raw = client.hget(tenant_keys(tenant).st, entry_id)
    assert raw is not None, f"{entry_id} has no state"
    return dict(zip(PARTS, msgpack.unpackb(raw), strict=True))


def set_state_part(
    client: redis.Redis, tenant: str, entry_id: str, part: str, raw: bytes | None
) -> None:
    """Put the msgpack bytes ``raw`` (``None``: a nil) in place of one part of the
    entry's stored state, leaving the others as they are."""
    pieces = {name: msgpack.packb(v) for name, v in read_state(client, tenant, entry_id).items()}
    pieces[part] = b"\xc0" if raw is None else raw
    packed = b"\x93" + b"".join(pieces[name] for name in PARTS)
    client.hset(tenant_keys(tenant).st, entry_id, packed)


def set_state_value(client: redis.Redis, tenant: str, entry_id: str, part: str, value: Any) -> None:
    """``set_state_part`` with a value to pack."""
    set_state_part(client, tenant, entry_id, part, msgpack.packb(value))


def stored(client: redis.Redis, tenant: str, entry_id: str) -> tuple[Any, Any]:
    """Everything stored of one entry: its hash and its state, as they are."""
    k = tenant_keys(tenant)
    return client.hgetall(k.entry(entry_id)), client.hget(k.st, entry_id)
