"""Per-request control, as the official ``openai`` client sends it (``extra_headers``):
``Cache-Control: no-store`` / ``no-cache`` / ``max-age=N`` and ``X-Zerda-Scope``, on the
proxy and on the HTTP API, against the real service, a real Redis and a canned
upstream that counts its calls."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from service_support import (
    Service,
    UpstreamState,
    ask,
    ask_streaming,
    openai_client,
    running_service,
    snapshot,
)

from zerda_cache import CacheManager
from zerda_cache.service.control import request_control
from zerda_cache.service.errors import ApiError

QUESTION = "How do I reset my password?"
NEAR = "How do I reset my password now?"


@pytest.fixture
def service(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> Iterator[Service]:
    with running_service(redis_client, redis_url, upstream_url=upstream[0]) as svc:
        yield svc


@pytest.fixture
def library(redis_client: redis.Redis) -> Iterator[CacheManager]:
    """The library's view of the same Redis, to read entries as stored."""
    manager = CacheManager(redis_client)
    try:
        yield manager
    finally:
        manager.close()


def stats(svc: Service, tenant: str = "acme") -> dict[str, Any]:
    resp = httpx.get(svc.url + "/v1/stats", headers=svc.headers(tenant), timeout=30)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def api(svc: Service, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        svc.url + path, json=body, headers={**svc.headers("acme"), **headers}, timeout=30
    )


def test_no_store_leaves_redis_unchanged(
    service: Service, upstream: tuple[str, UpstreamState], redis_client: redis.Redis
) -> None:
    _, state = upstream
    c = openai_client(service)
    cached, _ = ask(c, QUESTION)  # a cached answer, which no-store must not serve
    stats(service)  # flushes the replica's pending counts
    before_keys, before_size = snapshot(redis_client), redis_client.dbsize()
    before_stats = stats(service)
    no_store = {"Cache-Control": "no-store"}

    completion, h = ask(c, QUESTION, extra_headers=no_store)
    assert h["x-zerda-cache"] == "bypass" and h["x-zerda-bypass"] == "Cache-Control: no-store"
    assert completion.choices[0].message.content == cached.choices[0].message.content
    assert "x-zerda-entry-id" not in h and "x-zerda-completion-id" not in h
    _, h = ask(c, "A question never asked", extra_headers=no_store)
    assert h["x-zerda-cache"] == "bypass"
    text, _, h = ask_streaming(c, "Another new question", extra_headers=no_store)
    assert text == "answer to: Another new question" and h["x-zerda-cache"] == "bypass"
    # max-age=0 is no-store too; and directives are read case-insensitively, in a list
    _, h = ask(c, "A third new one", extra_headers={"Cache-Control": "max-age=0"})
    assert h["x-zerda-cache"] == "bypass"
    _, h = ask(c, QUESTION, extra_headers={"cache-control": "no-transform, No-Store"})
    assert h["x-zerda-cache"] == "bypass"
    # the HTTP API alike: a lookup reads nothing (a miss), a put writes nothing
    lookup = api(service, "/v1/lookup", {"query": QUESTION}, **no_store)
    body = lookup.json()
    assert (body["hit"], body["decision"], body["entry"]) == (False, "miss", None)
    assert body["verify_token"] is None
    put = api(service, "/v1/put", {"query": "q", "response": "a"}, **no_store)
    assert put.json()["stored"] is False and put.json()["reason"] == "Cache-Control: no-store"

    assert state.chat_calls() == 6  # every no-store request went upstream
    assert redis_client.dbsize() == before_size
    assert snapshot(redis_client) == before_keys
    assert stats(service) == before_stats


def test_no_cache_asks_upstream_and_updates_the_entry(
    service: Service,
    upstream: tuple[str, UpstreamState],
    redis_client: redis.Redis,
    library: CacheManager,
) -> None:
    _, state = upstream
    c = openai_client(service)
    old, h = ask(c, QUESTION)
    old_id = h["x-zerda-entry-id"]
    state.reply = "A fresh answer."
    fresh, h = ask(c, QUESTION, extra_headers={"Cache-Control": "no-cache"})
    assert h["x-zerda-cache"] == "miss" and state.chat_calls() == 2
    assert fresh.choices[0].message.content == "A fresh answer."
    new_id = h["x-zerda-entry-id"]
    # the fresh answer replaced the cached one (the same question and scope)
    assert new_id != old_id and not redis_client.exists(f"zc:{{acme}}:e:{old_id}")
    assert library.storage.get_entry("acme", new_id).response == "A fresh answer."
    served, h = ask(c, NEAR)
    assert h["x-zerda-cache"] == "hit" and h["x-zerda-entry-id"] == new_id
    assert served.choices[0].message.content == "A fresh answer."
    assert redis_client.zcard("zc:{acme}:ids") == 1

    # streamed, the same: upstream, then cached in place of the entry before
    state.reply = "A streamed fresh answer."
    text, _, h = ask_streaming(c, QUESTION, extra_headers={"Cache-Control": "no-cache"})
    assert text == "A streamed fresh answer." and h["x-zerda-cache"] == "miss"
    served, h = ask(c, QUESTION)
    assert served.choices[0].message.content == "A streamed fresh answer."
    assert h["x-zerda-cache"] == "hit" and state.chat_calls() == 3
    assert redis_client.zcard("zc:{acme}:ids") == 1
    # the API's lookup under no-cache: a miss without reading (the caller asks its LLM)
    miss = api(service, "/v1/lookup", {"query": QUESTION}, **{"Cache-Control": "no-cache"})
    assert miss.json()["hit"] is False
    assert old.choices[0].message.content == f"answer to: {QUESTION}"


