"""The OpenAI-compatible caching proxy, driven by the official ``openai`` client against
the real service and a small local upstream server that counts its calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from prometheus_client import CollectorRegistry
from service_support import (
    UPSTREAM_KEY,
    Service,
    ThreadedServer,
    UpstreamState,
    add_key,
    running_service,
    snapshot,
)

from zerda_cache import AsyncCacheManager, CacheConfig
from zerda_cache.embedders import HashingEmbedder
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.service import Upstream, create_app
from zerda_cache.service.chat import StreamCollector, chat_key, chat_scope
from zerda_cache.service.embedding import OpenAIEmbedder, make_embedder
from zerda_cache.storage import RedisStorage

QUESTION = "How do I reset my password?"
NEAR = "How do I reset my password now?"  # a near-duplicate: cosine 0.87 (hashing, 256-d)


@pytest.fixture
def service(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> Iterator[Service]:
    with running_service(redis_client, redis_url, upstream_url=upstream[0]) as svc:
        yield svc


def client(svc: Service, tenant: str = "acme", token: str | None = None) -> Any:
    return openai.OpenAI(
        base_url=svc.url + "/v1", api_key=token or svc.tokens[tenant], max_retries=0
    )


def ask(c: Any, question: str = QUESTION, **kwargs: Any) -> tuple[str | None, Any]:
    """``(answer, headers)`` of one chat completion through the proxy."""
    kwargs.setdefault("model", "gpt-test")
    messages = kwargs.pop("messages", None) or [{"role": "user", "content": question}]
    raw = c.chat.completions.with_raw_response.create(messages=messages, **kwargs)
    completion = raw.parse()
    return completion.choices[0].message.content, raw.headers


def test_second_identical_request_is_a_hit_without_upstream_call(
    service: Service, upstream: tuple[str, UpstreamState], redis_client: redis.Redis
) -> None:
    _, state = upstream
    c = client(service)
    first, h1 = ask(c)
    assert first == f"answer to: {QUESTION}" and h1["x-zerda-cache"] == "miss"
    entry_id = h1["x-zerda-entry-id"]
    assert redis_client.exists(f"zc:{{acme}}:e:{entry_id}") and state.chat_calls() == 1

    raw = c.chat.completions.with_raw_response.create(
        model="gpt-test", messages=[{"role": "user", "content": QUESTION}]
    )
    completion = raw.parse()  # the openai client parses the cached answer as usual
    assert completion.choices[0].message.content == first
    assert completion.choices[0].finish_reason == "stop" and completion.object == "chat.completion"
    assert completion.model == "gpt-test-0613"  # the model that answered, as cached
    assert raw.headers["x-zerda-cache"] == "hit" and raw.headers["x-zerda-entry-id"] == entry_id
    assert state.chat_calls() == 1  # no upstream call

    # the upstream saw its own key, never the tenant's
    sent = state.calls[0]["headers"]
    assert sent["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert service.tokens["acme"] not in str(state.calls)

    # feedback follows the entry named by the header
    resp = httpx.post(
        service.url + "/v1/feedback",
        json={
            "entry_id": raw.headers["x-zerda-entry-id"],
            "positive": True,
            "similarity": float(raw.headers["x-zerda-similarity"]),
        },
        headers=service.headers("acme"),
    )
    assert resp.status_code == 200
    assert int(redis_client.hget("zc:{acme}:stats", "positive") or 0) == 1


def test_near_duplicate_is_a_hit_and_other_tenants_never_see_it(
    service: Service, upstream: tuple[str, UpstreamState]
) -> None:
    _, state = upstream
    acme, globex = client(service, "acme"), client(service, "globex")
    first, _ = ask(acme)
    near, h = ask(acme, NEAR)
    assert near == first and h["x-zerda-cache"] == "hit" and state.chat_calls() == 1
    assert 0.85 < float(h["x-zerda-similarity"]) < 0.9  # served as a near match

    theirs, h = ask(globex)
    assert h["x-zerda-cache"] == "miss" and state.chat_calls() == 2
    theirs_near, h = ask(globex, NEAR)
    assert h["x-zerda-cache"] == "hit"  # globex's own entry now
    assert theirs == theirs_near == first  # (the upstream answers both tenants alike)
    # revoking acme's key: the proxy refuses it, as the openai client sees it
    service.storage.revoke_api_keys(tenant="acme")
    with pytest.raises(openai.AuthenticationError, match="revoked"):
        ask(acme)
    with pytest.raises(openai.AuthenticationError):
        ask(client(service, token="zk_" + "x" * 43))
    assert state.chat_calls() == 2


@pytest.mark.parametrize(
    "change",
    [
        {"model": "gpt-other"},
        {"messages": [{"role": "system", "content": "Answer in French."}]},
        {"messages": [{"role": "developer", "content": "Be terse."}]},
        {"temperature": 1.5},
        {"max_tokens": 50},
        {"response_format": {"type": "json_object"}},
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "lookup", "parameters": {"type": "object"}},
                }
            ]
        },
        {"messages": [{"role": "assistant", "content": "Hi! Ask me anything."}]},
    ],
)
def test_other_instructions_never_meet(
    service: Service, upstream: tuple[str, UpstreamState], change: dict[str, Any]
) -> None:
    _, state = upstream
    c = client(service)
    ask(c)
    kwargs = dict(change)
    if "messages" in kwargs:  # earlier turns before the same question
        kwargs["messages"] = [*kwargs["messages"], {"role": "user", "content": QUESTION}]
    for question in (QUESTION, NEAR):
        _, h = ask(c, question, **kwargs)
        assert h["x-zerda-cache"] == ("miss" if question == QUESTION else "hit"), change
    assert state.chat_calls() == 2
    # and the original scope still serves its own
    _, h = ask(c)
    assert h["x-zerda-cache"] == "hit" and state.chat_calls() == 2


def test_passed_through_or_not_cached(
    service: Service, upstream: tuple[str, UpstreamState], redis_client: redis.Redis
) -> None:
    _, state = upstream
    c = client(service)
    raw = c.chat.completions.with_raw_response.create(
        model="gpt-test", messages=[{"role": "user", "content": QUESTION}], n=2
    )
    assert len(raw.parse().choices) == 2 and raw.headers["x-zerda-cache"] == "bypass"
    assert raw.headers["x-zerda-bypass"] == "n>1"
    # the last message is not a user turn
    _, h = ask(
        c,
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Well,"}],
    )
    assert h["x-zerda-cache"] == "bypass"
    # images are not embedded: passed through
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    _, h = ask(c, messages=[{"role": "user", "content": parts}])
    assert h["x-zerda-cache"] == "bypass" and h["x-zerda-bypass"] == "non-text content"
    # a tool call and a truncated answer go back to the client, uncached
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    raw = c.chat.completions.with_raw_response.create(
        model="gpt-test",
        messages=[{"role": "user", "content": QUESTION}],
        tools=tools,
        tool_choice="required",
    )
    assert raw.parse().choices[0].message.tool_calls and raw.headers["x-zerda-cache"] == "miss"
    assert "x-zerda-entry-id" not in raw.headers
    _, h = ask(c, max_tokens=1)
    assert h["x-zerda-cache"] == "miss" and "x-zerda-entry-id" not in h
    # an upstream error is relayed as the upstream said it, and not cached
    with pytest.raises(openai.InternalServerError, match="upstream exploded"):
        ask(c, model="broken")
    calls = state.chat_calls()
    assert calls == 6
    assert not redis_client.exists("zc:{acme}:ids")  # nothing was cached
    # the same requests again: every one reaches the upstream again
    ask(c, max_tokens=1)
    assert state.chat_calls() == calls + 1


def test_streaming_hit_is_served_as_events_and_a_streamed_miss_is_cached(
    service: Service, upstream: tuple[str, UpstreamState]
) -> None:
    _, state = upstream
    c = client(service)
    messages = [{"role": "user", "content": QUESTION}]
    with c.chat.completions.with_streaming_response.create(
        model="gpt-test", messages=messages, stream=True
    ) as resp:
        assert resp.headers["x-zerda-cache"] == "miss"
        text = "".join(ch.choices[0].delta.content or "" for ch in resp.parse() if ch.choices)
    assert text == f"answer to: {QUESTION}" and state.chat_calls() == 1

    with c.chat.completions.with_streaming_response.create(
        model="gpt-test", messages=messages, stream=True, stream_options={"include_usage": True}
    ) as resp:
        assert resp.headers["x-zerda-cache"] == "hit" and resp.headers["x-zerda-entry-id"]
        chunks = list(resp.parse())
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 0  # no usage stored
    # stream is not in the scope: a plain request meets the streamed answer too
    answer, h = ask(c)
    assert answer == text and h["x-zerda-cache"] == "hit" and state.chat_calls() == 1


def test_embeddings_are_passed_through(
    service: Service, upstream: tuple[str, UpstreamState], redis_client: redis.Redis
) -> None:
    _, state = upstream
    c = client(service)
    before = snapshot(redis_client)
    for _ in range(2):
        out = c.embeddings.create(model="text-embedding-test", input="hello")
        assert out.data[0].embedding == [0.5, -0.25, 0.125]
    assert [call["path"] for call in state.calls] == ["/v1/embeddings"] * 2
    assert state.calls[0]["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert snapshot(redis_client) == before
    with pytest.raises(openai.AuthenticationError):
        client(service, token="zk_" + "y" * 43).embeddings.create(model="m", input="x")


def test_under_an_error_bound_a_near_duplicate_is_verified(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    url, state = upstream
    state.reply = "Settings > Security > Reset password."
    config = CacheConfig(max_error_rate=0.05, verify_rate=0.0)  # no exploration draw
    with running_service(redis_client, redis_url, upstream_url=url, config=config) as svc:
        c = client(svc)
        ask(c)
        # The question asked exactly: its answer is not confirmed yet, so it is verified
        # upstream; the answers agree, which confirms the fresh one...
        _, h = ask(c, QUESTION)
        assert h["x-zerda-cache"] == "verify" and h["x-zerda-verified"] == "true"
        _, h = ask(c, QUESTION)  # ...and it is served from then on
        assert h["x-zerda-cache"] == "hit"
        _, h = ask(c, NEAR)  # a near match, not yet proven safe: verified upstream
        assert h["x-zerda-cache"] == "verify" and h["x-zerda-verified"] == "true"
        assert state.chat_calls() == 3
        labels = redis_client.hgetall("zc:{acme}:cal")
        # one label each: the exact repeat's (counted apart) and the near match's
        assert float(labels[b"r:e"]) == 1 and float(labels[b"n"]) == 2


def test_the_proxy_carries_the_verify_token_to_its_put(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    """The proxy's lookup and its put of the upstream's answer run in one request; its
    put takes the lookup's verify token, so the verification holds without this
    replica's memory: here a replica that keeps no ticket at all, as when the put runs
    in another worker than the lookup."""
    url, state = upstream
    state.reply = "Settings > Security > Reset password."
    registry = CollectorRegistry()
    config = CacheConfig(max_error_rate=0.05, verify_rate=0.0, redis_timeout_s=10.0)
    manager = AsyncCacheManager.from_url(
        redis_url, config, embed_fn=HashingEmbedder(256), metrics=ReplicaMetrics(registry)
    )
    manager.verifier.hold = lambda *args: None  # no ticket in this replica's memory
    app = create_app(
        manager,
        upstream=Upstream(url, api_key=UPSTREAM_KEY),
        registry=registry,
        close_on_shutdown=True,
    )
    token = add_key(RedisStorage(redis_client), "acme")
    with (
        ThreadedServer(app) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0) as c,
    ):
        ask(c)
        _, h = ask(c, QUESTION)  # unconfirmed: verified upstream, by the token
        assert h["x-zerda-cache"] == "verify" and h["x-zerda-verified"] == "true"
        _, h = ask(c, QUESTION)  # the agreement confirmed it: served
        assert h["x-zerda-cache"] == "hit"
        _, h = ask(c, NEAR)  # a near match held back, verified by the token too
        assert h["x-zerda-cache"] == "verify" and h["x-zerda-verified"] == "true"
    assert state.chat_calls() == 3
    labels = redis_client.hgetall("zc:{acme}:cal")
    assert float(labels[b"r:e"]) == 1 and float(labels[b"n"]) == 2


def test_upstream_unreachable_or_unset(redis_client: redis.Redis, redis_url: str) -> None:
    with running_service(redis_client, redis_url, upstream_url="http://127.0.0.1:9/v1") as svc:
        with pytest.raises(openai.APIStatusError) as err:
            ask(client(svc))
        assert err.value.status_code == 502 and "unreachable" in str(err.value)
    with running_service(redis_client, redis_url) as svc:
        with pytest.raises(openai.APIStatusError) as err:
            ask(client(svc))
        assert err.value.status_code == 503 and "no upstream" in str(err.value)


def test_scope_and_question_rules() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "Hi?"}]}
    key = chat_key(base, 1000)
    assert not isinstance(key, str) and key.query == "Hi?" and key.scope.startswith("oa1:")
    # what does not change the answer stays out of the scope
    same = {**base, "stream": True, "user": "u1", "metadata": {"a": "b"}, "n": 1}
    assert chat_scope(same) == chat_scope(base)
    # the question itself is not in the scope; everything else is
    other_q = {**base, "messages": [{"role": "user", "content": "Hello?"}]}
    assert chat_scope(other_q) == chat_scope(base)
    assert chat_scope({**base, "seed": 1}) != chat_scope(base)
    assert chat_scope({**base, "some_new_param": True}) != chat_scope(base)
    assert chat_key({**base, "n": 3}, 1000) == "n>1"
    assert chat_key({**base, "logprobs": True}, 1000) == "logprobs"
    assert chat_key(base, 2) == "question over max_query_chars"
    parts = {**base, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi?"}]}]}
    key = chat_key(parts, 1000)
    assert not isinstance(key, str) and key.query == "Hi?"


def test_stream_collector_keeps_only_complete_single_answers() -> None:
    def events(*payloads: str) -> bytes:
        return b"".join(f"data: {p}\n\n".encode() for p in payloads)

    def delta(content: str, index: int = 0, finish: str | None = None) -> str:
        choice = {"index": index, "delta": {"content": content}, "finish_reason": finish}
        import json

        return json.dumps({"choices": [choice]})

    ok = StreamCollector()
    data = events(delta("Hel"), delta("lo"), delta("", finish="stop"), "[DONE]")
    for i in range(0, len(data), 7):  # split anywhere, even inside an event
        ok.feed(data[i : i + 7])
    assert ok.answer == "Hello"
    cut = StreamCollector()
    cut.feed(events(delta("Hel"), delta("lo")))  # no [DONE]: the client went away
    assert cut.answer is None
    two = StreamCollector()
    two.feed(events(delta("a"), delta("b", index=1), delta("", finish="stop"), "[DONE]"))
    assert two.answer is None
    truncated = StreamCollector()
    truncated.feed(events(delta("a", finish="length"), "[DONE]"))
    assert truncated.answer is None


def test_an_embeddings_endpoint_as_the_services_embedder(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    """--embedder URL: the service embeds questions through an OpenAI-compatible
    embeddings API (the stand-in upstream's); when it fails, cache endpoints say 502 and
    the proxy passes the request through."""
    url, state = upstream
    assert isinstance(make_embedder(url), OpenAIEmbedder)
    specs = [("none", True), ("hashing:32", True), ("bogus", False)]
    specs += [("sentence-transformers", False), ("sentence-transformers:", False)]  # no model
    for spec, ok in specs:
        if ok:
            make_embedder(spec)
        else:
            with pytest.raises(ValueError):
                make_embedder(spec)
    embedder = OpenAIEmbedder(url, "emb-test", api_key="emb-secret")
    registry = CollectorRegistry()
    manager = AsyncCacheManager.from_url(
        redis_url, embed_fn=embedder, metrics=ReplicaMetrics(registry)
    )
    app = create_app(
        manager,
        upstream=Upstream(url, api_key=UPSTREAM_KEY),
        registry=registry,
        close_on_shutdown=True,
    )
    tokens = {"acme": add_key(RedisStorage(redis_client), "acme")}
    with ThreadedServer(app) as server:
        h = {"Authorization": f"Bearer {tokens['acme']}"}
        put = httpx.post(server.url + "/v1/put", json={"query": "q", "response": "a"}, headers=h)
        assert put.status_code == 200 and put.json()["stored"], put.text
        emb_calls = [c for c in state.calls if c["path"] == "/v1/embeddings"]
        assert emb_calls[0]["body"] == {"model": "emb-test", "input": "q"}
        assert emb_calls[0]["headers"]["authorization"] == "Bearer emb-secret"
        hit = httpx.post(server.url + "/v1/lookup", json={"query": "q"}, headers=h)
        assert hit.json()["entry"]["response"] == "a"
        # the embeddings endpoint goes away: 502 for the cache endpoints, a pass-through
        # for the proxy (the client still gets its answer)
        embedder.url = "http://127.0.0.1:9/v1/embeddings"
        bad = httpx.post(server.url + "/v1/lookup", json={"query": "new q"}, headers=h)
        assert bad.status_code == 502 and bad.json()["error"]["type"] == "embedder_error"
        with openai.OpenAI(base_url=server.url + "/v1", api_key=tokens["acme"]) as c:
            answer, headers = ask(c, "a question never embedded")
        assert answer == "answer to: a question never embedded"
        assert (
            headers["x-zerda-cache"] == "bypass" and headers["x-zerda-bypass"] == "embedder failed"
        )
    assert embedder.client.is_closed  # the app's shutdown closed its embedder


def test_a_malformed_chat_request_is_refused_before_the_upstream(
    service: Service, upstream: tuple[str, UpstreamState]
) -> None:
    _, state = upstream
    for body in (
        {"messages": [{"role": "user", "content": "hi"}]},
        {"model": "m", "messages": []},
        {"model": "m", "messages": ["hi"]},
        {"model": 3, "messages": [{"role": "user", "content": "hi"}]},
    ):
        resp = httpx.post(
            service.url + "/v1/chat/completions", json=body, headers=service.headers("acme")
        )
        assert resp.status_code == 422 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(
        service.url + "/v1/chat/completions",
        content=b"[1, 2]",
        headers={**service.headers("acme"), "content-type": "application/json"},
    )
    assert resp.status_code == 422
    assert state.calls == []


def test_unencodable_text_anywhere_in_a_chat_request_is_a_422_on_a_kept_connection(
    service: Service, upstream: tuple[str, UpstreamState], redis_client: redis.Redis
) -> None:
    """A lone surrogate is a 422 wherever it is, not only in the question: a system
    message, the model, a stop sequence, a tool's name. The refusal is JSON and the
    connection stays usable, so a pooled client's next request is answered."""
    _, state = upstream
    fine = {"model": "gpt-test", "messages": [{"role": "user", "content": QUESTION}]}
    spoiled = [
        {
            **fine,
            "messages": [{"role": "system", "content": "Be \ud800 brief."}, *fine["messages"]],
        },
        {**fine, "model": "gpt-\ud800"},
        {**fine, "stop": ["\udfff"]},
        {**fine, "user": "\ud83d"},
        {**fine, "messages": [{"role": "user", "content": QUESTION, "name": "\ud800"}]},
        {**fine, "tools": [{"type": "function", "function": {"name": "\ud800"}}]},
        {**fine, "messages": [{"role": "user", "content": "Why \ud800?"}]},
    ]
    before = snapshot(redis_client)
    h = {**service.headers("acme"), "content-type": "application/json"}
    with httpx.Client(base_url=service.url, timeout=30) as http:
        for body in spoiled:
            raw = json.dumps(body).encode()  # "\ud800" as its JSON escape, as a client sends it
            for path in ("/v1/chat/completions", "/v1/embeddings"):
                resp = http.post(path, content=raw, headers=h)
                assert resp.status_code == 422, (body, resp.status_code, resp.text)
                assert resp.json()["error"]["code"] == "invalid_unicode"
                assert resp.headers.get("connection") != "close"
            # the same pooled client: the next request is answered
            ok = http.post("/v1/chat/completions", json=fine, headers=h)
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert state.chat_calls() == 1  # the first fine request; hits after it, no spoiled call
    assert {k for k in snapshot(redis_client) if b":e:" in k} - set(before)  # the fine answer
