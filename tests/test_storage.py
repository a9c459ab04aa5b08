"""RedisStorage against real servers (redis-server and valkey-server, see conftest)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
import redis.asyncio
from conftest import Blocking, Clock, close_loop
from state_support import read_state, set_raw_state, set_state_value, stored

from zerda_cache import (
    CacheConfig,
    CorruptEntryError,
    DimensionMismatchError,
    EntryNotFoundError,
    FeedbackSignal,
    InvalidEmbeddingError,
    InvalidEntryError,
    InvalidTenantError,
    RLConfig,
    StorageError,
)
from zerda_cache.core.entry import DEFAULT_QUALITY, DEFAULT_SIMILARITY, IntelligentCacheEntry
from zerda_cache.storage import AsyncRedisStorage, RedisStorage
from zerda_cache.storage import entry_store as entry_store_module
from zerda_cache.storage.connect import connect
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.storage.plans import HitStatus
from zerda_cache.worker.maintenance import Maintenance

DIM = 16


def vec(seed: int, dim: int = DIM) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.random.default_rng(seed).normal(size=dim)


def snapshot(client: redis.Redis) -> dict[bytes, bytes]:
    """Every key and its serialized value: equal snapshots mean Redis is unchanged."""
    return {k: client.dump(k) for k in sorted(client.keys("*"))}


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000.0)


@pytest.fixture
def storage(
    flavour: str, redis_client: redis.Redis, redis_url: str, clock: Clock
) -> Iterator[RedisStorage]:
    """Storage of each flavour; the async one behind blocking calls (conftest.Blocking)."""
    cfg = CacheConfig(max_response_bytes=1000)
    if flavour == "sync":
        yield RedisStorage(redis_client, cfg, clock=clock)
        return
    loop = asyncio.new_event_loop()
    st = AsyncRedisStorage(redis.asyncio.Redis.from_url(redis_url), cfg, clock=clock)
    yield Blocking(st, loop)  # type: ignore[misc]
    loop.run_until_complete(st.aclose())
    close_loop(loop)


def put(st: RedisStorage, i: int, tenant: str = "acme", **kw: Any) -> str:
    return st.put(tenant, f"question {i}?", f"answer {i}", vec(i), **kw).entry_id


# --- put / get / hit ----------------------------------------------------------------------
def test_put_writes_every_structure(storage: RedisStorage, redis_client: redis.Redis) -> None:
    out = storage.put(
        "acme",
        "What is Redis?",
        "A server.",
        vec(1),
        scope="s1",
        ttl_s=60,
        quality=0.9,
        metadata={"model": "m"},
    )
    k = tenant_keys("acme")
    e = storage.get_entry("acme", out.entry_id)
    assert (e.query, e.response, e.metadata, e.scope) == (
        "What is Redis?",
        "A server.",
        {"model": "m"},
        "s1",
    )
    assert e.created_at == 1000.0 and e.expires_at == 1060.0 and e.ttl_s == 60
    assert e.bandit_arm.alpha == 1.0 and e.bandit_arm.decayed_at == 1000.0
    assert e.version == 1 and e.size_bytes > DIM * 4
    np.testing.assert_allclose(np.linalg.norm(e.embedding), 1.0, rtol=1e-6)
    assert redis_client.zscore(k.ids, out.entry_id) == 1060.0
    assert storage.exact_match("acme", "  what is REDIS? ", "s1") == out.entry_id
    assert storage.exact_match("acme", "what is redis?", "other") is None
    events = redis_client.xrange(k.log)
    assert [(f[b"op"], f[b"id"].decode(), f[b"sc"]) for _, f in events] == [
        (b"add", out.entry_id, b"s1")
    ]
    assert storage.stats("acme") == {"puts": 1, "bytes": e.size_bytes, "entries": 1}
    assert storage.tenants() == ["acme"] and storage.tenant_dim("acme") == DIM


def test_a_served_entry_carries_the_state_its_hit_wrote(
    storage: RedisStorage, clock: Clock
) -> None:
    """The hit script returns the entry's state as it packed it (120 bytes), decoded
    field by field in Python (``codec.trusted_state``): every field of the served entry
    is what a read of the entry after the hit gives."""
    eid = put(storage, 1)
    storage.feedback(FeedbackSignal(eid, "acme", True, magnitude=2.0, similarity=0.9))
    storage.feedback(FeedbackSignal(eid, "acme", False, magnitude=0.5, similarity=0.8))
    storage.feedback(FeedbackSignal(eid, "acme", False, magnitude=0.5, similarity=0.95))
    clock.t = 1_500.0
    served = storage.hit("acme", eid).entry
    assert served is not None
    read = storage.get_entry("acme", eid)
    assert read is not None
    fields = (
        "usage_count",
        "last_access",
        "confidence_score",
        "version",
        "similarity_score",
        "quality_score",
        "similarity_bar",
        "min_positive_similarity",
        "negative_streak",
    )
    assert {f: getattr(served, f) for f in fields} == {f: getattr(read, f) for f in fields}
    assert served.bandit_arm == read.bandit_arm
    arm = served.bandit_arm
    assert arm.pulls == 3 and arm.decayed_at == 1_500.0 and arm.alpha > 1.0 and arm.beta > 1.0
    assert served.usage_count == 1 and served.negative_streak == 1
    assert served.similarity_bar > 0.8 and served.min_positive_similarity == 0.9


def test_exact_duplicate_put_reports_displaced(storage: RedisStorage) -> None:
    first = storage.put("acme", "Same q", "old", vec(1))
    second = storage.put("acme", "same Q", "new", vec(2))
    assert second.displaced_id == first.entry_id and first.displaced_id is None
    assert storage.exact_match("acme", "same q") == second.entry_id


def test_hit_counts_use_and_respects_expiry(
    storage: RedisStorage, clock: Clock, redis_client: redis.Redis
) -> None:
    eid = put(storage, 1, ttl_s=10)
    clock.t = 1005.0
    hit = storage.hit("acme", eid)
    assert hit.status == "served" and hit.entry is not None
    assert (hit.entry.response, hit.entry.usage_count, hit.entry.last_access) == (
        "answer 1",
        1,
        1005.0,
    )
    assert hit.entry.version == 2 and hit.entry.created_at == 1000.0
    assert storage.stats("acme")["hits"] == 1
    storage.feedback(FeedbackSignal(eid, "acme", False, magnitude=30.0))
    before = snapshot(redis_client)
    assert storage.hit("acme", eid, min_reward=0.05).status == "unservable"
    assert snapshot(redis_client) == before
    clock.t = 1010.0
    assert storage.hit("acme", eid).status == "expired"
    assert storage.hit("acme", "0" * 32).status == "gone"


def test_hit_refreshes_ttl_only_when_asked(
    storage: RedisStorage, clock: Clock, redis_client: redis.Redis
) -> None:
    eid = put(storage, 1, ttl_s=10)
    clock.t = 1008.0
    storage.hit("acme", eid)
    assert redis_client.zscore(tenant_keys("acme").ids, eid) == 1010.0
    storage.hit("acme", eid, refresh_ttl=True)
    assert redis_client.zscore(tenant_keys("acme").ids, eid) == 1018.0


# --- feedback ---
def test_feedback_updates_arm_counters_and_stream(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    eid = put(storage, 1)
    st = storage.feedback(FeedbackSignal(eid, "acme", True, magnitude=2.0, source="llm_eval"))
    assert st.bandit_arm.alpha == 3.0 and st.bandit_arm.pulls == 1
    st = storage.feedback(FeedbackSignal(eid, "acme", False))
    assert st.bandit_arm.beta == 2.0 and st.bandit_arm.reward_sum == 1.0
    assert storage.get_entry("acme", eid).bandit_arm == st.bandit_arm
    s = storage.stats("acme")
    assert (s["positive"], s["negative"]) == (1, 1)
    log = storage.feedback_log("acme")
    assert [(x["id"], x["pos"], x["src"]) for x in log] == [
        (eid, "0", "user"),
        (eid, "1", "llm_eval"),
    ]


def test_feedback_stream_is_capped(redis_client: redis.Redis, clock: Clock) -> None:
    st = RedisStorage(redis_client, CacheConfig(feedback_log_maxlen=250), clock=clock)
    eid = put(st, 1)
    for i in range(0, 1000, 50):
        st.feedback_many([FeedbackSignal(eid, "acme", True)] * 50)
        # Approximate trimming drops whole stream nodes (100 entries by default).
        assert min(i + 50, 250) <= redis_client.xlen(tenant_keys("acme").fb) <= 250 + 100
    assert st.get_entry("acme", eid).bandit_arm.pulls == 1000


def test_default_feedback_cap_is_10000(storage: RedisStorage) -> None:
    assert storage.config.feedback_log_maxlen == 10_000


# --- decay ---
def decay_storage(client: redis.Redis, clock: Clock) -> RedisStorage:
    cfg = CacheConfig(rl=RLConfig(usage_decay=0.5, decay_interval_s=10.0))
    return RedisStorage(client, cfg, clock=clock)


def test_decay_is_persisted_and_idempotent_in_time(redis_client: redis.Redis, clock: Clock) -> None:
    st = decay_storage(redis_client, clock)
    a, b = put(st, 1), put(st, 2)
    for eid in (a, b):
        for _ in range(8):
            st.feedback(FeedbackSignal(eid, "acme", True))
    # a: decayed at t1 then t2; b: once at t2; plus a doubled batch at t2.
    clock.t = 1010.0
    assert st.decay("acme", [a]).decayed == 1
    clock.t = 1030.0
    first = st.decay("acme", [a, b])
    before = snapshot(redis_client)
    again = st.decay("acme", [a, b])  # same instant: a no-op, nothing written
    assert (first.decayed, again.decayed) == (2, 0)
    assert snapshot(redis_client) == before
    arm_a = st.get_entry("acme", a).bandit_arm
    arm_b = st.get_entry("acme", b).bandit_arm
    assert arm_a.alpha == pytest.approx(1.0 + 8.0 * 0.125, abs=1e-12)
    assert arm_b.alpha == pytest.approx(arm_a.alpha, abs=1e-12)
    assert arm_a.decayed_at == arm_b.decayed_at == 1030.0
    clock.t = 1020.0  # a late batch from a lagging worker changes nothing
    assert st.decay("acme", [a, b]).decayed == 0


def test_decay_reports_missing(redis_client: redis.Redis, clock: Clock) -> None:
    st = decay_storage(redis_client, clock)
    a, fresh = put(st, 1), put(st, 2)
    st.feedback(FeedbackSignal(a, "acme", True))
    clock.t = 2000.0
    before = snapshot(redis_client)
    out = st.decay("acme", [a, fresh, "f" * 32])
    # the arm at its prior has nothing to decay and is not rewritten
    assert (out.decayed, out.missing, out.corrupt) == (1, 1, [])
    after = snapshot(redis_client)
    key = tenant_keys("acme").entry(fresh).encode()
    assert before[key] == after[key]


# --- evict / invalidate -------------------------------------------------------------------------
def test_evict_removes_every_trace(storage: RedisStorage, redis_client: redis.Redis) -> None:
    keep = put(storage, 1)
    gone = put(storage, 2, scope="s")
    size = storage.get_entry("acme", gone).size_bytes
    before_bytes = storage.stats("acme")["bytes"]
    out = storage.evict("acme", [(gone, 1)], "capacity")
    assert out.removed == [gone]
    k = tenant_keys("acme")
    assert not redis_client.exists(k.entry(gone))
    assert redis_client.zscore(k.ids, gone) is None
    assert storage.exact_match("acme", "question 2?", "s") is None
    assert redis_client.hlen(k.q) == 1
    ops = [(f[b"op"], f[b"id"].decode()) for _, f in redis_client.xrange(k.log)]
    assert ops[-1] == (b"del", gone)
    s = storage.stats("acme")
    assert s["evicted:capacity"] == 1 and s["bytes"] == before_bytes - size
    assert s["entries"] == 1 and storage.get_entry("acme", keep).response == "answer 1"


def test_evict_skips_entry_changed_since_scored(storage: RedisStorage) -> None:
    eid = put(storage, 1)
    scored_version = storage.load_states("acme", [eid]).entries[eid].version
    storage.feedback(FeedbackSignal(eid, "acme", True))  # arrives after scoring
    out = storage.evict("acme", [(eid, scored_version)], "low_reward")
    assert out.changed == [eid] and out.removed == []
    assert storage.count("acme") == 1
    current = storage.load_states("acme", [eid]).entries[eid].version
    assert storage.evict("acme", [(eid, current)], "low_reward").removed == [eid]


def test_evict_batch_with_an_id_twice_removes_it_once(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    """The script takes a batch's removed ids out of the ids zset and the evidence set in
    one call each, at its end: an id given twice is removed once, logged once, and its
    second place reports it gone."""
    a, b, c = put(storage, 1), put(storage, 2), put(storage, 3)
    storage.feedback(FeedbackSignal(a, "acme", True))  # a has evidence: in the ev set
    k = tenant_keys("acme")
    assert redis_client.sismember(k.ev, a)
    version_b = storage.load_states("acme", [b]).entries[b].version
    out = storage.evict("acme", [(a, None), (b, version_b), (a, None)], "capacity")
    assert out.removed == [a, b] and out.gone == [a] and out.changed == []
    assert not redis_client.sismember(k.ev, a)
    assert {x.decode() for x in redis_client.zrange(k.ids, 0, -1)} == {c}
    dels = [f[b"id"].decode() for _, f in redis_client.xrange(k.log) if f[b"op"] == b"del"]
    assert sorted(dels) == sorted([a, b])
    assert storage.stats("acme")["evicted:capacity"] == 2 and storage.count("acme") == 1


def test_evict_cleans_stray_ids_and_unknown_reason(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    k = tenant_keys("acme")
    redis_client.zadd(k.ids, {"a" * 32: math.inf})
    assert storage.evict("acme", [("a" * 32, None)], "expired").gone == ["a" * 32]
    assert redis_client.zcard(k.ids) == 0
    with pytest.raises(ValueError, match="reason"):
        storage.evict("acme", [("a" * 32, None)], "because")


def test_invalidate(storage: RedisStorage) -> None:
    eid = put(storage, 1)
    assert storage.invalidate("acme", eid) is True
    assert storage.invalidate("acme", eid) is False
    with pytest.raises(EntryNotFoundError):
        storage.get_entry("acme", eid)
    assert storage.stats("acme")["evicted:invalidated"] == 1


# --- the state hash -----------------------------------------------------------------------
def test_an_entry_keeps_its_state_in_the_tenant_state_hash(
    storage: RedisStorage, redis_client: redis.Redis
) -> None:
    """The entry's own hash holds its content; its learning state is one field of the
    tenant's state hash, written by every script that changes it and removed with it."""
    k = tenant_keys("acme")
    eid, other = put(storage, 1), put(storage, 2)
    assert set(redis_client.hkeys(k.entry(eid))) == {b"doc", b"vec", b"meta", b"dg"}
    state = read_state(redis_client, "acme", eid)
    assert state["arm"]["a"] == 1.0 and state["use"]["v"] == 1
    assert state["sz"] == storage.get_entry("acme", eid).size_bytes
    assert storage.hit("acme", eid).status == "served"
    assert read_state(redis_client, "acme", eid)["use"]["n"] == 1
    storage.feedback(FeedbackSignal(eid, "acme", True))
    assert read_state(redis_client, "acme", eid)["arm"]["n"] == 1
    assert storage.invalidate("acme", eid) is True
    assert redis_client.hkeys(k.st) == [other.encode()]
    storage.evict("acme", [(other, None)], "invalidated")
    assert not redis_client.exists(k.st) and storage.stats("acme")["bytes"] == 0


