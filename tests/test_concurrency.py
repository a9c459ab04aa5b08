"""No lost update: many OS processes change the same arms at once on a real server."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections import defaultdict

import numpy as np
import pytest
import redis

from zerda_cache import CacheConfig, FeedbackSignal, RLConfig
from zerda_cache.storage import RedisStorage

PROCS, SIGNALS, ENTRIES = 8, 2_000, 50
TENANT = "race"
MAGNITUDES = (0.5, 1.0, 2.0)  # exact in binary: the sums below are exact, not approximate


def _feedback_worker(url: str, ids: list[str], seed: int, rl: RLConfig) -> dict[str, list[float]]:
    """Send SIGNALS random signals; return per-entry [positive sum, negative sum, count]."""
    client = redis.Redis.from_url(url)
    storage = RedisStorage(client, CacheConfig(rl=rl))
    rng = random.Random(seed)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for _ in range(SIGNALS):
        eid = rng.choice(ids)
        positive = rng.random() < 0.6
        magnitude = rng.choice(MAGNITUDES)
        storage.feedback(FeedbackSignal(eid, TENANT, positive, magnitude=magnitude))
        sums[eid][0 if positive else 1] += magnitude
        sums[eid][2] += 1
    client.close()
    return dict(sums)


def _decay_loop(url: str, ids: list[str], rl: RLConfig, stop: mp.synchronize.Event) -> int:
    client = redis.Redis.from_url(url)
    storage = RedisStorage(client, CacheConfig(rl=rl))
    batches = 0
    while not stop.is_set():
        storage.decay(TENANT, ids)
        batches += 1
    client.close()
    return batches


def _setup(url: str, rl: RLConfig) -> tuple[RedisStorage, list[str]]:
    storage = RedisStorage(redis.Redis.from_url(url), CacheConfig(rl=rl))
    rng = np.random.default_rng(0)
    ids = [
        storage.put(TENANT, f"q{i}", f"a{i}", rng.normal(size=8)).entry_id for i in range(ENTRIES)
    ]
    return storage, ids


def _run(url: str, ids: list[str], rl: RLConfig) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(PROCS) as pool:
        results = pool.starmap(_feedback_worker, [(url, ids, seed, rl) for seed in range(PROCS)])
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for part in results:
        for eid, (pos, neg, n) in part.items():
            total[eid][0] += pos
            total[eid][1] += neg
            total[eid][2] += n
    assert sum(t[2] for t in total.values()) == PROCS * SIGNALS
    return total


@pytest.mark.slow
def test_no_lost_update(redis_client: redis.Redis, redis_url: str) -> None:
    # No decay and no forgetting (order-dependent): alpha and beta are exact sums.
    rl = RLConfig(usage_decay=1.0, negative_streak_forget=1.0)
    storage, ids = _setup(redis_url, rl)
    total = _run(redis_url, ids, rl)
    states = storage.load_states(TENANT, ids).entries
    for eid in ids:
        pos, neg, n = total.get(eid, [0.0, 0.0, 0.0])
        arm = states[eid].bandit_arm
        assert arm.alpha == 1.0 + pos
        assert arm.beta == 1.0 + neg
        assert arm.pulls == n
        assert arm.reward_sum == pos - neg
    assert storage.stats(TENANT)["positive"] + storage.stats(TENANT)["negative"] == PROCS * SIGNALS
    storage.client.close()


@pytest.mark.slow
def test_no_lost_update_while_decaying(redis_client: redis.Redis, redis_url: str) -> None:
    # Fast decay on the server's clock: the excess halves every 50 ms.
    rl = RLConfig(usage_decay=0.5, decay_interval_s=0.05, negative_streak_forget=1.0)
    storage, ids = _setup(redis_url, rl)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    decayer = ctx.Process(target=_decay_loop, args=(redis_url, ids, rl, stop))
    decayer.start()
    try:
        total = _run(redis_url, ids, rl)
    finally:
        stop.set()
        decayer.join(30)
    assert decayer.exitcode == 0
    states = storage.load_states(TENANT, ids).entries
    decayed_somewhere = False
    for eid in ids:
        pos, neg, n = total.get(eid, [0.0, 0.0, 0.0])
        arm = states[eid].bandit_arm
        assert arm.pulls == n  # counts are never decayed
        assert arm.reward_sum == pos - neg
        assert 1.0 <= arm.alpha <= 1.0 + pos + 1e-9
        assert 1.0 <= arm.beta <= 1.0 + neg + 1e-9
        decayed_somewhere |= arm.alpha < 1.0 + pos - 1e-6
    assert decayed_somewhere
    # Long after the last signal, decay brings every arm back to the prior.
    time.sleep(0.05 * 60)
    storage.decay(TENANT, ids)
    for entry in storage.load_states(TENANT, ids).entries.values():
        assert entry.bandit_arm.alpha == pytest.approx(1.0, abs=1e-6)
    storage.client.close()
