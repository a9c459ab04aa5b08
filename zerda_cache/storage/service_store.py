"""The HTTP service's and the proxy's shared state in Redis: API keys, the completion ids
the proxy answered with, and the leases that coalesce identical upstream calls.
"""

from __future__ import annotations

import logging
from typing import Any

from zerda_cache.apikeys import ApiKey
from zerda_cache.core.errors import (
    CorruptEntryError,
)
from zerda_cache.storage.codec import text
from zerda_cache.storage.driver import Flow, call, op, wrap_errors
from zerda_cache.storage.executor import StorageCore
from zerda_cache.storage.keys import api_keys_key
from zerda_cache.storage.plans import (
    ReadPlan,
    ScriptCall,
)

log = logging.getLogger(__name__)


class ServiceStore(StorageCore):
    """API keys, completion ids and upstream-call leases (``zerda_cache/service``)."""

    def remember_completion_flow(
        self, tenant: str, completion_id: str, value: str, ttl_s: float
    ) -> Flow[None]:
        """Map a completion id the proxy answered with to ``value`` (expires)."""
        key = self.keys(tenant).completion(completion_id)
        yield from self.command_flow("completion id", "set", key, value, ex=max(1, int(ttl_s)))

    def recall_completion_flow(self, tenant: str, completion_id: str) -> Flow[bytes | None]:
        """What a completion id maps to (``None``: unknown or expired)."""
        key = self.keys(tenant).completion(completion_id)
        raw = yield from self.command_flow("completion id", "get", key)
        return None if raw is None else bytes(raw)

    def take_flight_flow(self, tenant: str, digest: str, token: str, ms: int) -> Flow[bool]:
        """Take the lease on the upstream call of request ``digest`` if it is free."""
        key = self.keys(tenant).in_flight(digest)
        taken = yield from self.command_flow("lease", "set", key, token, nx=True, px=ms)
        return bool(taken)

    def read_flight_flow(self, tenant: str, digest: str) -> Flow[bytes | None]:
        """The lease's value: a holder's token, a finished holder's marker, or ``None``."""
        raw = yield from self.command_flow("lease", "get", self.keys(tenant).in_flight(digest))
        return None if raw is None else bytes(raw)

    def renew_flight_flow(self, tenant: str, digest: str, token: str, ms: int) -> Flow[bool]:
        """Extend the lease if it is still ``token``'s (``lua/lease_renew.lua``)."""
        key = self.keys(tenant).in_flight(digest)
        plan = ScriptCall("lease_renew", [key], [token, ms], lambda res: bool(res))
        return (yield from self.run_flow(plan))

    def finish_flight_flow(
        self, tenant: str, digest: str, token: str, marker: str, ms: int
    ) -> Flow[bool]:
        """Replace the lease by ``marker`` for ``ms`` if it is still ``token``'s
        (``lua/lease_finish.lua``)."""
        key = self.keys(tenant).in_flight(digest)
        plan = ScriptCall("lease_finish", [key], [token, marker, ms], lambda res: bool(res))
        return (yield from self.run_flow(plan))

    def add_api_key_flow(self, digest: str, record: ApiKey) -> Flow[bool]:
        """Store a new key's record under its token's digest; False if that digest exists."""
        key = api_keys_key(self.config.key_prefix)
        with wrap_errors("apikey_add"):
            res = yield call(self.scripts.apikey_add, keys=[key], args=[digest, record.encode()])
        return bool(int(res))

    def api_key_flow(self, digest: str) -> Flow[ApiKey | None]:
        """The record of the key whose token has this digest (revoked ones included).

        Raises:
            CorruptEntryError: the stored record does not decode.
        """
        key = api_keys_key(self.config.key_prefix)
        raw = yield from self.command_flow("api key", "hget", key, digest)
        if raw is None:
            return None
        try:
            return ApiKey.decode(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptEntryError(key, f"record of {digest[:12]}: {exc}") from exc

    def find_api_key_flow(self, digest: str) -> Flow[tuple[ApiKey | None, bool]]:
        """``api_key_flow`` and ``has_api_keys_flow`` in one round trip: the record of
        the key whose token has this digest, and whether the store holds any record (an
        unknown key's refusal says when none is: the store was lost). The service's
        check of every request's key.

        Raises:
            CorruptEntryError: the stored record does not decode.
        """
        key = api_keys_key(self.config.key_prefix)

        def queue(pipe: Any) -> None:
            pipe.hget(key, digest)
            pipe.exists(key)

        def parse(res: list[Any]) -> tuple[ApiKey | None, bool]:
            raw, held = res
            if raw is None:
                return None, bool(held)
            try:
                return ApiKey.decode(raw), True
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptEntryError(key, f"record of {digest[:12]}: {exc}") from exc

        return (yield from self.read_flow(ReadPlan("api key", queue, parse, 2)))

    def has_api_keys_flow(self) -> Flow[bool]:
        """Whether the key store holds any record (revoked ones included): none after an
        empty restart or a flush of the Redis it lives in."""
        key = api_keys_key(self.config.key_prefix)
        return bool((yield from self.command_flow("api keys", "exists", key)))

    def api_keys_flow(self) -> Flow[list[ApiKey]]:
        """Every key's record (undecodable ones are logged and skipped), by tenant."""
        key = api_keys_key(self.config.key_prefix)
        raw = yield from self.command_flow("api keys", "hgetall", key)
        out = []
        for digest, value in raw.items():
            try:
                out.append(ApiKey.decode(value))
            except (ValueError, KeyError, TypeError):
                log.warning("%s: skipping an undecodable record %s", key, text(digest)[:12])
        return sorted(out, key=lambda k: (k.tenant, k.created, k.id))

    def revoke_api_keys_flow(
        self, *, key_id: str | None = None, tenant: str | None = None
    ) -> Flow[list[str]]:
        """Revoke one key (by id) or every key of a tenant; returns the ids revoked now."""
        if (key_id is None) == (tenant is None):
            raise ValueError("revoke by key_id or by tenant (exactly one)")
        field, value = ("id", key_id) if key_id is not None else ("tenant", tenant)
        now = yield from self.now_flow()
        key = api_keys_key(self.config.key_prefix)
        with wrap_errors("apikey_revoke"):
            res = yield call(self.scripts.apikey_revoke, keys=[key], args=[field, value, repr(now)])
        return [text(i) for i in res or ()]

    def ping_flow(self) -> Flow[bool]:
        """True when the server answers PING (raises ``StorageError`` when it does not)."""
        return bool((yield from self.command_flow("ping", "ping")))

    remember_completion = op(remember_completion_flow)
    recall_completion = op(recall_completion_flow)
    take_flight = op(take_flight_flow)
    read_flight = op(read_flight_flow)
    renew_flight = op(renew_flight_flow)
    finish_flight = op(finish_flight_flow)
    add_api_key = op(add_api_key_flow)
    api_key = op(api_key_flow)
    has_api_keys = op(has_api_keys_flow)
    find_api_key = op(find_api_key_flow)
    api_keys = op(api_keys_flow)
    revoke_api_keys = op(revoke_api_keys_flow)
    ping = op(ping_flow)