def _to_layout_0_1(client: redis.Redis, tenant: str, entry_id: str) -> None:
    """Store an entry as zerda-cache 0.1 did: ``arm``, ``use`` and ``sz`` (a decimal
    string) fields of its own hash, nothing in the state hash."""
    k = tenant_keys(tenant)
    state = read_state(client, tenant, entry_id)
    use = {n: v for n, v in state["use"].items() if n != "ns" or v}  # 0.1 left a 0 run out
    old = {
        "arm": msgpack.packb(state["arm"]),
        "use": msgpack.packb(use),
        "sz": str(int(state["sz"])),
    }
    client.hset(k.entry(entry_id), mapping=old)
    client.hdel(k.st, entry_id)


def test_entries_written_before_the_state_hash_are_read_and_moved_to_it(
    storage: RedisStorage, redis_client: redis.Redis, clock: Clock
) -> None:
    """An upgrade loses nothing: entries stored by zerda-cache 0.1 are read as they are,
    and each script that touches one moves its state to the state hash, unchanged."""
    k = tenant_keys("acme")
    ids = [put(storage, i) for i in range(7)]
    before = {eid: storage.get_entry("acme", eid) for eid in ids}
    stats = storage.stats("acme")
    for eid in ids:
        _to_layout_0_1(redis_client, "acme", eid)
    moved = lambda eid: (  # noqa: E731
        redis_client.hexists(k.st, eid)
        and not redis_client.hexists(k.entry(eid), "arm")
        and not redis_client.hexists(k.entry(eid), "sz")
    )
    # Readers take either layout and move nothing.
    for eid in ids:
        got = storage.get_entry("acme", eid)
        assert (got.bandit_arm, got.version, got.size_bytes) == (
            before[eid].bandit_arm, before[eid].version, before[eid].size_bytes)  # fmt: skip
    assert sorted(storage.load_states("acme", ids).entries) == sorted(ids)
    assert not any(moved(eid) for eid in ids)
    # Each script moves what it touches.
    assert storage.hit("acme", ids[0]).status == "served" and moved(ids[0])
    assert read_state(redis_client, "acme", ids[0])["use"]["n"] == 1
    storage.feedback(FeedbackSignal(ids[1], "acme", True))
    assert moved(ids[1]) and read_state(redis_client, "acme", ids[1])["arm"]["n"] == 1
    clock.t += 10
    storage.decay("acme", [ids[2]])
    assert moved(ids[2])
    cols = storage.state_arrays("acme", [ids[3], ids[4]])
    assert cols.ids == [ids[3], ids[4]] and all(moved(e) for e in ids[3:5])
    assert cols.size.tolist() == [before[e].size_bytes for e in ids[3:5]]
    assert cols.version.tolist() == [1, 1]
    # Removal takes the old fields' size off the byte count.
    assert storage.invalidate("acme", ids[5]) is True
    assert storage.stats("acme")["bytes"] == stats["bytes"] - before[ids[5]].size_bytes
    # An old entry whose arm does not decode moves as corrupt and stays corrupt.
    redis_client.hset(k.entry(ids[6]), "arm", b"\xc1")
    assert storage.hit("acme", ids[6]).status == "corrupt" and moved(ids[6])
    assert storage.state_arrays("acme", [ids[6]]).corrupt == [ids[6]]
    assert storage.invalidate("acme", ids[6]) is True
    assert storage.stats("acme")["bytes"] == stats["bytes"] - sum(
        before[e].size_bytes for e in ids[5:])  # fmt: skip


