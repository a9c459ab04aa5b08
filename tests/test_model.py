"""The public API across two replicas and the worker, against a simple Python model.

A hypothesis state machine drives two replicas on one server (a ``CacheManager`` and an
``AsyncCacheManager``, sharing an injected clock) and worker cycles (``Maintenance``)
with random puts (with and without a TTL), lookups of the exact question and of a near
copy, feedback, invalidations, clears and the clock moving on. The model is a dict of
questions to entries with their arms, written from the documented rules (not from the
library's code): a positive signal adds 1 to alpha, a negative one adds 1 to beta and,
from the second in a row, first forgets 3/4 of alpha's excess over the prior; arms decay
toward the prior by ``usage_decay`` per ``decay_interval_s``; an answer below the serving
bar is not served; the worker evicts expired entries and those below
``min_reward_to_keep``. After every step: Redis holds exactly the model's entries, each
readable, with the model's arm; no lookup ever served an entry the model does not hold
(invalidated, cleared, expired, replaced) or another question's answer.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio
from conftest import Blocking, Clock, close_loop, near, unit
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from prometheus_client import CollectorRegistry

from zerda_cache import (
    AsyncCacheManager,
    CacheConfig,
    CacheManager,
    EvictionConfig,
    FeedbackSignal,
    RLConfig,
)
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.testing import RedisServer
from zerda_cache.worker.maintenance import Maintenance

TENANT = "m"
DIM = 32
QUESTIONS = [f"question {i}" for i in range(4)]
VECTORS = {q: unit(1000 + i, DIM) for i, q in enumerate(QUESTIONS)}
#: Replicas serve near matches from 0.9; near copies are asked at 0.97; the questions'
#: own vectors are far apart, so a near copy of one never reaches another.
THRESHOLD, NEAR = 0.9, 0.97
assert (
    max(abs(float(VECTORS[a] @ VECTORS[b])) for a in QUESTIONS for b in QUESTIONS if a != b) < 0.6
)

PRIOR = 1.0
DECAY, INTERVAL = 0.5, 100.0
KEEP = 0.3  # min_reward_to_keep, the serving bar too: two complaints in a row reach it
FORGET = 0.25
RL = RLConfig(
    usage_decay=DECAY,
    decay_interval_s=INTERVAL,
    min_reward_to_keep=KEEP,
    negative_streak_forget=FORGET,
    seed=3,
)
CONFIG = CacheConfig(
    similarity_threshold=THRESHOLD,
    redis_timeout_s=2.0,  # the bound on waiting for a (tiny) index build
    rl=RL,
    eviction=EvictionConfig(max_entries=1_000),
)


@dataclass
class Arm:
    """The model's arm: alpha, beta as of time t, and the streak of negatives."""

    alpha: float
    beta: float
    t: float
    streak: int = 0

    def at(self, now: float) -> tuple[float, float]:
        if now <= self.t:
            return self.alpha, self.beta
        f = DECAY ** ((now - self.t) / INTERVAL)
        return PRIOR + (self.alpha - PRIOR) * f, PRIOR + (self.beta - PRIOR) * f

    def reward(self, now: float) -> float:
        a, b = self.at(now)
        return a / (a + b)

    def signal(self, positive: bool, now: float) -> None:
        self.alpha, self.beta = self.at(now)
        self.t = now
        if positive:
            self.alpha += 1.0
            self.streak = 0
        else:
            self.streak += 1
            if self.streak >= 2 and self.alpha > PRIOR:
                self.alpha = PRIOR + (self.alpha - PRIOR) * FORGET
            self.beta += 1.0


@dataclass
class Entry:
    entry_id: str
    answer: str
    expires_at: float
    arm: Arm


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


