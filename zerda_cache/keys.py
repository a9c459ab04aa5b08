"""The only place Redis key strings are built.

Every key of one tenant carries the hash tag ``{<tenant>}``, so every Lua script touches a
single Redis Cluster slot. Tenant ids are validated before they come near a key: a brace,
colon, space or newline would change which slot (or which tenant) a key belongs to.

Layout (``p`` is the configured prefix, ``zc`` by default):

=====================  =======  ==========================================================
key                    type     holds
=====================  =======  ==========================================================
``p:{t}:e:<id>``       hash     one entry: doc, vec, meta, arm, use, ver
``p:{t}:ids``          zset     live entry ids, scored by expiry (unix s, +inf = none)
``p:{t}:q``            hash     digest of (normalised query, scope) -> entry id
``p:{t}:log``          stream   add/del events that keep replicas' vector indexes current
``p:{t}:stats``        hash     counters (hits, misses, puts, bytes, evicted:<reason>, ...)
``p:{t}:fb``           stream   the rolling feedback log (exact cap)
``p:{t}:cfg``          hash     tenant settings: dim; max_entries, max_bytes, ttl overrides
``p:tenants``          set      known tenants (global; never touched inside a script)
``p:worker:leader``    string   the worker's lease
``p:worker:cycles``    stream   start/end of the worker's cycles (capped)
=====================  =======  ==========================================================
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from zerda_cache.errors import InvalidTenantError

TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
ENTRY_ID_RE = re.compile(r"[0-9a-f]{32}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]{1,32}")


def validate_tenant(tenant: object) -> str:
    """Return ``tenant`` if it is a valid tenant id, else raise ``InvalidTenantError``."""
    if not isinstance(tenant, str):
        raise InvalidTenantError(f"tenant id must be a str, got {type(tenant).__name__}")
    if not TENANT_RE.fullmatch(tenant):
        shown = tenant if len(tenant) <= 80 else tenant[:77] + "..."
        raise InvalidTenantError(
            f"invalid tenant id {shown!r}: use 1 to 64 characters from [A-Za-z0-9._-]"
        )
    return tenant


def validate_entry_id(entry_id: object) -> str:
    """Return ``entry_id`` if it looks like an id this library made (32 hex chars)."""
    if not isinstance(entry_id, str) or not ENTRY_ID_RE.fullmatch(entry_id):
        from zerda_cache.errors import InvalidFeedbackError

        raise InvalidFeedbackError(f"invalid entry id {entry_id!r}: expected 32 hex characters")
    return entry_id


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"key_prefix must match [A-Za-z0-9._-]{{1,32}}, got {prefix!r}")
    return prefix


def new_entry_id() -> str:
    """A 128-bit random id, as 32 lowercase hex characters."""
    return secrets.token_hex(16)


@dataclass(frozen=True, slots=True)
class TenantKeys:
    """The keys of one tenant. Build with :func:`tenant_keys`."""

    tenant: str
    base: str  # "p:{t}:"
    ids: str
    q: str
    log: str
    stats: str
    fb: str
    cfg: str

    def entry(self, entry_id: str) -> str:
        return self.base + "e:" + entry_id

    @property
    def entry_prefix(self) -> str:
        return self.base + "e:"


def tenant_keys(tenant: str, prefix: str = "zc") -> TenantKeys:
    """Validate ``tenant`` and return the names of all of its keys."""
    validate_tenant(tenant)
    base = f"{prefix}:{{{tenant}}}:"
    return TenantKeys(
        tenant=tenant,
        base=base,
        ids=base + "ids",
        q=base + "q",
        log=base + "log",
        stats=base + "stats",
        fb=base + "fb",
        cfg=base + "cfg",
    )


def tenants_key(prefix: str = "zc") -> str:
    return f"{prefix}:tenants"


def cycles_key(prefix: str = "zc") -> str:
    """The worker's cycle log (stream): start and end of every maintenance cycle."""
    return f"{prefix}:worker:cycles"


def leader_key(prefix: str = "zc") -> str:
    return f"{prefix}:worker:leader"
