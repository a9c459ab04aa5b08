"""Feedback by completion id: every chat completion the proxy answers under a cache key
(hit or miss, streamed or not) carries an id of the proxy's making, which
``POST /v1/feedback`` takes in place of an entry id, reaching the entry the response was
answered with. Checked with the official ``openai`` client and the library's own view of
the entry's arm."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
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
from zerda_cache.service import ServiceSettings

QUESTION = "How do I reset my password?"
NEAR = "How do I reset my password now?"  # a near duplicate (cosine 0.87, hashing 256-d)
TTL_S = 3600.0


@pytest.fixture
def service(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> Iterator[Service]:
    settings = ServiceSettings(completion_ttl_s=TTL_S)
    with running_service(
        redis_client, redis_url, upstream_url=upstream[0], settings=settings
    ) as svc:
        yield svc


@pytest.fixture
def library(redis_client: redis.Redis) -> Iterator[CacheManager]:
    manager = CacheManager(redis_client)
    try:
        yield manager
    finally:
        manager.close()


def feedback(svc: Service, body: dict[str, Any], tenant: str = "acme") -> httpx.Response:
    return httpx.post(svc.url + "/v1/feedback", json=body, headers=svc.headers(tenant), timeout=30)


def arm(library: CacheManager, entry_id: str) -> tuple[float, float]:
    entry = library.storage.get_entry("acme", entry_id)
    return entry.bandit_arm.alpha, entry.bandit_arm.beta


def test_feedback_by_the_completion_id_of_a_streamed_miss_and_of_a_hit(
    service: Service, library: CacheManager, redis_client: redis.Redis
) -> None:
    c = openai_client(service)
    text, chunks, h = ask_streaming(c, QUESTION)
    assert h["x-zerda-cache"] == "miss" and text == f"answer to: {QUESTION}"
    streamed_id = h["x-zerda-completion-id"]
    assert streamed_id.startswith("chatcmpl-zc")
    assert {ch.id for ch in chunks} == {streamed_id}  # every chunk, the proxy's id
    assert streamed_id in h["x-zerda-feedback"] and h["x-zerda-feedback"].startswith(
        "POST /v1/feedback"
    )
    # the id expires: mapped for the configured time
    key = f"zc:{{acme}}:cmp:{streamed_id}"
    assert 0 < redis_client.ttl(key) <= TTL_S

    hit, h = ask(c, NEAR)
    assert h["x-zerda-cache"] == "hit"
    entry_id, similarity = h["x-zerda-entry-id"], float(h["x-zerda-similarity"])
    assert similarity < 1 and hit.id.startswith("chatcmpl-zc") and hit.id != streamed_id
    assert h["x-zerda-completion-id"] == hit.id

    # negative feedback by the streamed miss's id: the entry it created
    before = arm(library, entry_id)
    resp = feedback(service, {"completion_id": streamed_id, "positive": False})
    assert resp.status_code == 200 and resp.json() == {"applied": True, "entry_id": entry_id}
    after_negative = arm(library, entry_id)
    assert after_negative[1] > before[1] and after_negative[0] == before[0]

    # positive feedback by the hit's id: the served entry, at the similarity it was
    # served at (a near match's positive signal lowers the entry's lowest positive bar)
    resp = feedback(service, {"completion_id": hit.id, "positive": True})
    assert resp.status_code == 200 and resp.json()["entry_id"] == entry_id
    after_positive = arm(library, entry_id)
    assert after_positive[0] > after_negative[0]
    assert library.storage.get_entry("acme", entry_id).min_positive_similarity == pytest.approx(
        similarity, abs=1e-5
    )
    stats = httpx.get(service.url + "/v1/stats", headers=service.headers("acme")).json()
    assert stats["positive"] == 1 and stats["negative"] == 1


def test_feedback_by_the_completion_id_of_a_plain_miss_and_a_streamed_hit(
    service: Service, library: CacheManager
) -> None:
    c = openai_client(service)
    miss, h = ask(c, QUESTION)
    assert h["x-zerda-cache"] == "miss" and miss.id == h["x-zerda-completion-id"]
    entry_id = h["x-zerda-entry-id"]
    _, chunks, h = ask_streaming(c, QUESTION)
    assert h["x-zerda-cache"] == "hit" and {ch.id for ch in chunks} == {h["x-zerda-completion-id"]}
    before = arm(library, entry_id)
    for completion_id in (miss.id, chunks[0].id):
        resp = feedback(service, {"completion_id": completion_id, "positive": False})
        assert resp.status_code == 200 and resp.json()["entry_id"] == entry_id
    assert arm(library, entry_id)[1] > before[1] + 1


def test_unknown_expired_or_another_tenants_completion_id_is_a_404(
    service: Service, redis_client: redis.Redis
) -> None:
    c = openai_client(service)
    mine, h = ask(c, QUESTION)
    key = f"zc:{{acme}}:cmp:{mine.id}"
    assert redis_client.exists(key)
    before = snapshot(redis_client)

    for body, tenant in [
        ({"completion_id": "chatcmpl-zc" + "0" * 24, "positive": False}, "acme"),  # unknown
        ({"completion_id": mine.id, "positive": False}, "globex"),  # acme's, not globex's
    ]:
        resp = feedback(service, body, tenant)
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["type"] == "not_found"
    assert snapshot(redis_client) == before  # nothing of acme's changed

    # an id that expired: Redis drops the key, and the id is unknown from then on
    redis_client.pexpire(key, 1)
    while redis_client.exists(key):
        pass
    resp = feedback(service, {"completion_id": mine.id, "positive": True})
    assert resp.status_code == 404 and "expired" in resp.json()["error"]["message"]

    # an answer that was not cached (a bypass) maps no id: a 404 too
    bypass, h = ask(c, QUESTION, n=2)
    assert h["x-zerda-cache"] == "bypass" and "x-zerda-completion-id" not in h
    assert feedback(service, {"completion_id": bypass.id, "positive": True}).status_code == 404

    # one of entry_id and completion_id, and a completion id of plain characters
    for body in (
        {"positive": True},
        {
            "entry_id": "0" * 32,
            "completion_id": mine.id,
            "positive": True,
        },
        {"completion_id": "chatcmpl {acme}", "positive": True},
        {"completion_id": "x" * 129, "positive": True},
        {"completion_id": 7, "positive": True},
    ):
        resp = feedback(service, body)
        assert resp.status_code == 422, (body, resp.text)


def test_hits_report_the_saved_usage_and_a_wrong_hit_counts_against_the_savings(
    service: Service, library: CacheManager
) -> None:
    """A miss stores the upstream's usage with its answer; a hit reports those tokens,
    marked as served from cache, and counts them saved; feedback by a hit's completion
    id that says it was wrong counts that call bought after all."""
    c = openai_client(service)
    messages = [{"role": "user", "content": QUESTION}]
    miss = c.chat.completions.with_raw_response.create(model="gpt-test", messages=messages)
    assert miss.headers["x-zerda-cache"] == "miss"
    entry = library.storage.get_entry("acme", miss.headers["x-zerda-entry-id"])
    assert entry.usage is not None and (
        entry.usage.prompt_tokens,
        entry.usage.completion_tokens,
    ) == (5, 7)
    raw = c.chat.completions.with_raw_response.create(model="gpt-test", messages=messages)
    assert raw.headers["x-zerda-cache"] == "hit"
    usage = raw.parse().usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (5, 7)
    assert usage.model_extra["zerda_cache"]["served_from_cache"] is True
    wrong = feedback(
        service, {"completion_id": raw.headers["x-zerda-completion-id"], "positive": False}
    )
    assert wrong.status_code == 200
    # a miss's completion id judged wrong is the LLM's answer, not a wrong hit
    fine = feedback(
        service, {"completion_id": miss.headers["x-zerda-completion-id"], "positive": False}
    )
    assert fine.status_code == 200
    savings = library.stats("acme")["savings"]  # (the hit script counted the hit's saving)
    model = entry.usage.model
    assert savings[model]["wrong_calls"] == 1 and savings[model]["wrong_prompt_tokens"] == 5


def test_a_wrong_hit_is_counted_once_however_often_its_completion_id_is_sent(
    service: Service, library: CacheManager
) -> None:
    """One hit and four negatives by its completion id: one wrong call, net zero; a
    second hit judged wrong counts apart. The saving is counted as the hit is served,
    so the net is never below zero, whichever replica reads it and when."""
    c = openai_client(service)
    messages = [{"role": "user", "content": QUESTION}]
    c.chat.completions.create(model="gpt-test", messages=messages)  # the miss stores it
    ids = []
    for _ in range(2):
        raw = c.chat.completions.with_raw_response.create(model="gpt-test", messages=messages)
        assert raw.headers["x-zerda-cache"] == "hit"
        ids.append(raw.headers["x-zerda-completion-id"])
    for _ in range(4):
        wrong = feedback(service, {"completion_id": ids[0], "positive": False})
        assert wrong.status_code == 200, wrong.text
    (model,) = [m for m in library.stats("acme")["savings"] if m != "*"]
    savings = library.stats("acme")["savings"][model]
    assert (savings["calls"], savings["wrong_calls"], savings["net_calls"]) == (2, 1, 1)
    for _ in range(3):
        feedback(service, {"completion_id": ids[1], "positive": False})
    savings = library.stats("acme")["savings"][model]
    assert (savings["calls"], savings["wrong_calls"], savings["net_calls"]) == (2, 2, 0)
