"""The match model (``match_model.py``): features of a candidate list, the fit, the
label log, the worker's publication with rescored counts, and replicas serving by the
model's score (real servers)."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner
from conftest import near
from conftest import unit as _unit
from state_support import tenant_state

from zerda_cache import CacheConfig
from zerda_cache.cli import cli
from zerda_cache.flows import counting
from zerda_cache.learning.calibration import Calibration, bin_of
from zerda_cache.learning.match_model import (
    FEATURES,
    MIN_FIT_LABELS,
    MatchModel,
    auc,
    candidate_features,
    fit,
    score_of,
)
from zerda_cache.learning.tenant_state import plan_label
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.worker.maintenance import Maintenance

DIM = 64


def unit(seed: int) -> np.ndarray:
    return _unit(seed, DIM)


# --- without a server ------------------------------------------------------------------------
def test_features_of_a_candidate_list() -> None:
    found = [("a", 0.95), ("b", 0.94), ("c", 0.90)]
    feats = candidate_features(found, 0.85)
    # a search knows no text: the text features are unknown
    assert all(len(f) == len(FEATURES) and all(map(math.isnan, f[3:])) for f in feats)
    assert feats[0][:3] == pytest.approx((0.95, 0.01, 1.0))  # b is within 0.02 of it
    assert feats[1][:3] == pytest.approx((0.94, 0.01, 1.0))  # the nearest other: above it
    assert feats[2][:3] == pytest.approx((0.90, 0.04, 0.0))
    assert candidate_features([("a", 0.9)], 0.85)[0][:3] == pytest.approx((0.9, 0.05, 0.0))
    assert candidate_features([], 0.85) == []


def synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Matches whose answer is right when the candidate is alone (gap >= 0.04), at any
    similarity: what similarity alone cannot tell, and the gap can (1% noise)."""
    rng = np.random.default_rng(seed)
    s = rng.uniform(0.86, 0.99, n)
    gap = rng.uniform(0, 1, n) * (s - 0.85)
    crowd = np.where(gap < 0.02, rng.integers(1, 4, n), 0).astype(float)
    right = (gap >= 0.04) ^ (rng.random(n) < 0.01)
    return np.column_stack([s, gap, crowd]), right


def test_the_fit_learns_what_similarity_alone_misses() -> None:
    x, y = synthetic(2_000)
    model = fit(x, y, version=1)
    p = np.array([model.p_right(r) for r in x])
    assert auc(p, y) > 0.97 > auc(x[:, 0], y) + 0.1
    assert model.p_right((0.90, 0.05, 0.0)) > 0.8 > 0.1 > model.p_right((0.95, 0.005, 2.0))
    # an unknown feature (feedback carries the similarity only) weighs nothing
    assert math.isfinite(model.p_right((0.9, math.nan, math.nan)))
    assert score_of(None, (0.91, 0.0, 0.0)) == 0.91
    assert 0.5 <= score_of(model, (0.91, 0.0, 0.0)) <= 1.0


def test_a_model_round_trips_and_damage_reads_as_none() -> None:
    model = fit(*synthetic(500), version=3)
    assert MatchModel.decode(model.encode()) == model
    bad = json.loads(model.encode())
    for broken in (
        "{",
        json.dumps({**bad, "v": 0}),
        json.dumps({**bad, "w": bad["w"][:2]}),
        json.dumps({**bad, "sd": [0.0, 1.0, 1.0]}),
        json.dumps({**bad, "mu": [float("nan"), 0.0, 0.0]}),
    ):
        assert MatchModel.decode(broken) is None
    assert MatchModel.decode(None) is None


# --- the label log and the worker's fit --------------------------------------------------------
def teach(st: RedisStorage, tenant: str, x: np.ndarray, y: np.ndarray, model: Any = None) -> None:
    pipe = st.client.pipeline(transaction=False)
    for row, ok in zip(x, y, strict=True):
        plan = plan_label(st, tenant, row[0], bool(ok), features=tuple(row), model=model)
        st.scripts.label(keys=plan.keys, args=plan.args, client=pipe)
    pipe.execute()