def test_max_age_sets_the_stored_answers_ttl(
    service: Service, upstream: tuple[str, UpstreamState], library: CacheManager
) -> None:
    _, state = upstream
    c = openai_client(service)
    _, h = ask(c, QUESTION, extra_headers={"Cache-Control": "max-age=120"})
    assert library.storage.get_entry("acme", h["x-zerda-entry-id"]).ttl_s == 120
    _, h = ask(c, QUESTION)  # a hit is served as it is
    assert h["x-zerda-cache"] == "hit"
    text, _, h = ask_streaming(
        c, "A streamed question", extra_headers={"Cache-Control": "public, max-age=90"}
    )
    assert text == "answer to: A streamed question" and h["x-zerda-cache"] == "miss"
    _, h = ask(c, "A streamed question")
    assert h["x-zerda-cache"] == "hit"
    assert library.storage.get_entry("acme", h["x-zerda-entry-id"]).ttl_s == 90
    _, h = ask(c, "No max-age")
    assert library.storage.get_entry("acme", h["x-zerda-entry-id"]).ttl_s is None
    # the HTTP API: max-age is the TTL when the body sets none
    put = api(
        service, "/v1/put", {"query": "q1", "response": "a"}, **{"Cache-Control": "max-age=60"}
    )
    assert library.storage.get_entry("acme", put.json()["entry_id"]).ttl_s == 60
    put = api(
        service,
        "/v1/put",
        {"query": "q2", "response": "a", "ttl_s": 30},
        **{"Cache-Control": "max-age=60"},
    )
    assert library.storage.get_entry("acme", put.json()["entry_id"]).ttl_s == 30
    # a malformed max-age is refused before anything is read or sent
    calls = state.chat_calls()
    for bad in ("max-age=soon", "max-age=-1", "max-age=", "max-age=1.5"):
        with pytest.raises(openai.UnprocessableEntityError, match="max-age"):
            ask(c, "Refused", extra_headers={"Cache-Control": bad})
        resp = api(service, "/v1/put", {"query": "q", "response": "a"}, **{"Cache-Control": bad})
        assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_cache_control"
    assert state.chat_calls() == calls


def test_the_scope_header_keeps_two_users_apart(
    service: Service, upstream: tuple[str, UpstreamState], library: CacheManager
) -> None:
    _, state = upstream
    c = openai_client(service)
    alice = openai_client(service, default_headers={"X-Zerda-Scope": "user:alice@example.com"})
    state.reply = "Alice's answer."
    _, h = ask(alice, QUESTION)
    assert h["x-zerda-cache"] == "miss"
    alice_id = h["x-zerda-entry-id"]
    state.reply = "Bob's answer."
    bob, h = ask(c, QUESTION, extra_headers={"X-Zerda-Scope": "user:bob"})
    assert h["x-zerda-cache"] == "miss" and bob.choices[0].message.content == "Bob's answer."
    state.reply = "Everyone's answer."
    _, h = ask(c, QUESTION)  # no partition: a scope of its own
    assert h["x-zerda-cache"] == "miss" and state.chat_calls() == 3

    mine, h = ask(alice, NEAR)
    assert h["x-zerda-cache"] == "hit" and h["x-zerda-entry-id"] == alice_id
    assert mine.choices[0].message.content == "Alice's answer."
    theirs, h = ask(c, NEAR, extra_headers={"X-Zerda-Scope": "user:bob"})
    assert theirs.choices[0].message.content == "Bob's answer."
    text, _, h = ask_streaming(alice, QUESTION)
    assert text == "Alice's answer." and h["x-zerda-cache"] == "hit"
    assert state.chat_calls() == 3
    # the partition is on top of the proxy's scope, never in place of it
    scope = library.storage.get_entry("acme", alice_id).scope
    assert scope.startswith("oa1:") and scope.endswith("|user:alice@example.com")
    _, h = ask(alice, QUESTION, model="gpt-other")
    assert h["x-zerda-cache"] == "miss" and state.chat_calls() == 4

    # the HTTP API: the header partitions the body's scope the same way
    body = {"query": "Which plan?", "response": "Alice's plan.", "scope": "billing"}
    assert api(service, "/v1/put", body, **{"X-Zerda-Scope": "alice"}).json()["stored"]
    lookup = {"query": "Which plan?", "scope": "billing"}
    hit = api(service, "/v1/lookup", lookup, **{"X-Zerda-Scope": "alice"}).json()
    assert hit["hit"] and hit["entry"]["scope"] == "billing|alice"
    assert not api(service, "/v1/lookup", lookup, **{"X-Zerda-Scope": "bob"}).json()["hit"]
    assert not api(service, "/v1/lookup", lookup).json()["hit"]
    # a partition that is not a plain label is refused
    for bad in ("two words", "x" * 129, "a,b", "{acme}"):
        resp = api(service, "/v1/lookup", lookup, **{"X-Zerda-Scope": bad})
        assert resp.status_code == 422, bad
        assert resp.json()["error"]["code"] == "invalid_scope_partition"
    with pytest.raises(openai.UnprocessableEntityError):
        ask(c, QUESTION, extra_headers={"X-Zerda-Scope": "a b"})
    assert state.chat_calls() == 4


