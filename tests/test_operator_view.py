"""What an operator reads: the worker's log lines, and the settings replicas and
workers serve under as ``zerda-cache tenant show`` reports them."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner
from conftest import unit

from zerda_cache import CacheConfig, EvictionConfig
from zerda_cache.cli import cli
from zerda_cache.learning.tenant_state import TenantState
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import process_key, tenant_keys
from zerda_cache.storage.reports import (
    PAYLOAD_TTL_S,
    REPORT_EVERY_S,
    REPORT_TTL_S,
    SettingsReporter,
)
from zerda_cache.worker.eviction import EvictionReport
from zerda_cache.worker.maintenance import Maintenance
from zerda_cache.worker.scheduler import Worker


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


def show(redis_url: str, tenant: str, *flags: str) -> str:
    result = CliRunner().invoke(cli, ["--redis-url", redis_url, "tenant", "show", tenant, *flags])
    assert result.exit_code == 0, result.output
    cells = re.sub("[\u2500-\u257f]", " ", result.output)  # the table's borders
    return " ".join(cells.split())  # one line: row by row, however a cell wrapped


def test_tenant_show_says_the_settings_replicas_and_the_worker_apply(
    make_manager: Any, redis_client: redis.Redis, redis_url: str
) -> None:
    """Replicas ran with max_error_rate in their CacheConfig and the worker with
    --max-entries 100000, and `tenant show` said "max error rate none (no bound)" and
    "max entries 10,000 (default)": this command's own configuration, not theirs."""
    st = RedisStorage(redis_client)
    st.put("acme", "q", "a", unit(1, 8))
    out = show(redis_url, "acme")  # nobody reported yet: says so
    assert "settings reported by no replica or worker in the last 60 s" in out, out
    assert "max entries 10,000 (default: no worker reported its settings)" in out, out
    assert "max error rate none (no bound) (default: no replica reported its settings)" in out

    replica = make_manager(CacheConfig(max_error_rate=0.05))
    replica.lookup("q", tenant="acme", embedding=unit(1, 8))  # reads the policy: reports
    worker = Worker(redis_client, CacheConfig(eviction=EvictionConfig(max_entries=100_000)))
    worker.maintenance.evict_tenant("acme")  # its pass reads the policy: reports
    out = show(redis_url, "acme")
    assert "settings reported by 1 replica, 1 worker" in out, out
    assert "max entries 100,000 (configuration of 1 worker)" in out, out
    assert "max error rate 5.00% (configuration of 1 replica)" in out, out
    assert "serves near matches from" in out, out  # what the replicas' bound serves
    shown = json.loads(CliRunner().invoke(
        cli, ["--redis-url", redis_url, "tenant", "show", "acme", "--json"]
    ).output)  # fmt: skip
    assert shown["max_error_rate"] == 0.05 and shown["max_entries"] == 100_000
    assert shown["applied"]["max_error_rate"] == [
        {"value": 0.05, "processes": [replica.storage.reporter.process]}
    ]
    assert {r["role"] for r in shown["reports"]} == {"replica", "worker"}

    # A replica configured otherwise: they disagree, and tenant show says so.
    other = make_manager(CacheConfig(max_error_rate=0.02))
    other.lookup("q", tenant="acme", embedding=unit(1, 8))
    out = show(redis_url, "acme")
    assert "replicas disagree: " in out and "5.00% (1 replica)" in out, out
    assert "2.00% (1 replica)" in out and "serves near matches from" not in out, out

    # A stored setting is what every process applies, whatever their configuration.
    st.set_tenant_policy("acme", {"max_error_rate": 0.01})
    out = show(redis_url, "acme")
    assert "max error rate 1.00% " in out and "disagree" not in out, out


