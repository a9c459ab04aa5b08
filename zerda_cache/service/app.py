"""The HTTP service: the cache's flows over JSON, one tenant per API key.

``create_app`` builds a FastAPI app around one ``AsyncCacheManager`` (every request of a
service replica shares it, as the threads of an app replica share a ``CacheManager``).
Every ``/v1`` endpoint needs ``Authorization: Bearer <key>``; the key's record in Redis
names the tenant, and the request body has no tenant field at all, so a key can reach
its own tenant's keys and no other's (entry ids are looked up under the key's tenant:
another tenant's id is simply not found). ``/healthz``, ``/readyz``, ``/metrics`` and the
OpenAPI document need no key: keep the port off the public network, or filter those
paths at the ingress.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations at
# runtime, and the API-key dependency is a local of the app factory.
import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zerda_cache.aio import AsyncCacheManager
from zerda_cache.apikeys import looks_like_token, token_digest
from zerda_cache.errors import StorageError
from zerda_cache.policy_learner import FeedbackSignal
from zerda_cache.service.body import JsonBody
from zerda_cache.service.control import request_control
from zerda_cache.service.coordination import COMPLETION_ID_RE, CoalesceSettings, Coordination
from zerda_cache.service.embedding import EmbedderError
from zerda_cache.service.errors import ApiError, error_response, install_error_handlers
from zerda_cache.service.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit, send_error
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
from zerda_cache.storage.store import AsyncRedisStorage
from zerda_cache.validation import validate_entry_id

log = logging.getLogger(__name__)

HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: A record digest no token has: reading it proves the service may read the keys hash.
_PROBE_DIGEST = "0" * 64


class ServiceMetrics:
    """What the service exports on ``/metrics`` next to the manager's replica metrics
    (``docs/operations.md`` lists them). ``route`` is the route's path (``other`` for
    paths the app does not serve), so the series count stays bounded."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "zerda_cache_http_requests_total",
            "HTTP requests by route, method and status code",
            ["route", "method", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "zerda_cache_http_request_duration_seconds",
            "HTTP request duration by route (proxy misses include the upstream call)",
            ["route"],
            buckets=HTTP_BUCKETS,
            registry=registry,
        )
        self.auth_failures = Counter(
            "zerda_cache_http_auth_failures_total",
            "Requests refused for their API key (missing, malformed, unknown, revoked)",
            ["reason"],
            registry=registry,
        )
        self.proxy = Counter(
            "zerda_cache_proxy_requests_total",
            "Proxy requests by endpoint and result (hit, miss, verify, bypass, error)",
            ["endpoint", "result"],
            registry=registry,
        )
        self.upstream_latency = Histogram(
            "zerda_cache_proxy_upstream_duration_seconds",
            "Duration of the proxy's upstream calls",
            ["endpoint"],
            buckets=HTTP_BUCKETS,
            registry=registry,
        )


_metrics: dict[int, tuple[CollectorRegistry, ServiceMetrics]] = {}
_metrics_lock = threading.Lock()


def service_metrics(registry: CollectorRegistry) -> ServiceMetrics:
    """The ``ServiceMetrics`` of ``registry``, made on first use: apps created again in
    one process (tests, examples) share them instead of registering them twice."""
    with _metrics_lock:
        known = _metrics.get(id(registry))
        if known is None or known[0] is not registry:
            known = (registry, ServiceMetrics(registry))
            _metrics[id(registry)] = known
        return known[1]


