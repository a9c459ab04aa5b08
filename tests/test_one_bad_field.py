"""One entry with a corrupt field, written into a real Redis by hand: it affects that
entry only. It is never served, never indexed, never exported, reported, and evicted by
the worker; every other entry and tenant is served, indexed, exported, evicted and
fitted as usual (issue: "a corrupt field that stops the worker").

The field: ``meta.us = [model, inf, 3]`` (an infinite token count), which msgpack holds
and the put script never writes. ``codec.unpack_meta`` raised an untyped
``OverflowError`` on it (``int(inf)``), which no path caught."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from click.testing import CliRunner
from conftest import near
from conftest import unit as _unit
from state_support import read_state, write_state
from test_match_model import synthetic, teach

from zerda_cache import CacheConfig, CacheManager, CorruptEntryError, FeedbackSignal
from zerda_cache.cli import cli
from zerda_cache.flows.transfer import export_tenant
from zerda_cache.learning.match_model import MIN_FIT_LABELS
from zerda_cache.storage import RedisStorage, codec, connect
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.worker.maintenance import Maintenance
from zerda_cache.worker.scheduler import Worker

DIM = 32
USAGE = {"model": "gpt-x", "prompt_tokens": 12, "completion_tokens": 30}
#: Fields of meta that do not read, each as the replicas must see it: corrupt.
BAD_META: list[tuple[str, Any]] = [
    ("us", ["gpt-x", float("inf"), 3]),  # OverflowError: int(inf)
    ("us", ["gpt-x", 12, float("-inf")]),
    ("us", ["gpt-x", 2.5, 3]),  # not a whole count
    ("ct", float("inf")),
    ("dim", 1e300),  # int() of it is a 301-digit int
    ("dim", 31.5),  # int() of it was 31
    # the rest the scripts read apart from the decoder: they took each as sound
    ("sc", 3),
    ("tg", "news"),
    ("tg", ["news", 1]),
    ("us", ["gpt-x", 12]),
    ("us", ["gpt-x", 12, 30, 0]),
    ("us", ["", 12, 30]),  # zc_usage counted nothing, zc_sound_meta let it through
    ("us", ["gpt-x\n", 12, 30]),
    ("us", ["gpt-\u00e9", 12, 30]),
    ("us", ["m" * 129, 12, 30]),
    ("us", [7, 12, 30]),
]


def unit(seed: int) -> np.ndarray:
    return _unit(seed, DIM)


def damage(client: redis.Redis, tenant: str, entry_id: str, field: str, value: Any) -> None:
    """Rewrite one field of the entry's stored meta, as a hand or another program would."""
    key = tenant_keys(tenant).entry(entry_id)
    meta = msgpack.unpackb(client.hget(key, "meta"))
    meta[field] = value
    client.hset(key, "meta", msgpack.packb(meta))


def fill(put: Any, tenant: str = "t", n: int = 20) -> list[str]:
    return [
        put(f"question {i}", f"answer {i}", tenant=tenant, embedding=unit(i), usage=USAGE).entry_id
        for i in range(n)
    ]


@pytest.mark.parametrize(("field", "value"), BAD_META)
def test_the_decoder_calls_every_bad_number_corrupt(field: str, value: Any) -> None:
    meta = {"v": 1, "ct": 1.0, "ttl": 0, "sc": "", "dim": DIM, "us": ["gpt-x", 1, 2]}
    assert codec.unpack_meta(msgpack.packb(meta))["us"].completion_tokens == 2
    with pytest.raises(CorruptEntryError):
        codec.unpack_meta(msgpack.packb({**meta, field: value}))


