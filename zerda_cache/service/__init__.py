"""The HTTP service (``zerda-cache serve``): the cache's flows over JSON with per-tenant
API keys, and an OpenAI-compatible caching proxy on the same port.

================  ==========================================================================
module            holds
================  ==========================================================================
``app``           ``create_app``: the cache endpoints, health, metrics
``context``       ``ServiceContext``, what every route shares; ``Upstream``, the settings
``auth``          the API-key check: ``Tenant``, the key's tenant
``proxy``         ``/v1/chat/completions`` and ``/v1/embeddings``: lookups, upstream calls
``chat``          the OpenAI chat format: cache keys, scopes, cached answers, streams
``control``       per-request ``Cache-Control`` and ``X-Zerda-Scope``
``coordination``  completion ids and upstream-call leases shared in Redis
``models``        request and response bodies of the cache endpoints
``errors``        the one JSON error shape, and how library errors map to statuses
``limits``        the request body limit (an ASGI middleware)
``body``          JSON bodies checked once for every route: type, UTF-8, depth, surrogates
``embedding``     the embedders ``--embedder`` names (an OpenAI-compatible endpoint too)
================  ==========================================================================

Needs the ``service`` extra (``pip install 'zerda-cache[service]'``).
"""

from zerda_cache.service.app import create_app
from zerda_cache.service.context import (
    ServiceContext,
    ServiceMetrics,
    ServiceSettings,
    Upstream,
)

__all__ = ["ServiceContext", "ServiceMetrics", "ServiceSettings", "Upstream", "create_app"]