class TwoReplicasAndAWorker(RuleBasedStateMachine):
    url = ""  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.admin = redis.Redis.from_url(self.url)
        self.admin.flushall()
        self.clock = Clock(50_000.0)
        self.loop = asyncio.new_event_loop()
        sync = CacheManager(
            redis.Redis.from_url(self.url),
            CONFIG,
            clock=self.clock,
            metrics=ReplicaMetrics(CollectorRegistry()),
        )
        aio = AsyncCacheManager(
            redis.asyncio.Redis.from_url(self.url),
            CONFIG,
            clock=self.clock,
            metrics=ReplicaMetrics(CollectorRegistry()),
        )
        self.replicas: list[Any] = [sync, Blocking(aio, self.loop)]
        self.storage = RedisStorage(redis.Redis.from_url(self.url), CONFIG, clock=self.clock)
        self.worker = Maintenance(self.storage, worker_id="model")
        self.model: dict[str, Entry] = {}
        self.gone: set[str] = set()  # ids the model no longer holds: never to be served
        self.puts = 0

    def teardown(self) -> None:
        for r in self.replicas:
            r.close()
        self.storage.close()
        self.admin.close()
        close_loop(self.loop)

    # -- the model's view of time ------------------------------------------------------------
    def _live(self, q: str) -> Entry | None:
        entry = self.model.get(q)
        if entry is None or self.clock.t >= entry.expires_at:
            return None
        return entry

    def _drop(self, q: str) -> None:
        entry = self.model.pop(q, None)
        if entry is not None:
            self.gone.add(entry.entry_id)

    # -- rules --------------------------------------------------------------------------------
    @rule(
        replica=st.integers(0, 1),
        q=st.sampled_from(QUESTIONS),
        ttl=st.sampled_from([None, None, 50.5, 250.5]),
    )
    def put(self, replica: int, q: str, ttl: float | None) -> None:
        self.puts += 1
        answer = f"answer {self.puts} to {q}"
        res = self.replicas[replica].put(q, answer, tenant=TENANT, embedding=VECTORS[q], ttl_s=ttl)
        assert res.stored and res.entry_id not in self.gone
        old = self.model.get(q)
        if old is not None:  # the same question replaces its earlier entry
            assert res.replaced_id == old.entry_id
            self._drop(q)
        now = self.clock.t
        expires = math.inf if ttl is None else now + ttl
        self.model[q] = Entry(res.entry_id, answer, expires, Arm(PRIOR, PRIOR, now))

    def _question(self, data: st.DataObject) -> str:
        """Mostly a question the model holds (lookups of nothing find nothing)."""
        held = sorted(self.model)
        if held and data.draw(st.integers(0, 3)):
            return data.draw(st.sampled_from(held))
        return data.draw(st.sampled_from(QUESTIONS))

    @rule(replica=st.integers(0, 1), near_copy=st.booleans(), data=st.data())
    def lookup(self, replica: int, near_copy: bool, data: st.DataObject) -> None:
        q = self._question(data)
        vec = near(VECTORS[q], NEAR, seed=len(q)) if near_copy else VECTORS[q]
        text = f"how about {q}?" if near_copy else q
        hit = self.replicas[replica].lookup(text, tenant=TENANT, embedding=vec)
        if hit is not None:  # never a ghost, never another question's answer
            assert hit.entry_id not in self.gone
            assert hit.query == q
            assert hit.exact == (not near_copy)
        entry = self._live(q)
        event("lookup: " + ("hit" if hit else "miss") + (", near" if near_copy else ", exact"))
        if entry is None:
            if q in self.model:
                event("lookup: expired entry not served")
            assert hit is None
            return
        reward = entry.arm.reward(self.clock.t)
        if abs(reward - KEEP) < 1e-9:
            return  # on the bar: either answer is right
        if reward < KEEP:
            event("lookup: entry below the bar not served")
            assert hit is None  # below the serving bar
        else:
            assert hit is not None, (q, near_copy, reward)
            assert (hit.entry_id, hit.response) == (entry.entry_id, entry.answer)

    @rule(replica=st.integers(0, 1), positive=st.booleans(), data=st.data())
    def feedback(self, replica: int, positive: bool, data: st.DataObject) -> None:
        if not self.model:
            return
        q = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[q]
        self.replicas[replica].feedback(FeedbackSignal(entry.entry_id, TENANT, positive))
        entry.arm.signal(positive, self.clock.t)

    @rule(replica=st.integers(0, 1), q=st.sampled_from(QUESTIONS))
    def invalidate(self, replica: int, q: str) -> None:
        entry = self.model.get(q)
        if entry is None:
            return
        assert self.replicas[replica].invalidate(entry.entry_id, tenant=TENANT) is True
        self._drop(q)
        assert self.replicas[1 - replica].invalidate(entry.entry_id, tenant=TENANT) is False

    @rule(replica=st.integers(0, 1))
    def clear(self, replica: int) -> None:
        assert self.replicas[replica].clear(TENANT) == len(self.model)
        for q in list(self.model):
            self._drop(q)

    @rule(dt=st.sampled_from([1.0, 30.0, 120.0, 400.0]))
    def advance(self, dt: float) -> None:
        self.clock.t += dt

    @rule()
    def worker_cycle(self) -> None:
        """A decay cycle, then an eviction cycle: expired entries and those below
        ``min_reward_to_keep`` go; decay changes no arm's value (it is time-based)."""
        self.worker.run_decay()
        reports = self.worker.run_eviction()
        now = self.clock.t
        expired = {q for q, e in self.model.items() if now >= e.expires_at}
        low = {q for q, e in self.model.items() if q not in expired and e.arm.reward(now) < KEEP}
        removed = reports[0].removed if reports else {}
        assert removed.get("expired", 0) == len(expired)
        assert removed.get("low_reward", 0) == len(low)
        assert set(removed) <= {"expired", "low_reward"}
        for q in expired | low:
            self._drop(q)
        event(f"worker: evicted {len(expired)} expired, {len(low)} low reward")

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def redis_holds_the_model(self) -> None:
        keys = tenant_keys(TENANT)
        ids = {m.decode() for m in self.admin.zrange(keys.ids, 0, -1)}
        assert ids == {e.entry_id for e in self.model.values()}
        assert not self.admin.exists(keys.bad)  # no replica found anything undecodable
        exact = {v.decode() for v in self.admin.hvals(keys.q)}
        assert exact == ids  # the exact-match map points at live entries only
        now = self.clock.t
        for q, e in self.model.items():
            got = self.storage.get_entry(TENANT, e.entry_id, with_vector=False)
            assert (got.query, got.response) == (q, e.answer)
            arm = got.bandit_arm.at(now, RL)
            want = e.arm.at(now)
            assert _close(arm.alpha, want[0]) and _close(arm.beta, want[1]), (arm, want)
            assert np.isfinite(got.confidence_score)


