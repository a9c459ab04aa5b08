"""CacheManager and AsyncCacheManager against real servers."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import redis
from conftest import Blocking, Clock, close_loop, near, unit
from prometheus_client import CollectorRegistry

from zerda_cache import (
    AsyncCacheManager,
    CacheConfig,
    CacheManager,
    DimensionMismatchError,
    EntryNotFoundError,
    FeedbackSignal,
    InvalidEmbeddingError,
    InvalidEntryError,
    InvalidFeedbackError,
    InvalidTenantError,
    RLConfig,
    ZerdaError,
)
from zerda_cache.core.errors import StorageError
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage.connect import HEALTH_CHECK_INTERVAL_S, connect
from zerda_cache.storage.keys import tenant_keys

DIM = 16


def snapshot(client: redis.Redis) -> dict[bytes, bytes]:
    return {k: client.dump(k) for k in sorted(client.keys("*"))}


def metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    value = reg.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def manager(make_manager: Any, registry: CollectorRegistry) -> Any:
    """A manager of each flavour (``flavour``: sync, async), on a flushed server."""
    cfg = CacheConfig(similarity_threshold=0.8, max_response_bytes=2_000)
    return make_manager(cfg, metrics=ReplicaMetrics(registry))


# --- the basic path ---------------------------------------------------------------------------
def test_put_then_lookup_hit_and_miss(manager: Any, registry: CollectorRegistry) -> None:
    v = unit(1)
    assert manager.lookup("How do I reset my password?", tenant="acme", embedding=v) is None
    res = manager.put(
        "How do I reset my password?",
        "Settings > Security.",
        tenant="acme",
        embedding=v,
        metadata={"model": "m1"},
    )
    assert res and res.entry_id and res.reason is None
    hit = manager.lookup("how to reset password", tenant="acme", embedding=near(v, 0.9))
    assert hit is not None and hit.entry_id == res.entry_id
    assert hit.response == "Settings > Security." and hit.metadata == {"model": "m1"}
    # float16 storage (the default) moves a cosine by ~1e-4 at most at this dimension
    assert hit.similarity == pytest.approx(0.9, abs=1e-3) and not hit.exact
    assert 0 < hit.score <= 1 and hit.expected_reward == 0.5
    assert manager.lookup("unrelated", tenant="acme", embedding=near(v, 0.5)) is None
    s = manager.stats("acme")
    assert (s["hits"], s["misses"], s["puts"], s["entries"]) == (1, 2, 1, 1)
    assert s["hit_rate"] == pytest.approx(1 / 3)
    assert metric(registry, "zerda_cache_lookups_total", tenant="acme", result="hit") == 1
    assert metric(registry, "zerda_cache_lookups_total", tenant="acme", result="miss") == 2


def test_feedback_on_a_fresh_answer_judges_it_before_it_is_served(
    make_manager: Any, registry: CollectorRegistry
) -> None:
    """The user's reaction to the LLM's answer (a miss) goes to the entry just cached: a
    wrong one is never served from the cache, and its similarity bar is not touched."""
    cfg = CacheConfig(similarity_threshold=0.8, rl=RLConfig(min_reward_to_serve=0.4))
    m = make_manager(cfg, metrics=ReplicaMetrics(registry))
    v = unit(7)
    res = m.put("What is the capital of Australia?", "Sydney.", tenant="geo", embedding=v)
    signal = res.feedback(False)
    assert (signal.entry_id, signal.tenant_id, signal.similarity) == (res.entry_id, "geo", 1.0)
    m.feedback(signal)
    assert m.lookup("capital of australia", tenant="geo", embedding=near(v, 0.95)) is None
    entry = m.storage.get_entry("geo", res.entry_id or "", with_vector=False)
    assert (entry.bandit_arm.beta, entry.similarity_bar) == (2.0, 0.0)
    refused = m.put("empty?", "", tenant="geo", embedding=unit(8))
    with pytest.raises(ValueError, match="nothing was stored"):
        refused.feedback(True)


def test_threshold_is_cosine_higher_is_stricter(
    make_manager: Any, registry: CollectorRegistry
) -> None:
    v = unit(2)
    loose = make_manager(CacheConfig(similarity_threshold=0.7), metrics=ReplicaMetrics(registry))
    strict = make_manager(CacheConfig(similarity_threshold=0.95))
    loose.put("q", "a", tenant="t", embedding=v)
    assert loose.lookup("q2", tenant="t", embedding=near(v, 0.9)) is not None
    assert strict.lookup("q2", tenant="t", embedding=near(v, 0.9)) is None
    assert strict.lookup("q3", tenant="t", embedding=near(v, 0.96)) is not None


def test_exact_fast_path_needs_no_embedding(manager: Any) -> None:
    manager.put("What is Redis?", "A server.", tenant="acme", embedding=unit(3))
    hit = manager.lookup("  what IS redis? ", tenant="acme")
    assert hit is not None and hit.exact and hit.similarity == 1.0


def test_embed_fn_is_memoised(make_manager: Any) -> None:
    calls: list[str] = []

    def embed(text: str) -> np.ndarray:
        calls.append(text)
        return unit(len(text))

    m = make_manager(embed_fn=embed)
    m.put("hello", "world", tenant="t")
    assert m.lookup("hello", tenant="t") is not None
    assert m.lookup("hello", tenant="t") is not None
    assert calls == ["hello"]
    assert m.embeddings.stats["hits"] == 2


def test_scopes_keep_answers_apart(manager: Any) -> None:
    v = unit(4)
    en = manager.put("Summarise X", "English summary", tenant="t", embedding=v, scope="en")
    tr = manager.put("Summarise X", "Türkçe özet", tenant="t", embedding=v, scope="tr")
    assert en.entry_id != tr.entry_id and tr.replaced_id is None
    assert manager.lookup("Summarise X", tenant="t", embedding=v, scope="en").response == (  # type: ignore[union-attr]
        "English summary"
    )
    assert manager.lookup("Summarise X", tenant="t", embedding=v, scope="tr").response == (  # type: ignore[union-attr]
        "Türkçe özet"
    )
    assert manager.lookup("Summarise X", tenant="t", embedding=v) is None  # default scope ""


def test_same_question_replaces_and_dedup_option(make_manager: Any) -> None:
    plain = make_manager()
    first = plain.put("Q?", "old", tenant="t", embedding=unit(5))
    second = plain.put("q?", "new", tenant="t", embedding=unit(5))
    assert second.replaced_id == first.entry_id and plain.stats("t")["entries"] == 1
    assert plain.stats("t")["evicted:replaced"] == 1
    plain.put("other words", "near copy", tenant="t", embedding=near(unit(5), 0.99))
    assert plain.stats("t")["entries"] == 2  # no dedup by default

    dedup = make_manager(
        CacheConfig(dedup_threshold=0.98), metrics=ReplicaMetrics(CollectorRegistry())
    )
    res = dedup.put("yet other words", "newest", tenant="t", embedding=near(unit(5), 0.995, 7))
    assert res.replaced_id is not None and dedup.stats("t")["entries"] == 2


def test_admission_check_refuses_and_says_why(
    redis_client: redis.Redis, registry: CollectorRegistry, make_manager: Any
) -> None:
    def no_secrets(query: str, response: str, metadata: Any) -> tuple[bool, list[str]]:
        if "password=" in response:
            return False, ["answer contains a credential"]
        return True, ["long answer"] if len(response) > 10 else []

    m = make_manager(admission=no_secrets, metrics=ReplicaMetrics(registry))
    before = snapshot(redis_client)
    res = m.put("q", "password=hunter2", tenant="t", embedding=unit(6))
    assert not res and res.reason == "answer contains a credential" and res.entry_id is None
    assert snapshot(redis_client) == before
    ok = m.put("q", "a fine long answer", tenant="t", embedding=unit(6))
    assert ok and ok.warnings == ("long answer",)
    assert (
        metric(registry, "zerda_cache_puts_rejected_total", reason="answer_contains_a_credential")
        == 1
    )
    default = make_manager()
    refused = default.put("q", "   ", tenant="t", embedding=unit(6))  # the ContextGuard
    assert not refused and refused.reason is not None and "empty" in refused.reason


def test_expired_entries_are_not_served(make_manager: Any) -> None:
    clock = Clock()
    m = make_manager(clock=clock)
    m.put("q", "a", tenant="t", embedding=unit(8), ttl_s=60)
    clock.t += 59
    assert m.lookup("q", tenant="t", embedding=unit(8)) is not None
    clock.t += 2
    assert m.lookup("q", tenant="t", embedding=unit(8)) is None


def test_ttl_refresh_on_hit_is_an_option(make_manager: Any) -> None:
    clock = Clock()
    m = make_manager(CacheConfig(refresh_ttl_on_hit=True), clock=clock)
    m.put("q", "a", tenant="t", embedding=unit(8), ttl_s=60)
    for _ in range(3):
        clock.t += 50
        assert m.lookup("q", tenant="t", embedding=unit(8)) is not None


def test_invalidate_and_clear(manager: Any) -> None:
    a = manager.put("a", "A", tenant="t", embedding=unit(10)).entry_id
    manager.put("b", "B", tenant="t", embedding=unit(11))
    assert a is not None and manager.invalidate(a, tenant="t")
    assert not manager.invalidate(a, tenant="t")
    assert manager.lookup("a", tenant="t", embedding=unit(10)) is None
    assert manager.clear("t") == 1
    assert manager.stats("t")["entries"] == 0
    assert manager.lookup("b", tenant="t", embedding=unit(11)) is None
    # the tenant's dimension is reset too
    assert manager.put("c", "C", tenant="t", embedding=unit(12, dim=8))


# --- learning ------------------------------------------------------------------------------
@pytest.mark.slow
def test_liked_candidate_wins_and_seeded_lookups_reproduce(
    redis_client: redis.Redis, make_manager: Any
) -> None:
    def run() -> list[str]:
        redis_client.flushall()
        clock = Clock()
        m = make_manager(
            CacheConfig(rl=RLConfig(seed=11)),
            clock=clock,
            metrics=ReplicaMetrics(CollectorRegistry()),
        )
        v = unit(20)
        plain = m.put("plain question", "plain", tenant="t", embedding=v).entry_id
        clock.t += 1
        liked = m.put("liked question", "liked", tenant="t", embedding=v).entry_id
        assert plain and liked
        for _ in range(20):
            m.feedback(FeedbackSignal(liked, "t", True))
        out = []
        for _ in range(1000):
            hit = m.lookup("a third phrasing", tenant="t", embedding=v)
            assert hit is not None
            out.append(hit.response)
        return out

    first = run()
    assert first.count("liked") >= 950
    assert run() == first


def test_the_exact_question_gets_its_own_answer(make_manager: Any) -> None:
    """Python and Java questions 0.9 apart: asking either exactly (or a near-copy of it)
    always serves its own answer, with default settings, until feedback takes that answer
    out of service."""
    m = make_manager()
    py = unit(60, dim=384)  # many dimensions: a near-copy of py stays ~0.87 from java
    java = near(py, 0.9, seed=61)
    p = m.put("How do I learn Python?", "Start with the tutorial.", tenant="t", embedding=py)
    j = m.put("How do I learn Java?", "Start with the JDK docs.", tenant="t", embedding=java)
    for i in range(200):
        hit = m.lookup("How do I learn Python?", tenant="t", embedding=py)
        assert hit is not None and hit.entry_id == p.entry_id and hit.exact
        copy = m.lookup(f"how to learn python {i}", tenant="t", embedding=near(py, 0.97, 1000 + i))
        assert copy is not None and copy.entry_id == p.entry_id
        hit = m.lookup("How do I learn Java?", tenant="t", embedding=java)
        assert hit is not None and hit.entry_id == j.entry_id
    for _ in range(25):  # below the serving bar: the other answer is the best one left
        m.feedback(FeedbackSignal(p.entry_id, "t", False))
    hit = m.lookup("How do I learn Python?", tenant="t", embedding=py)
    assert hit is not None and hit.entry_id == j.entry_id and not hit.exact


def test_negative_feedback_stops_serving(manager: Any) -> None:
    v = unit(30)
    bad = manager.put("q bad", "wrong answer", tenant="t", embedding=v).entry_id
    good = manager.put("q good", "right answer", tenant="t", embedding=near(v, 0.95)).entry_id
    assert bad and good
    for _ in range(25):
        manager.feedback(FeedbackSignal(bad, "t", False))
    for _ in range(50):
        hit = manager.lookup("q", tenant="t", embedding=v)
        assert hit is not None and hit.entry_id == good
    manager.invalidate(good, tenant="t")
    assert manager.lookup("q", tenant="t", embedding=v) is None  # below min_reward_to_keep


# --- bad input ---------------------------------------------------------------------------------
BAD: dict[str, tuple[Any, type[Exception]]] = {
    "wrong dimension": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=unit(1, DIM + 2)),
        DimensionMismatchError,
    ),
    "wrong dimension lookup": (
        lambda m: m.lookup("q2", tenant="acme", embedding=unit(1, DIM + 2)),
        DimensionMismatchError,
    ),
    "NaN embedding": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=[math.nan] * DIM),
        InvalidEmbeddingError,
    ),
    "NaN lookup": (
        lambda m: m.lookup("q2", tenant="acme", embedding=[math.nan] * DIM),
        InvalidEmbeddingError,
    ),
    "no embedding": (lambda m: m.put("q2", "a", tenant="acme"), InvalidEmbeddingError),
    "empty query": (lambda m: m.put("", "a", tenant="acme", embedding=unit(1)), InvalidEntryError),
    "empty query lookup": (
        lambda m: m.lookup(" ", tenant="acme", embedding=unit(1)),
        InvalidEntryError,
    ),
    "oversized answer": (
        lambda m: m.put("q2", "x" * 2_001, tenant="acme", embedding=unit(1)),
        InvalidEntryError,
    ),
    "unknown entry": (
        lambda m: m.feedback(FeedbackSignal("0" * 32, "acme", True)),
        EntryNotFoundError,
    ),
    "other tenant's entry": (
        lambda m: m.feedback(FeedbackSignal(m._eid, "other", True)),
        EntryNotFoundError,
    ),
    "non-str metadata key": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=unit(1), metadata={3: "x"}),
        InvalidEntryError,
    ),
    "unserialisable metadata": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=unit(1), metadata={"x": {1, 2}}),
        InvalidEntryError,
    ),
    "bad tenant": (lambda m: m.lookup("q", tenant="a:b", embedding=unit(1)), InvalidTenantError),
    "bad tenant put": (
        lambda m: m.put("q", "a", tenant="{x}", embedding=unit(1)),
        InvalidTenantError,
    ),
    "not a signal": (lambda m: m.feedback(("id", True)), InvalidFeedbackError),
    "None signal": (lambda m: m.feedback(None), InvalidFeedbackError),
    "huge magnitude": (
        lambda m: m.feedback(FeedbackSignal(m._eid, "acme", True, magnitude=1e308)),
        InvalidFeedbackError,
    ),
    "surrogate source": (
        lambda m: m.feedback(FeedbackSignal(m._eid, "acme", True, source="u\udc80")),
        InvalidFeedbackError,
    ),
    "surrogate query": (
        lambda m: m.put("q\ud800", "a", tenant="acme", embedding=unit(1)),
        InvalidEntryError,
    ),
    "surrogate query lookup": (
        lambda m: m.lookup("q\ud800", tenant="acme", embedding=unit(1)),
        InvalidEntryError,
    ),
    "surrogate response": (
        lambda m: m.put("q2", "a\udfff", tenant="acme", embedding=unit(1)),
        InvalidEntryError,
    ),
    "surrogate metadata key": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=unit(1), metadata={"\udc80": 1}),
        InvalidEntryError,
    ),
    "surrogate metadata value": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=unit(1), metadata={"k": ["\udc80"]}),
        InvalidEntryError,
    ),
    "surrogate scope": (
        lambda m: m.lookup("q", tenant="acme", embedding=unit(1), scope="\udc80"),
        InvalidEntryError,
    ),
    "invalidate None": (lambda m: m.invalidate(None, tenant="acme"), InvalidEntryError),
    "invalidate int": (lambda m: m.invalidate(123, tenant="acme"), InvalidEntryError),
    "complex embedding": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=unit(1) + 1j),
        InvalidEmbeddingError,
    ),
    "bool embedding": (
        lambda m: m.lookup("q2", tenant="acme", embedding=[True] * DIM),
        InvalidEmbeddingError,
    ),
    "string embedding": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=["0.5"] * DIM),
        InvalidEmbeddingError,
    ),
    "ragged embedding": (
        lambda m: m.put("q2", "a", tenant="acme", embedding=[[1.0], [1.0, 2.0]]),
        InvalidEmbeddingError,
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input(case: str, manager: Any, redis_client: redis.Redis) -> None:
    res = manager.put("q", "a", tenant="acme", embedding=unit(1))
    manager.lookup("q", tenant="acme", embedding=unit(1))
    manager._eid = res.entry_id  # type: ignore[attr-defined]
    call, exc = BAD[case]
    before = snapshot(redis_client)
    with pytest.raises(exc) as raised:
        call(manager)
    assert isinstance(raised.value, ZerdaError)  # typed: one except clause catches them all
    assert snapshot(redis_client) == before


# --- fail-open -----------------------------------------------------------------------------------
def test_fail_open_and_recovery(
    redis_server_factory: Any, make_manager: Any, registry: CollectorRegistry
) -> None:
    server = redis_server_factory()
    m = make_manager(
        CacheConfig(redis_timeout_s=0.5),
        url=server.url,
        from_url=True,
        metrics=ReplicaMetrics(registry),
    )
    v = unit(40)
    m.put("q", "a", tenant="t", embedding=v)
    assert m.lookup("q", tenant="t", embedding=v) is not None
    server.stop()
    started = time.monotonic()
    assert m.lookup("q", tenant="t", embedding=v) is None
    assert m.lookup("q", tenant="t", embedding=v) is None
    assert time.monotonic() - started < 4 * 0.5  # two lookups, each bounded by the timeout
    assert metric(registry, "zerda_cache_fail_open_total", tenant="t") == 2
    with pytest.raises(StorageError, match="failed"):
        m.put("q", "a", tenant="t", embedding=v)  # writes raise StorageError
    server.restart()  # same port, empty (no persistence)
    m.put("q", "a again", tenant="t", embedding=v)
    hit = m.lookup("q", tenant="t", embedding=v)
    assert hit is not None and hit.response == "a again"
    assert m.clear("t") == 1


@pytest.mark.slow
def test_fail_open_when_redis_is_slow(
    redis_server_factory: Any, make_manager: Any, registry: CollectorRegistry
) -> None:
    server = redis_server_factory()
    m = make_manager(
        CacheConfig(redis_timeout_s=0.3),
        url=server.url,
        from_url=True,
        metrics=ReplicaMetrics(registry),
    )
    v = unit(41)
    m.put("q", "a", tenant="t", embedding=v)
    admin = server.client()
    admin.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    try:
        assert m.lookup("q", tenant="t", embedding=v) is None
        assert metric(registry, "zerda_cache_fail_open_total", tenant="t") >= 1
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
    time.sleep(0.1)
    assert m.lookup("q", tenant="t", embedding=v) is not None


# --- sync and async agree ------------------------------------------------------------------------
def _sequence() -> list[tuple[str, Any]]:
    ops: list[tuple[str, Any]] = []
    for i in range(12):
        ops.append(("put", (f"question {i}", f"answer {i}", unit(100 + i % 6), f"s{i % 2}")))
    for i in range(40):
        ops.append(("lookup", (f"ask {i}", near(unit(100 + i % 6), 0.97, i), f"s{i % 2}")))
        if i % 3 == 0:
            ops.append(("feedback", (i % 2 == 0, 1.0 + i % 3)))
    return ops


def test_sync_and_async_give_the_same_results(redis_client: redis.Redis, redis_url: str) -> None:
    cfg = CacheConfig(similarity_threshold=0.8, rl=RLConfig(seed=5))
    loop = asyncio.new_event_loop()

    def run(flavour: str) -> list[Any]:
        clock = Clock()
        metrics = ReplicaMetrics(CollectorRegistry())
        if flavour == "sync":
            m: Any = CacheManager(
                redis.Redis.from_url(redis_url), cfg, clock=clock, metrics=metrics
            )
        else:
            client = redis.asyncio.Redis.from_url(redis_url)
            m = Blocking(AsyncCacheManager(client, cfg, clock=clock, metrics=metrics), loop)
        out: list[Any] = []
        last = None
        for op, args in _sequence():
            clock.t += 1.0
            if op == "put":
                q, r, v, s = args
                out.append(bool(m.put(q, r, tenant=flavour, embedding=v, scope=s)))
            elif op == "lookup":
                q, v, s = args
                last = m.lookup(q, tenant=flavour, embedding=v, scope=s)
                out.append(None if last is None else (last.response, round(last.score, 12)))
            elif last is not None:
                m.feedback(last.feedback(args[0], magnitude=args[1]))
        out.append(m.stats(flavour)["hits"])
        m.close()
        return out

    try:
        sync_out, async_out = run("sync"), run("async")
    finally:
        close_loop(loop)
    assert sync_out == async_out
    assert sum(1 for x in sync_out[:-1] if isinstance(x, tuple)) > 20  # it really served


# --- what each driver takes --------------------------------------------------------------------
def test_async_embed_fn_is_awaited(redis_url: str, redis_client: redis.Redis) -> None:
    calls: list[str] = []

    async def embed(text: str) -> np.ndarray:
        await asyncio.sleep(0)  # an HTTP embedding API, say
        calls.append(text)
        return unit(len(text))

    async def run() -> None:
        m = AsyncCacheManager(redis.asyncio.Redis.from_url(redis_url), embed_fn=embed)
        assert await m.put("hello", "world", tenant="t")
        hit = await m.lookup("hello", tenant="t")
        assert hit is not None and hit.response == "world"
        await m.aclose()

    asyncio.run(run())
    assert calls == ["hello"]  # memoised like a sync one


def test_sync_manager_refuses_async_parts(redis_url: str, redis_client: redis.Redis) -> None:
    async def embed(text: str) -> np.ndarray:
        return unit(1)

    m = CacheManager(redis.Redis.from_url(redis_url), embed_fn=embed)
    with pytest.raises(TypeError, match="AsyncCacheManager"):
        m.put("hello", "world", tenant="t")
    with pytest.raises(TypeError, match="AsyncCacheManager"):
        m.lookup("hello", tenant="t")
    m.close()
    wrong = CacheManager(redis.asyncio.Redis.from_url(redis_url))
    with pytest.raises(TypeError, match=r"redis\.asyncio"):
        wrong.put("hello", "world", tenant="t", embedding=unit(1))


def _options(client: Any, cluster: bool) -> tuple[Any, dict[str, Any]]:
    if cluster:
        return client.retry, client.nodes_manager.connection_kwargs
    kwargs = client.connection_pool.connection_kwargs
    return kwargs.get("retry") or client.get_retry(), kwargs


def _check_options(url: str, cluster: bool, asyncio_client: bool) -> None:
    """One quick retry and health checks, for plain and cluster clients of both flavours
    (the async cluster client used to get neither)."""
    cfg = CacheConfig(redis_timeout_s=0.25)
    client = connect(url, cfg, cluster=cluster, asyncio=asyncio_client)
    retry, kwargs = _options(client, cluster)
    assert retry is not None and retry._retries == 1
    # A timeout is never retried: the fail-open bound is one redis_timeout_s, not two.
    assert retry._supported_errors == (redis.exceptions.ConnectionError,)
    if asyncio_client or not cluster:  # redis-py's sync cluster client drops this option
        assert kwargs["health_check_interval"] == HEALTH_CHECK_INTERVAL_S
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.25
    if not asyncio_client:
        client.close()


@pytest.mark.parametrize("asyncio_client", [False, True], ids=["sync", "async"])
def test_plain_clients_of_both_flavours_get_the_same_options(asyncio_client: bool) -> None:
    _check_options("redis://127.0.0.1:1/0", False, asyncio_client)  # no connection made


@pytest.mark.parametrize("asyncio_client", [False, True], ids=["sync", "async"])
def test_cluster_clients_of_both_flavours_get_the_same_options(
    redis_cluster: Any, asyncio_client: bool
) -> None:
    _check_options(redis_cluster.url, True, asyncio_client)


# --- the branches where the two copies had drifted ---------------------------------------------
def test_a_trimmed_log_makes_a_reader_rebuild(
    make_manager: Any, registry: CollectorRegistry, redis_client: redis.Redis
) -> None:
    cfg = CacheConfig(index_log_maxlen=10)
    writer = make_manager(cfg)
    reader = make_manager(cfg, metrics=ReplicaMetrics(registry))
    writer.put("q0", "a0", tenant="t", embedding=unit(500))
    assert reader.sync_index("t") == 1
    rebuilds = metric(registry, "zerda_cache_index_rebuilds_total", tenant="t")
    for i in range(1, 400):  # far past the log's cap: the reader's position is trimmed away
        writer.put(f"q{i}", f"a{i}", tenant="t", embedding=unit(500 + i))
    # This lookup finds the position trimmed away and starts the rebuild; it waits for it
    # at most redis_timeout_s (a loaded machine may take longer: then it misses).
    reader.lookup("q7 again", tenant="t", embedding=near(unit(507), 0.97))
    reader.sync_index("t")
    hit = reader.lookup("q7 again", tenant="t", embedding=near(unit(507), 0.97))
    assert hit is not None and hit.response == "a7"
    assert metric(registry, "zerda_cache_index_rebuilds_total", tenant="t") == rebuilds + 1
    live = {m.decode() for m in redis_client.zrange(tenant_keys("t").ids, 0, -1)}
    assert len(live) == 400 and reader.index_ids("t") == live


@pytest.mark.parametrize("first", ["no near match", "a near match"])
def test_a_replica_more_than_a_batch_behind_catches_up_on_a_lookup(
    make_manager: Any, redis_client: redis.Redis, first: str
) -> None:
    """A lookup reads the log backwards from its newest event, ``PEEK_EVENTS`` at most:
    more events than that since the replica's position are read forward, in batches of
    ``CATCHUP_BATCH``, all of them. Whether the lookup's index finds nothing near (the
    peek is a command of the lookup's pipeline) or a near match (the hit script peeks)."""
    from zerda_cache.storage import RedisStorage
    from zerda_cache.storage.plans import CATCHUP_BATCH

    reader = make_manager()
    st = RedisStorage(redis_client, CacheConfig())  # the other replica's writes, pipelined
    reader.put("q0", "a0", tenant="t", embedding=unit(500))
    assert reader.sync_index("t") == 1
    calls = [
        st.plan_put("t", f"q{i}", f"a{i}", unit(500 + i), scope="")
        for i in range(1, CATCHUP_BATCH + 20)
    ]
    pipe = redis_client.pipeline(transaction=False)
    for c in calls:
        st.scripts.put(keys=c.keys, args=c.args, client=pipe)
    pipe.execute()
    if first == "a near match":  # q0, the one entry the index holds: the script peeks
        hit = reader.lookup("q0 again", tenant="t", embedding=near(unit(500), 0.97))
        assert hit is not None and hit.response == "a0"
        assert len(reader.index_ids("t")) == CATCHUP_BATCH + 20  # caught up by that lookup
    hit = reader.lookup("q3 again", tenant="t", embedding=near(unit(503), 0.97))
    assert hit is not None and hit.response == "a3"  # among the oldest of the new events
    live = {m.decode() for m in redis_client.zrange(tenant_keys("t").ids, 0, -1)}
    assert len(live) == CATCHUP_BATCH + 20 and reader.index_ids("t") == live


