"""The error bound: calibration from labelled outcomes, serve / miss / verify, on both
drivers against real servers."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import pytest
import redis
from conftest import near
from conftest import unit as _unit
from prometheus_client import CollectorRegistry
from state_support import tenant_state

from zerda_cache import CacheConfig, EntryNotFoundError, FeedbackSignal
from zerda_cache.flows.put import DISPUTED
from zerda_cache.flows.verification import Ticket, same_meaning, same_text
from zerda_cache.learning.calibration import (
    BIN_FLOOR,
    BIN_WIDTH,
    CONFIRMED_REWARD,
    EXACT_LEVELS,
    EXPLORE_LABELS,
    MIN_LABELS,
    N_BINS,
    NEVER,
    Calibration,
    bin_of,
    check_error_rate,
    exact_level,
    served_level,
    wilson_upper,
)
from zerda_cache.learning.tenant_state import plan_label
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import tenant_keys

DIM = 384


def unit(seed: int) -> np.ndarray:
    return _unit(seed, DIM)


def metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


# --- the calibration, without a server -------------------------------------------------------
def test_wilson_upper_bound() -> None:
    assert wilson_upper(0, 0) == 1.0
    assert wilson_upper(0, 100) == pytest.approx(0.0263, abs=1e-3)  # the "rule of three"-ish
    assert wilson_upper(5, 100) == pytest.approx(0.0992, abs=1e-3)
    assert wilson_upper(5, 1000) == pytest.approx(0.0102, abs=1e-3)
    assert wilson_upper(100, 100) == 1.0


def test_bins_cover_the_unit_interval() -> None:
    assert bin_of(1.0) == N_BINS - 1 and bin_of(0.0) == 0 and bin_of(0.9) == bin_of(0.9 + 1e-12)
    assert bin_of(0.9 + BIN_WIDTH) == bin_of(0.9) + 1


def counts(**by_sim: tuple[int, int]) -> Calibration:
    """``{"0.95": (right, wrong)}`` as a Calibration."""
    right, wrong = [0.0] * N_BINS, [0.0] * N_BINS
    for sim, (r, w) in by_sim.items():
        right[bin_of(float(sim))] += r
        wrong[bin_of(float(sim))] += w
    return Calibration(tuple(right), tuple(wrong))


def test_threshold_is_the_lowest_safe_similarity() -> None:
    cal = counts(**{"0.97": (200, 0), "0.93": (200, 2), "0.90": (100, 30)})
    assert cal.threshold(0.02) == pytest.approx(0.93)  # 2 in 400 from 0.93 up: ub 1.50%
    assert cal.threshold(0.014) == pytest.approx(0.97)  # 0 in 200: ub 1.33%
    assert cal.threshold(0.005) is None  # 200 clean labels do not prove 0.5%
    assert cal.threshold(0.2) == pytest.approx(0.90)
    assert Calibration().threshold(0.5) is None  # no labels, nothing by similarity
    few = counts(**{"0.99": (MIN_LABELS - 1, 0)})
    assert few.threshold(0.5) is None


def with_traffic(cal: Calibration, other: float, **by_sim: float) -> Calibration:
    """``cal`` with lookup counts: ``other`` without a near candidate, the rest per bin."""
    traffic = [0.0] * N_BINS
    for sim, n in by_sim.items():
        traffic[bin_of(float(sim))] += n
    return Calibration(cal.right, cal.wrong, cal.max_error_rate, tuple(traffic), other)


def test_the_bound_is_on_wrong_serves_per_request() -> None:
    # 5% of the labelled matches at 0.93 are wrong: too many among serves at δ = 2%...
    cal = counts(**{"0.93": (380, 20)})
    assert cal.threshold(0.02) is None
    # ...but if only a tenth of the requests have a match that close, serving them all
    # serves a wrong answer to ~0.5% of the requests.
    busy = with_traffic(cal, 9_000, **{"0.93": 1_000})
    assert busy.threshold(0.02) == pytest.approx(0.93)
    assert busy.wrong_per_request(0.93) == pytest.approx(0.1 * 0.05)
    # Half the requests: 2.5%, over the bound; the upper bounds of both factors count.
    assert with_traffic(cal, 1_000, **{"0.93": 1_000}).threshold(0.02) is None
    assert with_traffic(cal, 9, **{"0.93": 1}).threshold(0.02) is None  # 10 lookups: unsure
    # Lookups below the lowest labelled bin are requests too, never served by similarity.
    low = with_traffic(counts(**{"0.97": (400, 20)}), 0, **{"0.97": 100, "0.90": 1_900})
    assert low.threshold(0.02) == pytest.approx(0.97) and low.lookups == 2_000


def test_busy_bins_weigh_by_their_requests_not_their_labels() -> None:
    # A thousand labels say matches at 0.99 are right, thirty that a third of those at
    # 0.90 are wrong; nine requests in ten have their best match at 0.90.
    labels = counts(**{"0.99": (1_000, 0), "0.90": (20, 10)})
    assert labels.threshold(0.05) == pytest.approx(0.90)  # pooled labels: 1% wrong
    busy = with_traffic(labels, 0, **{"0.99": 100, "0.90": 900})
    assert busy.threshold(0.05) == pytest.approx(0.99)  # per request: ~30% at 0.90
    assert busy.wrong_per_request(0.90) == pytest.approx(0.9 * 10 / 30)


def test_parse_ignores_what_is_not_a_count() -> None:
    cal = Calibration.parse(
        {b"r:10": b"3", b"w:10": b"1", b"n": b"4", b"r:x": b"1", b"w:5": b"nan"}, b"0.05"
    )
    assert (cal.right[10], cal.wrong[10], cal.wrong[5], cal.max_error_rate) == (3.0, 1.0, 0.0, 0.05)
    cal = Calibration.parse({b"t:10": b"7", b"t:x": b"2", b"tn": b"9", b"t:y": b"1"}, None)
    assert (cal.traffic[10], cal.traffic_other, cal.lookups) == (7.0, 2.0, 9.0)
    assert Calibration.parse({}, b"2").max_error_rate is None  # out of range: not a bound
    with pytest.raises(ValueError, match="max_error_rate"):
        check_error_rate(0)
    with pytest.raises(ValueError, match="max_error_rate"):
        CacheConfig(max_error_rate=1.5)


def test_same_text_ignores_case_space_and_punctuation() -> None:
    assert same_text("Paris.", "  paris ")
    assert same_text("It's 42!", "its 42") is False  # the apostrophe splits a word
    assert not same_text("Paris", "Lyon")


# --- the label script -------------------------------------------------------------------------
def test_labels_are_counted_and_halved_past_the_window(redis_client: redis.Redis) -> None:
    st = RedisStorage(redis_client, CacheConfig(label_window=10))
    for i in range(10):
        assert tenant_state(st).label("t", 0.95, i % 5 != 0) == i + 1
    cal = tenant_state(st).calibration("t")
    assert (cal.right[bin_of(0.95)], cal.wrong[bin_of(0.95)]) == (8.0, 2.0)
    assert tenant_state(st).label("t", 0.95, True) == pytest.approx(5.5)  # 11 labels: all halved
    cal = tenant_state(st).calibration("t")
    assert (cal.right[bin_of(0.95)], cal.wrong[bin_of(0.95)]) == (4.5, 1.0)
    st.set_tenant_settings("t", max_error_rate=0.02)
    assert tenant_state(st).calibration("t").max_error_rate == 0.02
    with pytest.raises(ValueError, match="max_error_rate"):
        st.set_tenant_settings("t", max_error_rate=2)


def test_lookups_are_counted_per_bin_and_halved_apart_from_labels(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    m = make_manager(CacheConfig(label_window=10))
    v = unit(40)
    m.put("q", "a", tenant="t", embedding=v)
    for i in range(5):
        m.lookup(f"close {i}", tenant="t", embedding=near(v, 0.952, 300 + i))
    m.lookup("q", tenant="t", embedding=v)  # the question itself: counted apart
    m.lookup("far", tenant="t", embedding=unit(41))  # nothing above the search threshold
    m.stats("t")  # writes the pending counts
    cal = tenant_state(m.storage).calibration("t")
    assert (cal.traffic[bin_of(0.95)], cal.traffic_exact, cal.traffic_other) == (5.0, 1.0, 1.0)
    assert cal.lookups == 7.0
    st = RedisStorage(redis_client, CacheConfig(label_window=10))
    tenant_state(st).label("t", 0.95, True)
    # Past ten label windows of lookups the counts are halved, the labels left alone.
    for i in range(100):
        m.lookup(f"close {i}", tenant="t", embedding=near(v, 0.952, 400 + i))
    m.stats("t")
    cal = tenant_state(m.storage).calibration("t")
    assert 50 <= cal.lookups <= 100 and cal.right[bin_of(0.95)] == 1.0
    for _ in range(10):  # and past the label window, the labels are, not the lookups
        tenant_state(st).label("t", 0.95, True)
    after = tenant_state(m.storage).calibration("t")
    assert after.lookups == cal.lookups and after.right[bin_of(0.95)] == pytest.approx(5.5)


def test_exact_repeats_in_the_traffic_let_a_near_match_be_served(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    teach(redis_client, "t", {0.95: (380, 20)})  # 5% wrong among matches that close
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0, policy_refresh_s=0.05))
    v = unit(42)
    cached = m.put("q", "a", tenant="t", embedding=v)
    m.feedback(FeedbackSignal(cached.entry_id, "t", True))  # confirmed: its repeats are served
    assert m.lookup("close", tenant="t", embedding=near(v, 0.955, 500)) is None  # verify
    for _ in range(400):  # most requests are the question itself
        assert m.lookup("q", tenant="t", embedding=v) is not None
    m.stats("t")
    cal = tenant_state(m.storage).calibration("t")
    assert cal.threshold(0.02) == pytest.approx(0.95)
    time.sleep(0.1)  # the replica's policy (and its counts) is read again
    m.lookup("q", tenant="t", embedding=v)
    hit = m.lookup("close again", tenant="t", embedding=near(v, 0.955, 501))
    assert hit is not None and hit.entry_id == cached.entry_id


# --- serve, miss or verify --------------------------------------------------------------------
def teach(redis_client: redis.Redis, tenant: str, sims: dict[float, tuple[int, int]]) -> None:
    """Labelled outcomes as if earlier verifications had produced them."""
    st = RedisStorage(redis_client)
    for sim, (right, wrong) in sims.items():
        for _ in range(right):
            tenant_state(st).label(tenant, sim, True)
        for _ in range(wrong):
            tenant_state(st).label(tenant, sim, False)


def test_cold_start_verifies_and_the_put_teaches(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    registry = CollectorRegistry()
    m = make_manager(
        CacheConfig(max_error_rate=0.05, verify_rate=0.0), metrics=ReplicaMetrics(registry)
    )
    v = unit(1)
    question = "What is the capital of France?"
    first = m.put(question, "Paris.", tenant="t", embedding=v)
    # The question itself: its entry is not confirmed yet (no positive signal), so its
    # answer is as likely wrong as a fresh one: verified, not served.
    assert m.lookup(question, tenant="t", embedding=v) is None
    assert m.awaiting_verification(question, tenant="t")
    again = m.put(question, "paris", tenant="t", embedding=v)
    # The answers agree: the cached entry stays, confirmed by the verification.
    assert again.verified is True and again.entry_id == first.entry_id
    assert again.replaced_id is None
    assert metric(registry, "zerda_cache_puts_total", tenant="t", result="kept") == 1
    assert m.storage.get_entry("t", first.entry_id).response == "Paris."
    # an exact label, counted apart
    assert tenant_state(m.storage).calibration("t").exact_right == 1
    # Its exact repeats are served from then on.
    exact = m.lookup(question, tenant="t", embedding=v)
    assert exact is not None and exact.exact and exact.entry_id == again.entry_id
    # a near match is not: no label says matches that close are right yet
    assert m.lookup("capital of france?", tenant="t", embedding=near(v, 0.95, 2)) is None
    assert metric(registry, "zerda_cache_lookups_total", tenant="t", result="verify") == 2
    # that None was a verify, not a plain miss; in its own scope only
    assert m.awaiting_verification("capital of france?", tenant="t")
    assert not m.awaiting_verification("capital of france?", tenant="t", scope="other")
    assert not m.awaiting_verification("What is the capital of France?", tenant="t")
    res = m.put("capital of france?", "paris", tenant="t", embedding=near(v, 0.95, 2))
    assert res.stored and res.verified is True
    assert not m.awaiting_verification("capital of france?", tenant="t")  # the put took it
    cal = tenant_state(m.storage).calibration("t")
    assert sum(cal.right) == 1 and cal.labels == 1
    # a put with no verification pending says so
    assert m.put("unrelated", "x", tenant="t", embedding=unit(3)).verified is None


def test_a_wrong_verification_is_a_negative_at_that_similarity(make_manager: Any) -> None:
    m = make_manager(CacheConfig(max_error_rate=0.05))
    v = unit(4)
    cached = m.put("How many legs has a spider?", "Eight.", tenant="t", embedding=v)
    assert m.lookup("How many legs has an ant?", tenant="t", embedding=near(v, 0.93, 5)) is None
    res = m.put("How many legs has an ant?", "Six.", tenant="t", embedding=near(v, 0.93, 5))
    assert res.verified is False
    entry = m.storage.get_entry("t", cached.entry_id, with_vector=False)
    assert entry.bandit_arm.beta > 1.0  # the entry learnt it was wrong for that question
    cal = tenant_state(m.storage).calibration("t")
    assert sum(cal.wrong) == 1 and sum(cal.right) == 0


def test_serves_where_the_labels_say_matches_are_right(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    teach(redis_client, "t", {0.96: (300, 1), 0.91: (100, 40)})
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    v = unit(6)
    cached = m.put("q", "a", tenant="t", embedding=v)
    for i in range(20):
        hit = m.lookup(f"close {i}", tenant="t", embedding=near(v, 0.97, 100 + i))
        assert hit is not None and hit.entry_id == cached.entry_id
        assert m.lookup(f"far {i}", tenant="t", embedding=near(v, 0.915, 200 + i)) is None
    assert tenant_state(m.storage).calibration("t").threshold(0.02) == pytest.approx(0.96)


def test_the_bound_per_call_and_per_tenant(make_manager: Any, redis_client: redis.Redis) -> None:
    plain = make_manager()  # no bound anywhere
    v = unit(7)
    for tenant in ("a", "b"):
        put = plain.put("q", "x", tenant=tenant, embedding=v)
        plain.feedback(FeedbackSignal(put.entry_id, tenant, True))  # confirmed
    copy = near(v, 0.95, 8)
    assert plain.lookup("q2", tenant="a", embedding=copy) is not None
    assert plain.lookup("q2", tenant="a", embedding=copy, max_error_rate=0.01) is None
    with pytest.raises(ValueError, match="max_error_rate"):
        plain.lookup("q2", tenant="a", embedding=copy, max_error_rate=0.0)
    plain.storage.set_tenant_settings("b", max_error_rate=0.01)
    fresh = make_manager(CacheConfig(verify_rate=0.0))  # reads tenant b's bound first
    assert fresh.lookup("q2", tenant="b", embedding=copy) is None
    assert fresh.lookup("q2", tenant="a", embedding=copy) is not None
    assert fresh.lookup("q", tenant="b", embedding=v) is not None  # exact, confirmed: served


def test_exploration_verifies_some_servable_matches(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    teach(redis_client, "t", {0.96: (150, 0)})  # under EXPLORE_LABELS: all of verify_rate
    always = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=1.0))
    v = unit(9)
    put = always.put("q", "a", tenant="t", embedding=v)
    assert always.lookup("q2", tenant="t", embedding=near(v, 0.98, 10)) is None  # verified
    assert always.lookup("q", tenant="t", embedding=v) is None  # exact, unconfirmed: too
    always.feedback(FeedbackSignal(put.entry_id, "t", True))
    # A confirmed entry's exact repeat is explored too: the label its level needs (one
    # positive signal: expected reward 2/3, level 2).
    assert always.lookup("q", tenant="t", embedding=v) is None
    assert always.awaiting_verification("q", tenant="t")
    assert always.put("q", "a", tenant="t", embedding=v).verified is True
    cal = tenant_state(always.storage).calibration("t")
    assert exact_level(2 / 3) == 2 and cal.level_right[2 - 1] == 1.0
    never = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    assert never.lookup("q", tenant="t", embedding=v) is not None  # confirmed: served


def test_exploration_falls_off_as_labels_stand_behind_what_is_served(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """``verify_rate`` is a ceiling: with many labels at and above the threshold, a
    servable near match is verified at ``verify_rate * EXPLORE_LABELS / labels``."""
    right = [0.0] * len(Calibration().right)
    right[bin_of(0.96)] = 2_000.0
    cal = Calibration(right=tuple(right))
    assert cal.exploration(0.02) == (1.0, EXPLORE_LABELS / 2_000)
    few = [0.0] * len(right)
    few[bin_of(0.96)] = 50.0
    assert Calibration(right=tuple(few)).exploration(0.02)[1] == 1.0
    assert Calibration().exploration(0.02) == (1.0, 1.0)  # nothing served: all verified
    teach(redis_client, "t", {0.96: (2_000, 0)})
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=1.0))
    v = unit(19)
    m.put("q", "a", tenant="t", embedding=v)
    verified = sum(
        m.lookup(f"q{i}", tenant="t", embedding=near(v, 0.98, 100 + i)) is None for i in range(200)
    )
    assert 5 <= verified <= 40  # about 10% of 200, the same on every run (hashed draws)


def test_feedback_under_a_bound_labels_the_match(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    m = make_manager(CacheConfig(max_error_rate=0.5, verify_rate=0.0))
    v = unit(11)
    put = m.put("q", "a", tenant="t", embedding=v)
    m.feedback(FeedbackSignal(put.entry_id, "t", True))  # confirmed (no similarity: no label)
    hit = m.lookup("q", tenant="t", embedding=v)
    m.feedback(hit.feedback(False))  # similarity 1: the question itself, not a near match
    assert tenant_state(m.storage).calibration("t").labels == 0
    m.feedback(FeedbackSignal(hit.entry_id, "t", False, similarity=0.9))
    m.feedback(FeedbackSignal(hit.entry_id, "t", True, similarity=0.9))
    cal = tenant_state(m.storage).calibration("t")
    assert (cal.right[bin_of(0.9)], cal.wrong[bin_of(0.9)]) == (1.0, 1.0)
    assert m.stats("t")["negative"] == 2 and m.stats("t")["positive"] == 2
    assert redis_client.hget(tenant_keys("t").cal, "n") == b"2"  # the tenant's cal hash


def test_an_exact_repeat_is_never_a_near_match_label(make_manager: Any) -> None:
    m = make_manager(CacheConfig(max_error_rate=0.05, verify_rate=0.0))
    v = unit(12)
    put = m.put("What is 2 + 2?", "4", tenant="t", embedding=v)
    m.feedback(FeedbackSignal(put.entry_id, "t", True))
    for _ in range(5):  # the fast path (one candidate) too
        hit = m.lookup("What is 2 + 2?", tenant="t", embedding=v)
        assert hit is not None and hit.exact and hit.similarity == 1.0
        m.feedback(hit.feedback(True))
    assert tenant_state(m.storage).calibration("t").labels == 0


def test_a_per_call_bound_learns_and_failed_feedback_labels_nothing(make_manager: Any) -> None:
    m = make_manager()  # no bound but the call's
    v = unit(13)
    cached = m.put("q", "a", tenant="t", embedding=v)
    assert m.lookup("q2", tenant="t", embedding=near(v, 0.95, 14), max_error_rate=0.05) is None
    assert m.put("q2", "a", tenant="t", embedding=near(v, 0.95, 14)).verified is True
    assert tenant_state(m.storage).calibration("t").labels == 1
    bounded = make_manager(CacheConfig(max_error_rate=0.05))
    assert bounded.invalidate(cached.entry_id, tenant="t")
    with pytest.raises(EntryNotFoundError):
        bounded.feedback(FeedbackSignal(cached.entry_id, "t", False, similarity=0.9))
    assert (
        tenant_state(m.storage).calibration("t").labels == 1
    )  # not counted: the signal was not applied


def test_verification_survives_the_candidate_being_replaced(make_manager: Any) -> None:
    m = make_manager(CacheConfig(max_error_rate=0.05, dedup_threshold=0.95))
    v = unit(15)
    cached = m.put("q", "a", tenant="t", embedding=v)
    assert m.lookup("q again", tenant="t", embedding=near(v, 0.97, 16)) is None
    res = m.put("q again", "a", tenant="t", embedding=near(v, 0.97, 16))
    assert res.replaced_id == cached.entry_id and res.verified is True
    assert tenant_state(m.storage).calibration("t").labels == 1
    m.clear("t")  # a cleared tenant starts its calibration again
    assert tenant_state(m.storage).calibration("t").labels == 0


def test_a_verification_at_a_similarity_a_hair_over_one_is_labelled(make_manager: Any) -> None:
    """An HNSW index re-scores from float16 vectors, so a match can come out at
    1.00005: the put that verifies it crashed on the feedback signal's range check (found
    by the full QQP run). The similarity is clamped to 1 for the label."""
    m = make_manager(CacheConfig(max_error_rate=0.02))
    held = m.put("held question", "the cached answer", tenant="t", embedding=unit(1)).entry_id
    engine = m.target if hasattr(m, "target") else m
    ticket = Ticket(held, 1.0000551490042169)
    engine.verifier.hold("t", "asked", "", ticket)
    result = m.put("asked", "the cached answer", tenant="t", embedding=unit(2))
    assert result and result.verified is True
    assert m.storage.get_entry("t", held).bandit_arm.alpha == pytest.approx(2.0)


# --- exact repeats under a bound ---------------------------------------------------------------
def exact_error(cal: Calibration, max_error_rate: float) -> float | None:
    """What serving every exact repeat (confirmed or not) spends of the bound, when
    ``exact_plan`` serves them all (a bar of 0); else ``None``."""
    bar, spend = cal.exact_plan(max_error_rate)
    return spend if bar == 0.0 else None


def test_exact_error_spends_the_bound_only_once_proven() -> None:
    few = Calibration(exact_right=20.0)
    assert exact_error(few, 0.05) is None  # under MIN_LABELS
    clean = Calibration(exact_right=400.0)
    assert exact_error(clean, 0.05) == pytest.approx(wilson_upper(0, 400))  # no counts: share 1
    assert exact_error(clean, 0.01) is None  # 0.7% is more than half of 1%
    # A tenth of the requests are exact repeats: what they cost is a tenth as much.
    cheap = Calibration(
        exact_right=380.0, exact_wrong=20.0, traffic_exact=1_000, traffic_other=9_000
    )
    spent = exact_error(cheap, 0.05)
    assert spent is not None and spent < 0.011
    # ...and the near matches work with what is left of the bound.
    base = counts(**{"0.93": (380, 20)})
    near_only = with_traffic(base, 9_000, **{"0.93": 1_000})
    both = Calibration(
        near_only.right, near_only.wrong, None, near_only.traffic, 8_000, None, 390.0, 10.0, 1_000
    )
    need = wilson_upper(1_000, 10_000) * wilson_upper(20, 400)  # the near matches' cost
    assert near_only.threshold(need * 1.01) == pytest.approx(0.93)
    assert near_only.threshold(need * 0.99) is None
    spent = exact_error(both, 1.0)
    assert spent is not None and spent < need
    # Both fit where their estimates and their margins, combined, do...
    joint = combined(both, 1.0, wilson_upper(1_000, 10_000) * wilson_upper(20, 400), 0.1 * 0.05)
    assert joint < spent + need  # (less than the sum of both bounds)
    assert both.threshold(joint * 1.001) == pytest.approx(0.93)
    assert both.threshold(joint * 0.999) is None  # ...and not in less
    # Where both do not fit, the bound goes where it serves more lookups: here the
    # exact repeats (1,000) and the near matches (1,000) tie, and the exact repeats keep it.
    assert exact_error(both, need) is not None and both.threshold(need) is None


def test_exact_levels_follow_the_expected_reward() -> None:
    assert [exact_level(r) for r in (0.5, 0.549, 0.55, 2 / 3, 0.75, 0.8, 0.95)] == [
        0, 0, 1, 2, 3, 4, 5,
    ]  # fmt: skip
    assert EXACT_LEVELS[0] == CONFIRMED_REWARD


def combined(cal: Calibration, bound: float, near_bound: float, near_estimate: float) -> float:
    """The error bound the near matches' estimate and bound need beside the exact repeats
    ``cal.exact_plan`` serves under ``bound``: both estimates plus their margins combined
    as independent errors."""
    _, estimate, spend = cal._exact_choice(bound)
    return estimate + near_estimate + math.hypot(spend - estimate, near_bound - near_estimate)


def levels(**by_level: tuple[float, float, float]) -> Calibration:
    """A calibration with exact-repeat labels and lookups per level ("l0".."l5": right,
    wrong, lookups) and 10,000 lookups in all."""
    right, wrong, traffic = [0.0] * 5, [0.0] * 5, [0.0] * 5
    r0 = w0 = t_all = 0.0
    for name, (r, w, t) in by_level.items():
        k = int(name[1:])
        t_all += t
        if k == 0:
            r0, w0 = r, w
        else:
            right[k - 1], wrong[k - 1], traffic[k - 1] = r, w, t
    return Calibration(
        traffic_other=10_000 - t_all,
        exact_right=r0,
        exact_wrong=w0,
        traffic_exact=t_all,
        level_right=tuple(right),
        level_wrong=tuple(wrong),
        level_traffic=tuple(traffic),
    )


def test_exact_repeats_and_near_matches_split_the_bound_to_serve_the_most() -> None:
    # A new tenant: entries confirmed by a positive signal are trusted, nothing is spent.
    assert Calibration().exact_plan(0.02) == (CONFIRMED_REWARD, 0.0)
    # One positive signal (level 2) is wrong 10% of the time, two (level 3) never in 200.
    cal = levels(l0=(50, 50, 1_000), l2=(90, 10, 2_000), l3=(200, 0, 1_000))
    bar, spend = cal.exact_plan(0.02)
    assert bar == EXACT_LEVELS[3 - 1]  # level 3 and up only
    expected = wilson_upper(1_000, 10_000) * wilson_upper(0, 200)
    assert spend == pytest.approx(expected)
    # A looser bound takes level 2 in as well; a tighter one, nothing. Without near
    # matches to serve, the exact repeats may have the whole bound.
    assert cal.exact_plan(0.04)[0] == CONFIRMED_REWARD  # level 1 has none: as level 2
    assert cal.exact_plan(0.3)[0] == 0.0  # every level, unconfirmed too
    assert cal.exact_plan(0.002) == (EXACT_LEVELS[3 - 1], spend)
    assert cal.exact_plan(0.001) == (NEVER, 0.0)  # labelled, none within: all verified
    # What the exact repeats spend, the near matches do without.
    near = with_traffic(counts(**{"0.93": (380, 20)}), 9_000, **{"0.93": 1_000})
    both = Calibration(
        near.right,
        near.wrong,
        None,
        near.traffic,
        cal.traffic_other - 1_000,  # the same 10,000 lookups
        None,
        cal.exact_right,
        cal.exact_wrong,
        cal.traffic_exact,
        cal.level_right,
        cal.level_wrong,
        cal.level_traffic,
    )
    need = wilson_upper(1_000, 10_000) * wilson_upper(20, 400)  # the near matches' cost
    assert both.lookups == near.lookups == 10_000
    joint = combined(both, 0.02, need, 0.1 * 0.05)
    fits, short = joint * 1.001, joint * 0.999
    assert both.exact_plan(fits) == both.exact_plan(short) == (bar, spend)
    assert both.threshold(fits) == pytest.approx(0.93)
    assert both.threshold(short) is None
    assert near.threshold(short) == pytest.approx(0.93)  # without exact repeats it fits
    # With three times the near matches, the bound goes to them: exact repeats verified.
    busy = with_traffic(counts(**{"0.93": (380, 20)}), 3_000, **{"0.93": 3_000})
    busy = dataclasses.replace(
        busy,
        exact_right=cal.exact_right,
        exact_wrong=cal.exact_wrong,
        traffic_exact=cal.traffic_exact,
        level_right=cal.level_right,
        level_wrong=cal.level_wrong,
        level_traffic=cal.level_traffic,
    )
    assert busy.lookups == 10_000
    need3 = wilson_upper(3_000, 10_000) * wilson_upper(20, 400)
    tight = need3 * 1.001
    assert busy.exact_plan(tight) == (NEVER, 0.0)
    assert combined(busy, 0.02, need3, 0.3 * 0.05) > tight  # both would not fit
    assert busy.threshold(tight) == pytest.approx(0.93)


def teach_levels(redis_client: redis.Redis, tenant: str) -> None:
    """Exact labels: entries with two positive signals (level 3) were right, with one
    (level 2) half of them were wrong; so a bound of 2% serves level 3 only."""
    st = RedisStorage(redis_client)
    for _ in range(400):
        tenant_state(st).label(tenant, 1.0, True, level=3)
    for _ in range(100):
        tenant_state(st).label(tenant, 1.0, True, level=2)
        tenant_state(st).label(tenant, 1.0, False, level=2)


def test_an_exact_repeat_is_served_at_the_level_its_labels_prove(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    teach_levels(redis_client, "t")
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    assert m.tenant_policy("t").exact_bar() == EXACT_LEVELS[3 - 1]
    v = unit(70)
    put = m.put("q", "a", tenant="t", embedding=v)
    m.feedback(FeedbackSignal(put.entry_id, "t", True))  # one positive: level 2
    assert m.lookup("q", tenant="t", embedding=v) is None  # not proven: verified
    fresh = m.put("q", "a", tenant="t", embedding=v)
    assert fresh.verified is True  # agreed: the fresh entry has one positive signal
    assert (
        tenant_state(m.storage).calibration("t").level_right[2 - 1] == 101.0
    )  # labelled at level 2
    m.feedback(FeedbackSignal(fresh.entry_id, "t", True))  # two: level 3
    hit = m.lookup("q", tenant="t", embedding=v)
    assert hit is not None and hit.exact and hit.entry_id == fresh.entry_id
    m.stats("t")  # writes the pending lookup counts: each at its entry's level
    cal = tenant_state(m.storage).calibration("t")
    assert cal.traffic_exact == 2.0
    assert (cal.level_traffic[2 - 1], cal.level_traffic[3 - 1]) == (1.0, 1.0)
    assert redis_client.hget(tenant_keys("t").cal, "tn") == b"2"  # a level's: not twice


def test_an_agreeing_put_with_settings_of_its_own_is_stored_anew(make_manager: Any) -> None:
    """The question's own entry is kept when the fresh answer agrees, unless the put sets
    a TTL, quality or metadata of its own: then the fresh entry replaces it, confirmed."""
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    v = unit(71)
    first = m.put("q", "a", tenant="t", embedding=v)
    assert m.lookup("q", tenant="t", embedding=v) is None  # unconfirmed: verified
    fresh = m.put("q", "a", tenant="t", embedding=v, metadata={"model": "v2"})
    assert fresh.verified is True and fresh.entry_id != first.entry_id
    assert fresh.replaced_id == first.entry_id
    hit = m.lookup("q", tenant="t", embedding=v)  # confirmed by the agreement: served
    assert hit is not None and hit.entry_id == fresh.entry_id and hit.metadata == {"model": "v2"}


def test_one_disagreement_is_not_a_verdict(make_manager: Any, redis_client: redis.Redis) -> None:
    """An LLM errs too: a verification whose fresh answer disagrees with the question's
    own entry keeps that entry (counted wrong meanwhile), records the fresh answer on it
    and holds it out; the next answer settles it. Here it agrees with the cached one: the
    entry stays and its label turns right."""
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    v = unit(64)
    first = m.put("q", "right", tenant="t", embedding=v)
    assert m.lookup("q", tenant="t", embedding=v) is None  # unconfirmed: verified
    slip = m.put("q", "a slip of the LLM", tenant="t", embedding=v)
    assert not slip.stored and slip.verified is False and slip.entry_id is None
    assert slip.compared_id == first.entry_id and slip.reason == DISPUTED
    key = tenant_keys("t").entry(first.entry_id)
    assert redis_client.hexists(key, "dsp")
    assert m.decide("q", tenant="t", embedding=v).reason == "disputed"  # unconfirmed too
    cal = tenant_state(m.storage).calibration("t")
    assert (cal.exact_right, cal.exact_wrong) == (0.0, 1.0)  # counted wrong for now
    # Held out, not served, whatever its level: the next answer settles it.
    m.feedback(FeedbackSignal(first.entry_id, "t", True))
    m.feedback(FeedbackSignal(first.entry_id, "t", True))
    assert m.lookup("q", tenant="t", embedding=v) is None
    assert m.awaiting_verification("q", tenant="t")
    again = m.put("q", "right", tenant="t", embedding=v)
    assert again.verified is True and again.entry_id == first.entry_id  # kept
    assert not redis_client.hexists(key, "dsp")
    cal = tenant_state(m.storage).calibration("t")
    assert cal.exact_wrong == 0.0 and cal.exact_right + sum(cal.level_right) == 2.0
    assert cal.labels == 0  # none of them a near-match label
    hit = m.lookup("q", tenant="t", embedding=v)
    assert hit is not None and hit.response == "right"


def test_two_answers_against_a_cached_one_replace_it(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    v = unit(60)
    first = m.put("q", "wrong answer", tenant="t", embedding=v)
    assert m.lookup("q", tenant="t", embedding=v) is None
    fresh = m.put("q", "right answer", tenant="t", embedding=v)
    assert not fresh.stored and fresh.verified is False
    assert m.lookup("q", tenant="t", embedding=v) is None  # disputed: verified again
    again = m.put("q", "right answer", tenant="t", embedding=v)
    assert again.stored and again.verified is False and again.replaced_id == first.entry_id
    assert not redis_client.exists(tenant_keys("t").entry(first.entry_id))
    cal = tenant_state(m.storage).calibration("t")
    assert (cal.exact_right, cal.exact_wrong, cal.labels) == (0.0, 2.0, 0.0)
    # The two fresh answers agree: the new entry is confirmed and served.
    hit = m.lookup("q", tenant="t", embedding=v)
    assert hit is not None and hit.response == "right answer"


def test_proven_exact_labels_serve_unconfirmed_entries(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    st = RedisStorage(redis_client)
    for _ in range(400):
        st.run(plan_label(st, "t", 1.0, True, exact=True))
    m = make_manager(CacheConfig(max_error_rate=0.05, verify_rate=0.0))
    v = unit(61)
    put = m.put("q", "a", tenant="t", embedding=v)
    hit = m.lookup("q", tenant="t", embedding=v)  # unconfirmed, but proven safe enough
    assert hit is not None and hit.entry_id == put.entry_id
    assert m.lookup("q", tenant="t", embedding=v, max_error_rate=0.01) is None  # not at 1%


def test_an_exact_repeat_is_never_served_another_question_instead(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    teach(redis_client, "t", {0.96: (400, 0)})  # near matches at 0.96 are safe
    m = make_manager(CacheConfig(max_error_rate=0.05, verify_rate=0.0))
    v = unit(62)
    other = m.put("other question", "other answer", tenant="t", embedding=near(v, 0.965, 63))
    m.feedback(FeedbackSignal(other.entry_id, "t", True))
    own = m.put("q", "own answer", tenant="t", embedding=v)
    assert m.lookup("q", tenant="t", embedding=v) is None  # its own entry is unconfirmed
    assert m.awaiting_verification("q", tenant="t")
    assert m.put("q", "own answer", tenant="t", embedding=v).entry_id == own.entry_id  # kept
    hit = m.lookup("q", tenant="t", embedding=v)
    assert hit is not None and hit.response == "own answer" and hit.exact


def test_an_exact_repeat_with_a_slightly_other_embedding_is_held_to_its_own_bar(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """The question asked again, its embedding a hair off its entry's (an embedding API
    that is not bit-exact; float16 rows re-scored): the lookup serves its best match in
    its first round trip, and the hit script, which knows the question's digest, still
    holds the entry to the level its labels must prove, as a ranked lookup does."""
    teach(redis_client, "t", {0.96: (400, 0)})  # near matches are safe: lookups speculate
    teach_levels(redis_client, "t")
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    v = unit(71)
    put = m.put("q", "a", tenant="t", embedding=v)
    m.feedback(FeedbackSignal(put.entry_id, "t", True))  # level 2: not proven
    off = near(v, 0.99999, 72)
    assert m.lookup("q", tenant="t", embedding=off) is None
    assert m.awaiting_verification("q", tenant="t")
    m.feedback(FeedbackSignal(put.entry_id, "t", True))  # level 3: proven
    hit = m.lookup("q", tenant="t", embedding=off)
    assert hit is not None and hit.exact and hit.entry_id == put.entry_id
    assert hit.similarity == 1.0


def test_an_exact_repeat_is_served_its_own_entry_before_a_clear_near_match(
    make_manager: Any,
) -> None:
    """The question is cached, but its entry is not what the index finds (put with
    another embedding): the clear best near match gives way in the hit script, and the
    lookup serves the question's own entry, as ranking does."""
    m = make_manager(CacheConfig(similarity_threshold=0.8))
    v = unit(80)
    near_one = m.put("another question", "another answer", tenant="t", embedding=v)
    own = m.put("q", "own answer", tenant="t", embedding=unit(81))
    hit = m.lookup("q", tenant="t", embedding=near(v, 0.99, 82))
    assert hit is not None and hit.entry_id == own.entry_id and hit.exact
    assert hit.response == "own answer"
    # Another question near it: the near match, served in the first round trip.
    other = m.lookup("q2", tenant="t", embedding=near(v, 0.99, 82))
    assert other is not None and other.entry_id == near_one.entry_id and not other.exact


