"""Several app replicas, each an OS process with its own CacheManager, on one server."""

from __future__ import annotations

import multiprocessing as mp
import random
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import redis

from zerda_cache.storage.keys import tenant_keys

DIM = 16


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=DIM)
    return v / np.linalg.norm(v)


def _replica(url: str, conn: Connection) -> None:
    """A replica process: runs the commands it receives, answers each one."""
    from prometheus_client import CollectorRegistry

    from zerda_cache import CacheConfig, CacheManager, FeedbackSignal, RLConfig
    from zerda_cache.metrics import ReplicaMetrics

    registry = CollectorRegistry()
    cfg = CacheConfig(similarity_threshold=0.8, rl=RLConfig(seed=2))  # reproducible draws
    m = CacheManager.from_url(url, cfg, metrics=ReplicaMetrics(registry))
    while True:
        op, args = conn.recv()
        try:
            if op == "stop":
                conn.send(("ok", None))
                return
            if op == "put":
                query, response, seed = args
                conn.send(("ok", m.put(query, response, tenant="t", embedding=unit(seed)).entry_id))
            elif op == "lookup":
                query, seed = args
                hit = m.lookup(query, tenant="t", embedding=unit(seed))
                conn.send(("ok", None if hit is None else hit.entry_id))
            elif op == "feedback":
                eid, positive, n = args
                for _ in range(n):
                    m.feedback(FeedbackSignal(eid, "t", positive))
                conn.send(("ok", None))
            elif op == "churn":
                conn.send(("ok", _churn(m, *args)))
            elif op == "index":
                m.sync_index("t")
                conn.send(("ok", sorted(m.index_ids("t"))))
            elif op == "rebuilds":  # after the build a lookup started, if any, is done
                m.sync_index("t")
                conn.send(
                    (
                        "ok",
                        registry.get_sample_value(
                            "zerda_cache_index_rebuilds_total", {"tenant": "t"}
                        ),
                    )
                )
            else:
                conn.send(("error", f"unknown op {op}"))
        except Exception as exc:  # report, do not hang the test
            conn.send(("error", repr(exc)))


def _churn(m: Any, seed: int, ops: int) -> int:
    """Random puts and invalidations (of this replica's own entries), with lookups."""
    rng = random.Random(seed)
    mine: list[str] = []
    for i in range(ops):
        r = rng.random()
        if mine and r < 0.3:
            m.invalidate(mine.pop(rng.randrange(len(mine))), tenant="t")
        else:
            eid = m.put(f"q {seed} {i}", "a", tenant="t", embedding=unit(seed * 100_000 + i))
            mine.append(eid.entry_id)
        if i % 50 == 0:
            m.lookup("probe", tenant="t", embedding=unit(rng.randrange(10**6)))
    return len(mine)


class Replica:
    def __init__(self, url: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_replica, args=(url, child), daemon=True)
        self.proc.start()

    def call(self, op: str, *args: Any, timeout: float = 240) -> Any:
        self.conn.send((op, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"replica did not answer {op}")
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def send(self, op: str, *args: Any) -> None:
        self.conn.send((op, args))

    def result(self, timeout: float = 240) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("replica did not answer")
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def stop(self) -> None:
        try:
            self.call("stop", timeout=10)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture
def replicas(redis_client: redis.Redis, redis_url: str) -> Iterator[list[Replica]]:
    started = [Replica(redis_url) for _ in range(3)]
    yield started
    for r in started:
        r.stop()


@pytest.mark.slow
def test_cross_replica_put_feedback_and_never_serving(replicas: list[Replica]) -> None:
    a, b, _ = replicas
    # Both replicas have built their (empty) index before the put.
    assert a.call("lookup", "warm up", 1) is None and b.call("lookup", "warm up", 1) is None
    first = a.call("put", "How do I export data?", "Use the Export button.", 1)
    assert b.call("lookup", "how to export data", 1) == first  # B's very next lookup
    second = a.call("put", "Export my data how?", "Settings > Export.", 1)
    # Negative feedback from B on the first entry moves A's choice to the other one.
    before = [a.call("lookup", "export data?", 1) for _ in range(30)]
    assert before.count(first) >= 5  # both are served while nothing is known
    b.call("feedback", first, False, 15)  # Beta(1, 16): still servable, rarely chosen
    choices = [a.call("lookup", "export data?", 1) for _ in range(30)]
    assert choices.count(second) >= 25
    # Once the entry is below min_reward_to_keep, neither replica serves it.
    b.call("feedback", first, False, 30)
    a.call("feedback", second, False, 30)
    assert all(r.call("lookup", "export data?", 1) is None for r in (a, b) for _ in range(10))


@pytest.mark.slow
def test_every_index_matches_redis_after_churn_and_after_trim(
    replicas: list[Replica], redis_client: redis.Redis
) -> None:
    for r in replicas:
        r.call("lookup", "warm up", 1)
    for seed, r in enumerate(replicas):
        r.send("churn", seed + 1, 3_334)  # 10,002 operations over 3 processes
    for r in replicas:
        r.result()
    live = sorted(m.decode() for m in redis_client.zrange(tenant_keys("t").ids, 0, -1))
    assert len(live) > 3_000
    for r in replicas:
        assert r.call("index") == live

    # Replica C stops reading; A and B go on; the log is trimmed past C's position.
    a, b, c = replicas
    rebuilds_before = c.call("rebuilds")
    for i in range(20):
        a.call("put", f"late {i}", "x", 900_000 + i)
    gone = a.call("put", "to be removed", "x", 999_999)
    redis_client.xtrim(tenant_keys("t").log, maxlen=5, approximate=False)
    b.call("feedback", gone, True, 1)
    redis_client.delete(tenant_keys("t").entry(gone))  # removed behind the log's back...
    redis_client.zrem(tenant_keys("t").ids, gone)  # ...so only a rebuild can notice
    c.call("lookup", "anything", 5)
    assert c.call("rebuilds") == rebuilds_before + 1
    live = sorted(m.decode() for m in redis_client.zrange(tenant_keys("t").ids, 0, -1))
    assert c.call("index") == live
