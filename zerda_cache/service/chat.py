"""The OpenAI chat completion format as the proxy reads and writes it.

A request's cache key (``chat_key``: its question and scope, by the rule the ``proxy``
module's docstring states), the answer of an upstream completion that may be cached
(``cacheable_answer``, or ``StreamCollector`` for a streamed one), and a cached answer
served as a ``chat.completion`` or as the server-sent events of a stream. Nothing here
does I/O.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zerda_cache.core.entry import LLMUsage
from zerda_cache.core.errors import ZerdaError
from zerda_cache.core.results import CacheHit
from zerda_cache.service.coordination import new_completion_id
from zerda_cache.service.errors import ApiError

#: Scopes the proxy makes start with this (version 1 of the rule in ``proxy``'s docstring).
SCOPE_PREFIX = "oa1:"
#: Request fields that do not change the answer, so they stay out of the scope.
NOT_IN_SCOPE = frozenset(
    {"messages", "stream", "stream_options", "user", "metadata", "store", "service_tier", "n"}
)


@dataclass(frozen=True, slots=True)
class ChatKey:
    """Where a chat completion request is cached: its question and scope."""

    query: str
    scope: str


def chat_scope(body: Mapping[str, Any]) -> str:
    """The scope of a chat completion request (see the ``proxy`` module's docstring)."""
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


@dataclass
class StreamCollector:
    """Reassembles a streamed completion from its server-sent events, to cache it once
    the stream ended: the content of choice 0, unless another choice or a tool call
    shows up."""

    splitter: EventSplitter = field(default_factory=EventSplitter)
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    usable: bool = True
    model: str | None = None
    usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        for event in self.splitter.feed(chunk):
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


@dataclass
class RelayedStream:
    """A streamed upstream answer on its way to the client. Under a ``completion_id``
    (the request has a cache key) its events carry that id, ``collector`` reassembles
    the answer to cache, and ``[DONE]`` and what follows it are ``held`` until the answer
    is cached, so feedback sent once the stream ended finds it; without one (passed
    through uncached) the bytes go on as they come."""

    completion_id: str | None
    collector: StreamCollector = field(default_factory=StreamCollector)
    splitter: EventSplitter = field(default_factory=EventSplitter)
    held: list[bytes] = field(default_factory=list)

    def feed(self, chunk: bytes) -> list[bytes]:
        """What of ``chunk`` goes to the client now."""
        if self.completion_id is None:
            self.collector.feed(chunk)
            return [chunk]
        now = []
        for event in self.splitter.feed(chunk):
            self.collector.feed(event)
            if self.collector.done:
                self.held.append(event)
            else:
                now.append(with_completion_id(event, self.completion_id))
        return now

    def end(self) -> None:
        """The upstream's stream ended: what is left of an unfinished event is held too."""
        if self.splitter.buffer:
            self.held.append(self.splitter.buffer)


__all__ = [
    "NOT_IN_SCOPE",
    "SCOPE_PREFIX",
    "ChatKey",
    "EventSplitter",
    "RelayedStream",
    "StreamCollector",
    "cacheable_answer",
    "chat_key",
    "chat_scope",
    "check_chat_request",
    "completion_from_hit",
    "hit_usage",
    "stream_from_hit",
    "usage_of",
    "with_completion_id",
]