def test_a_report_is_said_once_in_a_while_and_a_stopped_process_leaves_no_trace(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """Reports ride on policy refreshes, at most every REPORT_EVERY_S a tenant (never
    on the hit path); report.lua drops members older than REPORT_TTL_S and the set
    expires when nobody reports."""
    replica = make_manager()
    reporter = replica.storage.reporter
    for _ in range(3):
        replica.lookup("q", tenant="acme", embedding=unit(1, 8))
    assert reporter.due("acme") is False  # said by the first lookup, not due again yet
    srv = tenant_keys("acme").srv
    assert redis_client.zcard(srv) == 1 and 0 < redis_client.pttl(srv) <= REPORT_TTL_S * 1000
    st = RedisStorage(redis_client)
    old = SettingsReporter(CacheConfig(), "replica", process="gone")
    st.run(old.publish("zc"))
    st.run(old.plan(tenant_keys("acme"), now="1000"))
    assert [r.process for r in st.settings_reports("acme")] == [reporter.process]  # aged out
    later = SettingsReporter(CacheConfig(), "worker", process="w")
    assert st.run(later.plan(tenant_keys("acme"), now=repr(1000 + REPORT_TTL_S + 1))) == 2
    assert sorted(m.decode() for m in redis_client.zrange(srv, 0, -1)) == sorted(
        [reporter.process, "w"]
    )  # "gone" was dropped by the next report


def test_a_process_stores_its_settings_once_and_each_tenant_only_who_serves_it(
    make_manager: Any, redis_client: redis.Redis, redis_url: str
) -> None:
    """The ~750-byte report was stored per (tenant, process) and rewritten every 15 s:
    10,000 tenants x 10 replicas held ~80 MB of the same few payloads. Now the payload
    is one key a process, written at most every REPORT_EVERY_S, and a tenant holds
    only which processes serve it, with when."""
    replica = make_manager(CacheConfig(max_error_rate=0.05))
    reporter = replica.storage.reporter
    proc = process_key(reporter.process)
    tenants = ("acme", "beta", "gamma")
    for tenant in tenants:
        replica.lookup("q", tenant=tenant, embedding=unit(1, 8))
    assert redis_client.get(proc) == reporter.payload.encode()
    assert 0 < redis_client.pttl(proc) <= PAYLOAD_TTL_S * 1000
    for tenant in tenants:
        srv = tenant_keys(tenant).srv
        assert redis_client.type(srv) == b"zset", tenant
        assert [m for m, _ in redis_client.zrange(srv, 0, -1, withscores=True)] == [
            reporter.process.encode()
        ]
        assert not redis_client.exists(tenant_keys(tenant).base + "rep")  # no payload there
        assert "max error rate 5.00% (configuration of 1 replica)" in show(redis_url, tenant)

    # Written at most every REPORT_EVERY_S: the next tenant's report within that time
    # stamps the tenant only; past it, the payload is written again.
    redis_client.delete(proc)
    replica.lookup("q", tenant="delta", embedding=unit(1, 8))
    assert redis_client.zcard(tenant_keys("delta").srv) == 1 and not redis_client.exists(proc)
    assert reporter.published is not None
    reporter.published -= REPORT_EVERY_S
    replica.lookup("q", tenant="epsilon", embedding=unit(1, 8))
    assert redis_client.get(proc) == reporter.payload.encode()
    # A member whose payload is gone (its process stopped) is no report.
    redis_client.delete(proc)
    assert RedisStorage(redis_client).settings_reports("acme") == []


def test_a_replica_on_a_cluster_reports_too(
    redis_cluster: Any, cluster_client: Any, make_manager: Any
) -> None:
    """The report rides in the policy read's pipeline: on Redis Cluster as elsewhere;
    the processes' payloads live in slots of their own, apart from the tenant's keys
    (a plain MGET of them would be refused: CROSSSLOT)."""
    config = CacheConfig(redis_timeout_s=5.0, max_error_rate=0.05)
    replica = make_manager(config, url=redis_cluster.url, cluster=True)
    other = make_manager(config, url=redis_cluster.url, cluster=True)
    writer = make_manager(url=redis_cluster.url, cluster=True)
    for manager, name in ((replica, "replica a"), (other, "replica b")):  # slots known
        storage = getattr(manager, "target", manager).storage  # (an async one: Blocking)
        storage.reporter = SettingsReporter(config, "replica", process=name)
    procs = ["replica a", "replica b"]
    slots = {cluster_client.keyslot(process_key(p)) for p in procs}
    for tenant in ("t1", "tenant-three"):
        writer.put("q", "a", tenant=tenant, embedding=unit(1, 8))
        replica.lookup("q", tenant=tenant, embedding=unit(1, 8))
        other.lookup("q", tenant=tenant, embedding=unit(1, 8))
        reports = RedisStorage(cluster_client).settings_reports(tenant)
        assert [r.process for r in reports] == procs, tenant
        assert [r.settings["max_error_rate"] for r in reports] == [0.05, 0.05]
        slots.add(cluster_client.keyslot(tenant_keys(tenant).srv))
    assert len(slots) == 4  # each payload, and each tenant's set, in a slot of its own


def test_a_report_written_by_hand_breaks_no_tenant_show(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """Payloads that do not read are left out; a value no configuration takes is shown
    as reported, and the policy stays this command's."""
    RedisStorage(redis_client).put("acme", "q", "a", unit(1, 8))
    now = float(redis_client.time()[0])
    bad = json.dumps({"role": "worker", "settings": {"max_entries": -5}})
    redis_client.zadd(tenant_keys("acme").srv, {"w": now, "x": now, "y": now, "z": now})
    redis_client.set(process_key("w"), bad)
    redis_client.set(process_key("x"), "garbage")
    redis_client.set(process_key("y"), "{")
    out = show(redis_url, "acme")
    assert "settings reported by 1 worker" in out and "max entries -5 (configuration" in out, out


def test_tenant_show_applies_every_reported_setting_and_keeps_the_good_ones(
    make_manager: Any, redis_client: redis.Redis, redis_url: str
) -> None:
    """`tenant show` applied only four reported settings, by hand: what the bound serves
    was computed under this command's own max_serve_error beside the replicas' bound,
    and one value no configuration takes threw away every reported value."""
    st = RedisStorage(redis_client)
    st.put("acme", "q", "a", unit(1, 8))
    for sim, right, wrong in ((0.96, 300, 1), (0.91, 300, 12)):
        for positive, n in ((True, right), (False, wrong)):
            for _ in range(n):
                TenantState(st).label("acme", sim, positive)
    config = CacheConfig(max_error_rate=0.05, max_serve_error=0.02, similarity_threshold=0.8)
    replica = make_manager(config)
    replica.lookup("q", tenant="acme", embedding=unit(1, 8))
    theirs = TenantState(RedisStorage(redis_client, config)).policy("acme")
    mine = TenantState(RedisStorage(redis_client, replace(config, max_serve_error=None)))
    assert theirs.serving() != mine.policy("acme").serving()  # the ceiling tells
    shown = json.loads(CliRunner().invoke(
        cli, ["--redis-url", redis_url, "tenant", "show", "acme", "--json"]
    ).output)  # fmt: skip
    assert shown["serving"] == dataclasses.asdict(theirs.serving())
    assert shown["effective"]["max_serve_error"] == 0.02
    assert shown["effective"]["similarity_threshold"] == 0.8
    assert shown["applied"]["similarity_threshold"] == [
        {"value": 0.8, "processes": [replica.storage.reporter.process]}
    ]
    out = show(redis_url, "acme")
    assert f"serves near matches from similarity {theirs.threshold():.3f}" in out, out

    # A worker reports a capacity no configuration takes: that one stays this command's,
    # the others are as reported.
    now = float(redis_client.time()[0])
    bad = {"role": "worker", "settings": {"max_entries": -5, "max_bytes": 4096}}
    redis_client.zadd(tenant_keys("acme").srv, {"w": now})
    redis_client.set(process_key("w"), json.dumps(bad))
    shown = json.loads(CliRunner().invoke(
        cli, ["--redis-url", redis_url, "tenant", "show", "acme", "--json"]
    ).output)  # fmt: skip
    assert shown["max_entries"] == CacheConfig().eviction.max_entries
    assert shown["max_bytes"] == 4096 and shown["max_error_rate"] == 0.05
    assert shown["serving"] == dataclasses.asdict(theirs.serving())


def test_the_worker_reports_in_the_round_trip_that_reads_the_policy(
    redis_client: redis.Redis,
) -> None:
    """The worker's report was a round trip of its own after each tenant pass's policy
    read (and metrics_job reads every tenant's policy every 15 s): it rides in the
    read's pipeline now, as a replica's does."""
    RedisStorage(redis_client).put("acme", "q", "a", unit(1, 8))
    worker = Worker(redis_client, CacheConfig(eviction=EvictionConfig(max_entries=100_000)))
    st = worker.storage
    for call in st.report_settings("other"):  # its payload, and the scripts loaded
        st.run(call)
    wire, trips = st.wire, []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(wire, name)

        def send(self, *args: Any) -> Any:
            trips.append("EVALSHA")
            return wire.send(*args)

        def execute(self, pipe: Any) -> Any:
            trips.append(f"pipeline of {len(pipe.command_stack)}")
            return wire.execute(pipe)

    st.wire = Counting()
    worker.maintenance.policy("acme")
    assert trips == ["pipeline of 3"]  # the policy read (2 commands) and the report
    reports = RedisStorage(redis_client).settings_reports("acme")
    assert [(r.process, r.settings["max_entries"]) for r in reports] == [
        (worker.worker_id, 100_000)
    ]
    trips.clear()
    worker.maintenance.policy("acme")  # not due again yet: the read alone
    assert trips == ["pipeline of 2"]
