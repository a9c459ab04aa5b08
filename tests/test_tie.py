"""A lookup's best candidate with rivals within ``similarity_tie_margin``: the hit script
serves it in the lookup's one round trip only when the bandit's ranking would put it
first whatever the Thompson draws, and otherwise returns the candidates' states, writing
nothing (hit.lua, ``StoragePlans.plan_hit``)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
from conftest import Clock, near, unit
from state_support import read_state, set_raw_state, write_state
from test_cold_start import counting_manager

from zerda_cache import CacheConfig, CacheManager, FeedbackSignal, RLConfig
from zerda_cache.core.entry import IntelligentCacheEntry
from zerda_cache.flows import lookup as lookup_module
from zerda_cache.learning.bandit import CONFIDENCE_WEIGHT, CachePolicyLearner
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.codec import query_digest
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.storage.plans import HitStatus

NOW = 1_000.0
UNASKED = query_digest("a question nobody cached")


@pytest.fixture
def storage(redis_client: redis.Redis) -> Iterator[RedisStorage]:
    yield RedisStorage(redis_client, CacheConfig(), clock=Clock(NOW))


def snapshot(client: redis.Redis) -> dict[bytes, bytes]:
    return {k: client.dump(k) for k in sorted(client.keys("*"))}


def composite_span(entry: IntelligentCacheEntry, sim: float, rl: RLConfig) -> tuple[float, float]:
    """The composite score's lowest and highest at ``NOW``, as ``score_candidates``
    computes it: an arm's mean, or any Thompson draw in [0, 1] for an arm with evidence
    (every arm in the seed's order)."""
    arm = entry.bandit_arm.at(NOW, rl)
    s, c = rl.similarity_bonus_scale, entry.confidence_score
    denom = 1.0 + s + CONFIDENCE_WEIGHT
    drawn = arm.pulls or rl.similarity_tie_margin >= 2
    rewards = (0.0, 1.0) if drawn else (arm.expected_reward,) * 2
    lo, hi = ((sim + s * r + CONFIDENCE_WEIGHT * c) / denom for r in rewards)
    return lo, hi


def test_a_tie_is_served_exactly_when_no_draw_can_rank_another_first(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    """Random ties: arms with and without evidence (some to decay), several scales and
    margins (2: the seed's order, every arm drawn), a rival gone, with a corrupt state
    or with its state lost, and half the cases on the edge. Served exactly when the
    leader's lowest composite is above every live rival's highest; then the learner
    ranks it first under any seed. Otherwise nothing is written, and the states come
    back as ``read_states`` reads them."""
    rng = random.Random(7)
    served = tied = 0
    tenant, st_key = "t", tenant_keys("t").st
    for case in range(150):
        redis_client.flushdb()
        rl = RLConfig(
            similarity_bonus_scale=rng.choice([0.0, 0.02, 0.5, 2.0]),
            similarity_tie_margin=rng.choice([0.01, 0.05, 2.0]),
        )
        n = rng.randint(2, 4)
        vecs = np.random.default_rng(case).normal(size=(n, 8))
        ids = [storage.put(tenant, f"q{i}", f"a{i}", vecs[i]).entry_id for i in range(n)]
        margin = min(rl.similarity_tie_margin, 0.05)
        sims = [0.9, *sorted((0.9 - rng.uniform(0, margin) for _ in ids[1:]), reverse=True)]
        for eid in ids:
            state = read_state(redis_client, tenant, eid)
            if rng.random() < 0.5:  # alpha/beta off the prior, to decay (pulls or none)
                state["arm"].update(
                    a=rng.uniform(1, 9), b=rng.uniform(1, 9), n=rng.randint(0, 3), t=NOW - 3600
                )
            state["use"]["c"] = rng.random()
            write_state(redis_client, tenant, eid, state)
        if rng.random() < 0.2:  # a rival gone from Redis (another replica's invalidation)
            storage.invalidate(tenant, ids[-1])
        # a rival the script cannot rank (the lookup will)
        unread = rng.random() < 0.2 and redis_client.hexists(st_key, ids[1])
        if unread and rng.random() < 0.5:
            set_raw_state(redis_client, tenant, ids[1], b"x")  # corrupt
        elif unread:
            redis_client.hdel(st_key, ids[1])  # its state lost, its hash kept
        live = [
            (e, sim) for e, sim in zip(ids[1:], sims[1:], strict=True) if e != ids[1] or not unread
        ]
        live = [(e, sim) for e, sim in live if redis_client.hexists(st_key, e)]
        before = storage.load_states(tenant, ids)
        if live and rng.random() < 0.5:
            # On the edge: the leader's confidence set so that its lowest composite is
            # a hair above or below the best rival's highest.
            top = max(composite_span(before.entries[e], sim, rl)[1] for e, sim in live)
            lead = read_state(redis_client, tenant, ids[0])
            drawn = lead["arm"]["n"] or rl.similarity_tie_margin >= 2
            arm = before.entries[ids[0]].bandit_arm.at(NOW, rl)
            mean = 0.0 if drawn else arm.expected_reward
            s_, w = rl.similarity_bonus_scale, CONFIDENCE_WEIGHT
            target = top + rng.choice([1e-9, -1e-9])
            lead["use"]["c"] = (target * (1.0 + s_ + w) - sims[0] - s_ * mean) / w
            write_state(redis_client, tenant, ids[0], lead)
            before = storage.load_states(tenant, ids)
        lowest = composite_span(before.entries[ids[0]], sims[0], rl)[0]
        expect = not unread and all(
            lowest > composite_span(before.entries[e], sim, rl)[1] for e, sim in live
        )
        rivals = list(zip(ids[1:], sims[1:], strict=True))
        kept = snapshot(redis_client)
        outcome = storage.hit(
            tenant, ids[0], similarity=sims[0], rl=rl, asked=UNASKED, rivals=rivals, candidates=ids
        )
        if expect:
            served += 1
            assert outcome.status is HitStatus.SERVED and outcome.states is None
            cands = []
            for eid, sim in zip(ids, sims, strict=True):
                if eid in before.entries:
                    entry = before.entries[eid]
                    entry.bandit_arm = entry.bandit_arm.at(NOW, rl)
                    cands.append((eid, sim, entry))
            cands.sort(key=lambda c: (-c[1], c[2].created_at, c[0]))
            for seed in range(30):
                learner = CachePolicyLearner(rl, rng=np.random.default_rng(seed))
                assert learner.score_candidates(cands, rl)[0][0][0] == ids[0]
        else:
            tied += 1
            assert outcome.status is HitStatus.TIED
            assert snapshot(redis_client) == kept  # nothing written
            assert outcome.states is not None
            assert outcome.states.entries == before.entries
            assert outcome.states.missing == before.missing
    assert served >= 30 and tied >= 30  # both ways, many times


def test_a_tie_refused_or_asked_exactly_costs_no_extra_round_trip(redis_server: Any) -> None:
    """The question's own entry leading a tie: served as such in the first round trip,
    whatever its rival with evidence might draw. A tie whose leader is under the
    serving bar: refused, with every candidate's state, so the rival is served in the
    second round trip, without a read of the states of its own."""
    cfg = CacheConfig(similarity_threshold=0.8, rl=RLConfig(min_reward_to_serve=0.4))
    client, m = counting_manager(redis_server.url, cfg)
    a = unit(1)
    best = m.put("qa", "answer a", tenant="s", embedding=a).entry_id
    twin = m.put("qt", "answer t", tenant="s", embedding=near(a, 0.999, seed=6)).entry_id
    query = near(a, 0.99, seed=7)
    assert abs(float(a @ query) - float(near(a, 0.999, seed=6) @ query)) < 0.01
    assert float(a @ query) > float(near(a, 0.999, seed=6) @ query)  # best leads
    m.feedback(FeedbackSignal(twin, "s", True))  # evidence: its draw may rank it first
    m.lookup("warm", tenant="s", embedding=unit(999))  # the policy and the clock
    client.trips = 0
    hit = m.lookup("qa", tenant="s", embedding=query)  # the leader's question, exactly
    assert hit is not None and hit.entry_id == best and hit.exact and client.trips == 1
    for _ in range(3):  # 1 / 5 < 0.4: under the serving bar
        m.feedback(FeedbackSignal(best, "s", False))
    client.trips = 0
    hit = m.lookup("q?", tenant="s", embedding=query)
    assert hit is not None and hit.entry_id == twin and client.trips == 2
    m.close()


def tie(m: CacheManager) -> tuple[str, str, Any]:
    """Two entries within the margin of a query, the first (``best``) more similar."""
    a = unit(1)
    best = m.put("qa", "answer a", tenant="s", embedding=a).entry_id
    twin = m.put("qt", "answer t", tenant="s", embedding=near(a, 0.999, seed=6)).entry_id
    query = near(a, 0.99, seed=7)
    gap = float(a @ query) - float(near(a, 0.999, seed=6) @ query)
    assert 0 < gap < 0.01
    m.lookup("warm", tenant="s", embedding=unit(999))  # the policy and the clock
    return best, twin, query


def test_a_tied_leader_the_script_cannot_prove_is_still_ranked(
    redis_server: Any, redis_client: redis.Redis
) -> None:
    """A rival with evidence, however poor, might draw high: the script replies tied, and
    the leader stays a candidate of the ranking, which serves it (a Beta(3, 40) draw
    above 0.5 has a chance under 1e-9)."""
    client, m = counting_manager(redis_server.url, CacheConfig(similarity_threshold=0.8))
    best, twin, query = tie(m)
    state = read_state(redis_client, "s", twin)
    state["arm"].update(a=3.0, b=40.0, n=41.0)
    write_state(redis_client, "s", twin, state)
    client.trips = 0
    hit = m.lookup("q?", tenant="s", embedding=query)
    assert hit is not None and hit.entry_id == best and client.trips == 2
    m.close()


def test_equal_composites_are_left_to_the_ranking(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    """Two entries without feedback at the same similarity and confidence: equal
    composites, which ranking orders by creation time, so the script proves neither."""
    ids = [storage.put("t", f"q{i}", f"a{i}", np.eye(8)[i]).entry_id for i in range(2)]
    for leader, rival in (ids, ids[::-1]):
        outcome = storage.hit(
            "t",
            leader,
            similarity=0.9,
            asked=UNASKED,
            rivals=[(rival, 0.9)],
            candidates=[leader, rival],
        )
        assert outcome.status is HitStatus.TIED
        assert outcome.states is not None and set(outcome.states.entries) == set(ids)


def test_a_tied_leader_with_a_corrupt_answer_is_skipped(
    redis_server: Any, redis_client: redis.Redis
) -> None:
    """The script serves a tie's leader whose answer does not decode here: not served
    (and no states in that reply), the rival is, as for a clear leader."""
    _, m = counting_manager(redis_server.url, CacheConfig(similarity_threshold=0.8))
    best, twin, query = tie(m)
    redis_client.hset(tenant_keys("s").entry(best), "doc", b"garbage")
    hit = m.lookup("q?", tenant="s", embedding=query)
    assert hit is not None and hit.entry_id == twin
    m.close()


def test_a_tie_of_more_candidates_than_the_script_takes_is_ranked(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``TIE_MAX`` candidates a tie is not passed to the script: its states are
    read first, then the ranked best served (two round trips)."""
    monkeypatch.setattr(lookup_module, "TIE_MAX", 1)
    client, m = counting_manager(redis_server.url, CacheConfig(similarity_threshold=0.8))
    best, _, query = tie(m)
    client.trips = 0
    hit = m.lookup("q?", tenant="s", embedding=query)
    assert hit is not None and hit.entry_id == best and client.trips == 2
    m.close()