def test_labels_are_logged_with_their_features_and_capped(redis_client: redis.Redis) -> None:
    st = RedisStorage(redis_client, CacheConfig(label_window=50))
    x, y = synthetic(80)
    teach(st, "t", x, y)
    tenant_state(st).label("t", 0.93, True)  # feedback: the similarity only
    logs = tenant_state(st).label_logs("t")
    assert len(logs.y) == 50 and logs.logged == 81 and logs.fitted == 0
    assert logs.x[-1, 0] == 0.93 and np.isnan(logs.x[-1, 1:]).all()
    # logged with three features (the search's): the text ones read as unknown
    assert np.allclose(logs.x[-2, :3], x[-1]) and logs.y[-2] == y[-1]
    assert logs.x.shape[1] == len(FEATURES) and np.isnan(logs.x[-2, 3:]).all()
    assert tenant_state(st).calibration("t").labels <= 50  # the counts halve past the window too


def test_the_worker_publishes_a_better_model_with_rescored_counts(
    redis_client: redis.Redis,
) -> None:
    st = RedisStorage(redis_client)
    x, y = synthetic(MIN_FIT_LABELS * 2)
    teach(st, "t", x, y)
    st.run(plan_label(st, "t", 1.0, False, exact=True))  # an exact repeat's: no score
    st.run(plan_label(st, "t", 1.0, True, exact=True, level=3))  # at a confirmed level
    maint = Maintenance(st)
    report = maint.calibrate_tenant("t")
    assert report is not None and report.published and report.version == 1
    assert report.auc_model > report.auc_similarity
    assert maint.calibrate_tenant("t") is None  # not due: no new labels
    cal = tenant_state(st).calibration("t")
    assert cal.model is not None and cal.model.version == 1
    # labels without text features: a model of the search's three, no text guard
    assert not report.text and len(cal.model.mu) == 3 and not cal.model.weighs_text
    assert cal.labels == pytest.approx(len(y))  # rescored: every logged label, in score bins
    assert cal.exact_wrong == 1.0 and cal.level_right[3 - 1] == 1.0  # kept as they were
    assert redis_client.hget(tenant_keys("t").cal, "n") == str(len(y) + 2).encode()
    fields = redis_client.hgetall(tenant_keys("t").cal)
    left = [f for f in fields if f[:2] in (b"r:", b"w:") and f[2:3] != b"e"]
    assert not left  # no similarity bin is left
    # A label scored under the old version (a replica that has not read the model yet)
    # is logged, not counted; one under the new version is counted.
    teach(st, "t", x[:1], y[:1])
    assert tenant_state(st).calibration("t").labels == pytest.approx(len(y))
    teach(st, "t", x[:1], y[:1], model=cal.model)
    assert tenant_state(st).calibration("t").labels == pytest.approx(len(y) + 1)
    assert tenant_state(st).label_logs("t").logged == len(y) + 2
    # Publication is refused if another fit was published since the logs were read.
    assert not tenant_state(st).calibrate("t", 0, cal.model, 0, {})


def test_tenant_show_names_the_model(redis_client: redis.Redis, redis_url: str) -> None:
    st = RedisStorage(redis_client)
    st.set_tenant_settings("t", max_error_rate=0.02)
    x, y = synthetic(MIN_FIT_LABELS * 2)
    teach(st, "t", x, y)
    runner = CliRunner()
    before = runner.invoke(cli, ["--redis-url", redis_url, "tenant", "show", "t", "--json"])
    assert before.exit_code == 0 and json.loads(before.output)["match_model_version"] == 0
    assert Maintenance(st).calibrate_tenant("t") is not None
    shown = runner.invoke(cli, ["--redis-url", redis_url, "tenant", "show", "t", "--json"])
    assert json.loads(shown.output)["match_model_version"] == 1
    table = runner.invoke(cli, ["--redis-url", redis_url, "tenant", "show", "t"])
    assert table.exit_code == 0 and "version 1" in table.output, table.output


