"""The least-privilege ACL rule in docs/operations.md is enough for a replica and a worker."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import redis
from prometheus_client import CollectorRegistry

from zerda_cache import CacheConfig, CacheManager
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.worker.scheduler import Worker

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def rules() -> dict[str, list[str]]:
    found = re.findall(r"^ACL SETUSER (zerda-\w+) (.+)$", DOC.read_text(), re.M)
    assert {user for user, _ in found} == {"zerda-app", "zerda-worker"}
    return {user: rule.split() for user, rule in found}


def test_documented_acl_rules_suffice(redis_client: redis.Redis, redis_server: object) -> None:
    port = redis_client.connection_pool.connection_kwargs["port"]
    for user, rule in rules().items():
        redis_client.execute_command("ACL", "SETUSER", user, *rule)
    try:
        url = f"redis://zerda-app:app-password@127.0.0.1:{port}/0"
        m = CacheManager.from_url(url, metrics=ReplicaMetrics(CollectorRegistry()))
        assert m.put("q", "a", tenant="t", embedding=np.ones(8))
        hit = m.lookup("q", tenant="t", embedding=np.ones(8))
        assert hit is not None
        m.feedback(hit.feedback(False))
        assert m.lookup("other", tenant="t", embedding=-np.ones(8)) is None
        assert m.stats("t")["negative"] == 1 and m.stats("t")["misses"] == 1
        assert m.invalidate(hit.entry_id, tenant="t")
        m.put("q", "a", tenant="t", embedding=np.ones(8))

        client = redis.Redis.from_url(f"redis://zerda-worker:worker-password@127.0.0.1:{port}/0")
        w = Worker(client, CacheConfig(), health_file=None)
        w.lease_tick()
        assert w.lease.held
        w.decay_job()
        w.evict_job()
        w.metrics_job()
        errors = [w.metrics.errors.labels(j)._value.get() for j in ("decay", "evict", "metrics")]
        assert errors == [0.0, 0.0, 0.0]
        assert [c["outcome"] for c in w.maintenance.recent_cycles(4) if c["phase"] == "end"] == [
            "ok",
            "ok",
        ]
        assert m.clear("t") == 1
        w.close()
        m.close()
        # and the rule really restricts: no dangerous commands, no other keys
        app = redis.Redis.from_url(url)
        for forbidden in (("FLUSHALL",), ("KEYS", "*"), ("SET", "other:key", "1")):
            try:
                app.execute_command(*forbidden)
            except redis.exceptions.NoPermissionError:
                continue
            raise AssertionError(f"{forbidden} was allowed")
        app.close()
    finally:
        for user in rules():
            redis_client.execute_command("ACL", "DELUSER", user)
