"""The HTTP service: the cache's flows over JSON, one tenant per API key.

``create_app`` builds a FastAPI app around one ``AsyncCacheManager`` (every request of a
service replica shares it, as the threads of an app replica share a ``CacheManager``).
Every ``/v1`` endpoint needs ``Authorization: Bearer <key>``; the key's record in Redis
names the tenant, and the request body has no tenant field at all, so a key can reach
its own tenant's keys and no other's (entry ids are looked up under the key's tenant:
another tenant's id is simply not found). ``/healthz``, ``/readyz``, ``/metrics`` and the
OpenAPI document need no key: keep the port off the public network, or filter those
paths at the ingress.

The endpoints are the bound methods of ``CacheRoutes``, ``OperationRoutes`` and
``proxy.ProxyRoutes``, each holding the app's one ``ServiceContext``.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations at
# runtime.
import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zerda_cache.aio import AsyncCacheManager
from zerda_cache.core.entry import FeedbackSignal
from zerda_cache.core.errors import StorageError
from zerda_cache.core.results import DisputeSignal
from zerda_cache.core.validation import validate_entry_id
from zerda_cache.service.auth import Tenant
from zerda_cache.service.body import JsonBody
from zerda_cache.service.context import (
    ServiceContext,
    ServiceMetrics,
    ServiceSettings,
    Upstream,
    service_metrics,
)
from zerda_cache.service.control import RequestControl, request_control
from zerda_cache.service.coordination import (
    COMPLETION_ID_RE,
    Coordination,
    Served,
    hit_id,
    parse_hit_id,
)
from zerda_cache.service.embedding import EmbedderError
from zerda_cache.service.errors import ApiError, error_response, install_error_handlers
from zerda_cache.service.limits import BodyLimit, send_error
from zerda_cache.service.models import (
    Entry,
    FeedbackRequest,
    FeedbackResponse,
    InvalidateRequest,
    InvalidateResponse,
    InvalidateTagRequest,
    InvalidateTagResponse,
    LookupRequest,
    LookupResponse,
    PutRequest,
    PutResponse,
)
from zerda_cache.service.proxy import ProxyRoutes
from zerda_cache.storage.store import AsyncRedisStorage

log = logging.getLogger(__name__)

#: A record digest no token has: reading it proves the service may read the keys hash.
_PROBE_DIGEST = "0" * 64


class CacheRoutes:
    """The cache endpoints (``/v1/lookup`` ... ``/v1/stats``) over one
    ``ServiceContext``. The bound methods are the endpoints: FastAPI reads their
    signatures (without ``self``) for the body model and the API-key dependency."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.manager = ctx.manager

    def register(self, app: FastAPI) -> None:
        posts: list[tuple[str, Callable[..., Awaitable[Any]]]] = [
            ("/v1/lookup", self.lookup),
            ("/v1/put", self.put),
            ("/v1/feedback", self.feedback),
            ("/v1/invalidate", self.invalidate),
            ("/v1/invalidate/tag", self.invalidate_tag),
        ]
        for path, endpoint in posts:
            app.add_api_route(path, endpoint, methods=["POST"], tags=["cache"])
        app.add_api_route("/v1/stats", self.stats, methods=["GET"], tags=["cache"])

    def controlled(
        self, request: Request, scope: str | None, embedding: list[float] | None
    ) -> tuple[RequestControl, str | None]:
        """The request's control, and ``scope`` with its partition on top; a 422 when
        the question comes without a vector and the service cannot embed it."""
        control = request_control(request.headers)
        scoped = control.scoped(scope)
        if embedding is None and not self.ctx.can_embed:
            raise ApiError(
                422,
                'no embedding: send "embedding" (this service has no embedder configured)',
                "invalid_request_error",
                "no_embedding",
            )
        return control, scoped

    async def lookup(self, body: LookupRequest, tenant: Tenant, request: Request) -> LookupResponse:
        """The best servable cached answer for the question, or a miss.

        ``decision`` tells a plain miss from a *verification* (``verify``: under the
        tenant's error bound a cached candidate was held back): send its
        ``verify_token`` with the ``/v1/put`` of the LLM's answer, to any service
        replica, and that put reports ``verified``. ``reason`` says why, and under a
        bound ``threshold`` and ``estimated_error`` what it serves.
        ``Cache-Control: no-cache`` or ``no-store`` answer a miss without reading the
        cache; ``X-Zerda-Scope`` adds a partition to the scope."""
        control, scope = self.controlled(request, body.scope, body.embedding)
        if not control.read:
            return LookupResponse(hit=False, decision="miss", entry=None, reason="no_cache")
        decision = await self.manager.decide(
            body.query,
            tenant=tenant,
            embedding=body.embedding,
            scope=scope,
            max_error_rate=body.max_error_rate,
        )
        hit = decision.hit
        entry = None
        if hit is not None:
            entry = Entry(
                entry_id=hit.entry_id,
                response=hit.response,
                query=hit.query,
                similarity=hit.similarity,
                score=hit.score,
                expected_reward=hit.expected_reward,
                confidence=hit.confidence,
                exact=hit.exact,
                scope=hit.scope,
                metadata=hit.metadata,
                hit_id=hit_id(hit.entry_id, hit.hit_number, hit.similarity),
            )
        return LookupResponse(
            hit=hit is not None,
            decision=decision.kind,
            entry=entry,
            reason=decision.reason,
            verify_token=decision.verify_token,
            max_error_rate=decision.max_error_rate,
            threshold=decision.threshold,
            exact_level=decision.exact_level,
            estimated_error=decision.estimated_error,
        )

    async def put(self, body: PutRequest, tenant: Tenant, request: Request) -> PutResponse:
        """Cache an answer (unless the admission check refuses it: ``stored`` false and
        the ``reason``; nothing is written then). ``Cache-Control: no-store`` stores
        nothing, ``max-age=N`` is the TTL when the body sets none; ``X-Zerda-Scope`` adds
        a partition to the scope. ``verify_token``: the lookup's, for a ``verify``."""
        control, scope = self.controlled(request, body.scope, body.embedding)
        if not control.write:
            return PutResponse(stored=False, reason="Cache-Control: no-store", verified=None)
        result = await self.manager.put(
            body.query,
            body.response,
            tenant=tenant,
            embedding=body.embedding,
            scope=scope,
            ttl_s=body.ttl_s if body.ttl_s is not None else control.ttl_s,
            quality=body.quality,
            metadata=body.metadata,
            tags=body.tags if body.tags is not None else control.tags,
            usage=body.usage,
            verify_token=body.verify_token,
        )
        return PutResponse(
            stored=result.stored,
            entry_id=result.entry_id,
            reason=result.reason,
            warnings=list(result.warnings),
            replaced_id=result.replaced_id,
            verified=result.verified,
            compared_id=result.compared_id,
            disputed=result.disputed,
            dispute_id=result.dispute_id,
        )

    async def feedback(self, body: FeedbackRequest, tenant: Tenant) -> FeedbackResponse:
        """A user's (or a judge's) verdict on an answer, named by its ``entry_id``, by
        the ``completion_id`` the proxy answered with or by a ``/v1/lookup`` hit's
        ``hit_id``: 404 for an entry this key's tenant does not have, and for a completion
        id it was not answered (or that expired). A negative verdict named by a hit's
        completion id or hit id counts that hit wrong in the savings, once."""
        named = [body.entry_id, body.completion_id, body.hit_id]
        if sum(name is not None for name in named) != 1:
            raise ApiError(
                422,
                'send one of "entry_id", "completion_id" and "hit_id"',
                "invalid_request_error",
                "entry_or_completion",
            )
        similarity = body.similarity
        served = None
        if body.completion_id is not None:
            served = await self.served(tenant, body.completion_id)
        elif body.hit_id is not None:
            served = parse_hit_id(body.hit_id)
            if served is None:
                raise ApiError(
                    422,
                    "invalid hit id: expected a /v1/lookup hit's entry.hit_id",
                    "invalid_request_error",
                    "invalid_hit_id",
                )
        if served is not None:
            entry_id, dispute = served.entry_id, served.dispute
            if similarity is None:
                similarity = served.similarity
        else:
            entry_id, dispute = validate_entry_id(body.entry_id), disputed(body)
        signal = FeedbackSignal(
            entry_id=entry_id,
            tenant_id=tenant,
            positive=body.positive,
            magnitude=body.magnitude,
            source=body.source,
            similarity=similarity,
            served=served is not None and served.hit,
            hit=served.hit_number if served is not None else None,
        )
        if dispute is not None:  # a reaction to the answer that disputes the entry
            signal = DisputeSignal(
                entry_id,
                tenant,
                body.positive,
                body.magnitude,
                body.source,
                similarity=similarity,
                dispute=dispute,
            )
        await self.manager.feedback(signal)
        return FeedbackResponse(applied=True, entry_id=entry_id)

    async def served(self, tenant: str, completion_id: str) -> Served:
        """What the proxy answered ``completion_id`` with: a 422 for an id of the wrong
        form, a 404 for one this key's tenant was not answered (or that expired)."""
        if not COMPLETION_ID_RE.fullmatch(completion_id):
            raise ApiError(
                422,
                "invalid completion id: expected 1 to 128 of A-Z a-z 0-9 _ . : -",
                "invalid_request_error",
                "invalid_completion_id",
            )
        served = await self.ctx.coordination.recall(tenant, completion_id)
        if served is None:
            raise ApiError(
                404,
                f"no completion {completion_id!r} for this key's tenant "
                "(unknown, expired, or its answer was not cached)",
                "not_found",
            )
        return served

    async def invalidate(self, body: InvalidateRequest, tenant: Tenant) -> InvalidateResponse:
        """Remove one entry from every replica: 404 if this key's tenant has no such
        entry."""
        if not await self.manager.invalidate(body.entry_id, tenant=tenant):
            raise ApiError(404, f"no entry {body.entry_id!r} for this key's tenant", "not_found")
        return InvalidateResponse(removed=True)

    async def invalidate_tag(
        self, body: InvalidateTagRequest, tenant: Tenant
    ) -> InvalidateTagResponse:
        """Remove every entry of this key's tenant put with ``tag`` (from every replica),
        in one call through the tag's index in Redis; ``removed``: how many (0 for a tag
        no live entry has)."""
        removed = await self.manager.invalidate_tag(body.tag, tenant=tenant)
        return InvalidateTagResponse(removed=removed)

    async def stats(self, tenant: Tenant) -> dict[str, Any]:
        """The key's tenant's shared counters (hits, misses, puts, feedback, evictions,
        entries, bytes), hit rate and ``savings`` (calls, tokens and dollars saved, wrong
        and net, per model)."""
        return {"tenant": tenant, **(await self.manager.stats(tenant))}