def test_a_lookup_is_served_after_the_servers_scripts_were_flushed(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """The common lookup sends its hit script's EVALSHA on its own: after SCRIPT FLUSH
    (or on a new server) the NOSCRIPT reply makes it load the script and run it."""
    m = make_manager()
    own = m.put("q1", "a1", tenant="t", embedding=unit(1)).entry_id
    hit = m.lookup("q1 rephrased", tenant="t", embedding=near(unit(1), 0.97))
    assert hit is not None and hit.entry_id == own
    import hashlib

    from zerda_cache.storage.scripts import script_source

    sha = hashlib.sha1(script_source("hit").encode()).hexdigest()
    redis_client.script_flush()
    assert redis_client.script_exists(sha) == [False]
    hit = m.lookup("q1 put otherwise", tenant="t", embedding=near(unit(1), 0.97))
    assert hit is not None and hit.entry_id == own and not hit.exact
    assert redis_client.script_exists(sha) == [True]  # loaded again by that lookup


def test_a_tenant_recreated_with_another_dimension_is_rebuilt(
    make_manager: Any, registry: CollectorRegistry
) -> None:
    old = make_manager(metrics=ReplicaMetrics(registry))
    admin = make_manager()
    old.put("q", "a 16-d answer", tenant="t", embedding=unit(1))
    assert old.lookup("q", tenant="t", embedding=unit(1)) is not None
    assert admin.clear("t") == 1
    res = admin.put("q8", "an 8-d answer", tenant="t", embedding=unit(2, dim=8))
    hit = old.lookup("q8 again", tenant="t", embedding=near(unit(2, dim=8), 0.97))
    assert hit is not None and hit.entry_id == res.entry_id  # no DimensionMismatchError
    assert old.sync_index("t") == 1
    with pytest.raises(DimensionMismatchError):
        old.lookup("q", tenant="t", embedding=unit(1))  # now 16-d is the wrong size


@pytest.mark.parametrize("puts_after_flush", [3, 30])
def test_ghosts_left_by_flushall_do_not_hide_live_entries(
    make_manager: Any, redis_client: redis.Redis, puts_after_flush: int
) -> None:
    """Ten entries close to a question, then FLUSHALL, then a new entry at 0.894: an old
    replica used to keep the ten ids and miss the new entry behind them for good. With a
    few puts after the flush, the log is seen to be re-created (fewer events ever added
    than this replica consumed) and the index rebuilt; with more, the ids the hit script
    reports gone are forgotten and the search runs again."""
    q = unit(700, dim=384)
    old, writer = make_manager(), make_manager()
    for i in range(10):
        writer.put(f"close {i}", f"old {i}", tenant="t", embedding=near(q, 0.95 + i / 250, 800 + i))
    assert old.sync_index("t") == 10
    redis_client.flushall()
    for i in range(puts_after_flush - 1):
        writer.put(f"other {i}", "x", tenant="t", embedding=unit(900 + i, dim=384))
    new = writer.put("the new one", "new", tenant="t", embedding=near(q, 0.894, 999))
    hit = old.lookup("a question", tenant="t", embedding=q)
    assert hit is not None and hit.entry_id == new.entry_id
    live = {m.decode() for m in redis_client.zrange(tenant_keys("t").ids, 0, -1)}
    if puts_after_flush == 3:
        assert old.index_ids("t") == live  # rebuilt
    assert len(old.index_ids("t") - live) <= 2  # the ghosts that took the top-k are gone


def test_dedup_put_catches_up_first(make_manager: Any) -> None:
    cfg = CacheConfig(dedup_threshold=0.98)
    a, b = make_manager(cfg), make_manager(cfg)
    first = a.put("one phrasing", "x", tenant="t", embedding=unit(9))
    b.sync_index("t")  # b's index is built before a's second put
    a.put("unrelated", "y", tenant="t", embedding=unit(10))
    res = b.put("other phrasing", "x2", tenant="t", embedding=near(unit(9), 0.99))
    assert res.replaced_id == first.entry_id
    assert b.stats("t")["entries"] == 2 and b.stats("t")["evicted:replaced"] == 1


# --- Redis Cluster -------------------------------------------------------------------------------
def test_manager_on_cluster(redis_cluster: Any, cluster_client: Any, make_manager: Any) -> None:
    url = redis_cluster.url
    # A first lookup waits for the index build at most redis_timeout_s, then serves exact
    # matches only: on a loaded machine 0.5 s was once too short for a cluster's first.
    cfg = CacheConfig(redis_timeout_s=5.0)
    a = make_manager(cfg, url=url, cluster=True)
    b = make_manager(cfg, url=url.replace("redis://", "redis+cluster://"), from_url=True)
    for tenant in ("t1", "t2", "tenant-three"):
        v = unit(len(tenant))
        res = a.put("q", f"answer for {tenant}", tenant=tenant, embedding=v)
        hit = b.lookup("q again", tenant=tenant, embedding=v)
        assert hit is not None and hit.entry_id == res.entry_id
        b.feedback(hit.feedback(True))
        assert a.stats(tenant)["positive"] == 1
        assert a.invalidate(hit.entry_id, tenant=tenant)
        assert b.lookup("q again", tenant=tenant, embedding=v) is None
    assert (
        len({cluster_client.keyslot(tenant_keys(t).ids) for t in ("t1", "t2", "tenant-three")}) >= 2
    )


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("usearch", "i8"), ("usearch", "f16"), ("usearch", "b1"), ("hnswlib", "i8")],
)
def test_large_scope_uses_hnsw_and_stays_consistent(
    redis_client: redis.Redis, backend: str, dtype: str, make_manager: Any
) -> None:
    cfg = CacheConfig(
        ann_threshold=260, similarity_threshold=0.9, ann_backend=backend, ann_dtype=dtype
    )
    writer = make_manager(cfg)
    reader = make_manager(cfg)
    ids = [
        writer.put(f"q{i}", f"a{i}", tenant="big", embedding=unit(1000 + i)).entry_id
        for i in range(300)
    ]
    reader.sync_index("big")  # the build's wait is bounded: a loaded machine may miss first
    hit = reader.lookup("q7 again", tenant="big", embedding=near(unit(1007), 0.97))
    assert hit is not None and hit.response == "a7"
    assert reader.indexes["big"].index.kind("") == "hnsw"  # type: ignore[union-attr]
    for eid in ids[:100]:
        assert eid is not None
        writer.invalidate(eid, tenant="big")
    assert reader.lookup("q7 again", tenant="big", embedding=near(unit(1007), 0.97)) is None
    hit = reader.lookup("q250 again", tenant="big", embedding=near(unit(1250), 0.97))
    assert hit is not None and hit.response == "a250"
    live = {m.decode() for m in redis_client.zrange(tenant_keys("big").ids, 0, -1)}
    assert reader.index_ids("big") == live


