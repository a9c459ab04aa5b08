"""What an operator reads: the worker's log lines, and the settings replicas and
workers serve under as ``zerda-cache tenant show`` reports them."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import redis
from conftest import unit

from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.worker.eviction import EvictionReport
from zerda_cache.worker.maintenance import Maintenance


def test_the_eviction_log_line_says_what_happened_in_words() -> None:
    assert EvictionReport("t", removed={"corrupt": 0}).summary() is None
    assert EvictionReport("t", removed={"corrupt": 0}, already_gone=1).summary() is None
    report = EvictionReport("t", removed={"expired": 1, "capacity": 2, "corrupt": 0})
    assert report.summary() == "evicted 3 entries (capacity 2, expired 1)"
    report = EvictionReport("t", removed={"low_reward": 1}, kept_changed=1)
    assert report.summary() == (
        "evicted 1 entry (low reward 1); kept 1 entry that changed since it was scored"
    )
    assert EvictionReport("t", kept_changed=2).summary() == (
        "kept 2 entries that changed since they were scored"
    )


def test_a_cycle_that_removed_nothing_logs_nothing(
    redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica reported an entry corrupt that was gone by the worker's cycle: the worker
    logged "evicted {'corrupt': 0}, kept 0 changed since scored"."""
    st = RedisStorage(redis_client)
    st.put("t", "q", "a", unit(1, 8))
    redis_client.sadd(tenant_keys("t").bad, "an-entry-gone-meanwhile")
    with caplog.at_level(logging.INFO, logger="zerda_cache"):
        report = Maintenance(st).evict_tenant("t")
    assert report.removed == {"corrupt": 0} and report.already_gone == 1
    assert [r.getMessage() for r in caplog.records if "tenant t:" in r.getMessage()] == []
    # A cycle that did remove something says how many and why, without zero counts.
    redis_client.sadd(tenant_keys("t").bad, "an-entry-gone-meanwhile")
    eid = st.put("t", "q2", "a2", np.ones(8)).entry_id
    redis_client.hset(tenant_keys("t").entry(eid), "meta", b"\xc1not msgpack")
    redis_client.sadd(tenant_keys("t").bad, eid)
    with caplog.at_level(logging.INFO, logger="zerda_cache"):
        Maintenance(st).evict_tenant("t")
    lines = [r.getMessage() for r in caplog.records if "tenant t:" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("tenant t: evicted 1 entry (corrupt 1) ("), lines
