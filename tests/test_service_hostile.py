"""Hostile text in every field of every endpoint of the service and the proxy: whatever a
client sends, the answer is the service's JSON error shape with a 4xx, or a JSON success,
and never a 5xx (real service in a thread, real Redis, a stand-in upstream that answers
anything). The connection a hostile request came on keeps serving: a pooled client's next
request works. ``tests/test_hostile.py`` does the same to the library's API."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from fastapi import FastAPI, Request
from service_support import Service, ThreadedServer, running_service

from zerda_cache.service.body import MAX_JSON_DEPTH
from zerda_cache.storage import RedisStorage

#: Stands for a value spliced into the JSON text as raw bytes (what json.dumps cannot make).
MARK = "@@HOSTILE@@"

#: (name, value): JSON values, or bytes spliced in raw where the field's value goes.
HOSTILE: list[tuple[str, Any]] = [
    ("lone surrogate", "\ud800"),
    ("lone surrogate in text", "What is \udfff Redis?"),
    ("surrogate key", {"\ud83d": "x"}),
    ("NUL", "a\x00b"),
    ("only NUL", "\x00"),
    ("control characters", "\x01\x1b[31m\x7f"),
    ("empty", ""),
    ("long", "x" * 300_000),
    ("integer", 12345),
    ("huge integer", 2**80),
    ("float", 1.5e308),
    ("boolean", True),
    ("null", None),
    ("list", ["a", 1, None]),
    ("object", {"a": {"b": [1, "c"]}}),
    (
        "nested within the limit",
        json.loads("[" * (MAX_JSON_DEPTH - 8) + "]" * (MAX_JSON_DEPTH - 8)),
    ),
    ("nested past the limit", b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)),
    ("nested past the parser", b"[" * 100_000 + b"]" * 100_000),
    ("invalid UTF-8", b'"\xff\xfe"'),
    ("truncated UTF-8", b'"caf\xc3"'),
    ("UTF-8 encoded surrogate", b'"\xed\xa0\x80"'),
    ("overlong UTF-8", b'"\xc0\xaf"'),
    ("NaN", b"NaN"),
    ("Infinity", b"-Infinity"),
    ("number past float", b"1e999"),
    ("digits past the int limit", b"9" * 5000),
]

FINE_CHAT = {
    "model": "gpt-test",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is Redis?"},
    ],
    "stop": ["\n\n"],
    "user": "u1",
    "temperature": 0.2,
    "response_format": {"type": "text"},
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
    "metadata": {"k": "v"},
}

#: Every endpoint taking a body, a fine body, and the path of every field in it to spoil
#: (a path ending in "*" is a new key of that object).
ENDPOINTS: dict[str, tuple[dict[str, Any], list[tuple[Any, ...]]]] = {
    "/v1/lookup": (
        {"query": "What is Redis?", "scope": "s", "max_error_rate": 0.1},
        [("query",), ("scope",), ("embedding",), ("max_error_rate",), ("*",)],
    ),
    "/v1/put": (
        {"query": "What is Redis?", "response": "A store.", "scope": "s", "metadata": {"k": "v"}},
        [
            ("query",),
            ("response",),
            ("scope",),
            ("embedding",),
            ("ttl_s",),
            ("quality",),
            ("metadata",),
            ("metadata", "k"),
            ("metadata", "*"),
        ],
    ),
    "/v1/feedback": (
        {"entry_id": "0" * 32, "positive": True, "source": "user"},
        [("entry_id",), ("positive",), ("magnitude",), ("source",), ("similarity",)],
    ),
    "/v1/invalidate": ({"entry_id": "0" * 32}, [("entry_id",), ("*",)]),
    "/v1/chat/completions": (
        FINE_CHAT,
        [
            ("model",),
            ("messages",),
            ("messages", 0, "role"),
            ("messages", 0, "content"),
            ("messages", 1, "role"),
            ("messages", 1, "content"),
            ("messages", 1, "*"),
            ("stop",),
            ("stop", 0),
            ("user",),
            ("temperature",),
            ("n",),
            ("stream",),
            ("response_format", "type"),
            ("tools", 0, "function", "name"),
            ("metadata", "k"),
            ("*",),
        ],
    ),
    "/v1/embeddings": (
        {"model": "text-embedding-test", "input": "hello"},
        [("model",), ("input",), ("encoding_format",), ("*",)],
    ),
}


def spoiled(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> bytes:
    """``body`` with the field at ``path`` set to ``value``, as the bytes sent."""
    out = copy.deepcopy(body)
    target: Any = out
    for step in path[:-1]:
        target = target[step]
    key = "x_\ud800" if path[-1] == "*" and value == "\ud800" else path[-1]
    if key == "*":
        key = "x_extra"
    raw = isinstance(value, bytes)
    target[key] = MARK if raw else value
    text = json.dumps(out).encode()  # ensure_ascii: "\ud800" goes out as its JSON escape
    return text.replace(json.dumps(MARK).encode(), value) if raw else text


def encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def upstream_stub() -> FastAPI:
    """An OpenAI-compatible upstream that answers any request with a fine completion (the
    service's statuses are under test here, not the upstream's)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        await request.body()
        message = {"role": "assistant", "content": "An answer."}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [choice], "usage": {"total_tokens": 0}}  # fmt: skip

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        await request.body()
        item = {"object": "embedding", "index": 0, "embedding": [0.5]}
        return {"object": "list", "data": [item], "model": "m", "usage": {"total_tokens": 0}}

    return app