def test_a_model_no_better_than_similarity_is_not_published(redis_client: redis.Redis) -> None:
    st = RedisStorage(redis_client)
    rng = np.random.default_rng(5)
    s = rng.uniform(0.86, 0.99, 700)
    x = np.column_stack([s, rng.uniform(0, 0.05, 700), rng.integers(0, 3, 700)])
    teach(st, "t", x, rng.random(700) < (s - 0.8) * 5)  # the similarity says it all
    report = Maintenance(st).calibrate_tenant("t")
    assert report is not None and not report.published and report.version == 0
    assert tenant_state(st).calibration("t").model is None
    assert Maintenance(st).calibrate_tenant("t") is None  # the fit is recorded: not due


def test_too_few_labels_or_of_one_kind_fit_nothing(redis_client: redis.Redis) -> None:
    st = RedisStorage(redis_client)
    x, _ = synthetic(600)
    teach(st, "t", x, np.ones(600, dtype=bool))
    assert Maintenance(st).calibrate_tenant("t", force=True) is None
    x, y = synthetic(100)
    teach(st, "u", x, y)
    assert Maintenance(st).calibrate_tenant("u", force=True) is None


# --- replicas serve by the model ----------------------------------------------------------------
def test_replicas_serve_a_lone_match_and_verify_a_crowded_one_once_a_model_is_in(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    st = RedisStorage(redis_client)
    x, y = synthetic(1_500, seed=3)
    teach(st, "t", x, y)
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0, policy_refresh_s=0.05))
    q_alone, q_crowd = unit(1), unit(2)
    alone = m.put("alone", "a", tenant="t", embedding=near(q_alone, 0.91, 10))
    for i in range(2):  # two different cached questions, equally close to q_crowd
        m.put(f"crowd {i}", f"c{i}", tenant="t", embedding=near(q_crowd, 0.95, 20 + i))
    # Similarity bins alone: 0.91 is not safe (half the matches that close were crowded).
    assert m.lookup("lone question", tenant="t", embedding=q_alone) is None
    assert m.awaiting_verification("lone question", tenant="t")
    report = Maintenance(st).calibrate_tenant("t")
    assert report is not None and report.published
    time.sleep(0.1)  # the replicas' policy (with the model) is read again
    m.lookup("warm", tenant="t", embedding=unit(3))
    hit = m.lookup("lone question", tenant="t", embedding=q_alone)
    assert hit is not None and hit.entry_id == alone.entry_id
    assert m.lookup("crowded question", tenant="t", embedding=q_crowd) is None
    assert m.awaiting_verification("crowded question", tenant="t")
    # The verification's label carries the crowded match's features, under the model.
    m.put("crowded question", "c0", tenant="t", embedding=q_crowd)
    logs = tenant_state(st).label_logs("t")
    assert logs.x[-1, 2] == 1.0 and logs.x[-1, 1] < 0.02  # crowd 1, small gap
    # Lookups are counted in the model's bins, and sampled under the bound.
    m.stats("t")
    cal = tenant_state(st).calibration("t")
    assert cal.model is not None
    lone = cal.model.score(candidate_features([(alone.entry_id, hit.similarity)], 0.85)[0])
    assert cal.traffic[bin_of(lone)] >= 1 and cal.traffic_other >= 1  # "warm": no candidate
    assert len(tenant_state(st).label_logs("t").seen) == 4  # every lookup under the bound


def test_a_damaged_model_means_similarity_bins_again() -> None:
    fields = {b"mv": b"2", b"model": b"{", b"r2:90": b"5", b"r:90": b"7"}
    cal = Calibration.parse(fields, None)
    assert cal.model is None and cal.right[90] == 7.0


