"""The bandit core in pure Python: the seed's formulas, defaults and fixed defects."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from zerda_cache import (
    BanditArm,
    CachePolicyLearner,
    EvictionCandidate,
    EvictionConfig,
    FeedbackSignal,
    IntelligentCacheEntry,
    InvalidFeedbackError,
    InvalidTenantError,
    RLConfig,
)
from zerda_cache.core.entry import compute_confidence, usage_credibility


def make_entry(eid: str = "e1", **kw: object) -> IntelligentCacheEntry:
    return IntelligentCacheEntry(entry_id=eid, tenant="acme", query="q", response="r", **kw)  # type: ignore[arg-type]


def sig(eid: str = "e1", positive: bool = True, magnitude: float = 1.0) -> FeedbackSignal:
    return FeedbackSignal(entry_id=eid, tenant_id="acme", positive=positive, magnitude=magnitude)


def test_a_streak_of_negatives_forgets_earned_praise() -> None:
    """An answer confirmed 30 times that went stale stops being served after three
    complaints in a row (not after ~30); one noisy complaint costs it nothing extra."""
    cfg = RLConfig(min_reward_to_serve=0.4, negative_streak_forget=0.25)
    learner = CachePolicyLearner(cfg)
    e = make_entry(bandit_arm=BanditArm.fresh(cfg, now=0.0))
    for _ in range(30):
        learner.record_feedback(e, sig(), now=0.0)
    learner.record_feedback(e, sig(positive=False), now=0.0)  # noise: alpha kept
    assert (e.bandit_arm.alpha, e.negative_streak) == (31.0, 1)
    learner.record_feedback(e, sig(), now=0.0)  # a positive ends the streak
    assert e.negative_streak == 0
    served = []
    for _ in range(4):
        learner.record_feedback(e, sig(positive=False), now=0.0)
        served.append(learner.is_servable(e))
    assert served == [True, True, False, False]
    assert e.bandit_arm.alpha == pytest.approx(1.0 + 31.0 * 0.25**3)

    seed = CachePolicyLearner(RLConfig(min_reward_to_serve=0.4, negative_streak_forget=1.0))
    e2 = make_entry(bandit_arm=BanditArm.fresh(cfg, now=0.0))
    for _ in range(31):
        seed.record_feedback(e2, sig(), now=0.0)
    for _ in range(4):
        seed.record_feedback(e2, sig(positive=False), now=0.0)
    assert seed.is_servable(e2)  # the seed's arm still trusts it


def test_near_miss_negatives_do_not_count_towards_the_streak() -> None:
    learner = CachePolicyLearner(RLConfig())
    e = make_entry()
    for _ in range(5):
        learner.record_feedback(e, sig(), now=0.0)
    for s in (0.80, 0.82, 0.84):
        learner.record_feedback(
            e, FeedbackSignal("e1", "acme", positive=False, similarity=s), now=0.0
        )
    assert e.negative_streak == 0
    assert e.bandit_arm.alpha == 6.0


# --- seed defaults ---------------------------------------------------------------------------
def test_seed_defaults() -> None:
    rl, ev = RLConfig(), EvictionConfig()
    assert rl.min_reward_to_keep == 0.05
    assert rl.usage_decay == 0.995
    assert (ev.reward_weight, ev.usage_weight, ev.recency_weight) == (0.50, 0.30, 0.20)
    s = FeedbackSignal(entry_id="x", tenant_id="t", positive=True)
    assert (s.magnitude, s.source) == (1.0, "user")


# --- record_feedback -------------------------------------------------------------------------
def test_record_feedback_applies_reward_and_confidence() -> None:
    cfg = RLConfig(positive_feedback_reward=2.0, negative_feedback_penalty=3.0)
    learner = CachePolicyLearner(cfg)
    e = make_entry(
        bandit_arm=BanditArm.fresh(cfg, now=100.0), quality_score=0.8, similarity_score=0.9
    )
    learner.record_feedback(e, sig(magnitude=0.5), now=100.0)
    assert e.bandit_arm.alpha == pytest.approx(1.0 + 0.5 * 2.0)
    assert e.bandit_arm.beta == 1.0
    learner.record_feedback(e, sig(positive=False, magnitude=2.0), now=100.0)
    assert e.bandit_arm.beta == pytest.approx(1.0 + 2.0 * 3.0)
    assert e.bandit_arm.pulls == 2
    assert e.bandit_arm.reward_sum == pytest.approx(1.0 - 6.0)
    expected = 2.0 / (2.0 + 7.0)
    assert e.expected_reward == pytest.approx(expected)
    assert e.confidence_score == pytest.approx(0.40 * expected + 0.25 * 0.9 + 0.25 * 0.8 + 0.0)


def test_feedback_counters_and_log_cap() -> None:
    learner = CachePolicyLearner(RLConfig())
    e = make_entry()
    for i in range(10_005):
        learner.record_feedback(e, sig(positive=i % 3 != 0), now=0.0)
    stats = learner.get_stats()
    assert stats["total_feedback"] == 10_005
    assert stats["negative_feedback"] == 3335
    assert stats["positive_feedback"] == 6670
    assert stats["positive_rate"] == pytest.approx(6670 / 10_005)
    assert stats["recent_signals"] == 10_000


def test_get_stats_empty() -> None:
    assert CachePolicyLearner(RLConfig()).get_stats() == {
        "total_feedback": 0,
        "positive_feedback": 0,
        "negative_feedback": 0,
        "positive_rate": 0.0,
        "recent_signals": 0,
    }


def test_concurrent_feedback_counts_are_exact() -> None:
    learner = CachePolicyLearner(RLConfig())
    entries = [make_entry(f"e{i}") for i in range(16)]

    def work(e: IntelligentCacheEntry) -> None:
        for _ in range(500):
            learner.record_feedback(e, sig(e.entry_id), now=0.0)

    threads = [threading.Thread(target=work, args=(e,)) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert learner.get_stats()["total_feedback"] == 16 * 500
    assert all(e.bandit_arm.alpha == 501.0 for e in entries)


# --- confidence ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 10, 50, 500])
def test_usage_credibility_saturates_at_50(n: int) -> None:
    assert usage_credibility(n) == pytest.approx(min(1.0, math.log1p(n) / math.log1p(50)))


def test_confidence_is_clipped() -> None:
    assert compute_confidence(1.0, 1.0, 1.0, 1000) == 1.0
    assert compute_confidence(0.0, 0.0, 0.0, 0) == 0.0


# --- rank_candidates ----------------------------------------------------------------------
def test_rank_candidates_composite_formula() -> None:
    cfg = RLConfig(similarity_bonus_scale=0.5, similarity_tie_margin=2.0, seed=7)  # seed order
    learner = CachePolicyLearner(cfg)
    e1 = make_entry("a", confidence_score=0.3, bandit_arm=BanditArm(alpha=5, beta=2, pulls=5))
    e2 = make_entry("b", confidence_score=0.9, bandit_arm=BanditArm(alpha=2, beta=5, pulls=5))
    scored = learner.score_candidates([("a", 0.91, e1), ("b", 0.88, e2)])
    # Replay the draws with an identically seeded generator.
    rng = np.random.default_rng(7)
    draws = {"a": rng.beta(5, 2), "b": rng.beta(2, 5)}
    for (eid, sim, entry), score in scored:
        want = (sim + 0.5 * draws[eid] + 0.1 * entry.confidence_score) / 1.6
        assert score == pytest.approx(want)
    assert scored[0][1] >= scored[1][1]
    ranked = learner.rank_candidates([("a", 0.91, e1), ("b", 0.88, e2)])
    assert {c[0] for c in ranked} == {"a", "b"}
    assert all(len(c) == 3 for c in ranked)


def test_fresh_arms_are_not_drawn_the_closer_question_wins() -> None:
    """Two answers without a signal are equally likely to be right: their prior mean
    stands in for the draw, so within the tie margin the closer question wins every
    time (a QQP near-copy got its source's twin 1.8% of the time by a draw)."""
    learner = CachePolicyLearner(RLConfig(seed=3))
    a = make_entry("a", confidence_score=0.5, bandit_arm=BanditArm())
    b = make_entry("b", confidence_score=0.5, bandit_arm=BanditArm())
    for _ in range(200):
        ranked = learner.rank_candidates([("b", 0.964, b), ("a", 0.970, a)])
        assert ranked[0][0] == "a"
    liked = make_entry("b", confidence_score=0.5, bandit_arm=BanditArm(8, 1, pulls=7))
    wins = sum(
        learner.rank_candidates([("b", 0.964, liked), ("a", 0.970, a)])[0][0] == "b"
        for _ in range(200)
    )
    assert wins > 150  # evidence still moves the choice within the margin


def test_rank_candidates_reproducible_with_seed_and_isolated_from_global_rng() -> None:
    def run() -> list[str]:
        learner = CachePolicyLearner(RLConfig(seed=42))
        cands = [(f"e{i}", 0.9, make_entry(f"e{i}")) for i in range(5)]
        out = []
        for _ in range(50):
            np.random.seed(np.random.randint(1 << 30))  # global state must not matter
            out.append(learner.rank_candidates(cands)[0][0])
        return out

    assert run() == run()


def test_similarity_comes_first_and_the_bandit_breaks_ties() -> None:
    """A liked answer wins among candidates about as similar as the best one; a
    clearly closer question is ranked first whatever the draws (the seed's composite
    let a fresh arm's draw outweigh a 0.1 similarity gap)."""
    learner = CachePolicyLearner(RLConfig(seed=3))  # margin 0.01
    liked, plain, far = make_entry("liked"), make_entry("plain"), make_entry("far")
    for _ in range(20):
        learner.record_feedback(liked, sig("liked"), now=0.0)
    for _ in range(200):
        ranked = learner.rank_candidates(
            [("far", 0.80, far), ("plain", 0.905, plain), ("liked", 0.90, liked)]
        )
        assert [c[0] for c in ranked[1:]] != ["far", "plain"]  # far is never before the pair
        assert ranked[-1][0] == "far"
    wins = sum(
        learner.rank_candidates([("plain", 0.905, plain), ("liked", 0.90, liked)])[0][0] == "liked"
        for _ in range(500)
    )
    assert wins >= 475
    seed_order = CachePolicyLearner(RLConfig(seed=3, similarity_tie_margin=2.0))
    firsts = {
        seed_order.rank_candidates([("close", 0.99, make_entry("close")), ("far", 0.89, far)])[0][0]
        for _ in range(300)
    }
    assert firsts == {"close", "far"}  # the seed's order: the draw can outweigh 0.1


def test_rank_prefers_liked_answer() -> None:
    learner = CachePolicyLearner(RLConfig(seed=1))
    liked = make_entry("liked")
    plain = make_entry("plain")
    for _ in range(20):
        learner.record_feedback(liked, sig("liked"), now=0.0)
    wins = sum(
        learner.rank_candidates([("plain", 0.9, plain), ("liked", 0.9, liked)])[0][0] == "liked"
        for _ in range(1000)
    )
    assert wins >= 950


# --- eviction_ranking ---------------------------------------------------------------------
def test_eviction_ranking_fast_path_and_order() -> None:
    learner = CachePolicyLearner(RLConfig(usage_decay=1.0))
    bad = make_entry("bad", bandit_arm=BanditArm(alpha=1, beta=40))  # 0.024 < 0.05
    good = make_entry(
        "good", bandit_arm=BanditArm(alpha=30, beta=1), usage_count=50, last_access=100.0
    )
    meh = make_entry("meh", bandit_arm=BanditArm(alpha=1, beta=1))
    out = learner.eviction_ranking([("kg", good), ("kb", bad), ("km", meh)], 2, now=100.0)
    assert out[0] == EvictionCandidate(entry_id="bad", key="kb", score=-1.0)
    assert out[1].entry_id == "meh"
    assert len(out) == 2
    assert learner.eviction_ranking([("kg", good)], 0, now=100.0) == []


def test_eviction_ranking_uses_config_weights() -> None:
    """The seed ignored EvictionConfig's weights; we pass them through."""
    # Entry A: high reward, never used. Entry B: low reward, heavily used.
    a = make_entry("a", bandit_arm=BanditArm(alpha=9, beta=1), usage_count=0)
    b = make_entry("b", bandit_arm=BanditArm(alpha=1, beta=3), usage_count=50)
    rl = RLConfig(usage_decay=1.0)
    reward_heavy = CachePolicyLearner(
        rl, EvictionConfig(reward_weight=1, usage_weight=0, recency_weight=0)
    )
    usage_heavy = CachePolicyLearner(
        rl, EvictionConfig(reward_weight=0, usage_weight=1, recency_weight=0)
    )
    pairs = [("ka", a), ("kb", b)]
    assert reward_heavy.eviction_ranking(pairs, 1, now=0.0)[0].entry_id == "b"
    assert usage_heavy.eviction_ranking(pairs, 1, now=0.0)[0].entry_id == "a"
    s = reward_heavy.eviction_ranking(pairs, 2, now=0.0)
    assert s[0].score == pytest.approx(0.25) and s[1].score == pytest.approx(0.9)


def test_eviction_score_formula() -> None:
    e = make_entry(bandit_arm=BanditArm(alpha=3, beta=1), usage_count=10, last_access=0.0)
    score = e.eviction_score(0.5, 0.5, 0.3, 0.2, now=600.0, interval_s=300.0)
    want = 0.5 * 0.75 + 0.3 * math.log1p(10) / math.log1p(50) + 0.2 * 0.5**2
    assert score == pytest.approx(want)


# --- decay ----------------------------------------------------------------------------------
def test_auto_decay_shrinks_excess_toward_prior() -> None:
    cfg = RLConfig(prior_alpha=2.0, prior_beta=1.0, usage_decay=0.5, decay_interval_s=10.0)
    learner = CachePolicyLearner(cfg)
    e = make_entry(bandit_arm=BanditArm(alpha=10.0, beta=5.0, decayed_at=0.0))
    learner.auto_decay([e], now=20.0)  # two intervals: factor 0.25
    assert e.bandit_arm.alpha == pytest.approx(2.0 + 8.0 * 0.25)
    assert e.bandit_arm.beta == pytest.approx(1.0 + 4.0 * 0.25)
    assert e.bandit_arm.decayed_at == 20.0
    for _ in range(200):
        learner.auto_decay([e], now=e.bandit_arm.decayed_at + 10.0)
    assert e.bandit_arm.alpha >= 2.0 and e.bandit_arm.beta >= 1.0
    assert e.bandit_arm.alpha == pytest.approx(2.0)


def test_auto_decay_is_idempotent_in_time() -> None:
    cfg = RLConfig(usage_decay=0.9, decay_interval_s=1.0)
    learner = CachePolicyLearner(cfg)
    once = make_entry(bandit_arm=BanditArm(alpha=20.0, beta=4.0))
    twice = make_entry(bandit_arm=BanditArm(alpha=20.0, beta=4.0))
    learner.auto_decay([once], now=7.0)
    learner.auto_decay([twice], now=3.0)
    learner.auto_decay([twice], now=7.0)
    learner.auto_decay([twice], now=7.0)  # a doubled cycle
    learner.auto_decay([twice], now=5.0)  # a late one: time never runs backwards
    assert twice.bandit_arm.alpha == pytest.approx(once.bandit_arm.alpha, abs=1e-12)
    assert twice.bandit_arm.beta == pytest.approx(once.bandit_arm.beta, abs=1e-12)


def test_feedback_decays_to_now_first() -> None:
    cfg = RLConfig(usage_decay=0.5, decay_interval_s=1.0)
    learner = CachePolicyLearner(cfg)
    e = make_entry(bandit_arm=BanditArm(alpha=5.0, beta=1.0, decayed_at=0.0))
    learner.record_feedback(e, sig(), now=1.0)
    assert e.bandit_arm.alpha == pytest.approx(1.0 + 4.0 * 0.5 + 1.0)


def test_arm_at_does_not_mutate() -> None:
    arm = BanditArm(alpha=5.0, beta=1.0, decayed_at=0.0)
    view = arm.at(300.0, RLConfig())
    assert arm.alpha == 5.0 and view.alpha == pytest.approx(1.0 + 4.0 * 0.995)


# --- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("magnitude", [math.nan, math.inf, -math.inf, -0.1, "1", True])
def test_bad_magnitude_is_rejected(magnitude: object) -> None:
    with pytest.raises(InvalidFeedbackError, match="magnitude"):
        FeedbackSignal(entry_id="x", tenant_id="t", positive=True, magnitude=magnitude)  # type: ignore[arg-type]


@pytest.mark.parametrize("tenant", ["", "a{b}", "a:b", "a b", "a\nb", "x" * 65, None])
def test_bad_tenant_in_signal_is_rejected(tenant: object) -> None:
    with pytest.raises(InvalidTenantError):
        FeedbackSignal(entry_id="x", tenant_id=tenant, positive=True)  # type: ignore[arg-type]


def test_bad_signal_fields() -> None:
    with pytest.raises(InvalidFeedbackError, match="entry_id"):
        FeedbackSignal(entry_id="", tenant_id="t", positive=True)
    with pytest.raises(InvalidFeedbackError, match="positive"):
        FeedbackSignal(entry_id="x", tenant_id="t", positive=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidFeedbackError, match="source"):
        FeedbackSignal(entry_id="x", tenant_id="t", positive=True, source="")


def test_vectorized_eviction_scores_match_eviction_ranking() -> None:
    rng = np.random.default_rng(9)
    cfg = RLConfig(usage_decay=0.9, decay_interval_s=50.0, prior_alpha=1.5, prior_beta=0.5)
    learner = CachePolicyLearner(
        cfg, EvictionConfig(reward_weight=0.6, usage_weight=0.1, recency_weight=0.3)
    )
    now = 10_000.0
    entries = []
    for i in range(400):
        at_prior = i % 4 == 0
        arm = BanditArm(
            alpha=1.5 if at_prior else 1.5 + rng.exponential(5),
            beta=0.5 if at_prior else 0.5 + (300 if i % 7 == 0 else rng.exponential(3)),
            decayed_at=now - rng.uniform(0, 20 if i % 7 == 0 else 2000),
        )
        la = now - rng.uniform(0, 5000)
        entries.append(
            make_entry(
                f"e{i}",
                bandit_arm=arm,
                usage_count=int(rng.integers(0, 90)),
                last_access=la,
                created_at=la - 10,
            )
        )
    ranked = {
        c.entry_id: c.score
        for c in learner.eviction_ranking([(e.entry_id, e) for e in entries], len(entries), now=now)
    }
    scores, expected = learner.eviction_scores(
        np.array([e.bandit_arm.alpha for e in entries]),
        np.array([e.bandit_arm.beta for e in entries]),
        np.array([e.bandit_arm.decayed_at for e in entries]),
        np.array([e.usage_count for e in entries], dtype=float),
        np.array([e.last_access for e in entries]),
        now=now,
    )
    assert (scores < 0).sum() > 5  # some are below min_reward_to_keep
    for e, score, er in zip(entries, scores, expected, strict=True):
        assert score == pytest.approx(ranked[e.entry_id], abs=1e-12)
        assert er == pytest.approx(e.bandit_arm.at(now, cfg).expected_reward, abs=1e-12)


def test_serving_bar() -> None:
    assert RLConfig().serve_bar == 0.05  # the seed's single bar by default
    cfg = RLConfig(min_reward_to_serve=0.4)
    learner = CachePolicyLearner(cfg)
    fresh = make_entry(bandit_arm=BanditArm(alpha=1, beta=1))
    once_wrong = make_entry(bandit_arm=BanditArm(alpha=1, beta=2))  # 0.33
    confirmed = make_entry(bandit_arm=BanditArm(alpha=4, beta=2))  # 0.67
    assert learner.is_servable(fresh) and learner.is_servable(confirmed)
    assert not learner.is_servable(once_wrong)
    with pytest.raises(ValueError, match="min_reward_to_serve"):
        RLConfig(min_reward_to_serve=0.01)
    with pytest.raises(ValueError, match="min_reward_to_serve"):
        RLConfig(min_reward_to_serve=1.5)


def test_signal_takes_tenant_as_every_other_call_does() -> None:
    by_keyword = FeedbackSignal(entry_id="x", tenant="t", positive=True)
    assert by_keyword.tenant_id == by_keyword.tenant == "t"
    assert FeedbackSignal("x", "t", False).tenant == "t"
    assert FeedbackSignal("x", tenant_id="t", tenant="t", positive=True).tenant == "t"
    with pytest.raises(InvalidFeedbackError, match="differ"):
        FeedbackSignal("x", tenant_id="t", tenant="u", positive=True)
    with pytest.raises(InvalidTenantError):
        FeedbackSignal("x", positive=True)
    with pytest.raises(InvalidFeedbackError, match="positive"):
        FeedbackSignal("x", tenant="t")