def test_a_bad_meta_is_a_miss_a_typed_feedback_error_and_no_index_entry(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """The exact lookup raised OverflowError, a fresh replica's build crashed and retried
    every second (no near match for the tenant's other entries), and feedback on it was
    applied. Now: a miss, reported; feedback refused as corrupt; the build skips it."""
    m = make_manager()
    ids = fill(m.put)
    bad = ids[3]
    damage(redis_client, "t", bad, "us", ["gpt-x", float("inf"), 3])
    assert m.lookup("question 3", tenant="t", embedding=unit(3)) is None
    with pytest.raises(CorruptEntryError):
        m.feedback(FeedbackSignal(bad, "t", True))
    fresh = make_manager()
    assert fresh.sync_index("t") == len(ids) - 1
    served = 0
    for i, eid in enumerate(ids):
        hit = fresh.lookup(f"asked another way {i}", tenant="t", embedding=near(unit(i), 0.97))
        served += hit is not None and hit.entry_id == eid
        assert hit is None or hit.entry_id != bad
    assert served == len(ids) - 1
    bad_set = {e.decode() for e in redis_client.smembers(tenant_keys("t").bad)}
    assert bad_set == {bad}  # reported by the lookups, for the worker
    assert Maintenance(RedisStorage(redis_client)).evict_tenant("t").removed == {"corrupt": 1}
    assert RedisStorage(redis_client).count("t") == len(ids) - 1


@pytest.mark.parametrize("refresh", [False, True])
@pytest.mark.parametrize(("field", "value"), BAD_META)
def test_a_bad_meta_is_neither_served_nor_counted(
    make_manager: Any, redis_client: redis.Redis, field: str, value: Any, refresh: bool
) -> None:
    """The hit script served such an entry (counting the hit, its use and the call it
    saved) before the lookup refused its meta: the savings counted a hit that was a
    miss. Now the script refuses it before any write and reports it."""
    m = make_manager(CacheConfig(refresh_ttl_on_hit=refresh))
    ids = fill(m.put, n=3)
    bad = ids[1]
    damage(redis_client, "t", bad, field, value)
    k = tenant_keys("t")
    state = redis_client.hget(k.st, bad)
    expiry = redis_client.zscore(k.ids, bad)
    assert m.lookup("question 1", tenant="t", embedding=unit(1)) is None  # its own entry
    assert m.lookup("asked another way", tenant="t", embedding=near(unit(1), 0.97)) is None
    stats = m.stats("t")
    assert stats.get("hits", 0) == 0
    assert stats.get("savings", {}).get("gpt-x", {}).get("calls", 0) == 0
    assert redis_client.hget(k.st, bad) == state  # its use count and version unchanged
    assert redis_client.zscore(k.ids, bad) == expiry
    assert {e.decode() for e in redis_client.smembers(k.bad)} == {bad}
    assert m.lookup("question 0", tenant="t", embedding=unit(0)) is not None  # the others
    assert m.stats("t")["savings"]["gpt-x"]["calls"] == 1


@pytest.mark.parametrize(("field", "value"), BAD_META)
def test_feedback_on_a_bad_meta_writes_nothing(
    make_manager: Any, redis_client: redis.Redis, field: str, value: Any
) -> None:
    """The feedback script's check of meta (zc_sound_meta) is the decoder's: it applied
    feedback on a meta the lookup refuses (a scope or tags of another type, a usage
    LLMUsage refuses), and counted a wrong hit of a usage with an empty model."""
    m = make_manager()
    ids = fill(m.put, n=2)
    hit = m.lookup("question 1", tenant="t", embedding=unit(1))
    assert hit is not None and hit.hit_number == 1
    damage(redis_client, "t", ids[1], field, value)
    k = tenant_keys("t")
    before = redis_client.hgetall(k.entry(ids[1])), redis_client.hget(k.st, ids[1])
    for signal in (hit.feedback(False), FeedbackSignal(ids[1], "t", True)):
        with pytest.raises(CorruptEntryError):
            m.feedback(signal)
    assert (redis_client.hgetall(k.entry(ids[1])), redis_client.hget(k.st, ids[1])) == before
    savings = m.stats("t")["savings"]["gpt-x"]
    assert (savings["calls"], savings["wrong_calls"]) == (1, 0)


def test_a_meta_of_another_schema_version_is_not_served_nor_reported(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """A newer zerda-cache's entry (meta.v 2) is refused as the decoder refuses it
    (SchemaVersionError): not served, nothing counted, but never reported for eviction
    (a rolling upgrade must not evict the new version's entries)."""
    m = make_manager()
    ids = fill(m.put, n=2)
    damage(redis_client, "t", ids[1], "v", 2)
    assert m.lookup("question 1", tenant="t", embedding=unit(1)) is None
    assert m.lookup("asked another way", tenant="t", embedding=near(unit(1), 0.97)) is None
    assert m.stats("t").get("hits", 0) == 0
    assert redis_client.scard(tenant_keys("t").bad) == 0
    with pytest.raises(CorruptEntryError):
        m.feedback(FeedbackSignal(ids[1], "t", True))


def test_export_leaves_it_out_and_reports_it_and_the_cli_goes_on(
    redis_client: redis.Redis, redis_url: str, tmp_path: Any
) -> None:
    """``export`` and ``evict --tenant`` exited 1 with a traceback. Now the export leaves
    the entry out, says so and reports it; ``evict --tenant`` evicts it as corrupt."""
    m = CacheManager(redis_client)
    st = m.storage
    ids = fill(m.put)
    damage(redis_client, "t", ids[0], "us", ["gpt-x", float("inf"), 3])
    damage(redis_client, "t", ids[1], "dim", 31.5)
    seen: list[str] = []
    out = io.StringIO()
    assert export_tenant(st, "t", out, corrupt=lambda eid, why: seen.append(eid)) == len(ids) - 2
    assert sorted(seen) == sorted(ids[:2])
    assert {e.decode() for e in redis_client.smembers(tenant_keys("t").bad)} == set(ids[:2])
    redis_client.delete(tenant_keys("t").bad)  # the CLI reports them again
    path = tmp_path / "t.jsonl"
    run = CliRunner().invoke(cli, ["--redis-url", redis_url, "export", "--tenant", "t", "-o", path])
    assert run.exit_code == 0, run.output
    assert "left out 2 corrupt entries" in run.stderr
    exported = [json.loads(line)["id"] for line in path.read_text().splitlines()[1:]]
    assert sorted(exported) == sorted(ids[2:])
    assert redis_client.scard(tenant_keys("t").bad) == 2
    run = CliRunner().invoke(cli, ["--redis-url", redis_url, "evict", "--tenant", "t", "--json"])
    assert run.exit_code == 0, run.output
    row = json.loads(run.stdout)["tenants"][0]
    assert row["planned"]["corrupt"] == 2 and row["removed"] == 2
    assert st.count("t") == len(ids) - 2


def test_the_worker_evicts_it_and_goes_on_with_the_other_tenants(
    redis_client: redis.Redis,
) -> None:
    """The worker's whole evict cycle failed on it every time: tenants that sort after
    it were never evicted, and no tenant's match model was fitted. Now it is evicted
    as corrupt, the next tenant's expired entry is evicted, and both models fitted."""
    m = CacheManager(redis_client)
    st = m.storage
    a, b = fill(m.put, "a", 10), fill(m.put, "b", 10)
    damage(redis_client, "a", a[4], "us", ["gpt-x", float("inf"), 3])
    redis_client.zadd(tenant_keys("b").ids, {b[0]: 1.0})  # expired long ago
    x, y = synthetic(MIN_FIT_LABELS * 2)
    for tenant in ("a", "b"):
        teach(st, tenant, x, y)
    w = Worker(redis_client, CacheConfig(), health_file=None)
    w.lease_tick()
    assert w.lease.held
    w.evict_job()
    assert w.metrics.errors.labels("evict")._value.get() == 0.0
    assert redis_client.zscore(tenant_keys("a").ids, a[4]) is None
    assert redis_client.zscore(tenant_keys("b").ids, b[0]) is None
    assert st.count("a") == 9 and st.count("b") == 9
    for tenant in ("a", "b"):
        assert redis_client.hget(tenant_keys(tenant).cal, "model") is not None, tenant
    w.close()


def test_one_tenants_failure_does_not_stop_the_cycle(
    redis_client: redis.Redis, monkeypatch: Any, caplog: Any
) -> None:
    """Whatever fails in one tenant (here a bug, raised by hand) is logged with that
    tenant's name, and the cycle goes on with the others."""
    m = CacheManager(redis_client)
    st = m.storage
    fill(m.put, "a", 3)
    b = fill(m.put, "b", 3)
    redis_client.zadd(tenant_keys("b").ids, {b[0]: 1.0})
    maint = Maintenance(st)
    real = maint.evict_tenant

    def evict(tenant: str) -> Any:
        if tenant == "a":
            raise RuntimeError("a bug in tenant a's part")
        return real(tenant)

    monkeypatch.setattr(maint, "evict_tenant", evict)
    with caplog.at_level(logging.ERROR, logger="zerda_cache.worker"):
        reports = maint.run_eviction()
    assert [r.tenant for r in reports] == ["b"] and reports[0].removed == {"expired": 1}
    assert "tenant a" in caplog.text and "a bug in tenant a's part" in caplog.text


def test_an_outage_is_one_warning_line_a_tick(redis_server_factory: Any, caplog: Any) -> None:
    """During a Redis outage ``evict_job`` let a StorageError out to APScheduler, which
    logged ERROR with three chained tracebacks every tick. Now each job logs one
    WARNING line, without a traceback, and the next tick tries again."""
    server = redis_server_factory()
    cfg = CacheConfig(redis_timeout_s=0.2)
    w = Worker(connect(server.url, cfg), cfg, health_file=None)
    w.lease_tick()
    assert w.lease.held
    server.stop()
    with caplog.at_level(logging.DEBUG, logger="zerda_cache.worker.scheduler"):
        w.evict_job()
        w.decay_job()
    records = [r for r in caplog.records if r.name == "zerda_cache.worker.scheduler"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
    assert "evict cycle skipped: Redis failed" in records[0].getMessage()
    assert w.metrics.errors.labels("evict")._value.get() == 1.0
    w.close()


@pytest.mark.parametrize("key", ["st", "tags"])
def test_a_tenants_key_of_another_type_is_that_tenants_failure(
    redis_client: redis.Redis, key: str, caplog: Any
) -> None:
    """A key of one tenant holding a string (WRONGTYPE, or a script's error on it) was
    taken for Redis being down: ``run_eviction`` raised, the tenants after it were not
    evicted, and the worker logged "evict cycle skipped: Redis failed". Now it is that
    tenant's failure, logged with its traceback, and the cycle goes on."""
    m = CacheManager(redis_client)
    fill(m.put, "a", 3)
    b = fill(m.put, "b", 3)
    redis_client.zadd(tenant_keys("b").ids, {b[0]: 1.0})  # expired long ago
    redis_client.delete(getattr(tenant_keys("a"), key))
    redis_client.set(getattr(tenant_keys("a"), key), "not a hash or a set")
    maint = Maintenance(m.storage)
    with caplog.at_level(logging.ERROR, logger="zerda_cache.worker"):
        reports = maint.run_eviction()
    assert [r.tenant for r in reports] == ["b"] and reports[0].removed == {"expired": 1}
    failed = [r for r in caplog.records if "tenant a" in r.getMessage()]
    assert failed and failed[0].exc_info is not None
    assert redis_client.zscore(tenant_keys("b").ids, b[0]) is None


def test_the_worker_logs_a_reply_error_as_a_failure_not_an_outage(
    redis_client: redis.Redis, monkeypatch: Any, caplog: Any
) -> None:
    """A reply error that escapes a cycle (here the tenant registry holding a string:
    WRONGTYPE on every cycle's first read) is not Redis being down: it is logged with
    its traceback as a failed cycle, not as "Redis failed"."""
    w = Worker(redis_client, CacheConfig(), health_file=None)
    w.lease_tick()
    assert w.lease.held
    redis_client.delete("zc:tenants")
    redis_client.set("zc:tenants", "not a set")
    with caplog.at_level(logging.DEBUG, logger="zerda_cache.worker.scheduler"):
        w.evict_job()
    records = [r for r in caplog.records if r.name == "zerda_cache.worker.scheduler"]
    assert [r.levelno for r in records] == [logging.ERROR]
    assert "evict cycle failed" in records[0].getMessage() and records[0].exc_info
    assert w.metrics.errors.labels("evict")._value.get() == 1.0
    w.close()


def test_a_tenants_failure_is_counted_as_the_cycles_error(redis_client: redis.Redis) -> None:
    """A tenant whose part of the cycle failed was logged, but the cycle still counted
    as ``ok``, set the last success and left ``worker_errors_total`` at 0: the alerts
    on both never saw it. Now the failure is counted and the cycle ends as ``error``
    (in the metrics and in the cycle log), while the other tenants were evicted."""
    m = CacheManager(redis_client)
    fill(m.put, "a", 3)
    b = fill(m.put, "b", 3)
    redis_client.zadd(tenant_keys("b").ids, {b[0]: 1.0})  # expired long ago
    redis_client.delete(tenant_keys("a").st)
    redis_client.set(tenant_keys("a").st, "not a hash")
    w = Worker(redis_client, CacheConfig(), health_file=None)
    w.lease_tick()
    assert w.lease.held
    w.evict_job()
    assert redis_client.zscore(tenant_keys("b").ids, b[0]) is None
    assert w.metrics.errors.labels("evict")._value.get() >= 1.0
    assert w.metrics.cycles.labels("evict", "error")._value.get() == 1.0
    assert w.metrics.cycles.labels("evict", "ok")._value.get() == 0.0
    assert w.metrics.last_success.labels("evict")._value.get() == 0.0
    ends = [c for c in w.maintenance.recent_cycles() if c.get("phase") == "end"]
    assert [c["outcome"] for c in ends if c["job"] == "evict"] == ["error"]
    redis_client.delete(tenant_keys("a").st)  # repaired: the next cycle is a good one
    w.evict_job()
    assert w.metrics.cycles.labels("evict", "ok")._value.get() == 1.0
    assert w.metrics.last_success.labels("evict")._value.get() > 0
    w.close()


#: Counts of a state that are not whole, or out of range: ``(part, field, value)``.
BAD_COUNTS: list[tuple[str, str, float]] = [
    ("arm", "n", 2.5),  # int() made it 2
    ("use", "n", 1.5),
    ("use", "v", 3.25),
    ("use", "ns", 2.5),
    ("use", "ns", 1e9),
    ("sz", "", 2.0**53),  # evict.lua: not a size (unknown)
    ("sz", "", 1e300),
]


@pytest.mark.parametrize(("part", "name", "value"), BAD_COUNTS)
def test_a_count_that_is_not_whole_is_corrupt(
    redis_client: redis.Redis, part: str, name: str, value: float
) -> None:
    """docs/operations.md calls a count that is not whole corrupt, but the decoder
    truncated ``arm.n``, ``use.n`` and ``use.v`` with ``int()`` and took any ``sz`` of
    2**53 or more, which evict.lua takes for no size. Now each is corrupt, as the
    bounds the scripts and the docs give; the largest size evict.lua takes still reads."""
    m = CacheManager(redis_client)
    st = m.storage
    eid = fill(m.put, "t", 1)[0]
    state = read_state(redis_client, "t", eid)
    if part == "sz":
        state["sz"] = 2.0**53 - 1
        write_state(redis_client, "t", eid, state)
        assert st.get_entry("t", eid).size_bytes == 2**53 - 1
        state["sz"] = value
    else:
        state[part][name] = value
    write_state(redis_client, "t", eid, state)
    with pytest.raises(CorruptEntryError):
        st.get_entry("t", eid)