class OperationRoutes:
    """``/healthz``, ``/readyz`` and ``/metrics``, which need no API key."""

    def __init__(self, ctx: ServiceContext, registry: CollectorRegistry) -> None:
        self.ctx = ctx
        self.registry = registry

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/healthz", self.healthz, methods=["GET"], tags=["operations"])
        app.add_api_route("/readyz", self.readyz, methods=["GET"], tags=["operations"])
        app.add_api_route(
            "/metrics", self.metrics, methods=["GET"], tags=["operations"], include_in_schema=False
        )

    async def healthz(self) -> JSONResponse:
        """Liveness: the process serves and Redis answers PING (503 otherwise)."""
        try:
            await self.ctx.keys.ping()
        except StorageError as exc:
            return JSONResponse({"status": "unavailable", "redis": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok", "redis": "ok"})

    async def readyz(self) -> JSONResponse:
        """Readiness: Redis answers and the keys can be read, the warm tenants' indexes
        are built, and the service is not shutting down (503 otherwise)."""
        problems = []
        try:
            await self.ctx.keys.ping()
            await self.ctx.keys.api_key(_PROBE_DIGEST)
        except StorageError as exc:
            problems.append(f"redis: {exc}")
        if not self.ctx.warmed:
            problems.append("building the indexes of the warm tenants")
        if self.ctx.draining:
            problems.append("shutting down")
        if problems:
            return JSONResponse({"status": "not ready", "problems": problems}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _RequestMetrics:
    """Counts every response (including the body limit's 413s) by route and status, and
    answers an exception no handler took with the JSON error shape (a 500): the error is
    logged here, not re-raised, so the server keeps the client's connection open."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, routes: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        responded = False
        started = time.perf_counter()

        async def counting(message: Message) -> None:
            nonlocal status, responded
            if message["type"] == "http.response.start":
                status = int(message["status"])
                responded = True
            await send(message)

        try:
            await self.app(scope, receive, counting)
        except Exception:
            log.exception("%s %s failed", scope.get("method", ""), scope.get("path", ""))
            if responded:  # mid-stream: the connection cannot be saved
                raise
            status = 500
            await send_error(send, 500, "internal error (logged by the service)", "server_error")
        finally:
            path = scope.get("path", "")
            route = path if path in self.routes else "other"
            self.metrics.requests.labels(route, scope.get("method", ""), str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)


def create_app(
    manager: AsyncCacheManager,
    *,
    keys: AsyncRedisStorage | None = None,
    upstream: Upstream | None = None,
    settings: ServiceSettings | None = None,
    registry: CollectorRegistry | None = None,
    close_on_shutdown: bool = False,
) -> FastAPI:
    """The service's ASGI app.

    Args:
        manager: the cache; its ``embed_fn`` (if any) embeds questions that come without
            a vector, and is the proxy's embedder (without one the proxy passes every
            request through uncached).
        keys: where API keys are read (default: the manager's storage, same Redis).
        upstream: the OpenAI-compatible API behind the proxy (default: none; proxy
            misses then answer 503).
        settings: body limit and start-up warming.
        registry: where the service's metrics are registered and what ``/metrics``
            serves: give the manager's metrics the same registry (default: the
            process-wide one, which ``ReplicaMetrics`` also uses by default).
        close_on_shutdown: close the manager (and an embedder with ``aclose``) when the
            app shuts down (``zerda-cache serve`` owns them; tests may not).
    """
    cfg = settings if settings is not None else ServiceSettings()
    reg = registry if registry is not None else REGISTRY
    ctx = ServiceContext(
        manager=manager,
        keys=keys if keys is not None else manager.storage,
        metrics=service_metrics(reg),
        upstream=upstream,
        settings=cfg,
        coordination=Coordination(
            manager.storage, completion_ttl_s=cfg.completion_ttl_s, settings=cfg.coalesce
        ),
    )
    app = FastAPI(
        title="zerda-cache",
        version=_version(),
        summary="A shared semantic cache for LLM apps, and an OpenAI-compatible caching proxy.",
        lifespan=lambda _: _running(ctx, close_on_shutdown),
    )
    app.state.zerda = ctx
    install_error_handlers(app)
    app.exception_handler(EmbedderError)(_embedder_error)
    CacheRoutes(ctx).register(app)
    OperationRoutes(ctx, reg).register(app)
    ProxyRoutes(ctx).register(app)

    routes = {getattr(r, "path", "") for r in app.routes}
    # Innermost first: the body limit reads the body, the JSON check parses it.
    json_routes = {r.path for r in app.routes if isinstance(r, APIRoute) and r.body_field}
    app.add_middleware(JsonBody, paths=json_routes)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.add_middleware(_RequestMetrics, metrics=ctx.metrics, routes=routes)
    return app


async def _embedder_error(request: Request, exc: EmbedderError) -> JSONResponse:
    log.warning("embedder failed: %s", exc)
    return error_response(502, f"the service's embedder failed: {exc}", "embedder_error")


@contextlib.asynccontextmanager
async def _running(ctx: ServiceContext, close_on_shutdown: bool) -> AsyncIterator[None]:
    """The app's lifetime: the warm tenants' indexes are built meanwhile; at shutdown
    ``/readyz`` answers 503 and the upstream client closes (and with
    ``close_on_shutdown`` the manager and an embedder with ``aclose``)."""
    warm = asyncio.create_task(_warm(ctx))
    try:
        yield
    finally:
        ctx.draining = True
        warm.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await warm
        await ctx.aclose_http()
        if close_on_shutdown:
            closer = getattr(ctx.manager.embed_fn, "aclose", None)
            if closer is not None and inspect.iscoroutinefunction(closer):
                await closer()
            await ctx.manager.aclose()


async def _warm(ctx: ServiceContext) -> None:
    """Build the warm tenants' indexes, retrying while Redis is unreachable."""
    for tenant in ctx.settings.warm_tenants:
        while True:
            try:
                size = await ctx.manager.sync_index(tenant)
                log.info("tenant %s: index built (%d entries)", tenant, size)
                break
            except StorageError as exc:
                log.warning("tenant %s: index not built yet: %s", tenant, exc)
                await asyncio.sleep(1.0)
    ctx.warmed = True


def disputed(body: FeedbackRequest) -> str | None:
    """The dispute a reaction by entry id answers (``dispute_id``, the put's), else
    None; a 422 for ``disputed`` without it: a reaction settles only the dispute it
    names, never one another answer recorded on the entry since."""
    if body.dispute_id is not None:
        return body.dispute_id
    if body.disputed:
        raise ApiError(
            422,
            'a reaction to a disputed answer names its dispute: send the put\'s "dispute_id"',
            "invalid_request_error",
            "dispute_id_missing",
        )
    return None


def _version() -> str:
    from zerda_cache import __version__

    return __version__


__all__ = [
    "CacheRoutes",
    "OperationRoutes",
    "ServiceContext",
    "ServiceMetrics",
    "ServiceSettings",
    "Upstream",
    "create_app",
]