def test_an_entry_whose_hash_was_lost_is_reported_by_a_lookup_and_evicted(
    redis_client: redis.Redis,
) -> None:
    """The whole scan reads states, not entries' hashes: an entry whose hash went (an
    allkeys-* eviction, a DEL) while its id and state remain is reported by the first
    lookup that finds it, never served, and the worker removes it whole."""
    storage = RedisStorage(redis_client, CacheConfig())
    k = tenant_keys("acme")
    lost, kept = put(storage, 1), put(storage, 2)
    redis_client.delete(k.entry(lost))
    assert storage.hit("acme", lost).status == "corrupt"
    assert redis_client.smembers(k.bad) == {lost.encode()}
    with pytest.raises(CorruptEntryError):
        storage.feedback(FeedbackSignal(lost, "acme", True))
    report = Maintenance(storage).evict_tenant("acme")
    assert report.removed == {"corrupt": 1}
    assert redis_client.hkeys(k.st) == [kept.encode()]
    assert redis_client.zrange(k.ids, 0, -1) == [kept.encode()]
    assert storage.stats("acme")["bytes"] == storage.get_entry("acme", kept).size_bytes


def test_iter_ids_with_expiry(storage: RedisStorage, clock: Clock) -> None:
    ids = {put(storage, i, ttl_s=5 if i % 2 else None) for i in range(25)}
    seen = [eid for batch in storage.iter_ids("acme", batch=4) for eid, _ in batch]
    assert set(seen) == ids
    clock.t = 1006.0
    expired = [eid for batch in storage.iter_ids("acme") for eid, exp in batch if exp <= clock.t]
    assert len(expired) == 12 and set(expired) < ids  # the scan carries each expiry


