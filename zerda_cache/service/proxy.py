"""The OpenAI-compatible caching proxy: ``POST /v1/chat/completions`` and ``/v1/embeddings``.

Point any OpenAI client at the service (``base_url=http://host:8080/v1``) with a tenant's
key as its API key. What is cached, and under which scope:

- **The question** is the text of the last message, which must be a user turn (string
  content, or text parts only). **The scope** is a digest of everything else in the
  request that can change the answer: the model, every earlier message (system and
  developer prompts, earlier user and assistant turns, tool results), ``tools``,
  ``tool_choice``, ``response_format``, the sampling parameters (``temperature``,
  ``top_p``, ``max_tokens``, ``seed``, ``stop``, penalties ...) and any parameter this
  proxy does not know. Left out are the fields that do not change the answer:
  ``stream``, ``stream_options``, ``user``, ``metadata``, ``store``, ``service_tier`` and
  ``n`` (only ``n=1`` is cached). So a near-duplicate question meets an earlier one only
  under the same instructions and the same conversation so far.
- **Cached answers** are single-choice text answers that finished (``finish_reason`` is
  ``stop``). A tool call, a truncated answer (``length``), a refusal without content, or
  an upstream error is returned to the client and not cached. Requests with tools are
  looked up like any other (the tools are in the scope): a cached text answer to them is
  served, a tool call never is.
- **Passed through uncached** (``x-zerda-cache: bypass`` with ``x-zerda-bypass``
  saying why): ``n`` > 1, ``logprobs``, a last message that is not a user turn or has
  non-text parts (images, audio), a question over ``max_query_chars``, and every
  request when the service has no embedder. ``/v1/embeddings`` is always passed
  through: caching embeddings saves little and the cache's own embedder is another
  model.
- **Streaming** (``stream: true``): a hit is served as a server-sent event stream in the
  ``chat.completion.chunk`` format (one content chunk, a finish chunk, a usage chunk if
  ``stream_options.include_usage``, ``[DONE]``). A miss is streamed through from the
  upstream as it arrives and cached once the stream completed, before its ``[DONE]`` is
  sent; its entry id is not known when the headers go out, so a streamed miss has no
  ``x-zerda-entry-id`` (its completion id serves for feedback).
- **Completion ids**: every answer under a cache key (hit, miss, verify; streamed or not)
  has an ``id`` of the proxy's making (``coordination.new_completion_id``), mapped in
  Redis to the entry it was answered with, which ``POST /v1/feedback`` takes as
  ``completion_id``. Passed-through answers keep the upstream's id.
- **Per-request control** (``control``): ``Cache-Control: no-cache`` skips the lookup and
  replaces the cached answer, ``no-store`` passes the request through, ``max-age=N`` is
  the stored answer's TTL, ``X-Zerda-Scope`` a partition on top of the scope.
- **Coalesced misses** (``coordination``): after a miss, one request per tenant, scope
  and normalised question holds a lease in Redis and calls upstream; the others wait
  for its answer to be cached (bounded), then are served it as hits.

Headers on every proxied chat completion: ``x-zerda-cache`` (``hit``, ``miss``,
``verify``: a miss that verified a near match under the tenant's error bound, or
``bypass``), and when an entry is known ``x-zerda-entry-id`` and ``x-zerda-similarity``
(send both back with ``POST /v1/feedback``); ``x-zerda-verified`` on a verify;
``x-zerda-completion-id`` and ``x-zerda-feedback`` (how to send feedback by it) when the
answer is mapped or, streamed, will be; ``x-zerda-coalesced`` when the request waited for
another's upstream call (``waited``, ``passed``, ``took-over``, ``timeout``, ``error``).

The client's key never leaves the service: upstream calls carry the configured upstream
key only.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations at
# runtime.
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
from fastapi import Body, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from zerda_cache.core.entry import LLMUsage
from zerda_cache.core.errors import StorageError, ZerdaError
from zerda_cache.core.results import CacheHit
from zerda_cache.service.auth import Tenant
from zerda_cache.service.chat import (
    ChatKey,
    RelayedStream,
    cacheable_answer,
    chat_key,
    check_chat_request,
    completion_from_hit,
    stream_from_hit,
    usage_of,
)
from zerda_cache.service.context import ServiceContext
from zerda_cache.service.control import RequestControl, request_control
from zerda_cache.service.coordination import Lease, new_completion_id
from zerda_cache.service.embedding import EmbedderError
from zerda_cache.service.errors import ApiError
from zerda_cache.storage.codec import query_digest

log = logging.getLogger(__name__)

#: Upstream response headers relayed to the client (request ids, rate limits).
RELAYED = ("x-request-id", "openai-processing-ms", "openai-version", "retry-after")
#: The upstream endpoints the proxy calls, as its metrics name them.
CHAT, EMBEDDINGS = "/chat/completions", "/embeddings"


def feedback_headers(completion_id: str) -> dict[str, str]:
    """Where a response says how to send feedback on it."""
    how = f'POST /v1/feedback {{"completion_id": "{completion_id}", "positive": true|false}}'
    return {"x-zerda-completion-id": completion_id, "x-zerda-feedback": how}


def stored_headers(
    entry_id: str | None, verified: bool | None, completion_id: str, mapped: bool
) -> dict[str, str]:
    """What a response says of the upstream answer it cached: its entry, the verdict on a
    held-back near match (a ``verify``), and how to send feedback (``mapped``: its
    completion id is known, for a cached answer or one that disputes an entry)."""
    headers = {}
    if entry_id is not None:
        headers.update({"x-zerda-entry-id": entry_id, "x-zerda-similarity": "1.000000"})
    if verified is not None:
        headers.update({"x-zerda-cache": "verify", "x-zerda-verified": str(verified).lower()})
    if mapped:
        headers.update(feedback_headers(completion_id))
    return headers


def _hit_headers(hit: CacheHit) -> dict[str, str]:
    return {
        "x-zerda-cache": "hit",
        "x-zerda-entry-id": hit.entry_id,
        "x-zerda-similarity": f"{hit.similarity:.6f}",
    }


def _relayed(resp: httpx.Response) -> dict[str, str]:
    out = {h: resp.headers[h] for h in RELAYED if h in resp.headers}
    out.update({h: v for h, v in resp.headers.items() if h.startswith("x-ratelimit-")})
    return out


def relay(resp: httpx.Response, headers: dict[str, str]) -> Response:
    """The upstream's response as it came, with ``headers`` added."""
    return Response(
        content=resp.content,
        status_code=resp.status_code,
        media_type=resp.headers.get("content-type", "application/json"),
        headers={**_relayed(resp), **headers},
    )