def test_a_replica_calibrates_the_search_width_of_the_index_it_builds(
    make_manager: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A built HNSW index measures the width it needs before lookups use it, and a
    lookup then finds near copies at that width (``index.CALIBRATE_FROM``)."""
    import zerda_cache.replica.ann as index_module

    monkeypatch.setattr(index_module, "CALIBRATE_FROM", 200)
    monkeypatch.setattr(index_module, "CALIBRATION_PROBES", 100)
    cfg = CacheConfig(ann_threshold=200, similarity_threshold=0.9)
    writer, reader = make_manager(cfg), make_manager(cfg)
    for i in range(300):
        writer.put(f"q{i}", f"a{i}", tenant="big", embedding=unit(2000 + i))
    with caplog.at_level(logging.INFO, logger="zerda_cache"):
        reader.sync_index("big")
    sub = reader.indexes["big"].index.sub("")  # type: ignore[union-attr]
    assert sub.calibrated is not None and sub.calibrated[0] == 300
    assert sub.search_width() == sub.calibrated[1] == cfg.ann_ef_search  # enough here
    assert any("search width" in r.getMessage() for r in caplog.records)
    hit = reader.lookup("q9 again", tenant="big", embedding=near(unit(2009), 0.97))
    assert hit is not None and hit.response == "a9"


def test_a_failed_calibration_leaves_the_index_in_use_at_the_configured_width(
    make_manager: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import zerda_cache.replica.scoped as index_module

    def broken(self: Any, k: int) -> Any:
        raise RuntimeError("calibration broke")

    monkeypatch.setattr(index_module.ScopedIndex, "calibrate", broken)
    cfg = CacheConfig(ann_threshold=200, similarity_threshold=0.9)
    writer, reader = make_manager(cfg), make_manager(cfg)
    for i in range(300):
        writer.put(f"q{i}", f"a{i}", tenant="big", embedding=unit(3000 + i))
    with caplog.at_level(logging.WARNING, logger="zerda_cache"):
        assert reader.sync_index("big") == 300
    assert "calibrating the index's search width failed" in caplog.text
    sub = reader.indexes["big"].index.sub("")  # type: ignore[union-attr]
    assert sub.calibrated is None and sub.search_width() == cfg.ann_ef_search
    hit = reader.lookup("q9 again", tenant="big", embedding=near(unit(3009), 0.97))
    assert hit is not None and hit.response == "a9"


def test_prompt_scope_keeps_guardrail_sets_apart(make_manager: Any) -> None:
    from zerda_cache.companions.prompt import OutputFormat, PromptRequest, prompt_scope

    m = make_manager()
    plain = PromptRequest(query="What is RAG?")
    cited = PromptRequest(query="What is RAG?", documents=["doc"], enable_citations=True)
    as_json = PromptRequest(query="What is RAG?", output_format=OutputFormat.JSON)
    scopes = {prompt_scope(r) for r in (plain, cited, as_json)}
    assert len(scopes) == 3
    v = unit(77)
    a = m.put(
        "What is RAG?",
        "Retrieval-augmented generation.",
        tenant="t",
        embedding=v,
        scope=prompt_scope(plain),
    )
    b = m.put(
        "What is RAG?",
        "RAG retrieves documents [Source: 1].",
        tenant="t",
        embedding=v,
        scope=prompt_scope(cited),
    )
    assert a.entry_id != b.entry_id and m.stats("t")["entries"] == 2  # two entries
    for _ in range(20):
        hit = m.lookup("What is RAG?", tenant="t", embedding=v, scope=prompt_scope(plain))
        assert hit is not None and hit.entry_id == a.entry_id
        hit = m.lookup("What is RAG?", tenant="t", embedding=v, scope=prompt_scope(cited))
        assert hit is not None and hit.entry_id == b.entry_id
    assert m.lookup("What is RAG?", tenant="t", embedding=v, scope=prompt_scope(as_json)) is None


def test_adaptive_windows_are_replica_metrics(make_manager: Any) -> None:
    registry = CollectorRegistry()
    m = make_manager(metrics=ReplicaMetrics(registry))
    m.put("q", "an answer", tenant="t", embedding=unit(5))
    m.put("q2", "  ", tenant="t", embedding=unit(6))  # refused by the guard
    for _ in range(3):
        m.lookup("q", tenant="t", embedding=unit(5))
    report = m.adaptive.get_performance_report()
    assert report["samples"] == 5 and report["guard_failure_rate"] == pytest.approx(0.2)
    assert metric(registry, "zerda_cache_replica_window_admission_failure_ratio") == (
        pytest.approx(0.2)
    )
    assert metric(registry, "zerda_cache_replica_window_candidates") > 0
    assert metric(registry, "zerda_cache_replica_window_answer_chars") > 0


def test_serving_bar_stops_an_unconfirmed_answer_after_one_negative(
    make_manager: Any,
) -> None:
    cfg = CacheConfig(rl=RLConfig(min_reward_to_serve=0.4, seed=3))
    m = make_manager(cfg)
    v, w = unit(90), unit(91)
    shaky = m.put("shaky", "unconfirmed answer", tenant="t", embedding=v).entry_id
    solid = m.put("solid", "confirmed answer", tenant="t", embedding=w).entry_id
    assert shaky and solid
    for _ in range(3):
        m.feedback(FeedbackSignal(solid, "t", True))
    m.feedback(FeedbackSignal(shaky, "t", False))  # Beta(1, 2): 0.33 < 0.4
    m.feedback(FeedbackSignal(solid, "t", False))  # Beta(4, 2): 0.67, still served
    assert m.lookup("shaky", tenant="t", embedding=v) is None
    hit = m.lookup("solid", tenant="t", embedding=w)
    assert hit is not None and hit.entry_id == solid
    # still cached (not evicted: min_reward_to_keep is 0.05), just not served
    assert m.stats("t")["entries"] == 2


def test_concurrent_lookups_build_once_and_agree(redis_client: redis.Redis, redis_url: str) -> None:
    """Many threads (sync) or tasks (asyncio) look up on a cold replica at once, while a
    writer puts: the tenant's index is built once under its flow lock, every lookup of a
    cached question gets its own answer, and the locks are free afterwards."""
    writer = CacheManager(redis_client, metrics=ReplicaMetrics(CollectorRegistry()))
    ids = [writer.put(f"q{i}", f"a{i}", tenant="t", embedding=unit(3000 + i)).entry_id
           for i in range(50)]  # fmt: skip

    def check(hits: list[Any]) -> None:
        assert all(h is not None and h.entry_id == ids[i % 50] for i, h in enumerate(hits))

    registry = CollectorRegistry()
    sync = CacheManager(redis.Redis.from_url(redis_url), metrics=ReplicaMetrics(registry))

    def ask(i: int) -> Any:
        return sync.lookup(f"q{i % 50}", tenant="t", embedding=unit(3000 + i % 50))

    with ThreadPoolExecutor(8) as pool:
        hits = list(pool.map(ask, range(200)))
    check(hits)
    assert metric(registry, "zerda_cache_index_rebuilds_total", tenant="t") == 1
    assert not sync.indexes["t"].lock.locked()
    sync.close()

    async def run() -> list[Any]:
        areg = CollectorRegistry()
        # from_url: its pool queues a burst of 200 for a connection (redis-py's default
        # asyncio pool refuses past 100), for up to redis_timeout_s: generous here, as
        # this test is about one build and right answers, not a latency budget on a
        # loaded machine (past it a lookup fails open: a miss)
        cfg = CacheConfig(redis_timeout_s=5.0)
        m = AsyncCacheManager.from_url(redis_url, cfg, metrics=ReplicaMetrics(areg))
        out = await asyncio.gather(*(
            m.lookup(f"q{i % 50}", tenant="t", embedding=unit(3000 + i % 50)) for i in range(200)
        ))  # fmt: skip
        assert metric(areg, "zerda_cache_index_rebuilds_total", tenant="t") == 1
        assert not m.indexes["t"].lock.locked()
        await m.aclose()
        return list(out)

    check(asyncio.run(run()))


def test_float16_vectors_are_served_to_every_replica_in_less_memory(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    half = make_manager()  # float16: the default
    full = make_manager(CacheConfig(vector_storage="float32"))
    v, w = unit(50, 384), unit(51, 384)
    small = half.put("q16", "a16", tenant="t", embedding=v)
    big = full.put("q32", "a32", tenant="t", embedding=w)
    keys = tenant_keys("t")
    raw16 = redis_client.hget(keys.entry(small.entry_id), "vec")
    assert raw16 is not None and len(raw16) == 769  # marked float16
    mem16 = redis_client.memory_usage(keys.entry(small.entry_id), samples=0)
    mem32 = redis_client.memory_usage(keys.entry(big.entry_id), samples=0)
    assert mem16 is not None and mem32 is not None and mem16 < 0.8 * mem32
    # A fresh replica of either storage builds its index from both kinds and serves both.
    for config in (CacheConfig(), CacheConfig(vector_storage="float32")):
        reader = make_manager(config)
        assert reader.sync_index("t") == 2
        hit = reader.lookup("near q16", tenant="t", embedding=near(v, 0.97))
        assert hit is not None and hit.entry_id == small.entry_id
        assert abs(hit.similarity - 0.97) < 2e-3
        hit = reader.lookup("near q32", tenant="t", embedding=near(w, 0.97))
        assert hit is not None and hit.entry_id == big.entry_id
    entry = full.storage.get_entry("t", small.entry_id, with_vector=True)
    assert entry.embedding is not None and float(entry.embedding @ v) > 1 - 1e-6


@pytest.mark.parametrize("why", ["marked_wrong", "expired"])
def test_unservable_neighbours_do_not_hide_a_real_match(make_manager: Any, why: str) -> None:
    """A real entry at cosine 0.93 behind ten entries at 0.995 that cannot be served
    (marked wrong once under ``min_reward_to_serve``, hidden for good since they are
    never evicted; or expired, hidden until the worker's next cycle): the window of
    ``top_k`` candidates held only those, and the lookup missed. It widens past them."""
    clock = Clock(1_000.0)
    cfg = CacheConfig(similarity_threshold=0.85, rl=RLConfig(min_reward_to_serve=0.4))
    m = make_manager(cfg, clock=clock)
    q = unit(1)
    real = m.put("the real question", "the real answer", tenant="t", embedding=near(q, 0.93))
    ttl = 5.0 if why == "expired" else None
    decoys = [
        m.put(f"decoy {i}", f"decoy answer {i}", tenant="t", embedding=near(q, 0.995, seed=100 + i),
              ttl_s=ttl).entry_id
        for i in range(10)
    ]  # fmt: skip
    assert cfg.top_k < len(decoys)
    if why == "marked_wrong":
        for eid in decoys:
            m.feedback(FeedbackSignal(eid, "t", False))
    else:
        clock.t += 10
    hit = m.lookup("asked another way", tenant="t", embedding=q)
    assert hit is not None and hit.entry_id == real.entry_id
    assert hit.similarity == pytest.approx(0.93, abs=1e-3)