def test_tags_on_stored_answers_and_invalidation_by_tag(
    service: Service,
    upstream: tuple[str, UpstreamState],
    library: CacheManager,
    redis_client: redis.Redis,
) -> None:
    _, state = upstream
    c = openai_client(service)
    handbook = {"X-Zerda-Tags": "doc:handbook, faq"}
    _, h = ask(c, QUESTION, extra_headers=handbook)
    assert set(library.storage.get_entry("acme", h["x-zerda-entry-id"]).tags) == {
        "doc:handbook",
        "faq",
    }
    ask_streaming(c, "Where is the handbook?", extra_headers=handbook)
    _, h = ask(c, "Where is the handbook?")
    assert h["x-zerda-cache"] == "hit"
    assert "doc:handbook" in library.storage.get_entry("acme", h["x-zerda-entry-id"]).tags
    ask(c, "An untagged question")
    # the HTTP API: a put's tags field
    put = api(service, "/v1/put", {"query": "q", "response": "a", "tags": ["doc:handbook"]})
    assert put.json()["stored"]
    assert library.storage.get_entry("acme", put.json()["entry_id"]).tags == ("doc:handbook",)

    # another tenant's key removes nothing of acme's
    before = snapshot(redis_client)
    resp = httpx.post(
        service.url + "/v1/invalidate/tag",
        json={"tag": "doc:handbook"},
        headers=service.headers("globex"),
    )
    assert resp.status_code == 200 and resp.json() == {"removed": 0}
    assert snapshot(redis_client) == before
    resp = api(service, "/v1/invalidate/tag", {"tag": "doc:handbook"})
    assert resp.status_code == 200 and resp.json() == {"removed": 3}
    calls = state.chat_calls()
    for question in (QUESTION, "Where is the handbook?"):
        _, h = ask(c, question)
        assert h["x-zerda-cache"] == "miss"
    assert not api(service, "/v1/lookup", {"query": "q"}).json()["hit"]
    _, h = ask(c, "An untagged question")
    assert h["x-zerda-cache"] == "hit" and state.chat_calls() == calls + 2

    # tags that are not tags are refused before anything is read or sent
    for bad in ("a b", ",".join(f"t{i}" for i in range(17)), "x" * 129):
        with pytest.raises(openai.UnprocessableEntityError, match="x-zerda-tags"):
            ask(c, QUESTION, extra_headers={"X-Zerda-Tags": bad})
    resp = api(service, "/v1/put", {"query": "q", "response": "a", "tags": ["a b"]})
    assert resp.status_code == 422
    assert api(service, "/v1/invalidate/tag", {"tag": ""}).status_code == 422
    assert state.chat_calls() == calls + 2


@pytest.mark.parametrize("arg", ["\xb2", "\xb9", "1\xb3", "\u0661", "\uff17", "1_0"])
def test_a_max_age_of_other_than_ascii_digits_is_refused(arg: str) -> None:
    """``"\\xb2".isdigit()`` is true and ``int("\\xb2")`` raises: a superscript digit in
    ``max-age`` was a 500. Only ASCII digits are whole seconds (``int`` also took
    Arabic-Indic and full-width digits)."""
    with pytest.raises(ApiError) as raised:
        request_control({"cache-control": f"max-age={arg}"})
    assert raised.value.status == 422 and raised.value.code == "invalid_cache_control"
    assert request_control({"cache-control": "max-age=17"}).ttl_s == 17.0


def test_a_superscript_max_age_is_a_422_on_every_route(service: Service) -> None:
    """Over HTTP (the header's bytes as latin-1, as servers decode them): the proxy,
    ``/v1/put`` and ``/v1/lookup`` answered 500."""
    routes = [
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "q"}]}),
        ("/v1/put", {"query": "q", "response": "a"}),
        ("/v1/lookup", {"query": "q"}),
    ]
    for path, body in routes:
        for value in (b"max-age=\xb2", b"max-age=1\xb3"):
            headers = {**service.headers("acme"), "Cache-Control": value.decode("latin-1")}
            resp = httpx.post(
                service.url + path,
                json=body,
                headers={k: v.encode("latin-1") for k, v in headers.items()},
                timeout=30,
            )
            assert resp.status_code == 422, (path, resp.status_code, resp.text)
            assert resp.json()["error"]["code"] == "invalid_cache_control"