@pytest.fixture
def model_server(server_kind: str) -> Iterator[RedisServer]:
    with RedisServer(kind=server_kind) as server:
        yield server


@pytest.mark.slow
def test_two_replicas_and_a_worker_agree_with_the_model(model_server: RedisServer) -> None:
    TwoReplicasAndAWorker.url = model_server.url
    run_state_machine_as_test(
        TwoReplicasAndAWorker,
        settings=settings(max_examples=150, stateful_step_count=30, deadline=None),
    )


def test_the_first_signal_on_an_old_entry_counts_whole(make_manager: Any) -> None:
    """An arm at its prior keeps the time it was put (decay has nothing to shrink), and
    the feedback script added the first signal to it without moving that time: the
    signal then read as decayed since the put, a day-old entry's first complaint at 24%
    of its weight (0.995 per 300 s). Found by the model test above."""
    clock = Clock(10_000.0)
    m = make_manager(CacheConfig(), clock=clock)
    eid = m.put("q", "a", tenant="t", embedding=unit(1)).entry_id
    clock.t += 86_400
    m.feedback(FeedbackSignal(eid, "t", False))
    arm = m.storage.get_entry("t", eid, with_vector=False).bandit_arm.at(clock.t, RLConfig())
    assert (arm.alpha, arm.beta) == (1.0, 2.0)
    clock.t += 300  # and from now on it decays as any evidence does
    arm = m.storage.get_entry("t", eid, with_vector=False).bandit_arm.at(clock.t, RLConfig())
    assert arm.beta == pytest.approx(1.995)
