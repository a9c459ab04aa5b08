"""What every route of the service shares: ``ServiceContext``, and what it is made of.

One ``ServiceContext`` per app holds the manager, the key store, the metrics, the upstream
and the completion ids and leases the replicas share in Redis. The route classes
(``app.CacheRoutes``, ``proxy.ProxyRoutes``) hold it; a dependency that has only the
request reaches it with ``context_of`` (the app keeps it as ``app.state.zerda``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import httpx
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Histogram

from zerda_cache.aio import AsyncCacheManager
from zerda_cache.service.coordination import CoalesceSettings, Coordination
from zerda_cache.service.limits import DEFAULT_MAX_BODY_BYTES
from zerda_cache.storage.store import AsyncRedisStorage

HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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


def context_of(request: Request) -> ServiceContext:
    """The ``ServiceContext`` of the app serving ``request``."""
    ctx: ServiceContext = request.app.state.zerda
    return ctx


__all__ = [
    "HTTP_BUCKETS",
    "ServiceContext",
    "ServiceMetrics",
    "ServiceSettings",
    "Upstream",
    "context_of",
    "service_metrics",
]
