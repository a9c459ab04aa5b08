"""Coalesced misses: concurrent identical misses of one tenant and scope make one upstream
call, across service replicas sharing a Redis (a lease in Redis), streaming requests
included; a waiter whose leader never finishes goes upstream itself after the wait's
timeout, and a lease whose holder died is taken over.

The canned upstream holds its first call until the test releases it, once every request
has missed (the replicas' lookup counters say so): the others are then certainly
waiting on the lease, whatever the machine's speed."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import redis
from service_support import (
    Service,
    ThreadedServer,
    UpstreamState,
    ask,
    ask_streaming,
    openai_client,
    running_service,
    upstream_app,
)

from zerda_cache.service import ServiceSettings
from zerda_cache.service.chat import chat_scope
from zerda_cache.service.coordination import CoalesceSettings
from zerda_cache.storage.codec import query_digest
from zerda_cache.storage.keys import tenant_keys

QUESTION = "What changed in the new release?"
ANSWER = f"answer to: {QUESTION}"


@pytest.fixture
def upstream() -> Iterator[tuple[str, UpstreamState]]:
    state = UpstreamState()
    with ThreadedServer(upstream_app(state)) as server:
        try:
            yield server.url + "/v1", state
        finally:
            state.release.set()  # never leave a held call behind


@contextlib.contextmanager
def replicas(
    redis_client: redis.Redis, redis_url: str, url: str, n: int, coalesce: CoalesceSettings
) -> Iterator[list[Service]]:
    """``n`` service replicas (their own managers, apps and servers) on one Redis."""
    settings = ServiceSettings(coalesce=coalesce)
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                running_service(redis_client, redis_url, upstream_url=url, settings=settings)
            )
            for _ in range(n)
        ]


def misses(services: list[Service]) -> float:
    """Lookups that missed, over the replicas (each replica's own registry)."""
    total = 0.0
    for svc in services:
        value = svc.registry.get_sample_value(
            "zerda_cache_lookups_total", {"tenant": "acme", "result": "miss"}
        )
        total += value or 0.0
    return total


def wait_until(condition: Callable[[], bool], futures: list[Future[Any]]) -> None:
    """Poll until ``condition`` holds; a request that failed meanwhile fails the test."""
    while not condition():
        for f in futures:
            if f.done() and f.exception() is not None:
                raise AssertionError("a request failed") from f.exception()
        threading.Event().wait(0.01)


@contextlib.contextmanager
def held(state: UpstreamState, workers: int = 1) -> Iterator[ThreadPoolExecutor]:
    """A thread pool for requests whose upstream call is held: released on the way out
    (a failed assertion must not leave the pool waiting for a held call forever)."""
    with ThreadPoolExecutor(workers) as pool:
        try:
            yield pool
        finally:
            state.release.set()


def lease_key(question: str, model: str = "gpt-test") -> str:
    body = {"model": model, "messages": [{"role": "user", "content": question}]}
    return tenant_keys("acme").in_flight(query_digest(question, chat_scope(body)))


def test_16_concurrent_identical_requests_over_2_replicas_make_1_upstream_call(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    url, state = upstream
    state.hold_first = 1
    # generous: a loaded machine must not let a waiter give up or a marker lapse
    coalesce = CoalesceSettings(wait_s=120.0, finished_s=60.0)
    with replicas(redis_client, redis_url, url, 2, coalesce) as services:
        clients = [openai_client(svc) for svc in services]

        def one(i: int) -> tuple[str, Any]:
            c = clients[i % 2]
            if i % 4 < 2:  # half of them stream
                text, _, headers = ask_streaming(c, QUESTION)
                return text, headers
            completion, headers = ask(c, QUESTION)
            return completion.choices[0].message.content, headers

        with held(state, 16) as pool:
            futures = [pool.submit(one, i) for i in range(16)]
            wait_until(lambda: misses(services) >= 16 and state.chat_calls() >= 1, futures)
            state.release.set()
            results = [f.result(timeout=120) for f in futures]
        for c in clients:
            c.close()

    assert state.chat_calls() == 1
    assert [text for text, _ in results] == [ANSWER] * 16
    kinds = sorted(h["x-zerda-cache"] for _, h in results)
    assert kinds == ["hit"] * 15 + ["miss"]  # the leader's miss, served to the others
    waited = [h for _, h in results if h["x-zerda-cache"] == "hit"]
    assert all(h["x-zerda-coalesced"] == "waited" for h in waited)
    # every one of them carries a completion id of its own, mapped for feedback
    ids = {h["x-zerda-completion-id"] for _, h in results}
    assert len(ids) == 16
    assert all(redis_client.exists(f"zc:{{acme}}:cmp:{cid}") for cid in ids)
    assert (
        not redis_client.exists(lease_key(QUESTION))
        or redis_client.get(lease_key(QUESTION)) == b"=stored"
    )


def test_a_waiter_whose_leader_hangs_goes_upstream_after_the_timeout(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    url, state = upstream
    state.hold_first = 1  # the leader's upstream call hangs
    coalesce = CoalesceSettings(wait_s=0.2)
    with (
        replicas(redis_client, redis_url, url, 2, coalesce) as (first, second),
        openai_client(first) as a,
        openai_client(second) as b,
        held(state) as pool,
    ):
        leader = pool.submit(ask, a, QUESTION)
        wait_until(lambda: state.chat_calls() == 1, [leader])  # holding the lease
        completion, h = ask(b, QUESTION)  # waits 0.2 s, then makes its own call
        assert completion.choices[0].message.content == ANSWER
        assert h["x-zerda-cache"] == "miss" and h["x-zerda-coalesced"] == "timeout"
        text, _, h = ask_streaming(b, QUESTION, extra_headers={"X-Zerda-Scope": "s"})
        assert h["x-zerda-cache"] == "miss" and "x-zerda-coalesced" not in h  # no lease
        assert not leader.done() and state.chat_calls() == 3
        state.release.set()
        _, h = leader.result(timeout=60)
        assert h["x-zerda-cache"] == "miss"
    assert text == ANSWER


def test_a_lease_whose_holder_died_times_out_or_is_taken_over(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    """A leader in another process that died: its lease stays until it expires. A waiter
    gives up at its timeout; once the lease has lapsed, the next waiter takes it."""
    url, state = upstream
    with replicas(redis_client, redis_url, url, 1, CoalesceSettings(wait_s=0.2)) as (svc,):
        c = openai_client(svc)
        key = lease_key(QUESTION)
        redis_client.set(key, "f" * 32, px=600_000)  # a dead replica's lease
        completion, h = ask(c, QUESTION)
        assert h["x-zerda-coalesced"] == "timeout" and state.chat_calls() == 1
        assert completion.choices[0].message.content == ANSWER
        text, _, h = ask_streaming(c, "A streamed question")  # a free lease: it leads
        assert "x-zerda-coalesced" not in h and text == "answer to: A streamed question"
        # streamed waiters time out the same way
        redis_client.set(lease_key("Third question"), "f" * 32, px=600_000)
        text, _, h = ask_streaming(c, "Third question")
        assert h["x-zerda-coalesced"] == "timeout" and text == "answer to: Third question"
        assert redis_client.get(lease_key("Third question")) == b"f" * 32  # not its to take
        c.close()

    with replicas(redis_client, redis_url, url, 1, CoalesceSettings(wait_s=120.0)) as (svc,):
        c = openai_client(svc)
        key = lease_key("Fourth question")
        redis_client.set(key, "f" * 32, px=300)  # lapses while the request waits
        _, h = ask(c, "Fourth question")
        assert h["x-zerda-coalesced"] == "took-over" and h["x-zerda-cache"] == "miss"
        assert redis_client.get(key) == b"=stored"  # it led, and finished
        assert state.chat_calls() == 4
        c.close()


def test_waiters_go_upstream_themselves_when_the_leaders_answer_is_not_cached(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    """A truncated answer (``max_tokens=1``: ``finish_reason`` length) is not cached:
    the waiters do not queue behind one another, each makes its own call at once."""
    url, state = upstream
    state.hold_first = 1
    with replicas(redis_client, redis_url, url, 2, CoalesceSettings(wait_s=120.0)) as services:
        clients = [openai_client(svc) for svc in services]
        with held(state, 4) as pool:
            futures = [pool.submit(ask, clients[i % 2], QUESTION, max_tokens=1) for i in range(4)]
            wait_until(lambda: misses(services) >= 4 and state.chat_calls() >= 1, futures)
            state.release.set()
            results = [f.result(timeout=120) for f in futures]
        for c in clients:
            c.close()
    assert state.chat_calls() == 4
    how = sorted(h.get("x-zerda-coalesced", "led") for _, h in results)
    assert how == ["led", "passed", "passed", "passed"]
    assert all(h["x-zerda-cache"] == "miss" for _, h in results)


def test_no_cache_and_coalescing_off_never_wait(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    url, state = upstream
    key = lease_key(QUESTION)
    with replicas(redis_client, redis_url, url, 1, CoalesceSettings(wait_s=120.0)) as (svc,):
        c = openai_client(svc)
        redis_client.set(key, "f" * 32, px=600_000)  # a lease nobody will finish
        _, h = ask(c, QUESTION, extra_headers={"Cache-Control": "no-cache"})
        assert h["x-zerda-cache"] == "miss" and "x-zerda-coalesced" not in h
        c.close()
    other = lease_key("Another question")
    redis_client.set(other, "f" * 32, px=600_000)
    with replicas(redis_client, redis_url, url, 1, CoalesceSettings(enabled=False)) as (svc,):
        c = openai_client(svc)
        _, h = ask(c, "Another question")
        assert h["x-zerda-cache"] == "miss" and "x-zerda-coalesced" not in h
        c.close()
    assert state.chat_calls() == 2
    assert redis_client.get(key) == redis_client.get(other) == b"f" * 32