def test_the_lookup_sample_keeps_the_exact_repeats_share() -> None:
    import msgpack

    from zerda_cache.learning.calibration import LabelLogs
    from zerda_cache.worker.fitting import rescored

    blob = msgpack.packb([[0.9, 0.05, 0.0], None, "e", "e", [0.95, 0.0, 1.0], "e2", "e9"])
    logs = LabelLogs.parse([], [blob], [b"1", b"0", b"0"])
    assert (len(logs.seen), logs.seen_exact) == (3, 4)  # "e9": no such level, level 0
    assert logs.seen_levels[2] == 1 and sum(logs.seen_levels) == 1
    model = fit(*synthetic(500), version=2)
    counts = rescored(model, logs)
    assert counts["t:e"] == 4 and counts["t:e2"] == 1  # the exact repeats' levels too
    assert counts["t2:x"] == 1  # one window for every share
    assert sum(v for k, v in counts.items() if k.startswith("t2:")) == 3


# --- text features ------------------------------------------------------------------------------
def synthetic_text(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Matches at any similarity whose answer is wrong when the two questions' numbers
    differ (1% noise): what neither similarity nor gap can tell."""
    rng = np.random.default_rng(seed)
    s = rng.uniform(0.86, 0.99, n)
    gap = rng.uniform(0, 1, n) * (s - 0.85)
    numbers = (rng.random(n) < 0.3).astype(float)
    names = (rng.random(n) < 0.3).astype(float)
    right = (numbers == 0) ^ (rng.random(n) < 0.01)
    return np.column_stack([s, gap, np.zeros(n), numbers, names, np.zeros(n)]), right


def test_a_model_weighs_text_differences_and_masks_the_combinations() -> None:
    x, y = synthetic_text(2_000)
    model = fit(x, y, version=1)
    assert model.weighs_text
    same = model.score((0.93, 0.05, 0.0, 0.0, 0.0, 0.0))
    other = model.score((0.93, 0.05, 0.0, 1.0, 0.0, 0.0))
    assert same > 0.95 > 0.6 > other
    unknown = (0.93, 0.05, 0.0, math.nan, math.nan, math.nan)
    mask = model.text_mask(unknown, 0.9)
    # every combination without a numbers difference (bit 0) passes, none with one
    assert mask == "".join("0" if i & 1 else "1" for i in range(8))
    assert model.text_mask((0.93, 0.05, 0.0, 0.0, 1.0, 0.0), 0.9) == "1" * 8  # known
    assert model.text_mask((0.93, 0.05, 0.0, 1.0, 0.0, 0.0), 0.9) == "0" * 8
    # a model of the search's three features weighs no text, and still scores a full row
    old = fit(x[:, :3], y, version=1)
    assert not old.weighs_text
    assert old.score((0.93, 0.05, 0.0, 1.0, 0.0, 0.0)) == old.score((0.93, 0.05, 0.0))
    assert MatchModel.decode(old.encode()) == old
    # a column never known weighs nothing
    blind = x.copy()
    blind[:, 3:] = math.nan
    assert not fit(blind, y, version=1).weighs_text


def test_a_near_match_whose_numbers_differ_is_verified_not_served(
    make_manager: Any, redis_client: redis.Redis, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The replicas' lookup counts stay pending until the end (the bound weighs each bin by
    # its lookups: counts of some of these few lookups only would move the threshold
    # between them; nothing here calls stats before the end, which sends them too): this
    # is about the guard.
    monkeypatch.setattr(counting, "TRAFFIC_FLUSH_S", 1e9)
    st = RedisStorage(redis_client)
    tenant = f"txt-{flavour}"
    x, y = synthetic_text(1_500, seed=5)
    teach(st, tenant, x, y)
    report = Maintenance(st).calibrate_tenant(tenant)
    assert report is not None and report.published and report.text  # numbers decide here
    m = make_manager(CacheConfig(max_error_rate=0.05, verify_rate=0.0, policy_refresh_s=0.05))
    q = unit(7)
    cached_question = "What is the price of the iPhone 14?"
    cached = m.put(cached_question, "$799", tenant=tenant, embedding=q)
    asked = near(q, 0.95, 3)
    # the same numbers: served, at the model's score for "no numbers difference"
    same = m.decide("What's the price of an iPhone 14 today?", tenant=tenant, embedding=asked)
    assert same.hit is not None and same.hit.entry_id == cached.entry_id
    # another number: the hit script refuses it, the lookup asks for a verification
    other = m.decide("What is the price of the iPhone 15?", tenant=tenant, embedding=asked)
    assert other.kind == "verify" and other.reason == "near_unproven"
    assert other.candidate_id == cached.entry_id
    # and its label carries the difference the script found (numbers, no name, no negation)
    m.put("What is the price of the iPhone 15?", "$899", tenant=tenant, embedding=asked)
    logs = tenant_state(st).label_logs(tenant)
    assert tuple(logs.x[-1, 3:]) == (1.0, 0.0, 0.0) and not logs.y[-1]
    # the leader differs in numbers, the runner-up does not: the lookup ranks on and
    # serves the runner-up (its guard checked by the hit script too)
    q2 = unit(8)
    m.put("What does the Pixel 9 cost?", "$599", tenant=tenant, embedding=near(q2, 0.97, 4))
    runner = m.put("What does the Pixel 8 cost?", "$499", tenant=tenant, embedding=near(q2, 0.95))
    dec = m.decide("How much does the Pixel 8 cost?", tenant=tenant, embedding=q2)
    assert dec.hit is not None and dec.hit.entry_id == runner.entry_id, dec
    # the refusals served nothing, and the lookups were sampled with the differences
    # their round trip showed: served (none), refused by the guard (numbers)
    assert m.stats(tenant)["hits"] == 2  # (stats sends the pending counts too)
    seen = tenant_state(st).label_logs(tenant).seen
    rows = {tuple(r[3:]) for r in seen if np.isfinite(r[3:]).all()}
    assert {(0.0, 0.0, 0.0), (1.0, 0.0, 0.0)} <= rows
    # a candidate's question, read when no hit script runs (or None: gone)
    assert st.read(st.read_question(tenant, cached.entry_id)) == cached_question
    assert st.read(st.read_question(tenant, "no-such-entry")) is None


def test_a_level_field_of_superscript_digits_is_skipped_not_a_crash() -> None:
    """``"e\\xb2"[1:].isdigit()`` is true and ``int("\\xb2")`` raises: a calibration field
    or a lookup sample written by hand with a superscript level stopped the tenant's
    calibration from reading (a ValueError on every refresh). It is skipped, as any
    field that does not parse."""
    import msgpack

    from zerda_cache.learning.calibration import LabelLogs

    cal = Calibration.parse({"r:e\xb2".encode(): b"5", b"r:e2": b"3"}, None)
    assert sum(cal.level_right) == 3.0
    blob = msgpack.packb(["e\xb2", "e2"])
    logs = LabelLogs.parse([], [blob], [b"inf", b"1e400", b"0"])  # counters: unparsable, 0
    assert logs.seen_exact == 2 and sum(logs.seen_levels) == 1


@pytest.mark.parametrize(
    ("raw", "count"),
    [(b"12", 12), ("3.0", 3), (7.9, 7), (b"inf", 0), (b"nan", 0), (b"garbage", 0), (None, 0)],
)
def test_a_counter_is_read_by_one_helper(redis_client: redis.Redis, raw: Any, count: int) -> None:
    """The fit's label counters were read by two copies of one helper (calibration's
    ``_count``, replies' ``as_int``), each patched on its own. One reads them now
    (``core.validation.count_or_zero``), the same from the fit-due check as from the
    label logs' reader."""
    from zerda_cache.core import validation
    from zerda_cache.learning import calibration
    from zerda_cache.storage import tenant_plans

    assert validation.count_or_zero(raw) == count
    assert calibration.count_or_zero is validation.count_or_zero
    assert tenant_plans.count_or_zero is validation.count_or_zero
    st = RedisStorage(redis_client)
    cal = tenant_keys("t").cal
    if raw is None:
        redis_client.hset(cal, "fit_ln", 0)
    else:
        redis_client.hset(cal, mapping={"ln": raw, "fit_ln": 0})
    assert st.read(st.read_fit_due("t")) == count
