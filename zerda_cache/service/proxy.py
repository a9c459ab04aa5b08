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
# runtime, and the API-key dependency is a local of the app factory.
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import httpx
from fastapi import Body, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from zerda_cache.entry import LLMUsage
from zerda_cache.errors import StorageError, ZerdaError
from zerda_cache.results import CacheHit
from zerda_cache.service.control import RequestControl, request_control
from zerda_cache.service.coordination import Lease, new_completion_id
from zerda_cache.service.embedding import EmbedderError
from zerda_cache.service.errors import ApiError
from zerda_cache.storage.codec import query_digest

if TYPE_CHECKING:
    from zerda_cache.service.app import ServiceContext

log = logging.getLogger(__name__)

#: Scopes the proxy makes start with this (version 1 of the rule above).
SCOPE_PREFIX = "oa1:"
#: Request fields that do not change the answer, so they stay out of the scope.
NOT_IN_SCOPE = frozenset(
    {"messages", "stream", "stream_options", "user", "metadata", "store", "service_tier", "n"}
)
#: Upstream response headers relayed to the client (request ids, rate limits).
RELAYED = ("x-request-id", "openai-processing-ms", "openai-version", "retry-after")


@dataclass(frozen=True, slots=True)
class ChatKey:
    """Where a chat completion request is cached: its question and scope."""

    query: str
    scope: str


def chat_scope(body: Mapping[str, Any]) -> str:
    """The scope of a chat completion request (see the module docstring)."""
    messages = list(body["messages"])
    last = {k: v for k, v in messages[-1].items() if k != "content"}
    payload = {
        "params": {k: v for k, v in body.items() if k not in NOT_IN_SCOPE},
        "history": messages[:-1],
        "last": last,
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return SCOPE_PREFIX + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]


def check_chat_request(body: Mapping[str, Any]) -> None:
    """What the proxy needs of a request before it can key it: a 422 otherwise."""
    model = body.get("model")
    messages = body.get("messages")
    if not isinstance(model, str) or not model:
        raise ApiError(422, '"model" must be a non-empty string', "invalid_request_error")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise ApiError(
            422,
            '"messages" must be a non-empty list of objects with a "role"',
            "invalid_request_error",
        )


def chat_key(body: Mapping[str, Any], max_query_chars: int) -> ChatKey | str:
    """The request's question and scope, or why it is passed through uncached."""
    n = body.get("n")
    if n is not None and n != 1:
        return "n>1"
    if body.get("logprobs"):
        return "logprobs"
    last = body["messages"][-1]
    if last.get("role") != "user":
        return "last message is not a user turn"
    content = last.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return "non-text content"
        content = "\n".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str) or not content.strip():
        return "no text in the user turn"
    if len(content) > max_query_chars:
        return "question over max_query_chars"
    return ChatKey(content, chat_scope(body))


def cacheable_answer(data: Any) -> str | None:
    """The text of a single-choice, finished, tool-free completion; else ``None``."""
    if not isinstance(data, dict):
        return None
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get("message")
    if choice.get("finish_reason") != "stop" or not isinstance(message, dict):
        return None
    if message.get("tool_calls") or message.get("function_call"):
        return None
    content = message.get("content")
    return content if isinstance(content, str) and content.strip() else None


def hit_usage(hit: CacheHit) -> dict[str, Any]:
    """A served answer's ``usage``: the tokens of the call that made it (what this hit
    saved; zeros when its put did not say), marked ``zerda_cache.served_from_cache``:
    none of them were spent on this request."""
    u = hit.usage
    prompt, completion = (u.prompt_tokens, u.completion_tokens) if u is not None else (0, 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "zerda_cache": {"served_from_cache": True, "saved_tokens": prompt + completion},
    }


def usage_of(model: object, usage: object) -> LLMUsage | None:
    """An upstream response's usage (and model) as the entry stores it, if it reads."""
    if not isinstance(model, str) or not isinstance(usage, dict):
        return None
    try:
        return LLMUsage.of(
            {
                "model": model,
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
            }
        )
    except ZerdaError:
        return None


def completion_from_hit(
    hit: CacheHit, model: str, completion_id: str | None = None
) -> dict[str, Any]:
    """A ``chat.completion`` object serving a cached answer (``hit_usage``: no tokens
    were spent on it)."""
    return {
        "id": completion_id or new_completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(hit.metadata.get("model") or model),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": hit.response, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": hit_usage(hit),
        "system_fingerprint": None,
    }


