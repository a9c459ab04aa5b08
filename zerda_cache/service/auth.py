"""The API-key check every ``/v1`` route depends on: ``Tenant`` is the key's tenant.

A route declares ``tenant: Tenant``; FastAPI then reads ``Authorization: Bearer <key>``,
and ``tenant_of`` looks the key's digest up in the key store of the app's
``ServiceContext``: a 401 for a missing, malformed, unknown or revoked key (counted by
reason in ``zerda_cache_http_auth_failures_total``), and one that says so when the key
store is empty (``no_api_keys``: the Redis it lives in lost it).
"""

# No `from __future__ import annotations`: FastAPI reads the dependency's annotations at
# runtime.
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from zerda_cache.apikeys import looks_like_token, token_digest
from zerda_cache.service.context import ServiceContext, context_of
from zerda_cache.service.errors import ApiError

bearer = HTTPBearer(auto_error=False, description="A tenant's key: `zerda-cache keys create`")


def refusal(ctx: ServiceContext, reason: str, message: str) -> ApiError:
    """A 401 for ``reason``, counted."""
    ctx.metrics.auth_failures.labels(reason).inc()
    return ApiError(401, message, "invalid_api_key", reason)


async def tenant_of(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    """The tenant the request's API key is bound to, else a 401."""
    ctx = context_of(request)
    if credentials is None:
        raise refusal(ctx, "missing_api_key", "missing API key: send Authorization: Bearer zk_...")
    token = credentials.credentials.strip()
    if not looks_like_token(token):
        raise refusal(ctx, "invalid_api_key", "malformed API key: expected zk_ and 43 characters")
    record, any_keys = await ctx.keys.find_api_key(token_digest(token))  # one round trip
    if record is None:
        if not any_keys:
            raise refusal(ctx, "no_api_keys", NO_KEYS)
        raise refusal(ctx, "invalid_api_key", "unknown API key")
    if not record.active:
        raise refusal(ctx, "revoked_api_key", "this API key was revoked")
    return record.tenant


#: The 401 when the key store is empty: every key is unknown then.
NO_KEYS = (
    "unknown API key: the service's key store in Redis holds no key at all (an empty "
    "restart, a flush, or a Redis other than the one the keys were created on?). Keys "
    "live in the cache's Redis: restore it from a backup that holds them, or create new "
    "ones with `zerda-cache keys create`"
)

#: The annotation of a route's ``tenant`` parameter.
Tenant = Annotated[str, Depends(tenant_of)]

__all__ = ["NO_KEYS", "Tenant", "bearer", "tenant_of"]