def event_stream(events: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    """Server-sent events, which no cache on the way may keep."""
    return StreamingResponse(
        events, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
    )


def json_of(resp: httpx.Response) -> Any:
    """The body of a 200 that reads as JSON, else ``None``."""
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:
        return None


class UpstreamCalls:
    """Calls to the upstream API with the configured key (never the client's), counted
    in the proxy's metrics when it cannot be reached."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def url(self, endpoint: str) -> str:
        if self.ctx.upstream is None:
            raise ApiError(
                503,
                "this service has no upstream (zerda-cache serve --upstream-url ...)",
                "upstream_unavailable",
            )
        return self.ctx.upstream.url(endpoint)

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "application/json"}
        if self.ctx.upstream is not None and self.ctx.upstream.api_key:
            headers["authorization"] = f"Bearer {self.ctx.upstream.api_key}"
        return headers

    def unreachable(self, endpoint: str, exc: httpx.HTTPError) -> ApiError:
        """The 502 for a call to ``endpoint`` that failed with ``exc``, counted."""
        self.ctx.metrics.proxy.labels(endpoint, "error").inc()
        return ApiError(
            502, f"the upstream API is unreachable ({type(exc).__name__})", "upstream_error"
        )

    async def post(self, endpoint: str, body: Mapping[str, Any]) -> httpx.Response:
        """The upstream's whole response to ``body`` (timed in the proxy's metrics)."""
        url = self.url(endpoint)
        started = time.perf_counter()
        try:
            return await self.ctx.http().post(url, json=body, headers=self.headers())
        except httpx.HTTPError as exc:
            log.warning("upstream %s failed: %r", url, exc)
            raise self.unreachable(endpoint, exc) from exc
        finally:
            elapsed = time.perf_counter() - started
            self.ctx.metrics.upstream_latency.labels(endpoint).observe(elapsed)

    async def open_stream(self, endpoint: str, body: Mapping[str, Any]) -> httpx.Response:
        """The upstream's response to ``body`` once its headers arrived: the caller
        reads its body and closes it."""
        url = self.url(endpoint)
        client = self.ctx.http()
        try:
            request = client.build_request("POST", url, json=body, headers=self.headers())
            return await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self.unreachable(endpoint, exc) from exc


@dataclass
class ProxiedChat:
    """One chat completion request on its way through the proxy: whose, what, how the
    client controls the cache, and the lease on the upstream call when this request
    holds it (finishing it tells the requests that wait whether the answer was
    cached), and the token of a verification its lookup asked for."""

    tenant: str
    body: Mapping[str, Any]
    control: RequestControl
    lease: Lease | None = None
    #: the lookup's verify token (a ``verify``), for the put of the upstream's answer
    verify_token: str | None = None

    @property
    def streaming(self) -> bool:
        return self.body.get("stream") is True

    async def finish(self, stored: bool) -> None:
        if self.lease is not None:
            await self.lease.finish(stored)


class ProxyRoutes:
    """The proxy's endpoints over one ``ServiceContext``. The bound methods are the
    endpoints: FastAPI reads their signatures (without ``self``) for the body and the
    API-key dependency."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.upstream = UpstreamCalls(ctx)

    def register(self, app: FastAPI) -> None:
        app.add_api_route(
            "/v1/chat/completions", self.chat_completions, methods=["POST"], tags=["proxy"]
        )
        app.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"], tags=["proxy"])

    def count(self, endpoint: str, result: str) -> None:
        self.ctx.metrics.proxy.labels(endpoint, result).inc()

    async def chat_completions(
        self, body: Annotated[dict[str, Any], Body()], tenant: Tenant, request: Request
    ) -> Response:
        """OpenAI chat completions, answered from the cache when it can (see
        ``x-zerda-cache``), else by the upstream API (then cached). ``Cache-Control``
        (``no-cache``, ``no-store``, ``max-age``) and ``X-Zerda-Scope`` control it per
        request."""
        check_chat_request(body)
        chat = ProxiedChat(tenant, body, request_control(request.headers))
        key = self.cache_key(chat)
        hit: CacheHit | None = None
        if isinstance(key, ChatKey) and chat.control.read:
            try:
                decision = await self.ctx.manager.decide(key.query, tenant=tenant, scope=key.scope)
                hit, chat.verify_token = decision.hit, decision.verify_token
            except EmbedderError as exc:
                log.warning("tenant %s: embedder failed, passing through: %s", tenant, exc)
                key = "embedder failed"
        if isinstance(key, str):
            return await self.bypass(chat, key)
        if hit is not None:
            return await self.serve_hit(chat, hit, {})
        return await self.miss(chat, key)

    async def embeddings(self, body: Annotated[dict[str, Any], Body()], tenant: Tenant) -> Response:
        """OpenAI embeddings, passed through to the upstream API (never cached)."""
        self.count(EMBEDDINGS, "bypass")
        return relay(await self.upstream.post(EMBEDDINGS, body), {"x-zerda-cache": "bypass"})

    def cache_key(self, chat: ProxiedChat) -> ChatKey | str:
        """Where the request is cached (its scope with the client's partition on top), or
        why it is passed through uncached (``x-zerda-bypass``)."""
        key = chat_key(chat.body, self.ctx.manager.config.max_query_chars)
        if isinstance(key, str):
            return key
        if chat.control.directive is not None:
            return chat.control.directive
        if not self.ctx.can_embed:
            return "no embedder configured"
        return ChatKey(key.query, chat.control.scoped(key.scope) or "")

    async def bypass(self, chat: ProxiedChat, reason: str) -> Response:
        """The upstream's answer, passed through uncached."""
        self.count(CHAT, "bypass")
        headers = {"x-zerda-cache": "bypass", "x-zerda-bypass": reason}
        if chat.streaming:
            return await self.stream_upstream(chat, None, headers)
        return relay(await self.upstream.post(CHAT, chat.body), headers)

    async def serve_hit(self, chat: ProxiedChat, hit: CacheHit, extra: dict[str, str]) -> Response:
        """A cached answer, under a fresh completion id mapped to its entry."""
        self.count(CHAT, "hit")
        completion_id = new_completion_id()
        await self.ctx.coordination.remember(
            chat.tenant,
            completion_id,
            hit.entry_id,
            hit.similarity,
            hit=True,
            number=hit.hit_number,
        )
        headers = {**_hit_headers(hit), **feedback_headers(completion_id), **extra}
        model = str(chat.body["model"])
        if chat.streaming:
            options = chat.body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            events = stream_from_hit(hit, model, usage, completion_id)
            return event_stream(_iterate(events), headers)
        return JSONResponse(completion_from_hit(hit, model, completion_id), headers=headers)

    async def miss(self, chat: ProxiedChat, key: ChatKey) -> Response:
        """A question the cache did not answer (or was not asked: ``no-cache``): served
        the answer of a concurrent identical request's upstream call, else answered
        upstream and cached."""
        headers = {"x-zerda-cache": "miss"}
        if chat.control.read:
            hit, chat.lease, how = await self.coalesce(chat.tenant, key)
            if how is not None:
                headers["x-zerda-coalesced"] = how
            if hit is not None:
                return await self.serve_hit(chat, hit, {"x-zerda-coalesced": how or ""})
        if chat.streaming:
            self.count(CHAT, "miss")
            return await self.stream_upstream(chat, key, headers)
        return await self.answer_upstream(chat, key, headers)

    async def answer_upstream(
        self, chat: ProxiedChat, key: ChatKey, headers: dict[str, str]
    ) -> Response:
        """The upstream's answer to a miss; a cacheable one is cached and sent under a
        completion id of the proxy's making. The request's lease is finished then."""
        stored = False
        try:
            resp = await self.upstream.post(CHAT, chat.body)
            data = json_of(resp)
            answer = cacheable_answer(data)
            if answer is not None:
                usage = usage_of(data.get("model"), data.get("usage"))
                data["id"] = completion_id = new_completion_id()
                entry_id, verified, mapped = await self.cache_answer(
                    chat, key, answer, data.get("model"), usage, completion_id
                )
                stored = entry_id is not None
                headers.update(stored_headers(entry_id, verified, completion_id, mapped))
        finally:
            await chat.finish(stored)
        self.count(CHAT, headers["x-zerda-cache"])
        if answer is None:
            return relay(resp, headers)
        return JSONResponse(
            data, status_code=resp.status_code, headers={**_relayed(resp), **headers}
        )

    async def stream_upstream(
        self, chat: ProxiedChat, key: ChatKey | None, headers: dict[str, str]
    ) -> Response:
        """Stream the upstream's answer through; under a ``key``, with an id of the
        proxy's making, cached (and the id mapped) before the final ``[DONE]`` is sent,
        so feedback sent once the stream ended finds it. The request's lease is finished
        then."""
        try:
            resp = await self.upstream.open_stream(CHAT, chat.body)
        except BaseException:
            await chat.finish(False)
            raise
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            await chat.finish(False)
            return relay(resp, headers)
        stream = RelayedStream(new_completion_id() if key is not None else None)
        if stream.completion_id is not None:
            headers = {**headers, **feedback_headers(stream.completion_id)}
        events = self.relay_events(chat, key, resp, stream)
        return event_stream(events, {**_relayed(resp), **headers})

    async def relay_events(
        self, chat: ProxiedChat, key: ChatKey | None, resp: httpx.Response, stream: RelayedStream
    ) -> AsyncIterator[bytes]:
        """The upstream's events as the client gets them; a complete answer is cached,
        and the lease finished, before the held ``[DONE]`` is sent."""
        stored = False
        try:
            try:
                async for chunk in resp.aiter_bytes():
                    for event in stream.feed(chunk):
                        yield event
                stream.end()
            finally:
                await resp.aclose()
            collector = stream.collector
            answer = collector.answer
            if key is not None and stream.completion_id is not None and answer is not None:
                usage = usage_of(collector.model, collector.usage)
                entry_id, _, _ = await self.cache_answer(
                    chat, key, answer, chat.body.get("model"), usage, stream.completion_id
                )
                stored = entry_id is not None
        finally:
            await chat.finish(stored)
        for event in stream.held:
            yield event

    async def cache_answer(
        self,
        chat: ProxiedChat,
        key: ChatKey,
        answer: str,
        model: object,
        usage: LLMUsage | None,
        completion_id: str,
    ) -> tuple[str | None, bool | None, bool]:
        """Cache an upstream answer (with the request's TTL and tags, the upstream's
        usage: what each later hit saves, and the lookup's verify token, so the
        verification holds whichever replica's put runs) and map ``completion_id`` to
        its entry, or to the entry a disputed answer disputes (its feedback settles the
        dispute): ``(entry id, verified, mapped)``; a failure only logs (the client still
        gets its answer)."""
        meta = {"model": model} if isinstance(model, str) else {}
        try:
            result = await self.ctx.manager.put(
                key.query,
                answer,
                tenant=chat.tenant,
                scope=key.scope,
                metadata=meta,
                ttl_s=chat.control.ttl_s,
                tags=chat.control.tags or None,
                usage=usage,
                verify_token=chat.verify_token,
            )
        except (ZerdaError, EmbedderError) as exc:
            log.warning("tenant %s: proxy answer not cached: %s", chat.tenant, exc)
            return None, None, False
        if not result.stored:
            log.info("tenant %s: proxy answer not cached: %s", chat.tenant, result.reason)
        co, mapped = self.ctx.coordination, result.entry_id is not None
        if result.entry_id is not None:
            await co.remember(chat.tenant, completion_id, result.entry_id, 1.0)
        elif result.disputed and result.compared_id is not None:  # its feedback settles it
            mapped = True
            dispute = result.dispute_id or ""
            await co.remember(chat.tenant, completion_id, result.compared_id, 1.0, dispute=dispute)
        return result.entry_id, result.verified, mapped

    async def look_up(self, tenant: str, key: ChatKey) -> CacheHit | None:
        """The lookup of a request that waits for another's upstream call."""
        try:
            return await self.ctx.manager.lookup(key.query, tenant=tenant, scope=key.scope)
        except EmbedderError as exc:
            log.warning("tenant %s: embedder failed while waiting: %s", tenant, exc)
            return None

    async def coalesce(
        self, tenant: str, key: ChatKey
    ) -> tuple[CacheHit | None, Lease | None, str | None]:
        """After a miss: lead the upstream call (a lease), or wait for the request that
        leads it. ``(hit, lease, how)``: a hit the wait found, the lease this request
        holds, and how the wait went (``x-zerda-coalesced``; ``None``: no wait)."""
        co = self.ctx.coordination
        if not co.settings.enabled:
            return None, None, None
        digest = query_digest(key.query, key.scope)
        try:
            lease = await co.try_lead(tenant, digest)
        except StorageError as exc:
            log.warning("tenant %s: no lease (%s); going upstream", tenant, exc)
            return None, None, None
        if lease is not None:
            return None, lease, None
        waited = await co.wait(tenant, digest, lambda: self.look_up(tenant, key))
        if waited.outcome == "found":
            return waited.found, None, "waited"
        if waited.outcome == "lead":
            return None, waited.lease, "took-over"
        if waited.outcome == "finished":
            hit = await self.look_up(tenant, key)
            return hit, None, "waited" if hit is not None else "passed"
        if waited.outcome == "timeout":
            log.warning(
                "tenant %s: waited %.1f s for another upstream call; going upstream",
                tenant,
                co.settings.wait_s,
            )
        return None, None, waited.outcome


async def _iterate(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


__all__ = [
    "CHAT",
    "EMBEDDINGS",
    "RELAYED",
    "ProxiedChat",
    "ProxyRoutes",
    "UpstreamCalls",
    "event_stream",
    "feedback_headers",
    "json_of",
    "relay",
    "stored_headers",
]