@pytest.fixture
def service(redis_client: redis.Redis, redis_url: str) -> Iterator[Service]:
    with (
        ThreadedServer(upstream_stub()) as upstream,
        running_service(redis_client, redis_url, upstream_url=upstream.url + "/v1") as svc,
    ):
        yield svc


def check(resp: httpx.Response, what: str) -> None:
    assert resp.status_code < 500, (what, resp.status_code, resp.text[:300])
    kind = resp.headers.get("content-type", "")
    if resp.status_code == 200 and kind.startswith("text/event-stream"):  # "stream": true
        assert resp.text.endswith("data: [DONE]\n\n"), (what, resp.text)
        return
    assert kind.startswith("application/json"), (what, resp.text)
    data = resp.json()
    if resp.status_code >= 400:
        err = data["error"]
        assert err["message"] and err["type"] and err["code"], (what, data)


@pytest.mark.slow
def test_hostile_text_in_every_field_of_every_endpoint(
    service: Service, redis_client: redis.Redis
) -> None:
    headers = {**service.headers("acme"), "content-type": "application/json"}
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=service.url, timeout=60) as http:  # one pooled connection
        for path, (fine, fields) in ENDPOINTS.items():
            ok = http.post(path, content=json.dumps(fine).encode(), headers=headers)
            check(ok, f"{path} fine")
            for field in fields:
                for name, value in HOSTILE:
                    what = f"{path} {'.'.join(map(str, field))} = {name}"
                    resp = http.post(path, content=spoiled(fine, field, value), headers=headers)
                    check(resp, what)
                    statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
                    if isinstance(value, bytes) or not encodable(value):
                        assert resp.status_code == 422, (what, resp.text[:300])
                    # the connection keeps serving (a 500 used to drop it)
                    assert http.get("/healthz").status_code == 200, what
        # hostile bodies, keys and query strings on the endpoints that take no body
        for path in ("/v1/stats", "/healthz", "/readyz", "/openapi.json", "/nowhere"):
            for auth in (service.tokens["acme"], "zk_\udcff", "x" * 10_000):
                h = {b"authorization": ("Bearer " + auth).encode("utf-8", "surrogateescape")}
                resp = http.request("GET", path + "?q=%ff%00&r=%ed%a0%80", headers=h,
                                    content=b'{"query": "\xff"}')  # fmt: skip
                check(resp, f"GET {path}")
    assert set(statuses) <= {200, 401, 404, 413, 422}, statuses
    assert statuses[422] and statuses[200]  # refused and served alike
    storage = RedisStorage(redis_client)
    for batch in storage.iter_ids("acme"):
        for entry_id, _ in batch:
            storage.get_entry("acme", entry_id)  # every stored entry decodes


def test_hostile_keys_are_refused_as_json(service: Service) -> None:
    body = json.dumps(ENDPOINTS["/v1/lookup"][0]).encode()
    with httpx.Client(base_url=service.url, timeout=30) as http:
        for path in [*ENDPOINTS, "/v1/stats"]:
            for auth in (b"Bearer zk_\xff\xfe", b"Bearer \xed\xa0\x80", b"Basic \x80\x81", b"zk_"):
                resp = http.request(
                    "GET" if path == "/v1/stats" else "POST",
                    path,
                    content=body,
                    headers={b"authorization": auth, b"content-type": b"application/json"},
                )
                check(resp, f"{path} {auth!r}")
                assert resp.status_code in (401, 422), (path, auth, resp.text)