@dataclass(frozen=True, slots=True)
class Upstream:
    """The OpenAI-compatible API the proxy forwards misses to.

    Attributes:
        base_url: e.g. ``https://api.openai.com/v1`` (``/chat/completions`` is appended).
        api_key: sent upstream as ``Authorization: Bearer``; never the client's key.
        timeout_s: per upstream call (LLM answers can take a while).
    """

    base_url: str
    api_key: str | None = None
    timeout_s: float = 120.0

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def __repr__(self) -> str:  # never print the key
        return f"Upstream({self.base_url!r}, api_key={'***' if self.api_key else None})"


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """Limits and start-up work of the service.

    Attributes:
        max_body_bytes: request bodies over this are refused (413) before they are read
            further; the manager's ``max_query_chars`` and ``max_response_bytes`` apply
            on top.
        warm_tenants: tenants whose index is built at start-up; ``/readyz`` answers 503
            until that is done (otherwise a tenant's first lookup builds it).
        completion_ttl_s: how long the proxy's completion ids stay mapped to their
            entries (feedback by a completion id after that is a 404).
        coalesce: how concurrent identical proxy misses share one upstream call.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    warm_tenants: tuple[str, ...] = ()
    completion_ttl_s: float = 86_400.0
    coalesce: CoalesceSettings = field(default_factory=CoalesceSettings)


@dataclass
class ServiceContext:
    """What the routes share: the manager, the key store, metrics, the upstream, and
    the completion ids and leases the replicas share in Redis."""

    manager: AsyncCacheManager
    keys: AsyncRedisStorage
    metrics: ServiceMetrics
    upstream: Upstream | None
    settings: ServiceSettings
    coordination: Coordination
    warmed: bool = False
    draining: bool = False
    _http: httpx.AsyncClient | None = field(default=None, repr=False)

    @property
    def can_embed(self) -> bool:
        return self.manager.embed_fn is not None

    def http(self) -> httpx.AsyncClient:
        """The upstream client, made on first use (in the serving event loop)."""
        if self._http is None:
            timeout = self.upstream.timeout_s if self.upstream is not None else 30.0
            self._http = httpx.AsyncClient(timeout=timeout)
        return self._http

    async def aclose_http(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


_bearer = HTTPBearer(auto_error=False, description="A tenant's key: `zerda-cache keys create`")


def _tenant_dependency(ctx: ServiceContext) -> Callable[..., Awaitable[str]]:
    async def tenant_of(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> str:
        """The tenant the request's API key is bound to, else a 401."""

        def refuse(reason: str, message: str) -> ApiError:
            ctx.metrics.auth_failures.labels(reason).inc()
            return ApiError(401, message, "invalid_api_key", reason)

        if credentials is None:
            raise refuse("missing_api_key", "missing API key: send Authorization: Bearer zk_...")
        token = credentials.credentials.strip()
        if not looks_like_token(token):
            raise refuse("invalid_api_key", "malformed API key: expected zk_ and 43 characters")
        record = await ctx.keys.api_key(token_digest(token))
        if record is None:
            raise refuse("invalid_api_key", "unknown API key")
        if not record.active:
            raise refuse("revoked_api_key", "this API key was revoked")
        return record.tenant

    return tenant_of


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
    from zerda_cache.service.proxy import add_proxy_routes

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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
                closer = getattr(manager.embed_fn, "aclose", None)
                if closer is not None and inspect.iscoroutinefunction(closer):
                    await closer()
                await manager.aclose()

    app = FastAPI(
        title="zerda-cache",
        version=_version(),
        summary="A shared semantic cache for LLM apps, and an OpenAI-compatible caching proxy.",
        lifespan=lifespan,
    )
    app.state.zerda = ctx
    install_error_handlers(app)

    @app.exception_handler(EmbedderError)
    async def embedder_error(request: Request, exc: EmbedderError) -> JSONResponse:
        log.warning("embedder failed: %s", exc)
        return error_response(502, f"the service's embedder failed: {exc}", "embedder_error")

    Tenant = Annotated[str, Depends(_tenant_dependency(ctx))]

    def need_vector(embedding: list[float] | None) -> None:
        if embedding is None and not ctx.can_embed:
            raise ApiError(
                422,
                'no embedding: send "embedding" (this service has no embedder configured)',
                "invalid_request_error",
                "no_embedding",
            )

    @app.post("/v1/lookup", tags=["cache"])
    async def lookup(body: LookupRequest, tenant: Tenant, request: Request) -> LookupResponse:
        """The best servable cached answer for the question, or a miss.

        ``decision`` tells a plain miss from a *verification* (``verify``: the tenant
        has an error bound and a near match was held back): the next ``/v1/put`` of the
        same question to this service replica then reports ``verified``.
        ``Cache-Control: no-cache`` or ``no-store`` answer a miss without reading the
        cache; ``X-Zerda-Scope`` adds a partition to the scope."""
        control = request_control(request.headers)
        scope = control.scoped(body.scope)
        need_vector(body.embedding)
        if not control.read:
            return LookupResponse(hit=False, decision="miss", entry=None)
        hit = await manager.lookup(
            body.query,
            tenant=tenant,
            embedding=body.embedding,
            scope=scope,
            max_error_rate=body.max_error_rate,
        )
        if hit is None:
            verify = manager.awaiting_verification(body.query, tenant=tenant, scope=scope)
            return LookupResponse(hit=False, decision="verify" if verify else "miss", entry=None)
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
        )
        return LookupResponse(hit=True, decision="hit", entry=entry)

    @app.post("/v1/put", tags=["cache"])
    async def put(body: PutRequest, tenant: Tenant, request: Request) -> PutResponse:
        """Cache an answer (unless the admission check refuses it: ``stored`` false and
        the ``reason``; nothing is written then). ``Cache-Control: no-store`` stores
        nothing, ``max-age=N`` is the TTL when the body sets none; ``X-Zerda-Scope`` adds
        a partition to the scope."""
        control = request_control(request.headers)
        scope = control.scoped(body.scope)
        need_vector(body.embedding)
        if not control.write:
            return PutResponse(stored=False, reason="Cache-Control: no-store", verified=None)
        result = await manager.put(
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
        )
        return PutResponse(
            stored=result.stored,
            entry_id=result.entry_id,
            reason=result.reason,
            warnings=list(result.warnings),
            replaced_id=result.replaced_id,
            verified=result.verified,
        )

    @app.post("/v1/feedback", tags=["cache"])
    async def feedback(body: FeedbackRequest, tenant: Tenant) -> FeedbackResponse:
        """A user's (or a judge's) verdict on an answer, named by its ``entry_id`` or by
        the ``completion_id`` the proxy answered with: 404 for an entry this key's tenant
        does not have, and for a completion id it was not answered (or that expired)."""
        if (body.entry_id is None) == (body.completion_id is None):
            raise ApiError(
                422,
                'send one of "entry_id" and "completion_id"',
                "invalid_request_error",
                "entry_or_completion",
            )
        similarity = body.similarity
        served_hit = False
        if body.completion_id is not None:
            if not COMPLETION_ID_RE.fullmatch(body.completion_id):
                raise ApiError(
                    422,
                    "invalid completion id: expected 1 to 128 of A-Z a-z 0-9 _ . : -",
                    "invalid_request_error",
                    "invalid_completion_id",
                )
            served = await ctx.coordination.recall(tenant, body.completion_id)
            if served is None:
                raise ApiError(
                    404,
                    f"no completion {body.completion_id!r} for this key's tenant "
                    "(unknown, expired, or its answer was not cached)",
                    "not_found",
                )
            entry_id = served.entry_id
            served_hit = served.hit
            if similarity is None:
                similarity = served.similarity
        else:
            entry_id = validate_entry_id(body.entry_id)
        signal = FeedbackSignal(
            entry_id=entry_id,
            tenant_id=tenant,
            positive=body.positive,
            magnitude=body.magnitude,
            source=body.source,
            similarity=similarity,
            served=served_hit,
        )
        await manager.feedback(signal)
        return FeedbackResponse(applied=True, entry_id=entry_id)

    @app.post("/v1/invalidate", tags=["cache"])
    async def invalidate(body: InvalidateRequest, tenant: Tenant) -> InvalidateResponse:
        """Remove one entry from every replica: 404 if this key's tenant has no such
        entry."""
        if not await manager.invalidate(body.entry_id, tenant=tenant):
            raise ApiError(404, f"no entry {body.entry_id!r} for this key's tenant", "not_found")
        return InvalidateResponse(removed=True)

    @app.post("/v1/invalidate/tag", tags=["cache"])
    async def invalidate_tag(body: InvalidateTagRequest, tenant: Tenant) -> InvalidateTagResponse:
        """Remove every entry of this key's tenant put with ``tag`` (from every replica),
        in one call through the tag's index in Redis; ``removed``: how many (0 for a tag
        no live entry has)."""
        return InvalidateTagResponse(removed=await manager.invalidate_tag(body.tag, tenant=tenant))

    @app.get("/v1/stats", tags=["cache"])
    async def stats(tenant: Tenant) -> dict[str, Any]:
        """The key's tenant's shared counters (hits, misses, puts, feedback, evictions,
        entries, bytes), hit rate and ``savings`` (calls, tokens and dollars saved, wrong
        and net, per model)."""
        return {"tenant": tenant, **(await manager.stats(tenant))}

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> JSONResponse:
        """Liveness: the process serves and Redis answers PING (503 otherwise)."""
        try:
            await ctx.keys.ping()
        except StorageError as exc:
            return JSONResponse({"status": "unavailable", "redis": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok", "redis": "ok"})

    @app.get("/readyz", tags=["operations"])
    async def readyz() -> JSONResponse:
        """Readiness: Redis answers and the keys can be read, the warm tenants' indexes
        are built, and the service is not shutting down (503 otherwise)."""
        problems = []
        try:
            await ctx.keys.ping()
            await ctx.keys.api_key(_PROBE_DIGEST)
        except StorageError as exc:
            problems.append(f"redis: {exc}")
        if not ctx.warmed:
            problems.append("building the indexes of the warm tenants")
        if ctx.draining:
            problems.append("shutting down")
        if problems:
            return JSONResponse({"status": "not ready", "problems": problems}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["operations"], include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    add_proxy_routes(app, ctx, Tenant)

    routes = {getattr(r, "path", "") for r in app.routes}
    # Innermost first: the body limit reads the body, the JSON check parses it.
    json_routes = {r.path for r in app.routes if isinstance(r, APIRoute) and r.body_field}
    app.add_middleware(JsonBody, paths=json_routes)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.add_middleware(_RequestMetrics, metrics=ctx.metrics, routes=routes)
    return app


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


def _version() -> str:
    from zerda_cache import __version__

    return __version__


__all__ = ["ServiceContext", "ServiceMetrics", "ServiceSettings", "Upstream", "create_app"]