def test_same_meaning_compares_answer_embeddings() -> None:
    vectors = {"Paris.": unit(70), "It is Paris": near(unit(70), 0.95, 71), "Lyon": unit(72)}
    judge = same_meaning(vectors.__getitem__, 0.9)
    assert judge("Paris.", "paris")  # the same text: no embedding needed
    assert judge("Paris.", "It is Paris") and not judge("Paris.", "Lyon")
    assert not same_meaning(vectors.__getitem__, 0.99)("Paris.", "It is Paris")
    with pytest.raises(ValueError, match="threshold"):
        same_meaning(vectors.__getitem__, 0)


@pytest.mark.parametrize("refresh_labels", [4, 1_000_000])
def test_a_replica_follows_new_labels_within_a_few_labels_whatever_the_clock(
    make_manager: Any, redis_client: redis.Redis, refresh_labels: int
) -> None:
    """Labels written elsewhere reach a replica's decisions through its lookups' round
    trips (the label stamp), not a timer: with a policy refresh of an hour, the replica
    serves a near match the new labels prove safe two lookups after it saw them."""
    config = CacheConfig(
        max_error_rate=0.05,
        verify_rate=0.0,
        policy_refresh_s=3600.0,
        policy_refresh_labels=refresh_labels,
    )
    m = make_manager(config)
    v = unit(90)
    put = m.put("a question", "its answer", tenant="t", embedding=v)
    m.feedback(FeedbackSignal(put.entry_id, "t", True))
    query = near(v, 0.965, 91)
    assert m.lookup("another", tenant="t", embedding=query) is None  # no labels: verify
    teach(redis_client, "t", {0.96: (400, 0)})  # another replica's verifications
    served = [m.lookup("another", tenant="t", embedding=query) is not None for _ in range(4)]
    # one lookup sees the stamp, the next reads the policy in its round trip, the third
    # decides with it
    assert served == ([False, False, True, True] if refresh_labels == 4 else [False] * 4)