def test_load_states_one_round_trip_shape(storage: RedisStorage) -> None:
    a, b = put(storage, 1), put(storage, 2)
    batch = storage.load_states("acme", [a, "0" * 32, b])
    assert set(batch.entries) == {a, b} and batch.missing == ["0" * 32]
    assert batch.entries[a].confidence_score == pytest.approx(0.4 * 0.5 + 0.25 + 0.125)


def test_tenants_are_isolated(storage: RedisStorage) -> None:
    a = put(storage, 1, tenant="t1")
    with pytest.raises(EntryNotFoundError, match="t2"):
        storage.feedback(FeedbackSignal(a, "t2", True))
    storage.put("t2", "q", "r", vec(1, dim=4))  # each tenant has its own dimension
    assert storage.tenant_dim("t2") == 4 and storage.tenant_dim("t1") == DIM


def test_scripts_survive_script_flush(storage: RedisStorage, redis_client: redis.Redis) -> None:
    eid = put(storage, 1)
    redis_client.script_flush()
    storage.feedback(FeedbackSignal(eid, "acme", True))  # NOSCRIPT -> reload -> retry
    assert storage.get_entry("acme", eid).bandit_arm.alpha == 2.0


def test_a_read_survives_a_dropped_connection_sync_and_async(
    redis_client: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup's read (one pipeline) gets the client's one quick retry when the pooled
    connection dropped as it was sent (a server restart, an idle timeout): ``connect``
    configures it, and redis-py applies it to pipelines from 6.0 on (5.3 did not retry)."""
    eid = put(RedisStorage(redis_client), 1)
    calls: list[int] = []
    sync_sent = redis.connection.Connection.send_packed_command
    async_sent = redis.asyncio.connection.Connection.send_packed_command

    def drop_once(conn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            conn.disconnect()
            raise redis.exceptions.ConnectionError("dropped")
        return sync_sent(conn, *args, **kwargs)

    async def drop_once_async(conn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            await conn.disconnect()
            raise redis.exceptions.ConnectionError("dropped")
        return await async_sent(conn, *args, **kwargs)

    st = RedisStorage(connect(redis_url, CacheConfig()))
    assert st.load_states("acme", [eid]).entries  # connected, before the drop
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", drop_once)
    assert st.load_states("acme", [eid]).entries[eid].entry_id == eid
    assert len(calls) > 1  # the failed send, then the retry
    monkeypatch.undo()
    st.client.close()
    calls.clear()
    loop = asyncio.new_event_loop()
    client = connect(redis_url, CacheConfig(), asyncio=True)
    try:
        ast = AsyncRedisStorage(client)
        assert loop.run_until_complete(ast.load_states("acme", [eid])).entries
        monkeypatch.setattr(
            redis.asyncio.connection.Connection, "send_packed_command", drop_once_async
        )
        again = loop.run_until_complete(ast.load_states("acme", [eid]))
        assert again.entries[eid].entry_id == eid and len(calls) > 1
    finally:
        monkeypatch.undo()
        loop.run_until_complete(client.aclose())
        close_loop(loop)


def test_a_cancelled_async_read_leaves_no_reply_for_the_next_command(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """A lookup cancelled while it waits for its read's replies (a request timeout in an
    app, the server paused): the replies still on their way are never read by the next
    command, and the connection goes back to the pool."""
    eid = put(RedisStorage(redis_client), 1)
    loop = asyncio.new_event_loop()
    client = connect(redis_url, CacheConfig(), asyncio=True)
    st = AsyncRedisStorage(client)

    async def scenario() -> None:
        await client.set("k", "1")
        redis_client.execute_command("CLIENT", "PAUSE", 300, "ALL")
        task = asyncio.ensure_future(st.load_states("acme", [eid]))  # Storage._read
        await asyncio.sleep(0.05)
        assert not task.done()  # waiting for the paused server's replies
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not client.connection_pool._in_use_connections  # type: ignore[attr-defined]
        assert await client.get("k") == b"1" and await client.hget("acme-none", "f") is None
        assert (await st.load_states("acme", [eid])).entries[eid].entry_id == eid

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.run_until_complete(client.aclose())
        close_loop(loop)


# --- bad input: a typed error and Redis unchanged ------------------------------------------------
BadCall = Callable[[RedisStorage, str], object]

BAD_CALLS: dict[str, tuple[BadCall, type[Exception]]] = {
    "tenant with brace": (lambda s, e: s.put("a{b}", "q", "r", vec(1)), InvalidTenantError),
    "tenant with colon": (lambda s, e: s.put("a:b", "q", "r", vec(1)), InvalidTenantError),
    "tenant with space": (lambda s, e: s.get_entry("a b", e), InvalidTenantError),
    "tenant with newline": (lambda s, e: s.stats("a\nb"), InvalidTenantError),
    "empty tenant": (lambda s, e: s.put("", "q", "r", vec(1)), InvalidTenantError),
    "tenant over 64": (lambda s, e: s.put("x" * 65, "q", "r", vec(1)), InvalidTenantError),
    "unknown entry feedback": (
        lambda s, e: s.feedback(FeedbackSignal("0" * 32, "acme", True)),
        EntryNotFoundError,
    ),
    "unknown entry get": (lambda s, e: s.get_entry("acme", "0" * 32), EntryNotFoundError),
    "NaN embedding": (
        lambda s, e: s.put("acme", "q", "r", [math.nan] * DIM),
        InvalidEmbeddingError,
    ),
    "wrong dimension": (
        lambda s, e: s.put("acme", "q", "r", vec(1, dim=DIM + 1)),
        DimensionMismatchError,
    ),
    "empty query": (lambda s, e: s.put("acme", "  ", "r", vec(1)), InvalidEntryError),
    "oversized response": (lambda s, e: s.put("acme", "q", "x" * 1001, vec(1)), InvalidEntryError),
    "non-str metadata key": (
        lambda s, e: s.put("acme", "q", "r", vec(1), metadata={1: 2}),
        InvalidEntryError,
    ),
    "unserialisable metadata": (
        lambda s, e: s.put("acme", "q", "r", vec(1), metadata={"f": object()}),
        InvalidEntryError,
    ),
    "bad ttl": (lambda s, e: s.put("acme", "q", "r", vec(1), ttl_s=math.nan), InvalidEntryError),
    "bad quality": (lambda s, e: s.put("acme", "q", "r", vec(1), quality=2), InvalidEntryError),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_typed_error_and_changes_nothing(
    case: str, storage: RedisStorage, redis_client: redis.Redis
) -> None:
    eid = put(storage, 1)
    storage.feedback(FeedbackSignal(eid, "acme", True))
    call, exc = BAD_CALLS[case]
    before = snapshot(redis_client)
    with pytest.raises(exc):
        call(storage, eid)
    assert snapshot(redis_client) == before


# --- corruption ---
@pytest.mark.parametrize("field", ["arm", "use", "meta", "doc"])
def test_corrupt_value_is_reported_and_tenant_keeps_working(
    field: str, storage: RedisStorage, redis_client: redis.Redis, clock: Clock
) -> None:
    bad, good = put(storage, 1), put(storage, 2)
    key = tenant_keys("acme").entry(bad)
    if field in ("arm", "use"):  # a number of the state that is not finite
        part = read_state(redis_client, "acme", bad)[field]
        set_state_value(redis_client, "acme", bad, field, {**part, "t": math.nan, "c": math.nan})
    else:
        redis_client.hset(key, field, b"\xc1garbage")
    with pytest.raises(CorruptEntryError, match=field):
        storage.get_entry("acme", bad)
    assert storage.hit("acme", bad).status == "corrupt"  # never served
    if field in ("arm", "use"):  # the learning state itself: the scripts refuse to touch it
        storage.feedback(FeedbackSignal(good, "acme", True))
        before = stored(redis_client, "acme", bad)
        with pytest.raises(CorruptEntryError):
            storage.feedback(FeedbackSignal(bad, "acme", True))
        clock.t = 5000.0
        out = storage.decay("acme", [bad, good])
        assert out.corrupt == [bad] and out.decayed == 1
        assert stored(redis_client, "acme", bad) == before  # nothing written to the bad entry
    if field != "doc":
        assert storage.load_states("acme", [bad, good]).corrupt == [bad]
    # The rest of the tenant still works, and the corrupt entry can be removed.
    storage.feedback(FeedbackSignal(good, "acme", True))
    assert storage.hit("acme", good).status == "served"
    assert storage.invalidate("acme", bad) is True
    assert storage.count("acme") == 1


def test_read_entries_returns_each_entry_or_its_error_in_order(
    storage: RedisStorage, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(entry_store_module, "READ_ENTRIES_BATCH", 2)  # several round trips
    ids = [put(storage, i) for i in range(1, 6)]
    redis_client.hset(tenant_keys("acme").entry(ids[1]), "doc", b"\xc1garbage")
    assert storage.invalidate("acme", ids[3]) is True
    asked = [ids[0], ids[1], ids[3], ids[4], ids[2], "e" * 32]
    out = storage.read_entries("acme", asked)
    assert len(out) == len(asked)
    assert isinstance(out[1], CorruptEntryError)
    assert isinstance(out[2], EntryNotFoundError) and isinstance(out[5], EntryNotFoundError)
    for at in (0, 3, 4):
        entry = out[at]
        assert isinstance(entry, IntelligentCacheEntry) and entry.entry_id == asked[at]
        alone = storage.get_entry("acme", asked[at])
        assert (entry.query, entry.response, entry.version) == (
            alone.query,
            alone.response,
            alone.version,
        )
        assert np.array_equal(entry.embedding, alone.embedding)
    assert storage.read_entries("acme", []) == []


@pytest.mark.parametrize(
    ("field", "name", "value"),
    [
        ("arm", "a", math.inf),
        ("arm", "b", -math.inf),
        ("arm", "a", 0.0),
        ("arm", "b", -1.0),
        ("use", "c", math.inf),
    ],
)
def test_an_infinite_or_impossible_arm_is_corrupt_everywhere(
    field: str, name: str, value: float, storage: RedisStorage, redis_client: redis.Redis
) -> None:
    """An arm at infinity used to be served with expected_reward=nan (past the serving
    bar) and NaN was written back: now it is corrupt for every script and the decoder,
    never served, never rewritten, and removable."""
    eid = put(storage, 1)
    state = read_state(redis_client, "acme", eid)[field]
    set_state_value(redis_client, "acme", eid, field, {**state, name: value})
    before = stored(redis_client, "acme", eid)
    assert storage.hit("acme", eid).status == "corrupt"
    with pytest.raises(CorruptEntryError):
        storage.feedback(FeedbackSignal(eid, "acme", False))
    assert storage.decay("acme", [eid]).corrupt == [eid]
    assert storage.state_arrays("acme", [eid]).corrupt == [eid]
    assert storage.load_states("acme", [eid]).corrupt == [eid]
    assert stored(redis_client, "acme", eid) == before
    assert storage.invalidate("acme", eid) is True


@pytest.mark.parametrize("ns", [float("nan"), float("inf"), -1, 1.5])
def test_corrupt_negative_streak_is_corrupt_everywhere(
    ns: object, storage: RedisStorage, redis_client: redis.Redis
) -> None:
    """A bad ``use.ns`` makes the entry corrupt for every script and for the decoder: it
    is neither served nor silently rewritten."""
    eid = put(storage, 1)
    use = read_state(redis_client, "acme", eid)["use"]
    set_state_value(redis_client, "acme", eid, "use", {**use, "ns": ns})
    before = stored(redis_client, "acme", eid)
    assert storage.hit("acme", eid).status == "corrupt"
    with pytest.raises(CorruptEntryError):
        storage.feedback(FeedbackSignal(eid, "acme", False))
    with pytest.raises(CorruptEntryError, match="use"):
        storage.get_entry("acme", eid)
    assert stored(redis_client, "acme", eid) == before


@pytest.mark.parametrize("raw", [b"", b"x", bytes(119), bytes(121)])
def test_a_state_of_the_wrong_size_is_corrupt(
    raw: bytes, storage: RedisStorage, redis_client: redis.Redis
) -> None:
    eid = put(storage, 1)
    set_raw_state(redis_client, "acme", eid, raw)
    with pytest.raises(CorruptEntryError):
        storage.feedback(FeedbackSignal(eid, "acme", True))
    with pytest.raises(CorruptEntryError, match="bytes"):
        storage.get_entry("acme", eid)
    assert storage.hit("acme", eid).status == "corrupt"
    assert storage.state_arrays("acme", [eid]).corrupt == [eid]
    assert storage.invalidate("acme", eid) is True


# --- server clock and errors ---
def test_server_clock_is_used_without_injection(redis_client: redis.Redis) -> None:
    st = RedisStorage(redis_client)
    server_now = st.now()
    eid = st.put("acme", "q", "r", vec(1)).entry_id
    created = st.get_entry("acme", eid).created_at
    assert abs(created - server_now) < 5.0


@pytest.mark.slow
def test_connection_failure_is_storage_error() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    st = RedisStorage(dead)
    with pytest.raises(StorageError) as info:
        st.count("acme")
    assert isinstance(info.value.__cause__, redis.exceptions.ConnectionError)
    dead.close()


def test_feedback_many_pipelines_and_reports_errors_per_signal(storage: RedisStorage) -> None:
    a, b = put(storage, 1), put(storage, 2)
    signals = [
        FeedbackSignal(a, "acme", True),
        FeedbackSignal("0" * 32, "acme", True),
        FeedbackSignal(b, "acme", False, magnitude=3.0),
        FeedbackSignal(a, "acme", True),
    ]
    out = storage.feedback_many(signals)
    assert isinstance(out[1], EntryNotFoundError)
    assert not isinstance(out[3], Exception) and out[3].bandit_arm.alpha == 3.0
    assert storage.get_entry("acme", b).bandit_arm.beta == 4.0
    assert storage.feedback_many([]) == []


def test_both_flavours_have_the_same_methods() -> None:
    """Every public storage method exists on both flavours (the async one lacked six)."""

    def public(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert public(RedisStorage) - {"close"} == public(AsyncRedisStorage) - {"aclose"}


def test_the_calls_the_async_flavour_lacked(storage: RedisStorage) -> None:
    a, b = put(storage, 1), put(storage, 2)
    signals = [FeedbackSignal(a, "acme", True), FeedbackSignal("0" * 32, "acme", False)]
    out = storage.feedback_many(signals)
    assert out[0].expected_reward == pytest.approx(2 / 3)  # type: ignore[union-attr]
    assert isinstance(out[1], EntryNotFoundError)
    cols = storage.state_arrays("acme", [a, b, "0" * 32])
    assert cols.ids == [a, b] and cols.alpha.tolist() == [2.0, 1.0]
    assert storage.tenants() == ["acme"]
    storage.set_tenant_settings("acme", max_entries=5)
    assert storage.tenant_settings("acme") == {"dim": DIM, "max_entries": 5.0}
    assert storage.exact_match("acme", "QUESTION 1?") == a
    assert storage.feedback_log("acme")[0]["id"] == a
    assert [eid for batch in storage.iter_ids("acme") for eid, _ in batch] != []
    assert storage.log_info("acme").added == 2 and storage.leader() is None


def test_a_stream_holds_what_was_added_after_a_mark_until_trimmed_or_re_created() -> None:
    from zerda_cache.storage.plans import LogInfo

    now = LogInfo(last_id="9-0", added=100, length=40)  # the first 60 were trimmed
    assert now.holds_since(60) and now.holds_since(100)
    assert not now.holds_since(59)  # one added after the mark is gone
    assert not now.holds_since(101)  # fewer ever added than at the mark: another stream
    assert LogInfo().holds_since(0)


def _hit_peek(st: RedisStorage, tenant: str, after: str) -> Any:
    """The hit script's peek at the log (``plan_hit(peek=...)``), the lookup's usual
    read of it: here for an entry that does not exist, which the script reports gone
    and peeks all the same."""
    from zerda_cache.storage.driver import run_sync

    plan = st.plan_hit(tenant, "0" * 32, asked="d" * 40, peek=after)
    outcome = run_sync(st.run_flow(plan))
    assert outcome.status is HitStatus.GONE
    return outcome.log


@pytest.mark.parametrize("reader", ["read_log", "peek_log", "hit_peek"])
def test_a_log_read_from_a_position_says_whether_events_may_be_missing(
    redis_client: redis.Redis, reader: str
) -> None:
    """One range from the reader's position (forward for catch-ups, backward from the
    newest event for lookups, in a pipeline of its own or inside the hit script): while
    that event is still in the log the read is whole; once it is trimmed away (or was
    never an event), it may not be."""
    from zerda_cache.storage.driver import run_sync
    from zerda_cache.storage.plans import CATCHUP_BATCH

    st = RedisStorage(redis_client, CacheConfig())

    def read(after: str) -> Any:
        if reader == "hit_peek":
            return _hit_peek(st, "acme", after)
        return run_sync(st.read_flow(getattr(st, reader)("acme", after)))

    k = tenant_keys("acme")
    ids = [
        redis_client.xadd(k.log, {"op": "add", "id": f"e{i}", "sc": ""}).decode() for i in range(5)
    ]
    whole = read(ids[1])
    assert not whole.maybe_trimmed and whole.count == 3 and list(whole.adds) == ["e2", "e3", "e4"]
    assert whole.last_id == ids[4] and not whole.more and not whole.partial
    caught_up = read(ids[4])
    assert caught_up.empty and caught_up.count == 0 and not caught_up.maybe_trimmed
    assert read("0-0").maybe_trimmed  # never an event
    redis_client.xadd(k.log, {"op": "del", "id": "e0"})
    redis_client.xtrim(k.log, maxlen=3, approximate=False)  # ids[0], ids[1] and ids[2] go
    gone = read(ids[1])
    assert gone.maybe_trimmed and list(gone.adds) == ["e3", "e4"] and gone.dels == {"e0"}
    for i in range(CATCHUP_BATCH + 5):
        redis_client.xadd(k.log, {"op": "add", "id": f"f{i}", "sc": ""})
    full = read(ids[4])
    if reader == "read_log":  # a full batch says so
        assert full.count == CATCHUP_BATCH and full.more and not full.maybe_trimmed
        rest = read(full.last_id or "")
        assert rest.count == 6 and not rest.more and not rest.maybe_trimmed
    else:  # only the newest batch came back: nothing to apply, read forward
        assert full.partial and full.empty and not full.maybe_trimmed


@pytest.mark.parametrize("reader", ["peek_log", "hit_peek"])
def test_a_lookups_peek_at_the_log_is_whole_up_to_its_size(
    redis_client: redis.Redis, reader: str
) -> None:
    """``peek_log`` (and the hit script's peek) returns up to ``PEEK_EVENTS`` events
    after the position, all of them (never ``more``); past that, or with the position
    trimmed away and more than that after it, it is ``partial`` and the forward read
    says the rest."""
    from zerda_cache.storage.driver import run_sync
    from zerda_cache.storage.plans import PEEK_EVENTS

    st = RedisStorage(redis_client, CacheConfig())

    def peek(after: str) -> Any:
        if reader == "hit_peek":
            return _hit_peek(st, "acme", after)
        return run_sync(st.read_flow(st.peek_log("acme", after)))

    k = tenant_keys("acme")

    def add(n: int, prefix: str) -> list[str]:
        return [
            redis_client.xadd(k.log, {"op": "add", "id": f"{prefix}{i}", "sc": ""}).decode()
            for i in range(n)
        ]

    start = add(1, "s")[0]
    ids = add(PEEK_EVENTS, "e")
    whole = peek(start)
    assert whole.count == PEEK_EVENTS and not whole.more and not whole.partial
    assert list(whole.adds) == [f"e{i}" for i in range(PEEK_EVENTS)] and whole.last_id == ids[-1]
    add(1, "f")
    over = peek(start)  # one more than a peek returns
    assert over.partial and over.empty and not over.maybe_trimmed
    assert not peek(ids[0]).partial  # from a later position, a peek holds them all again
    redis_client.xtrim(k.log, maxlen=PEEK_EVENTS + 1, approximate=False)  # start goes
    gone = peek(start)  # the position trimmed, and more than a peek after it
    assert gone.partial and not gone.maybe_trimmed
    assert run_sync(st.read_log_flow("acme", start)).maybe_trimmed  # the forward read says so
    redis_client.xtrim(k.log, maxlen=3, approximate=False)
    few = peek(start)  # the position trimmed, every event after it returned
    assert few.maybe_trimmed and not few.partial and few.count == 3


def test_entries_whose_state_was_lost_get_the_state_a_put_gives(
    redis_client: redis.Redis,
) -> None:
    """The state hash is one key: an allkeys-* eviction (or a DEL) of it loses every
    entry's evidence, not its answers. An entry found without a state gets the one a put
    gives (the prior, default similarity and quality) from the first script that needs
    it, the worker's scan included; nothing is evicted for it."""
    storage = RedisStorage(redis_client, CacheConfig())
    k = tenant_keys("acme")
    ids = [put(storage, i) for i in range(4)]
    storage.feedback(FeedbackSignal(ids[0], "acme", True))
    sizes = [storage.get_entry("acme", eid).size_bytes for eid in ids]
    redis_client.delete(k.st)
    assert storage.hit("acme", ids[0]).status == "served"
    state = read_state(redis_client, "acme", ids[0])
    assert (state["arm"]["a"], state["arm"]["b"], state["arm"]["n"]) == (1, 1, 0)
    assert state["use"]["ss"] == DEFAULT_SIMILARITY and state["use"]["qs"] == DEFAULT_QUALITY
    assert state["use"]["n"] == 1 and state["sz"] == sizes[0]
    storage.feedback(FeedbackSignal(ids[1], "acme", False))
    assert read_state(redis_client, "acme", ids[1])["arm"]["n"] == 1
    cols = storage.state_arrays("acme", ids[2:])
    assert cols.ids == ids[2:] and cols.corrupt == [] and cols.size.tolist() == sizes[2:]
    assert Maintenance(storage).plan_eviction("acme").total == 0
    assert storage.count("acme") == 4


def test_on_an_allkeys_server_the_whole_scan_finds_the_hashes_redis_evicted(
    redis_client: redis.Redis,
) -> None:
    """The scan reads states, not hashes. Where Redis may evict an entry's hash on its
    own (maxmemory-policy allkeys-*), it checks each hash too, so that the id and state
    of one Redis evicted are removed; elsewhere only a lookup finds such an entry."""
    storage = RedisStorage(redis_client, CacheConfig())
    k = tenant_keys("acme")
    ids = [put(storage, i) for i in range(5)]
    redis_client.delete(k.entry(ids[0]))
    assert Maintenance(storage).plan_eviction("acme").dangling == []
    policy = redis_client.config_get("maxmemory-policy")["maxmemory-policy"]
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        m = Maintenance(storage)
        plan = m.plan_eviction("acme")
        assert plan.dangling == [ids[0]] and plan.scanned == 4
        m.execute(plan)
    finally:
        redis_client.config_set("maxmemory-policy", policy)
    assert not redis_client.hexists(k.st, ids[0]) and redis_client.zscore(k.ids, ids[0]) is None
    assert storage.count("acme") == 4
