"""Hostile input from hypothesis: whatever a caller passes to the public API, the cache
raises a typed error (``ZerdaError``) or does its job, and never leaves a corrupt entry
in Redis (real server). The hand-written corpus is ``test_manager.test_bad_input``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from zerda_cache import CacheConfig, CacheManager, FeedbackSignal, ZerdaError
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import RedisStorage

DIM = 8
#: Every character, lone surrogates included (hypothesis leaves them out by default).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
TEXTS = st.one_of(ANY_TEXT, st.none(), st.integers(), st.binary(max_size=10), st.just(""))
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)
EMBEDDINGS = st.one_of(
    st.lists(FLOATS, min_size=0, max_size=DIM + 2),
    st.lists(st.integers(-(2**70), 2**70), min_size=DIM, max_size=DIM),
    st.lists(st.booleans(), min_size=DIM, max_size=DIM),
    st.lists(st.complex_numbers(), min_size=DIM, max_size=DIM),
    st.lists(ANY_TEXT, min_size=DIM, max_size=DIM),
    st.none(),
    ANY_TEXT,
    st.just(np.ones((2, DIM))),
)
METADATA = st.one_of(
    st.none(),
    st.dictionaries(
        st.one_of(ANY_TEXT, st.integers()),
        st.one_of(
            ANY_TEXT,
            FLOATS,
            st.integers(-(2**70), 2**70),
            st.binary(max_size=8),
            st.lists(st.integers(), max_size=3),
            st.none(),
        ),
        max_size=4,
    ),
    st.integers(),
    ANY_TEXT,
)
TENANTS = st.one_of(st.just("t"), ANY_TEXT, st.none(), st.integers())
SCOPES = st.one_of(st.none(), st.just(""), ANY_TEXT, st.integers())
NUMBERS = st.one_of(st.none(), FLOATS, st.integers(-(2**70), 2**70), ANY_TEXT, st.booleans())


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one call: a typed error is a fine answer, anything else untyped fails."""
    try:
        return fn(*args, **kwargs)
    except ZerdaError:
        return None


@pytest.fixture
def hostile(redis_client: redis.Redis) -> Any:
    m = CacheManager(redis_client, CacheConfig(), metrics=ReplicaMetrics(CollectorRegistry()))
    good = m.put("a fine question", "a fine answer", tenant="t", embedding=np.ones(DIM))
    yield m, good.entry_id
    m.close()


def no_corrupt_entry(m: CacheManager) -> None:
    st_ = m.storage
    for batch in st_.iter_ids("t"):
        for eid, _ in batch:
            entry = st_.get_entry("t", eid)  # raises CorruptEntryError if anything is off
            assert entry.embedding is not None and len(entry.embedding) == DIM
            assert math.isfinite(entry.bandit_arm.alpha) and math.isfinite(entry.bandit_arm.beta)
            assert 0 <= entry.confidence_score <= 1


HOSTILE = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@HOSTILE
@given(query=TEXTS, response=TEXTS, embedding=EMBEDDINGS, tenant=TENANTS, scope=SCOPES,
       metadata=METADATA, ttl=NUMBERS, quality=NUMBERS)  # fmt: skip
def test_hostile_puts_and_lookups(
    hostile: Any,
    query: Any,
    response: Any,
    embedding: Any,
    tenant: Any,
    scope: Any,
    metadata: Any,
    ttl: Any,
    quality: Any,
) -> None:
    m, _ = hostile
    call(
        m.put, query, response, tenant=tenant, embedding=embedding, scope=scope,
        metadata=metadata, ttl_s=ttl, quality=quality,
    )  # fmt: skip
    call(m.lookup, query, tenant=tenant, embedding=embedding, scope=scope)
    call(m.lookup, query, tenant=tenant, embedding=embedding, max_error_rate=quality)
    no_corrupt_entry(m)


@HOSTILE
@given(entry_id=TEXTS, tenant=TENANTS, positive=st.one_of(st.booleans(), NUMBERS),
       magnitude=NUMBERS, similarity=NUMBERS, source=TEXTS)  # fmt: skip
def test_hostile_feedback_and_invalidation(
    hostile: Any,
    entry_id: Any,
    tenant: Any,
    positive: Any,
    magnitude: Any,
    similarity: Any,
    source: Any,
) -> None:
    m, good = hostile
    for eid in (entry_id, good):
        kwargs = {"magnitude": magnitude, "similarity": similarity, "source": source}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        signal = call(FeedbackSignal, eid, tenant, positive, **kwargs)
        if signal is not None:
            call(m.feedback, signal)
    call(m.feedback, entry_id)
    call(m.invalidate, entry_id, tenant=tenant)
    no_corrupt_entry(m)
    assert RedisStorage(m.client).count("t") >= 0


@pytest.mark.parametrize(
    "make",
    [
        lambda eid: FeedbackSignal("\ud800", "t", True),
        lambda eid: FeedbackSignal(eid + "\udc80", "t", False),
        lambda eid: FeedbackSignal("x" * 10_000, "t", True),
        lambda eid: FeedbackSignal(eid, "t", True, magnitude=10**400),
        lambda eid: FeedbackSignal(eid, "t", True, magnitude=-(10**400)),
        lambda eid: FeedbackSignal(eid, "t", False, similarity=10**400),
        lambda eid: FeedbackSignal(eid, "t", False, timestamp=10**400),
    ],
)
def test_numbers_past_a_float_and_unencodable_ids_are_typed_errors(hostile: Any, make: Any) -> None:
    """Each of these crashed untyped: a lone surrogate reached hiredis (UnicodeEncodeError),
    ``math.isfinite(10**400)`` raised OverflowError."""
    m, eid = hostile
    with pytest.raises(ZerdaError):
        m.feedback(make(eid))
    no_corrupt_entry(m)


@pytest.mark.parametrize("field", ["ttl_s", "quality"])
@pytest.mark.parametrize("value", [10**400, -(10**400), float("inf")], ids=["huge", "-huge", "inf"])
def test_a_put_with_numbers_past_a_float_is_a_typed_error(
    hostile: Any, field: str, value: object
) -> None:
    m, _ = hostile
    with pytest.raises(ZerdaError):
        m.put("another question", "an answer", tenant="t", embedding=np.ones(DIM), **{field: value})
    no_corrupt_entry(m)