def test_a_per_serve_ceiling_raises_the_threshold_beside_the_bound(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """``max_serve_error`` caps the error among the answers served: matches at 0.96 are
    wrong 1 time in 11, which a loose per-request bound allows and a ceiling of 2% does
    not; matches at 0.99 were never wrong."""
    teach(redis_client, "t", {0.96: (300, 30), 0.99: (300, 0)})
    loose = make_manager(CacheConfig(max_error_rate=0.5, verify_rate=0.0))
    capped = make_manager(CacheConfig(max_error_rate=0.5, max_serve_error=0.02, verify_rate=0.0))
    assert loose.tenant_policy("t").threshold() == pytest.approx(bin_floor_of(0.96))
    assert capped.tenant_policy("t").threshold() == pytest.approx(bin_floor_of(0.99))
    v = unit(21)
    put = loose.put("q", "a", tenant="t", embedding=v)
    loose.feedback(FeedbackSignal(put.entry_id, "t", True))
    assert loose.lookup("q2", tenant="t", embedding=near(v, 0.97, 22)) is not None
    assert capped.lookup("q3", tenant="t", embedding=near(v, 0.97, 22)) is None  # verified
    assert capped.lookup("q4", tenant="t", embedding=near(v, 0.995, 23)) is not None
    with pytest.raises(ValueError, match="max_serve_error"):
        CacheConfig(max_serve_error=1.5)


def bin_floor_of(similarity: float) -> float:
    return BIN_FLOOR + bin_of(similarity) * BIN_WIDTH


def test_the_level_a_reward_bar_serves() -> None:
    assert served_level(None) is None and served_level(NEVER) is None  # none served
    assert served_level(0.0) == 0  # any servable entry
    assert served_level(CONFIRMED_REWARD) == 1
    assert served_level(EXACT_LEVELS[-1]) == len(EXACT_LEVELS)
