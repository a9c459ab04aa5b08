"""The eviction worker: eviction, decay, leader election, metrics (real servers)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from conftest import Clock
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from state_support import read_state, set_raw_state, set_state_value, tenant_state

from zerda_cache import CacheConfig, EvictionConfig, FeedbackSignal, RLConfig
from zerda_cache.core.errors import StorageError
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import RedisStorage, connect
from zerda_cache.storage.keys import leader_key, tenant_keys
from zerda_cache.worker.maintenance import Maintenance
from zerda_cache.worker.scheduler import Worker, check_health, health_problem

ROOT = Path(__file__).resolve().parents[1]
DIM = 8


def bulk_put(st: RedisStorage, tenant: str, n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    ids: list[str] = []
    for start in range(0, n, 1000):
        pipe = st.client.pipeline(transaction=False)
        calls = [
            st.plan_put(tenant, f"q{i}", f"a{i}", rng.normal(size=DIM))
            for i in range(start, min(n, start + 1000))
        ]
        for call in calls:
            st.scripts.put(keys=call.keys, args=call.args, client=pipe)
        ids += [call.parse(res).entry_id for call, res in zip(calls, pipe.execute(), strict=True)]
    st.client.sadd(st.tenants_key, tenant)
    return ids


# --- eviction -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_eviction_to_capacity_lowest_reward_first(redis_client: redis.Redis) -> None:
    clock = Clock(50_000.0)
    cfg = CacheConfig(eviction=EvictionConfig(max_entries=10_000), rl=RLConfig(usage_decay=1.0))
    st = RedisStorage(redis_client, cfg, clock=clock)
    ids = bulk_put(st, "big", 12_000)
    low = ids[:3_000]  # one negative signal each: expected reward 1/3
    worst = ids[3_000:3_010]  # 25 negative signals: below min_reward_to_keep
    st.feedback_many([FeedbackSignal(e, "big", False) for e in low])
    st.feedback_many([FeedbackSignal(e, "big", False) for e in worst for _ in range(25)])
    clock.t += 10

    m = Maintenance(st)
    plan = m.plan_eviction("big")
    assert plan.scanned == 12_000 and plan.complete
    assert {e for e, _ in plan.low_reward} == set(worst)
    target = plan.limits.target_entries  # 9,500: capacity minus the low watermark
    assert len(plan.capacity) == 12_000 - len(worst) - target
    assert {e for e, _ in plan.capacity} <= set(low)  # lowest reward first

    # Positive feedback after scoring: that entry survives this cycle.
    saved = plan.capacity[0][0]
    st.feedback(FeedbackSignal(saved, "big", True))
    report = m.execute(plan)
    assert report.removed == {"low_reward": 10, "capacity": len(plan.capacity) - 1}
    assert report.kept_changed == 1
    count = st.count("big")
    assert count <= 10_000 and count == target + 1
    assert st.get_entry("big", saved, with_vector=False).bandit_arm.pulls == 2

    # No key of an evicted entry remains, anywhere.
    k = tenant_keys("big")
    evicted = [e for e, _ in plan.capacity if e != saved] + worst
    pipe = redis_client.pipeline(transaction=False)
    for e in evicted:
        pipe.exists(k.entry(e))
    assert sum(pipe.execute()) == 0
    live = {x.decode() for x in redis_client.zrange(k.ids, 0, -1)}
    assert not live & set(evicted)
    assert not {v.decode() for v in redis_client.hvals(k.q)} & set(evicted)
    dels = {f[b"id"].decode() for _, f in redis_client.xrange(k.log) if f[b"op"] == b"del"}
    assert set(evicted) <= dels
    s = st.stats("big")
    assert s["evicted:capacity"] == len(plan.capacity) - 1 and s["evicted:low_reward"] == 10
    live_bytes = 0
    for batch in st.iter_ids("big"):
        states = st.load_states("big", [e for e, _ in batch]).entries
        live_bytes += sum(entry.size_bytes for entry in states.values())
    assert s["bytes"] == live_bytes


def test_expired_corrupt_and_byte_capacity(redis_client: redis.Redis) -> None:
    clock = Clock(50_000.0)
    st = RedisStorage(redis_client, CacheConfig(), clock=clock)
    ids = bulk_put(st, "t", 40)
    st.set_tenant_settings("t", max_bytes=20 * st.get_entry("t", ids[0]).size_bytes)
    short = st.put("t", "short-lived", "x", np.ones(DIM), ttl_s=5).entry_id
    set_raw_state(redis_client, "t", ids[1], b"\xc1")
    clock.t += 10
    m = Maintenance(st)
    plan = m.plan_eviction("t")
    assert plan.expired == [short] and plan.corrupt == [ids[1]]
    report = m.execute(plan)
    assert report.removed["expired"] == 1 and report.removed["corrupt"] == 1
    limits = m.limits("t")
    assert limits.max_bytes is not None and limits.target_bytes is not None
    assert st.stats("t")["bytes"] <= limits.target_bytes
    assert m.plan_eviction("t").total == 0  # nothing left to do


def test_evictions_go_in_calls_of_at_most_evict_batch(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of the evict script holds the server's one thread: capacity evictions go
    in calls of at most ``EVICT_BATCH`` entries, whatever ``scan_batch`` is, at most
    ``EVICT_IN_FLIGHT`` at once, and all of them are carried out, each call a run of the
    ids in their order (the ids zset's own order for entries of equal expiry, which
    keeps its skiplist's walks in the server's caches)."""
    from zerda_cache.worker.maintenance import EVICT_BATCH, EVICT_IN_FLIGHT

    monkeypatch.setattr("zerda_cache.worker.maintenance.EVICT_BATCH", 7)
    cfg = CacheConfig(eviction=EvictionConfig(scan_batch=500, low_watermark=0.0))
    st = RedisStorage(redis_client, cfg, clock=Clock(50_000.0))
    ids = sorted(bulk_put(st, "t", 60))
    # The 20 last ids in id order score lowest, the last one lowest of all: the plan
    # lists them the other way round.
    st.feedback_many(
        [FeedbackSignal(e, "t", False, magnitude=1.0 + 0.1 * k) for k, e in enumerate(ids[40:])]
    )
    st.set_tenant_settings("t", max_entries=40)
    calls: list[list[str]] = []
    running, most = 0, 0
    lock = threading.Lock()
    evict = st.evict

    def counted(tenant: str, items: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal running, most
        with lock:
            calls.append([eid for eid, _ in items])
            running += 1
            most = max(most, running)
        try:
            return evict(tenant, items, *args, **kwargs)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(st, "evict", counted)
    report = Maintenance(st).evict_tenant("t")
    assert report.removed == {"capacity": 20} and st.count("t") == 40
    assert sorted(len(call) for call in calls) == [6, 7, 7]
    assert [eid for call in sorted(calls) for eid in call] == ids[40:]
    assert 1 <= most <= EVICT_IN_FLIGHT
    assert (EVICT_BATCH, EVICT_IN_FLIGHT) == (50, 2)  # the defaults the docstrings name


def test_a_stop_during_the_removals_sends_no_further_call(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm stop (SIGTERM) during the removals: the calls already under way finish
    and are counted, no other is sent (``EVICT_IN_FLIGHT`` at most), and the plan's
    feedback mark is not kept (the next cycle reads those signals again)."""
    from zerda_cache.worker.maintenance import EVICT_IN_FLIGHT

    monkeypatch.setattr("zerda_cache.worker.maintenance.EVICT_BATCH", 3)
    cfg = CacheConfig(eviction=EvictionConfig(scan_batch=500, low_watermark=0.0))
    st = RedisStorage(redis_client, cfg, clock=Clock(50_000.0))
    bulk_put(st, "t", 60)
    st.set_tenant_settings("t", max_entries=30)  # 30 to remove: 10 calls of 3
    stop = threading.Event()
    m = Maintenance(st, stop=stop)
    plan = m.plan_eviction("t")
    assert len(plan.capacity) == 30
    calls = 0
    evict = st.evict

    def stopping(tenant: str, items: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        out = evict(tenant, items, *args, **kwargs)
        stop.set()  # SIGTERM arrives once the first call is done
        return out

    monkeypatch.setattr(st, "evict", stopping)
    report = m.execute(plan)
    assert 1 <= calls <= EVICT_IN_FLIGHT
    assert report.removed == {"capacity": 3 * calls} and st.count("t") == 60 - 3 * calls
    assert "t" not in m.planner.feedback_marks


def test_a_whole_scan_reads_state_in_calls_of_at_most_state_batch(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan's reads hold the server's one thread too: each ZSCAN step's ids are read
    in calls of the state script of at most ``STATE_BATCH``, and the plan is the one a
    single call per step makes."""
    from zerda_cache.worker.maintenance import STATE_BATCH

    cfg = CacheConfig(eviction=EvictionConfig(scan_batch=500, low_watermark=0.0))
    st = RedisStorage(redis_client, cfg, clock=Clock(50_000.0))
    ids = bulk_put(st, "t", 60)
    st.feedback_many([FeedbackSignal(e, "t", i % 3 == 0) for i, e in enumerate(ids[:30])])
    st.set_tenant_settings("t", max_entries=40)
    sizes: list[int] = []
    state_arrays = st.state_arrays

    def counted(tenant: str, entry_ids: Any, **kw: Any) -> Any:
        sizes.append(len(entry_ids))
        return state_arrays(tenant, entry_ids, **kw)

    monkeypatch.setattr(st, "state_arrays", counted)
    monkeypatch.setattr("zerda_cache.worker.maintenance.STATE_BATCH", 100)
    whole = Maintenance(st).plan_eviction("t")
    assert sizes == [60]
    sizes.clear()
    monkeypatch.setattr("zerda_cache.worker.maintenance.STATE_BATCH", 7)
    split = Maintenance(st).plan_eviction("t")
    assert sorted(sizes) == [4] + [7] * 8
    assert split.scanned == whole.scanned == 60 and split.bytes_scanned == whole.bytes_scanned
    assert split.capacity == whole.capacity and len(split.capacity) == 20
    assert split.low_reward == whole.low_reward
    assert STATE_BATCH == 500  # the default the docstrings name


def test_a_whole_scan_reads_ahead_in_threads_that_end_with_it(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan takes its ZSCAN steps and state reads ahead of the batch it scores, in
    threads: the plan is the same at any depth, and the threads end with the scan, when
    it is stopped midway, when its caller fails and when a read fails."""
    cfg = CacheConfig(eviction=EvictionConfig(scan_batch=20, low_watermark=0.0))
    st = RedisStorage(redis_client, cfg, clock=Clock(50_000.0))
    ids = bulk_put(st, "t", 300)
    st.feedback_many([FeedbackSignal(e, "t", i % 3 == 0) for i, e in enumerate(ids[:90])])
    st.set_tenant_settings("t", max_entries=250)

    def scan_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("zerda-scan")]

    plans = []
    for depth in (0, 1, 2, 3):
        m = Maintenance(st)
        m.read_ahead = depth
        plans.append(m.plan_eviction("t"))
    assert all(p.scanned == 300 and p.complete for p in plans)
    assert len({tuple(sorted(p.capacity)) for p in plans}) == 1 and len(plans[0].capacity) == 50
    assert len({tuple(sorted(p.low_reward)) for p in plans}) == 1
    assert scan_threads() == []

    stop = threading.Event()
    m = Maintenance(st, stop=stop)
    seen: list[int] = []

    def progress(n: int) -> None:
        seen.append(n)
        stop.set()  # asked to stop after the first batch

    halted = m.plan_eviction("t", progress=progress)
    assert not halted.complete and halted.capacity == [] and len(seen) == 1
    assert scan_threads() == []

    def failing_progress(n: int) -> None:
        raise RuntimeError("the caller's own error")

    with pytest.raises(RuntimeError) as caught:  # its traceback holds the scan's frame
        Maintenance(st).plan_eviction("t", progress=failing_progress)
    assert caught.value.__traceback__ is not None and scan_threads() == []

    iter_ids = st.iter_ids

    def failing(tenant: str, batch: int | None = None) -> Any:
        it = iter_ids(tenant, batch)
        yield next(it)
        raise StorageError("iter_ids failed: the server went away")

    monkeypatch.setattr(st, "iter_ids", failing)
    with pytest.raises(StorageError, match="went away"):
        Maintenance(st).plan_eviction("t")
    assert scan_threads() == []


def test_an_id_whose_entry_is_gone_is_planned_as_dangling_and_cleaned(
    redis_client: redis.Redis,
) -> None:
    """An id left in the ids zset after its hash and state went (hand-made damage, a
    half-applied script) is found by the whole scan, whatever batch it is in, and removed
    from the tenant's structures as already gone, not counted as evicted."""
    cfg = CacheConfig(eviction=EvictionConfig(scan_batch=20))
    st = RedisStorage(redis_client, cfg, clock=Clock(50_000.0))
    ids = bulk_put(st, "t", 100)
    k = tenant_keys("t")
    gone = sorted(ids)[:3]
    redis_client.delete(*(k.entry(e) for e in gone))
    redis_client.hdel(k.st, *gone)
    m = Maintenance(st)
    plan = m.plan_eviction("t")
    assert sorted(plan.dangling) == gone and plan.scanned == 97 and plan.capacity == []
    report = m.execute(plan)
    assert report.already_gone == 3 and sum(report.removed.values()) == 0
    assert redis_client.zcard(k.ids) == 97 and st.count("t") == 97


def test_a_tenant_within_capacity_is_evicted_without_a_scan(redis_client: redis.Redis) -> None:
    """Between whole scans, a tenant within its capacity is read incrementally: its
    expired ids, the ids replicas reported, and the arms that got a signal since the
    last plan this process carried out (its feedback stream)."""
    clock = Clock(50_000.0)
    st = RedisStorage(redis_client, CacheConfig(), clock=clock)
    ids = bulk_put(st, "t", 60)
    m = Maintenance(st)
    first = m.plan_incremental("t")
    assert first is None  # no whole scan yet in this process: one is made
    m.evict_tenant("t")  # ...and it fills the evidence list too (nothing had evidence)
    assert st.evidence_complete("t") is False  # no decay pass yet: the list is not known
    Maintenance(st).decay_tenant("t")
    assert st.evidence_complete("t")

    st.feedback_many([FeedbackSignal(ids[0], "t", False, magnitude=40.0)])  # bad answer
    st.feedback_many([FeedbackSignal(ids[1], "t", True)])  # a liked one
    short = st.put("t", "short-lived", "x", np.ones(DIM), ttl_s=5).entry_id
    set_raw_state(redis_client, "t", ids[2], b"\xc1")  # no scan finds it
    clock.t += 10
    plan = m.plan_incremental("t")
    assert plan is not None and plan.incremental
    assert plan.scanned == 2  # the two arms with a signal, not the 61 entries
    assert plan.expired == [short] and [e for e, _ in plan.low_reward] == [ids[0]]
    assert plan.corrupt == [] and plan.capacity == []
    report = m.evict_tenant("t")  # a plan not carried out reads the same signals again
    assert report.removed == {"expired": 1, "low_reward": 1}
    assert st.count("t") == 59
    # Carried out: the next plan reads only the signals after it.
    plan = m.plan_incremental("t")
    assert plan is not None and plan.scanned == 0 and plan.total == 0
    st.feedback_many([FeedbackSignal(ids[3], "t", False, magnitude=40.0)])
    plan = m.plan_incremental("t")
    assert plan is not None and plan.scanned == 1
    assert [e for e, _ in plan.low_reward] == [ids[3]]
    # More signals than the stream keeps since then: every arm with evidence is read.
    redis_client.xtrim(tenant_keys("t").fb, maxlen=0)
    st.feedback_many([FeedbackSignal(ids[4], "t", True)])
    plan = m.plan_incremental("t")
    assert plan is not None and plan.scanned == 3  # ids[1], ids[3], ids[4]
    assert [e for e, _ in plan.low_reward] == [ids[3]]
    m.execute(plan)
    assert st.count("t") == 58

    # Over capacity, the victims are the lowest scores of all: a whole scan.
    st.set_tenant_policy("t", {"max_entries": 50})
    assert m.plan_incremental("t") is None
    # A whole scan at least every full_scan_interval_s: it finds the corrupt state.
    st.set_tenant_policy("t", {"max_entries": None})
    always = CacheConfig(eviction=EvictionConfig(full_scan_interval_s=0.0))
    whole = Maintenance(RedisStorage(redis_client, always, clock=clock))
    assert whole.evict_tenant("t").removed == {"corrupt": 1}
    assert whole.plan_incremental("t") is None
    assert redis_client.zscore(tenant_keys("t").ids, ids[2]) is None


def test_tenant_settings_override_and_validation(redis_client: redis.Redis) -> None:
    st = RedisStorage(redis_client)
    bulk_put(st, "small", 30)
    st.set_tenant_settings("small", max_entries=20)
    m = Maintenance(st)
    assert m.limits("small").max_entries == 20
    m.evict_tenant("small")
    assert st.count("small") == 19  # 20 minus the 5% low watermark
    st.set_tenant_settings("small", max_entries=None)
    assert m.limits("small").max_entries == 10_000
    with pytest.raises(ValueError, match="max_entries"):
        st.set_tenant_settings("small", max_entries=-1)
    with pytest.raises(ValueError, match="unknown"):
        st.set_tenant_settings("small", colour=3)  # type: ignore[arg-type]


# --- decay ----------------------------------------------------------------------------------------
def test_decay_cycle_is_persisted_and_never_doubled(redis_client: redis.Redis) -> None:
    clock = Clock(50_000.0)
    cfg = CacheConfig(rl=RLConfig(usage_decay=0.5, decay_interval_s=100.0))
    st = RedisStorage(redis_client, cfg, clock=clock)
    ids = bulk_put(st, "t", 50)
    st.feedback_many([FeedbackSignal(e, "t", True, magnitude=8.0) for e in ids])
    clock.t += 100
    reports = [Maintenance(st).decay_tenant("t")]
    assert reports[0].decayed == 50
    arms = st.load_states("t", ids).entries
    assert all(a.bandit_arm.alpha == pytest.approx(1 + 8 * 0.5) for a in arms.values())
    # A restarted worker, and two cycles at once, at the same instant: no second decay.
    Maintenance(st).decay_tenant("t")
    threads = [threading.Thread(target=Maintenance(st).decay_tenant, args=("t",)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = st.load_states("t", ids).entries
    assert {e: a.bandit_arm for e, a in again.items()} == {e: a.bandit_arm for e, a in arms.items()}


def test_decay_visits_only_arms_with_evidence_once_the_tenant_was_scanned(
    redis_client: redis.Redis,
) -> None:
    """The feedback script keeps a list of the arms with evidence; after one full scan
    (for data written before the list existed) the decay job reads only that list."""
    clock = Clock(50_000.0)
    cfg = CacheConfig(rl=RLConfig(usage_decay=0.5, decay_interval_s=100.0))
    st = RedisStorage(redis_client, cfg, clock=clock)
    keys = tenant_keys("t")
    ids = bulk_put(st, "t", 40)
    st.feedback_many([FeedbackSignal(e, "t", True, magnitude=8.0) for e in ids[:10]])
    assert redis_client.smembers(keys.ev) == {e.encode() for e in ids[:10]}
    # Data from before the list: an arm with evidence that the list does not have.
    redis_client.srem(keys.ev, ids[0])
    assert not st.evidence_complete("t")
    clock.t += 100
    first = Maintenance(st).decay_tenant("t")  # a full scan: it finds ids[0] too
    assert first.decayed == 10 and st.evidence_complete("t")
    assert redis_client.scard(keys.ev) == 10
    # From now on only the list is read: an arm with evidence missing from it is not
    # decayed (this is what shows the scan is gone), and a gone entry leaves the list.
    redis_client.srem(keys.ev, ids[1])
    st.invalidate("t", ids[2])
    redis_client.sadd(keys.ev, "f" * 32)  # an id with no entry behind it
    clock.t += 100
    second = Maintenance(st).decay_tenant("t")
    assert second.decayed == 8 and second.missing == 1
    assert b"f" * 32 not in redis_client.smembers(keys.ev)
    arms = st.load_states("t", ids[:4]).entries
    assert arms[ids[0]].bandit_arm.alpha == pytest.approx(1 + 8 * 0.25)
    assert arms[ids[1]].bandit_arm.alpha == pytest.approx(1 + 8 * 0.5)  # skipped
    assert arms[ids[3]].bandit_arm.alpha == pytest.approx(1 + 8 * 0.25)
    # Losing the settings hash (allkeys-*) loses the flag: the next pass scans again.
    redis_client.hdel(keys.cfg, "evx")
    clock.t += 100
    assert Maintenance(st).decay_tenant("t").decayed == 9
    assert st.get_entry("t", ids[1]).bandit_arm.alpha == pytest.approx(1 + 8 * 0.125)


def test_decay_goes_in_calls_of_at_most_decay_batch(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of the decay script holds the server's one thread: the decay job and the
    whole scan persist decay in calls of at most ``DECAY_BATCH`` arms, whatever
    ``scan_batch`` is, every arm once; the list is flagged complete only by the call
    that ends a whole scan."""
    from zerda_cache.worker.maintenance import DECAY_BATCH

    monkeypatch.setattr("zerda_cache.worker.maintenance.DECAY_BATCH", 7)
    clock = Clock(50_000.0)
    eviction = EvictionConfig(scan_batch=500)
    cfg = CacheConfig(rl=RLConfig(usage_decay=0.5, decay_interval_s=100.0), eviction=eviction)
    st = RedisStorage(redis_client, cfg, clock=clock)
    ids = bulk_put(st, "t", 40)
    st.feedback_many([FeedbackSignal(e, "t", True, magnitude=8.0) for e in ids[:20]])
    redis_client.hdel(tenant_keys("t").cfg, "evx")  # as data from before the list
    calls: list[tuple[int, bool]] = []
    decay = st.decay

    def counted(tenant: str, items: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((len(items), bool(kwargs.get("complete"))))
        return decay(tenant, items, *args, **kwargs)

    monkeypatch.setattr(st, "decay", counted)
    clock.t += 100
    first = Maintenance(st).decay_tenant("t")  # the whole scan, then the flag alone
    assert first.decayed == 20 and st.evidence_complete("t")
    assert calls == [(7, False), (7, False), (6, False), (0, True)]
    calls.clear()
    clock.t += 100
    assert Maintenance(st).decay_tenant("t").decayed == 20  # the list, read by SSCAN
    assert sum(n for n, _ in calls) == 20 and all(n <= 7 for n, _ in calls)
    assert not any(flag for _, flag in calls)
    arms = st.load_states("t", ids[:20]).entries
    assert all(a.bandit_arm.alpha == pytest.approx(1 + 8 * 0.25) for a in arms.values())
    assert DECAY_BATCH == 100  # the default the docstrings name


def test_decay_job_persists_a_share_of_the_list_at_each_run(redis_client: redis.Redis) -> None:
    """Each run of the decay job takes the next decay_job_interval_s / decay_sweep_s of
    the arms with evidence (at least a batch), where the last run stopped: every arm is
    persisted once a sweep, and a run costs a share of the list."""
    clock = Clock(50_000.0)
    eviction = EvictionConfig(scan_batch=10, decay_job_interval_s=300.0, decay_sweep_s=1200.0)
    cfg = CacheConfig(rl=RLConfig(usage_decay=0.5, decay_interval_s=100.0), eviction=eviction)
    st = RedisStorage(redis_client, cfg, clock=clock)
    ids = bulk_put(st, "t", 400)  # over 128 arms: a hash table, which SSCAN walks in steps
    st.feedback_many([FeedbackSignal(e, "t", True, magnitude=8.0) for e in ids[:300]])
    m = Maintenance(st)
    m.decay_tenant("t")  # the list is not known yet: one whole scan fills it
    assert st.evidence_complete("t")
    clock.t += 100
    runs = []
    while not runs or not runs[-1].swept:
        runs.append(m.decay_tenant("t"))
        assert len(runs) <= 6
    # A quarter of 300 per run (75; SSCAN may return a little more), all of them once.
    assert 3 <= len(runs) <= 5 and all(r.decayed >= 75 for r in runs[:-1])
    assert sum(r.decayed for r in runs) == 300
    arms = st.load_states("t", ids[:300]).entries
    assert all(a.bandit_arm.alpha == pytest.approx(1 + 8 * 0.5) for a in arms.values())
    # The next sweep starts over: the first run again takes a share, not everything.
    clock.t += 100
    again = m.decay_tenant("t")
    assert 75 <= again.decayed < 300 and not again.swept


# --- the worker process ---------------------------------------------------------------------------
def spawn_worker(url: str, worker_id: str, tmp: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        str(ROOT / "workers" / "eviction_worker.py"),
        "--redis-url", url,
        "--worker-id", worker_id,
        "--lease-ttl", "1.5",
        "--decay-job-interval", "0.3",
        "--eviction-interval", "0.3",
        "--metrics-interval", "0.3",
        "--metrics-port", "0",
        "--health-file", str(tmp / f"{worker_id}.health"),
        "--log-level", "WARNING",
        *extra,
    ]  # fmt: skip
    with open(tmp / f"{worker_id}.log", "wb") as log:  # the child keeps its own handle
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def holder(client: redis.Redis) -> str | None:
    raw = client.get(leader_key())
    return raw.decode().rsplit(":", 1)[0] if raw else None


def wait_until(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def cycles(client: redis.Redis) -> list[tuple[float, str, str, str]]:
    out = []
    for sid, f in client.xrange("zc:worker:cycles"):
        ms, seq = sid.decode().split("-")
        out.append(
            (
                int(ms) + int(seq) / 1e6,
                f[b"worker"].decode(),
                f[b"job"].decode(),
                f[b"phase"].decode(),
            )
        )
    return out


@pytest.mark.slow
def test_one_leader_takeover_after_kill_and_no_overlap(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    st = RedisStorage(redis_client)
    bulk_put(st, "t", 300)
    procs = {w: spawn_worker(redis_url, w, tmp_path) for w in ("w1", "w2")}
    try:
        assert wait_until(lambda: holder(redis_client) is not None, 10)
        time.sleep(1.5)
        leader_name = holder(redis_client)
        assert leader_name in procs
        workers = {w for _, w, _, _ in cycles(redis_client)}
        assert workers == {leader_name}  # exactly one leads; the other stands by
        assert check_health(str(tmp_path / "w1.health"), 5)
        assert check_health(str(tmp_path / "w2.health"), 5)

        # kill -9 the leader: the standby leads within the lease TTL plus one interval.
        killed = procs[leader_name]
        kill_ms = int(redis_client.time()[0] * 1000 + redis_client.time()[1] / 1000)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        other = "w2" if leader_name == "w1" else "w1"
        # One read of the lease per try: between two, it can expire (a flake seen in CI).
        took = wait_until(lambda: (holder(redis_client) or "").startswith(other), 1.5 + 0.5 + 2.0)
        assert took
        assert wait_until(
            lambda: any(w.startswith(other) for _, w, _, p in cycles(redis_client) if p == "end"), 5
        )

        # Cycles never overlap: each start is followed by its own end before any other start
        # (the killed leader's last cycle may have no end: it ended at the kill).
        log = cycles(redis_client)
        open_cycle: tuple[str, str] | None = None
        for ts, worker, job, phase in log:
            if phase == "start":
                if open_cycle is not None:
                    assert open_cycle[0] == leader_name and ts >= kill_ms, log
                open_cycle = (worker, job)
            else:
                assert open_cycle == (worker, job), log
                open_cycle = None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_sigterm_stops_cleanly_and_releases_the_lease(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    proc = spawn_worker(redis_url, "solo", tmp_path)
    try:
        assert wait_until(lambda: holder(redis_client) == "solo", 10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert redis_client.get(leader_key()) is None  # released on exit
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_check_flag(tmp_path: Path) -> None:
    health = tmp_path / "h"
    run = [
        sys.executable,
        str(ROOT / "workers" / "eviction_worker.py"),
        "--check",
        "--health-file",
        str(health),
        "--lease-ttl",
        "5",
    ]
    assert subprocess.run(run, capture_output=True).returncode == 1
    health.touch()
    assert subprocess.run(run, capture_output=True).returncode == 0
    old = time.time() - 60
    os.utime(health, (old, old))
    assert subprocess.run(run, capture_output=True).returncode == 1


# --- metrics contract -----------------------------------------------------------------------------
CONTRACT = ROOT / "docs" / "metrics.md"


def contract() -> dict[str, tuple[str, set[str]]]:
    # the labels cell may be empty ("| |")
    rows = re.findall(
        r"^\| `(zerda_cache_\w+)` \| (\w+) \|( [\w, ]*?)? ?\|", CONTRACT.read_text(), re.M
    )
    return {
        name: (kind, {x.strip() for x in labels.split(",") if x.strip()})
        for name, kind, labels in rows
    }


def exposed(text: str) -> dict[str, tuple[str, set[str]]]:
    out: dict[str, tuple[str, set[str]]] = {}
    for fam in text_string_to_metric_families(text):
        labels: set[str] = set()
        for sample in fam.samples:
            labels |= set(sample.labels) - {"le"}
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = (fam.type, labels)
    return out


def test_worker_and_replica_expose_every_contract_metric(
    redis_client: redis.Redis, redis_url: str
) -> None:
    from zerda_cache import CacheManager, LLMUsage

    st = RedisStorage(redis_client)
    ids = bulk_put(st, "acme", 50)
    st.feedback_many([FeedbackSignal(e, "acme", i % 2 == 0) for i, e in enumerate(ids)])
    st.set_tenant_policy("acme", {"max_error_rate": 0.05})  # the error bound's gauges
    for i in range(400):
        tenant_state(st).label("acme", 0.97, i % 100 != 0)
    worker = Worker(
        redis.Redis.from_url(redis_url),
        CacheConfig(),
        metrics_port=0,
        metrics_host="127.0.0.1",
        health_file=None,
    )
    port = worker.serve_metrics()
    worker.lease_tick()
    worker.evict_job()
    worker.decay_job()
    worker.metrics_job()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    worker.close()

    registry = CollectorRegistry()
    m = CacheManager(redis_client, metrics=ReplicaMetrics(registry))
    m.put("q", "a", tenant="acme", embedding=np.ones(DIM))
    m.lookup("q", tenant="acme", embedding=np.ones(DIM))
    # (a tenant without the bound: its hit saves a call, then is judged wrong)
    m.put("q", "a", tenant="shop", embedding=np.ones(DIM), usage=LLMUsage("gpt-4o", 10, 5))
    hit = m.lookup("q", tenant="shop", embedding=np.ones(DIM))
    assert hit is not None
    m.feedback(hit.feedback(False))
    m.lookup("zz", tenant="acme", embedding=-np.ones(DIM))
    m.put("q2", " ", tenant="acme", embedding=np.ones(DIM))
    m.feedback(FeedbackSignal(ids[0], "acme", True))
    m._fail_open("acme", RuntimeError("x"))
    m.metrics.index_rebuilds.labels("acme")
    got = exposed(text) | exposed(generate_latest(registry).decode())

    # (the HTTP service's rows: tests/test_service.py checks them against a real service)
    service = ("zerda_cache_http_", "zerda_cache_proxy_")
    want = {n: row for n, row in contract().items() if not n.startswith(service)}
    assert len(want) >= 20
    for name, (kind, labels) in want.items():
        assert name in got, f"{name} is in docs/metrics.md but not exposed"
        assert got[name][0] == kind, f"{name}: {got[name][0]} exposed, {kind} documented"
        assert got[name][1] == labels, f"{name}: labels {got[name][1]} vs {labels}"
    # (*_created: prometheus_client's creation-time samples of counters and histograms)
    undocumented = {
        n for n in got if n.startswith("zerda_cache_") and not n.endswith("_created")
    } - set(want)
    assert not undocumented, f"exposed but not in docs/metrics.md: {undocumented}"
    assert 'zerda_cache_tenant_entries{tenant="acme"} 50.0' in text
    assert 'zerda_cache_tenant_error_bound{tenant="acme"} 0.05' in text
    assert "zerda_cache_worker_leader 1.0" in text


def test_health_file_is_not_touched_while_redis_is_unreachable(
    redis_server_factory: Any, tmp_path: Path
) -> None:
    """worker --check said healthy through a 21 s outage: the lease tick touched the file
    whatever happened. Now only a tick that reached Redis touches it, and --check says
    why it is unhealthy."""
    server = redis_server_factory()
    health = tmp_path / "health"
    cfg = CacheConfig(redis_timeout_s=0.2)
    w = Worker(connect(server.url, cfg), cfg, health_file=str(health))
    w.lease_tick()
    assert health.exists() and w.lease.held
    old = time.time() - 60
    os.utime(health, (old, old))
    server.stop()
    w.lease_tick()  # Redis is down: logged and counted, the file left as it was
    assert health.stat().st_mtime == pytest.approx(old, abs=1)
    assert not check_health(str(health), 5)
    problem = health_problem(str(health), 5)
    assert problem is not None and "cannot reach Redis" in problem
    w.close()


def test_the_scan_judges_learning_state_as_the_scripts_do(redis_client: redis.Redis) -> None:
    """What the worker's scan (the ``state`` script, decoded in numpy) calls corrupt is
    what the scripts that write an arm call corrupt (here: the decay script's answer for
    the same entries), and the scan also needs a size."""
    st = RedisStorage(redis_client, CacheConfig(), clock=Clock(50_000.0))
    ids = bulk_put(st, "t", 16)
    keys = tenant_keys("t")
    first = read_state(redis_client, "t", ids[0])
    arm, use = first["arm"], first["use"]
    nan, inf = float("nan"), float("inf")
    damage: list[tuple[str, Any]] = [
        ("raw", b"\xc1"),  # not a state at all
        ("raw", bytes(119)),  # one byte short
        ("arm", {**arm, "a": nan}),
        ("arm", {**arm, "b": -1.0}),  # not positive
        ("arm", {**arm, "a": 0.0}),
        ("use", {**use, "c": nan}),
        ("use", {**use, "ns": 1.5}),  # not a whole number
        ("use", {**use, "ns": 0.0}),  # no run: fine
        ("sz", nan),  # unknown size: fine for the scripts, not for the scan
        ("use", {**use, "ns": -1.0}),
        ("gone", None),  # neither fine nor corrupt
        ("use", {**use, "ns": 2.0}),  # a run of two: fine
        ("use", {**use, "la": -inf}),
        ("sz", inf),
        ("arm", {**arm, "a": 1e308, "b": 1e308}),  # finite, but the sum is not
        ("raw", bytes(121)),
    ]
    for eid, (name, value) in zip(ids, damage, strict=True):
        if name == "raw":
            set_raw_state(redis_client, "t", eid, value)
        elif name == "gone":
            redis_client.delete(keys.entry(eid))
            redis_client.hdel(keys.st, eid)
        else:
            set_state_value(redis_client, "t", eid, name, value)
    cols = st.state_arrays("t", ids)
    by_scripts = set(st.decay("t", ids).corrupt)
    assert by_scripts == {ids[i] for i in (0, 1, 2, 3, 4, 5, 6, 9, 12, 14, 15)}
    # The scan needs the size too (capacity in bytes): a bad one is corrupt there.
    assert set(cols.corrupt) == by_scripts | {ids[8], ids[13]}
    assert cols.ids == [ids[7], ids[11]]
    assert cols.alpha.tolist() == [arm["a"], arm["a"]]
    assert cols.size.tolist() == [read_state(redis_client, "t", i)["sz"] for i in cols.ids]
    # A batch of fine entries only: the same values.
    fine = st.state_arrays("t", [ids[7], ids[11]])
    assert fine.ids == cols.ids and fine.corrupt == []
    for name in ("alpha", "beta", "decayed_at", "usage_count", "last_access", "confidence"):
        assert getattr(fine, name).tolist() == getattr(cols, name).tolist()
    assert fine.version.tolist() == [use["v"]] * 2


def test_worker_jobs_on_a_redis_cluster(cluster_client: Any) -> None:
    """The whole scan (batches read ahead in threads), the incremental plan (the
    feedback stream) and the decay sweep on a Redis Cluster client."""
    clock = Clock(50_000.0)
    cfg = CacheConfig(eviction=EvictionConfig(scan_batch=20, max_entries=1_000))
    st = RedisStorage(cluster_client, cfg, clock=clock)
    rng = np.random.default_rng(0)
    ids = [st.put("t", f"q{i}", f"a{i}", rng.normal(size=DIM)).entry_id for i in range(150)]
    st.feedback_many([FeedbackSignal(e, "t", True) for e in ids[:30]])
    m = Maintenance(st)
    m.decay_tenant("t")  # fills the evidence list
    st.set_tenant_policy("t", {"max_entries": 100})
    report = m.evict_tenant("t")  # over capacity: a whole scan
    assert report.removed == {"capacity": 55}  # down to 95% of 100
    assert st.count("t") == 95
    st.set_tenant_policy("t", {"max_entries": None})
    survivor = next(e for e in ids if cluster_client.exists(tenant_keys("t").entry(e)))
    st.feedback_many([FeedbackSignal(survivor, "t", False, magnitude=40.0)])
    plan = m.plan_incremental("t")
    assert plan is not None and plan.scanned == 1
    assert [e for e, _ in plan.low_reward] == [survivor]
    clock.t += 3_600
    assert m.decay_tenant("t").decayed > 0


def test_a_corrupt_report_is_checked_before_the_entry_is_evicted(
    redis_client: redis.Redis,
) -> None:
    """A replica's report is a suspicion: the worker reads the entry whole first. One of
    another version may take an entry this one reads for corrupt (0.1 reads an entry
    whose state is in the state hash as having none): that report is dropped. So is a
    report of an entry of a newer schema, which this version cannot read but must not
    evict (a rolling upgrade)."""
    st = RedisStorage(redis_client, CacheConfig(), clock=Clock(50_000.0))
    ids = bulk_put(st, "t", 5)
    k = tenant_keys("t")
    redis_client.hset(k.entry(ids[1]), "meta", b"\xc1")  # the scan reads no meta
    newer = msgpack.packb({"v": 2, "q": "q", "r": "a", "m": {}}, use_bin_type=True)
    redis_client.hset(k.entry(ids[2]), "doc", newer)
    redis_client.sadd(k.bad, ids[0], ids[1], ids[2])
    report = Maintenance(st).evict_tenant("t")
    assert report.removed == {"corrupt": 1}
    assert st.count("t") == 4 and redis_client.zscore(k.ids, ids[1]) is None
    assert redis_client.hget(k.entry(ids[2]), "doc") == newer
    assert redis_client.scard(k.bad) == 0