def stream_from_hit(
    hit: CacheHit, model: str, include_usage: bool, completion_id: str | None = None
) -> list[bytes]:
    """The server-sent events serving a cached answer to a streaming request."""
    whole = completion_from_hit(hit, model, completion_id)
    base = {k: whole[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    chunks: list[dict[str, Any]] = [
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": hit.response},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]},
    ]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": whole["usage"]})
    events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]
    return [*events, b"data: [DONE]\n\n"]


@dataclass
class StreamCollector:
    """Reassembles a streamed completion from its server-sent events, to cache it once
    the stream ended: the content of choice 0, unless another choice or a tool call
    shows up."""

    buffer: bytes = b""
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    usable: bool = True
    model: str | None = None
    usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            data = json.loads(payload)
        except ValueError:
            self.usable = False
            return
        if isinstance(data, dict):
            if isinstance(data.get("model"), str):
                self.model = data["model"]
            if isinstance(data.get("usage"), dict):  # stream_options.include_usage
                self.usage = data["usage"]
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self.usable = False
                continue
            delta = choice.get("delta") or {}
            if delta.get("tool_calls") or delta.get("function_call"):
                self.usable = False
            if isinstance(delta.get("content"), str):
                self.parts.append(delta["content"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    @property
    def answer(self) -> str | None:
        text = "".join(self.parts)
        complete = self.done and self.usable and self.finish_reason == "stop"
        return text if complete and text.strip() else None


@dataclass
class EventSplitter:
    """Cuts a byte stream into whole server-sent events (each ending in a blank line)."""

    buffer: bytes = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self.buffer += chunk
        events = []
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            events.append(event + b"\n\n")
        return events


def with_completion_id(event: bytes, completion_id: str) -> bytes:
    """A server-sent event whose JSON ``data`` object carries ``completion_id`` as its
    ``id`` (other events, and data that is not a JSON object, as they are)."""
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        payload = line[5:].strip() if line.startswith(b"data:") else b""
        if not payload.startswith(b"{"):
            continue
        try:
            data = json.loads(payload)
        except ValueError:
            continue
        if isinstance(data, dict) and "id" in data:
            data["id"] = completion_id
            lines[i] = b"data: " + json.dumps(data, ensure_ascii=False).encode("utf-8")
    return b"\n".join(lines)


def feedback_headers(completion_id: str) -> dict[str, str]:
    """Where a response says how to send feedback on it."""
    how = f'POST /v1/feedback {{"completion_id": "{completion_id}", "positive": true|false}}'
    return {"x-zerda-completion-id": completion_id, "x-zerda-feedback": how}


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


def add_proxy_routes(app: FastAPI, ctx: "ServiceContext", tenant_dep: Any) -> None:
    """Register the proxy's routes on ``app`` (``tenant_dep``: the API-key dependency)."""
    manager, metrics = ctx.manager, ctx.metrics

    def upstream_headers() -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "application/json"}
        if ctx.upstream is not None and ctx.upstream.api_key:
            headers["authorization"] = f"Bearer {ctx.upstream.api_key}"
        return headers

    def upstream_url(path: str) -> str:
        if ctx.upstream is None:
            raise ApiError(
                503,
                "this service has no upstream (zerda-cache serve --upstream-url ...)",
                "upstream_unavailable",
            )
        return ctx.upstream.url(path)

    async def call(endpoint: str, body: Mapping[str, Any]) -> httpx.Response:
        url = upstream_url(endpoint)
        started = time.perf_counter()
        try:
            return await ctx.http().post(url, json=body, headers=upstream_headers())
        except httpx.HTTPError as exc:
            metrics.proxy.labels(endpoint, "error").inc()
            log.warning("upstream %s failed: %r", url, exc)
            raise ApiError(
                502, f"the upstream API is unreachable ({type(exc).__name__})", "upstream_error"
            ) from exc
        finally:
            metrics.upstream_latency.labels(endpoint).observe(time.perf_counter() - started)

    def relay(resp: httpx.Response, headers: dict[str, str]) -> Response:
        return Response(
            content=resp.content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
            headers={**_relayed(resp), **headers},
        )

    async def store(
        tenant: str,
        key: ChatKey,
        answer: str,
        model: Any,
        control: RequestControl,
        usage: LLMUsage | None = None,
    ) -> tuple[str | None, bool | None]:
        """Cache an upstream answer (with the request's TTL and tags, and the upstream's
        usage: what each later hit saves): ``(entry id, verified)``; a failure only logs
        (the client still gets its answer)."""
        meta = {"model": model} if isinstance(model, str) else {}
        try:
            result = await manager.put(
                key.query,
                answer,
                tenant=tenant,
                scope=key.scope,
                metadata=meta,
                ttl_s=control.ttl_s,
                tags=control.tags or None,
                usage=usage,
            )
        except (ZerdaError, EmbedderError) as exc:
            log.warning("tenant %s: proxy answer not cached: %s", tenant, exc)
            return None, None
        if not result.stored:
            log.info("tenant %s: proxy answer not cached: %s", tenant, result.reason)
        return result.entry_id, result.verified

    async def finish(lease: Lease | None, stored: bool) -> None:
        if lease is not None:
            await lease.finish(stored)

    async def passthrough_stream(
        tenant: str,
        body: Mapping[str, Any],
        key: ChatKey | None,
        headers: dict[str, str],
        *,
        lease: Lease | None = None,
        control: RequestControl | None = None,
    ) -> Response:
        """Stream the upstream's answer through; under a ``key``, with an id of the
        proxy's making, cached (and the id mapped) before the final ``[DONE]`` is sent,
        so feedback sent once the stream ended finds it. ``lease`` is finished then."""
        try:
            url = upstream_url("/chat/completions")
            client = ctx.http()
            request = client.build_request("POST", url, json=body, headers=upstream_headers())
            resp = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await finish(lease, False)
            metrics.proxy.labels("/chat/completions", "error").inc()
            raise ApiError(
                502, f"the upstream API is unreachable ({type(exc).__name__})", "upstream_error"
            ) from exc
        except BaseException:
            await finish(lease, False)
            raise
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            await finish(lease, False)
            return relay(resp, headers)
        completion_id = new_completion_id() if key is not None else None
        if completion_id is not None:
            headers = {**headers, **feedback_headers(completion_id)}

        async def events() -> AsyncIterator[bytes]:
            collector = StreamCollector()
            splitter = EventSplitter()
            held: list[bytes] = []  # [DONE] and after: sent once the answer is cached
            stored = False
            try:
                try:
                    async for chunk in resp.aiter_bytes():
                        if completion_id is None:
                            collector.feed(chunk)
                            yield chunk
                            continue
                        for event in splitter.feed(chunk):
                            collector.feed(event)
                            if collector.done:
                                held.append(event)
                            else:
                                yield with_completion_id(event, completion_id)
                    if splitter.buffer:
                        held.append(splitter.buffer)
                finally:
                    await resp.aclose()
                answer = collector.answer
                if key is not None and answer is not None:
                    entry_id, _ = await store(
                        tenant,
                        key,
                        answer,
                        body.get("model"),
                        control or RequestControl(),
                        usage_of(collector.model, collector.usage),
                    )
                    if entry_id is not None and completion_id is not None:
                        stored = True
                        await ctx.coordination.remember(tenant, completion_id, entry_id, 1.0)
            finally:
                await finish(lease, stored)
            for event in held:
                yield event

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={**_relayed(resp), **headers, "cache-control": "no-cache"},
        )

    async def serve_hit(
        tenant: str, hit: CacheHit, body: Mapping[str, Any], extra: dict[str, str]
    ) -> Response:
        """A cached answer, under a fresh completion id mapped to its entry."""
        metrics.proxy.labels("/chat/completions", "hit").inc()
        completion_id = new_completion_id()
        await ctx.coordination.remember(
            tenant, completion_id, hit.entry_id, hit.similarity, hit=True
        )
        headers = {**_hit_headers(hit), **feedback_headers(completion_id), **extra}
        model = str(body["model"])
        if body.get("stream") is True:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            return StreamingResponse(
                _iterate(stream_from_hit(hit, model, usage, completion_id)),
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache"},
            )
        return JSONResponse(completion_from_hit(hit, model, completion_id), headers=headers)

    async def look_up(tenant: str, key: ChatKey) -> CacheHit | None:
        try:
            return await manager.lookup(key.query, tenant=tenant, scope=key.scope)
        except EmbedderError as exc:
            log.warning("tenant %s: embedder failed while waiting: %s", tenant, exc)
            return None

    async def coalesce(
        tenant: str, key: ChatKey
    ) -> tuple[CacheHit | None, Lease | None, str | None]:
        """After a miss: lead the upstream call (a lease), or wait for the request that
        leads it. ``(hit, lease, how)``: a hit the wait found, the lease this request
        holds, and how the wait went (``x-zerda-coalesced``; ``None``: no wait)."""
        co = ctx.coordination
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
        waited = await co.wait(tenant, digest, lambda: look_up(tenant, key))
        if waited.outcome == "found":
            return waited.found, None, "waited"
        if waited.outcome == "lead":
            return None, waited.lease, "took-over"
        if waited.outcome == "finished":
            hit = await look_up(tenant, key)
            return hit, None, "waited" if hit is not None else "passed"
        if waited.outcome == "timeout":
            log.warning(
                "tenant %s: waited %.1f s for another upstream call; going upstream",
                tenant,
                co.settings.wait_s,
            )
        return None, None, waited.outcome

    @app.post("/v1/chat/completions", tags=["proxy"])
    async def chat_completions(
        body: Annotated[dict[str, Any], Body()], tenant: tenant_dep, request: Request
    ) -> Response:
        """OpenAI chat completions, answered from the cache when it can (see
        ``x-zerda-cache``), else by the upstream API (then cached). ``Cache-Control``
        (``no-cache``, ``no-store``, ``max-age``) and ``X-Zerda-Scope`` control it per
        request."""
        check_chat_request(body)
        control: RequestControl = request_control(request.headers)
        streaming = body.get("stream") is True
        key = chat_key(body, manager.config.max_query_chars)
        if isinstance(key, ChatKey):
            if control.directive is not None:
                key = control.directive
            elif not ctx.can_embed:
                key = "no embedder configured"
            else:
                key = ChatKey(key.query, control.scoped(key.scope) or "")
        hit: CacheHit | None = None
        if isinstance(key, ChatKey) and control.read:
            try:
                hit = await manager.lookup(key.query, tenant=tenant, scope=key.scope)
            except EmbedderError as exc:
                log.warning("tenant %s: embedder failed, passing through: %s", tenant, exc)
                key = "embedder failed"
        if isinstance(key, str):
            metrics.proxy.labels("/chat/completions", "bypass").inc()
            headers = {"x-zerda-cache": "bypass", "x-zerda-bypass": key}
            if streaming:
                return await passthrough_stream(tenant, body, None, headers)
            return relay(await call("/chat/completions", body), headers)
        if hit is not None:
            return await serve_hit(tenant, hit, body, {})
        lease: Lease | None = None
        headers = {"x-zerda-cache": "miss"}
        if control.read:
            hit, lease, how = await coalesce(tenant, key)
            if how is not None:
                headers["x-zerda-coalesced"] = how
            if hit is not None:
                return await serve_hit(tenant, hit, body, {"x-zerda-coalesced": how or ""})
        if streaming:
            metrics.proxy.labels("/chat/completions", "miss").inc()
            return await passthrough_stream(
                tenant, body, key, headers, lease=lease, control=control
            )
        stored = False
        try:
            resp = await call("/chat/completions", body)
            data: Any = None
            if resp.status_code == 200:
                try:
                    data = resp.json()
                except ValueError:
                    data = None
            answer = cacheable_answer(data)
            if answer is not None:
                usage = usage_of(data.get("model"), data.get("usage"))
                entry_id, verified = await store(
                    tenant, key, answer, data.get("model"), control, usage
                )
                if entry_id is not None:
                    stored = True
                    headers.update({"x-zerda-entry-id": entry_id, "x-zerda-similarity": "1.000000"})
                if verified is not None:
                    headers.update(
                        {"x-zerda-cache": "verify", "x-zerda-verified": str(verified).lower()}
                    )
                completion_id = new_completion_id()
                data["id"] = completion_id
                if entry_id is not None:
                    await ctx.coordination.remember(tenant, completion_id, entry_id, 1.0)
                    headers.update(feedback_headers(completion_id))
        finally:
            await finish(lease, stored)
        metrics.proxy.labels("/chat/completions", headers["x-zerda-cache"]).inc()
        if answer is None:
            return relay(resp, headers)
        return JSONResponse(
            data,
            status_code=resp.status_code,
            headers={**_relayed(resp), **headers},
        )

    @app.post("/v1/embeddings", tags=["proxy"])
    async def embeddings(body: Annotated[dict[str, Any], Body()], tenant: tenant_dep) -> Response:
        """OpenAI embeddings, passed through to the upstream API (never cached)."""
        metrics.proxy.labels("/embeddings", "bypass").inc()
        return relay(await call("/embeddings", body), {"x-zerda-cache": "bypass"})


async def _iterate(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


__all__ = [
    "NOT_IN_SCOPE",
    "SCOPE_PREFIX",
    "ChatKey",
    "StreamCollector",
    "add_proxy_routes",
    "cacheable_answer",
    "chat_key",
    "chat_scope",
    "completion_from_hit",
    "stream_from_hit",
]
