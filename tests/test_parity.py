"""The Python learner and the Lua scripts implement the same formulas.

Random sequences of feedback, hits and decay batches, at random times, are applied both to
a Python ``IntelligentCacheEntry`` (through ``CachePolicyLearner``) and to the entry in
Redis (through the scripts); after every step alpha, beta, expected reward and confidence
agree to 1e-9, and the counts exactly.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import redis
from conftest import Clock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerda_cache import (
    BanditArm,
    CacheConfig,
    CachePolicyLearner,
    FeedbackSignal,
    IntelligentCacheEntry,
    RLConfig,
)
from zerda_cache.storage import RedisStorage

_tenants = itertools.count()

rl_configs = st.builds(
    RLConfig,
    near_miss_penalty_share=st.floats(0.0, 1.0),
    negative_streak_forget=st.floats(0.0, 1.0),
    similarity_bar_margin=st.floats(0.0, 0.05),
    prior_alpha=st.floats(0.1, 5.0),
    prior_beta=st.floats(0.1, 5.0),
    positive_feedback_reward=st.floats(0.1, 3.0),
    negative_feedback_penalty=st.floats(0.1, 3.0),
    usage_decay=st.floats(0.05, 1.0),
    decay_interval_s=st.floats(0.5, 600.0),
)
steps = st.lists(
    st.tuples(
        st.sampled_from(["feedback", "hit", "decay"]),
        st.one_of(st.just(0.0), st.floats(0.0, 5.0), st.floats(0.0, 5_000.0)),  # time step
        st.booleans(),  # positive
        st.floats(0.0, 4.0),  # magnitude
        st.one_of(st.none(), st.floats(0.5, 1.0)),  # similarity served at
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    rl=rl_configs,
    steps=steps,
    quality=st.floats(0.0, 1.0),
    similarity=st.floats(0.0, 1.0),
    t0=st.floats(1e6, 2e9),
)
def test_python_and_lua_agree(
    redis_client: redis.Redis,
    rl: RLConfig,
    steps: list[tuple[str, float, bool, float, float | None]],
    quality: float,
    similarity: float,
    t0: float,
) -> None:
    tenant = f"parity{next(_tenants)}"
    clock = Clock(t0)
    storage = RedisStorage(redis_client, CacheConfig(rl=rl), clock=clock)
    learner = CachePolicyLearner(rl)
    vec = np.arange(1.0, 9.0)
    eid = storage.put(tenant, "q", "r", vec, quality=quality, similarity=similarity).entry_id
    model = IntelligentCacheEntry(
        entry_id=eid,
        tenant=tenant,
        query="q",
        response="r",
        created_at=t0,
        quality_score=quality,
        similarity_score=similarity,
        last_access=t0,
        bandit_arm=BanditArm.fresh(rl, t0),
    )
    model.confidence_score = learner._compute_confidence(model)
    compare(storage, tenant, eid, model)

    for op, dt, positive, magnitude, sim in steps:
        clock.t += dt
        if op == "feedback":
            signal = FeedbackSignal(eid, tenant, positive, magnitude=magnitude, similarity=sim)
            storage.feedback(signal)
            learner.record_feedback(model, signal, now=clock.t)
        elif op == "hit":
            assert storage.hit(tenant, eid).status == "served"
            learner.record_use(model, clock.t)
        else:
            storage.decay(tenant, [eid])
            learner.auto_decay([model], now=clock.t)
        compare(storage, tenant, eid, model)


def compare(storage: RedisStorage, tenant: str, eid: str, model: IntelligentCacheEntry) -> None:
    got = storage.get_entry(tenant, eid, with_vector=False)
    a, m = got.bandit_arm, model.bandit_arm
    assert a.alpha == pytest.approx(m.alpha, rel=1e-9, abs=1e-9)
    assert a.beta == pytest.approx(m.beta, rel=1e-9, abs=1e-9)
    assert got.expected_reward == pytest.approx(model.expected_reward, abs=1e-9)
    assert got.confidence_score == pytest.approx(model.confidence_score, abs=1e-9)
    assert a.reward_sum == pytest.approx(m.reward_sum, rel=1e-9, abs=1e-9)
    assert (a.pulls, got.usage_count) == (m.pulls, model.usage_count)
    assert a.decayed_at == m.decayed_at
    assert got.last_access == model.last_access
    assert got.similarity_bar == pytest.approx(model.similarity_bar, abs=1e-12)
    assert got.min_positive_similarity == pytest.approx(model.min_positive_similarity, abs=1e-12)
    assert got.negative_streak == model.negative_streak
