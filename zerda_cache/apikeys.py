"""Per-tenant API keys of the HTTP service: tokens, their digests and their records.

A token is ``zk_`` followed by 43 URL-safe characters (``secrets.token_urlsafe(32)``: 256
random bits). Only its SHA-256 digest is stored (``storage.keys.api_keys_key``), so a
copy of Redis does not hold a usable key, and the service finds a key by hashing what
the client sent and reading that one field: no comparison of secrets in Python, so no
timing side channel worth the name (an attacker would need a preimage). The key id is
the first 12 hex digits of the digest: it names a key in listings and revocations
without revealing it.

Pure: no I/O. ``RedisStorage.add_api_key`` and friends store and read the records.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Protocol

from zerda_cache.core.errors import ZerdaError
from zerda_cache.core.validation import validate_tenant

TOKEN_PREFIX = "zk_"
#: What a token looks like; anything else is refused without a Redis round trip.
TOKEN_RE = re.compile(r"zk_[A-Za-z0-9_-]{43}")
KEY_ID_RE = re.compile(r"[0-9a-f]{12}")
MAX_NAME_CHARS = 64


def new_token() -> str:
    """A fresh API key token (shown once; only its digest is stored)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """The SHA-256 hex digest under which a token's record is stored."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def key_id(digest: str) -> str:
    """The public id of the key with this digest."""
    return digest[:12]


def looks_like_token(value: str) -> bool:
    return TOKEN_RE.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key's record: the tenant it is bound to, a label, when it was made and (if so)
    revoked, in unix seconds."""

    id: str
    tenant: str
    name: str = ""
    created: float = 0.0
    revoked: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked is None

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> ApiKey:
        """Parse a stored record (the revoke script re-encodes records with cjson, which
        writes ``revoked`` as a number)."""
        data = json.loads(raw)
        revoked = data.get("revoked")
        return cls(
            id=str(data["id"]),
            tenant=str(data["tenant"]),
            name=str(data.get("name", "")),
            created=float(data.get("created", 0.0)),
            revoked=None if revoked is None else float(revoked),
        )


def new_record(tenant: str, name: str, now: float) -> tuple[str, str, ApiKey]:
    """``(token, digest, record)`` for a new key of ``tenant``.

    Raises:
        InvalidTenantError: a bad tenant id.
        ValueError: a name that is not 0-64 printable characters.
    """
    validate_tenant(tenant)
    if len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise ValueError(f"key name must be at most {MAX_NAME_CHARS} printable characters")
    token = new_token()
    digest = token_digest(token)
    return token, digest, ApiKey(id=key_id(digest), tenant=tenant, name=name, created=now)


class KeyStore(Protocol):
    """What ``create_key`` needs of storage (``RedisStorage`` is one): this module
    stays pure and below storage, which imports ``ApiKey`` from here."""

    def now(self) -> float: ...

    def add_api_key(self, digest: str, record: ApiKey) -> bool: ...


def create_key(storage: KeyStore, tenant: str, name: str = "") -> tuple[str, ApiKey]:
    """Make a key for ``tenant`` and store its record: ``(token, record)``. What
    ``zerda-cache keys create`` does; the token is not stored anywhere, so show it once.

    Raises:
        InvalidTenantError, ValueError: a bad tenant id or name; nothing is stored.
        StorageError: Redis failed.
    """
    token, digest, record = new_record(tenant, name, storage.now())
    if not storage.add_api_key(digest, record):  # 2**-256: a broken random source
        raise ZerdaError("a key with this digest exists already; nothing stored")
    return token, record


__all__ = [
    "TOKEN_PREFIX",
    "ApiKey",
    "KeyStore",
    "create_key",
    "key_id",
    "looks_like_token",
    "new_record",
    "new_token",
    "token_digest",
]
