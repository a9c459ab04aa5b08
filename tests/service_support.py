"""Helpers of the HTTP service tests: real servers in threads, never mocks of our code.

``ThreadedServer`` runs an ASGI app with uvicorn on a free port in a background thread
(the service, or the stand-in upstream). ``upstream_app`` is a tiny OpenAI-compatible
API that counts its calls and answers canned completions; ``running_service`` starts
the real service app on a real Redis with keys for two tenants.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry

from zerda_cache import AsyncCacheManager, CacheConfig
from zerda_cache.apikeys import new_record
from zerda_cache.embedders import HashingEmbedder
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.service import ServiceSettings, Upstream, create_app
from zerda_cache.service.testing import ServerThread
from zerda_cache.storage import RedisStorage

UPSTREAM_KEY = "upstream-secret"


#: uvicorn in a thread on a free port (the library's helper, shared with the README).
ThreadedServer = ServerThread


@dataclass
class UpstreamState:
    """What the stand-in upstream saw, and what it answers."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    #: A fixed answer for every question (default: the answer names the question).
    reply: str | None = None
    #: The first this many chat calls hang until ``release`` is set (a slow LLM).
    hold_first: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def chat_calls(self) -> int:
        return sum(1 for c in self.calls if c["path"] == "/v1/chat/completions")


def upstream_app(state: UpstreamState) -> FastAPI:
    """An OpenAI-compatible API: answers ``answer to: <question>`` (or ``state.reply``)
    (the first ``state.hold_first`` chat calls only once ``state.release`` is set);
    a tool call when ``tool_choice`` is ``required``; ``finish_reason: length`` when
    ``max_tokens`` is 1; an error for model ``broken``; streams when asked."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        with state.lock:
            state.calls.append(
                {"path": request.url.path, "headers": dict(request.headers), "body": body}
            )
            n = len(state.calls)
        if n <= state.hold_first:
            while not state.release.is_set():
                await asyncio.sleep(0.01)
        if body["model"] == "broken":
            err = {"error": {"message": "upstream exploded", "type": "server_error"}}
            return JSONResponse(err, status_code=500)
        question = body["messages"][-1]["content"]
        text = state.reply or f"answer to: {question}"
        finish = "length" if body.get("max_tokens") == 1 else "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if body.get("tool_choice") == "required":
            finish = "tool_calls"
            call = {"name": "lookup", "arguments": "{}"}
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
            }
        choices = [
            {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            for i in range(body.get("n") or 1)
        ]
        base = {"id": f"chatcmpl-up{n}", "created": 1, "model": body["model"] + "-0613"}
        if body.get("stream"):
            return StreamingResponse(_stream(base, text), media_type="text/event-stream")
        usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        return {**base, "object": "chat.completion", "choices": choices, "usage": usage}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        body = await request.json()
        with state.lock:
            state.calls.append(
                {"path": request.url.path, "headers": dict(request.headers), "body": body}
            )
        vec = [0.5, -0.25, 0.125]
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": vec}],
            "model": body["model"],
            "usage": {"prompt_tokens": 2, "total_tokens": 2},
        }

    return app


async def _stream(base: dict[str, Any], text: str) -> Any:
    base = {**base, "object": "chat.completion.chunk"}
    words = text.split(" ")
    pieces = [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]
    first = {"role": "assistant", "content": ""}
    for delta in [first, *({"content": p} for p in pieces)]:
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        yield f"data: {json.dumps(chunk)}\n\n"
    end = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    yield f"data: {json.dumps(end)}\n\n"
    yield "data: [DONE]\n\n"


@dataclass
class Service:
    url: str
    tokens: dict[str, str]
    registry: CollectorRegistry
    storage: RedisStorage

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}"}


def add_key(storage: RedisStorage, tenant: str) -> str:
    token, digest, record = new_record(tenant, "test", storage.now())
    assert storage.add_api_key(digest, record)
    return token


@contextlib.contextmanager
def running_service(
    redis_client: redis.Redis,
    redis_url: str,
    *,
    upstream_url: str | None = None,
    config: CacheConfig | None = None,
    settings: ServiceSettings | None = None,
    embedder: bool = True,
) -> Iterator[Service]:
    """The real service on ``redis_url`` with keys for tenants ``acme`` and ``globex``."""
    registry = CollectorRegistry()
    # A loaded test machine can pass the 0.5 s default: lookups would fail open (a miss)
    # and key reads fail closed (503), which is right in production and flaky here.
    config = dataclasses.replace(config or CacheConfig(), redis_timeout_s=10.0)
    manager = AsyncCacheManager.from_url(
        redis_url,
        config,
        embed_fn=HashingEmbedder(256) if embedder else None,
        metrics=ReplicaMetrics(registry),
    )
    upstream = Upstream(upstream_url, api_key=UPSTREAM_KEY) if upstream_url else None
    app = create_app(
        manager,
        upstream=upstream,
        settings=settings,
        registry=registry,
        close_on_shutdown=True,
    )
    storage = RedisStorage(redis_client)
    tokens = {t: add_key(storage, t) for t in ("acme", "globex")}
    with ThreadedServer(app) as server:
        yield Service(server.url, tokens, registry, storage)


def snapshot(client: redis.Redis) -> dict[bytes, bytes | None]:
    """Every key of the server with its serialized value: equal snapshots, same data."""
    return {key: client.dump(key) for key in sorted(client.scan_iter(count=1000))}


def openai_client(svc: Service, tenant: str = "acme", **kwargs: Any) -> Any:
    """The official ``openai`` client pointed at the service with ``tenant``'s key."""
    import openai

    return openai.OpenAI(
        base_url=svc.url + "/v1", api_key=svc.tokens[tenant], max_retries=0, **kwargs
    )


def ask(client: Any, question: str, **kwargs: Any) -> tuple[Any, Any]:
    """``(completion, headers)`` of one chat completion through the proxy (``model``
    defaults to ``gpt-test``; ``extra_headers`` and the rest go to ``create``)."""
    kwargs.setdefault("model", "gpt-test")
    messages = kwargs.pop("messages", None) or [{"role": "user", "content": question}]
    raw = client.chat.completions.with_raw_response.create(messages=messages, **kwargs)
    return raw.parse(), raw.headers


def ask_streaming(client: Any, question: str, **kwargs: Any) -> tuple[str, list[Any], Any]:
    """``(text, chunks, headers)`` of one streamed chat completion through the proxy."""
    kwargs.setdefault("model", "gpt-test")
    messages = kwargs.pop("messages", None) or [{"role": "user", "content": question}]
    with client.chat.completions.with_streaming_response.create(
        messages=messages, stream=True, **kwargs
    ) as resp:
        chunks = list(resp.parse())
        headers = resp.headers
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks, headers
