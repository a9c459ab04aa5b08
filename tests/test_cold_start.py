"""A cold replica: its index is built in the background and no lookup waits for it.

The build reads real Redis; only its pace is the test's: ``hold_build`` makes the
build's reads of vectors wait for a gate the test opens, so the build is certainly still
running while the test looks up (whatever the machine's speed).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.conftest import near, unit
from zerda_cache import CacheConfig, CacheManager, FeedbackSignal, RLConfig
from zerda_cache.core.errors import DimensionMismatchError, StorageError
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.replica import indexes as replica
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.scripts import script_source


def metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def hold_build(manager: Any, flavour: str) -> Callable[[], None]:
    """Make ``manager``'s index builds wait before each read of vectors until the
    returned function is called (a threading event for the sync flavour's build thread,
    an asyncio event for the async flavour's task)."""
    target = manager.target if flavour == "async" else manager
    storage = target.storage
    read_vectors = storage.vectors_flow
    gate: Any = threading.Event() if flavour == "sync" else asyncio.Event()
    wait = (lambda: gate.wait(60)) if flavour == "sync" else gate.wait

    def gated(tenant: str, entry_ids: Any, dim: int | None = None) -> Any:
        yield wait
        return (yield from read_vectors(tenant, entry_ids, dim))

    storage.vectors_flow = gated
    opened: Callable[[], None] = gate.set
    return opened


def pump(manager: Any, flavour: str) -> None:
    """Let background work go on a moment: a thread runs by itself; an asyncio task only
    while the (test's) event loop runs."""
    if flavour == "async":
        manager.run(asyncio.sleep(0.01))
    else:
        threading.Event().wait(0.01)


def until_ready(manager: Any, flavour: str, tenant: str = "t") -> None:
    """Wait for the background build alone (no lookup or sync_index to catch up)."""
    for _ in range(1000):
        if manager.index_ready(tenant):
            return
        pump(manager, flavour)
    raise AssertionError("the index was not built in 10 s")


def fill(make_manager: Any, n: int) -> list[str]:
    writer = make_manager()
    return [
        writer.put(f"q{i}", f"a{i}", tenant="t", embedding=unit(100 + i)).entry_id for i in range(n)
    ]


def test_a_cold_replica_serves_exact_matches_while_its_index_builds(
    make_manager: Any, flavour: str
) -> None:
    ids = fill(make_manager, 60)
    reg = CollectorRegistry()
    reader = make_manager(CacheConfig(redis_timeout_s=0.05), metrics=ReplicaMetrics(reg))
    release = hold_build(reader, flavour)
    # The build cannot finish: every lookup returns anyway (after a bounded wait).
    exact = reader.lookup("q7", tenant="t", embedding=unit(107))
    assert exact is not None and exact.entry_id == ids[7] and exact.exact
    assert reader.lookup("q7 reworded", tenant="t", embedding=near(unit(107), 0.97)) is None
    assert not reader.index_ready("t") and reader.index_progress("t") == (0, 60)
    assert metric(reg, "zerda_cache_index_ready", tenant="t") == 0
    assert reader.stats("t")["replica_index_ready"] is False
    with pytest.raises(DimensionMismatchError):  # checked against Redis meanwhile
        reader.lookup("q7", tenant="t", embedding=unit(107, dim=8))
    release()
    assert reader.sync_index("t") == 60  # waits for the build, however long it takes
    assert reader.index_ready("t") and reader.index_progress("t") == (60, 60)
    assert metric(reg, "zerda_cache_index_ready", tenant="t") == 1
    assert metric(reg, "zerda_cache_index_rebuilds_total", tenant="t") == 1
    assert metric(reg, "zerda_cache_index_build_seconds_count") == 1
    hit = reader.lookup("q7 reworded", tenant="t", embedding=near(unit(107), 0.97))
    assert hit is not None and hit.entry_id == ids[7] and not hit.exact


def test_puts_during_a_build_are_in_the_index_it_installs(make_manager: Any, flavour: str) -> None:
    """Events that race the scan (puts and removals by other replicas) are replayed from
    the log position read before the scan began."""
    ids = fill(make_manager, 30)
    reader = make_manager(CacheConfig(redis_timeout_s=0.05))
    release = hold_build(reader, flavour)
    assert reader.lookup("nothing", tenant="t", embedding=unit(999)) is None  # starts it
    writer = make_manager()
    new = writer.put("late", "a-late", tenant="t", embedding=unit(500)).entry_id
    assert writer.invalidate(ids[0], tenant="t")
    release()
    until_ready(reader, flavour)  # the build's own replay, before any catch-up
    assert new in reader.index_ids("t") and ids[0] not in reader.index_ids("t")
    assert reader.sync_index("t") == 30
    hit = reader.lookup("late?", tenant="t", embedding=near(unit(500), 0.97))
    assert hit is not None and hit.entry_id == new


def test_close_stops_a_running_build_and_waits_for_it(
    make_manager: Any, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` returns once the build has stopped, at its next batch, not when the
    whole scan would have been read: a sync build thread that outlives the interpreter
    aborts the process (``replica.STOP_WAIT_S``)."""
    fill(make_manager, 300)  # past the listpack size: a scan batch is no more than asked
    monkeypatch.setattr(replica, "BUILD_BATCH", 25)  # ~12 batches
    reader = make_manager(CacheConfig(redis_timeout_s=0.05))
    target = reader.target if flavour == "async" else reader
    storage = target.storage
    read_vectors = storage.vectors_flow
    reads: list[int] = []

    def slow(tenant: str, entry_ids: Any, dim: int | None = None) -> Any:
        reads.append(len(entry_ids))
        yield (lambda: asyncio.sleep(0.05)) if flavour == "async" else (lambda: time.sleep(0.05))
        return (yield from read_vectors(tenant, entry_ids, dim))

    storage.vectors_flow = slow
    assert reader.lookup("nothing", tenant="t", embedding=unit(999)) is None  # starts it
    job = target.indexes["t"].job
    assert job is not None and not job.done()
    reader.close()
    assert job.done() and not target.index_ready("t")
    assert 1 <= sum(reads) < 300
    assert not [t for t in threading.enumerate() if t.name == "zerda-index-t"]


@pytest.mark.slow
def test_a_process_exiting_during_a_build_exits_cleanly(
    redis_server: Any, redis_client: redis.Redis, server_kind: str
) -> None:
    """A script that looks up (starting the build of an HNSW index in a thread) and
    exits while the build inserts into the graph, closed or not, exits with no build
    thread left: one still inside usearch's C++ when the interpreter finalizes can abort
    the process ("terminate called without an active exception", status 134: seen
    before ``engine._stop_at_exit``). The script's own exit hook, registered first and
    so run last, fails it if a build thread is alive then."""
    if server_kind != "redis":
        pytest.skip("about the process's exit, not the server: run on one kind")
    st = RedisStorage(redis_client, CacheConfig())
    rng = np.random.default_rng(0)
    calls = [st.plan_put("t", f"q{i}", f"a{i}", rng.normal(size=384)) for i in range(6000)]
    pipe = redis_client.pipeline(transaction=False)
    for c in calls:
        st.scripts.put(keys=c.keys, args=c.args, client=pipe)
    pipe.execute()
    script = """
import atexit, os, sys, threading, time
import numpy as np

def check():
    alive = [t.name for t in threading.enumerate() if t.name.startswith("zerda-index")]
    if alive:
        print("build threads alive at exit:", alive, file=sys.stderr, flush=True)
        os._exit(3)

atexit.register(check)
from zerda_cache import CacheConfig, CacheManager
from zerda_cache.replica.usearch_index import UsearchIndex

inserting, add = threading.Event(), UsearchIndex._graph_add

def gated(self, *args):
    inserting.set()
    time.sleep(0.2)  # the main thread is on its way out meanwhile
    return add(self, *args)

UsearchIndex._graph_add = gated
m = CacheManager.from_url(sys.argv[1], CacheConfig(redis_timeout_s=0.05))
m.lookup("q", tenant="t", embedding=np.ones(384))
assert inserting.wait(60) and not m.index_ready("t")
if sys.argv[2] == "close":
    m.close()
"""
    for how in ("close", "exit"):
        proc = subprocess.run(
            [sys.executable, "-c", script, redis_server.url, how],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (how, proc.returncode, proc.stderr[-2000:])
        assert "terminate called" not in proc.stderr


def test_a_dedup_put_does_not_wait_for_the_build(make_manager: Any, flavour: str) -> None:
    """``dedup_threshold`` needs the index: while it is being built a put replaces only
    the same question, and the near duplicate is caught once the index is ready."""
    ids = fill(make_manager, 5)
    cfg = CacheConfig(redis_timeout_s=0.05, dedup_threshold=0.95)
    m = make_manager(cfg)
    release = hold_build(m, flavour)
    first = m.put("q1 again", "b1", tenant="t", embedding=near(unit(101), 0.99))
    assert first.stored and first.replaced_id is None  # the near duplicate stays meanwhile
    release()
    m.sync_index("t")
    second = m.put("q2 again", "b2", tenant="t", embedding=near(unit(102), 0.99))
    assert second.replaced_id == ids[2]


def test_a_failed_build_is_reported_and_retried(
    make_manager: Any, redis_server_factory: Any
) -> None:
    server = redis_server_factory()
    writer = make_manager(url=server.url)
    writer.put("q", "a", tenant="t", embedding=unit(1))
    reader = make_manager(CacheConfig(redis_timeout_s=0.2), url=server.url)
    server.stop()
    assert reader.lookup("q", tenant="t", embedding=unit(1)) is None  # fails open
    with pytest.raises(StorageError):
        reader.sync_index("t")  # the build's own error
    assert not reader.index_ready("t")
    server.restart()  # the same port; nothing persisted: an empty tenant
    assert reader.sync_index("t") == 0
    assert reader.index_ready("t")


def test_a_failed_build_is_retried_by_lookups(
    make_manager: Any, flavour: str, redis_server_factory: Any, monkeypatch: Any, caplog: Any
) -> None:
    """Not only ``sync_index``: the first lookup after the retry delay starts a new build."""
    import logging

    import zerda_cache.replica.indexes as replica_module

    monkeypatch.setattr(replica_module, "BUILD_RETRY_S", 0.01)
    server = redis_server_factory()
    reader = make_manager(CacheConfig(redis_timeout_s=0.2), url=server.url)
    server.stop()
    with caplog.at_level(logging.WARNING, logger="zerda_cache"):
        assert reader.lookup("q", tenant="t", embedding=unit(1)) is None
        for _ in range(200):  # the failed build ends in the background
            if "index build failed" in caplog.text:
                break
            pump(reader, flavour)
    assert "index build failed" in caplog.text
    server.restart()
    make_manager(url=server.url).put("q", "a", tenant="t", embedding=unit(1))
    for _ in range(500):
        hit = reader.lookup("q?", tenant="t", embedding=near(unit(1), 0.97))
        if hit is not None:
            break
        pump(reader, flavour)
    assert hit is not None and reader.index_ready("t")


def test_events_trimmed_away_during_a_build_are_not_lost(
    make_manager: Any, flavour: str, redis_client: Any
) -> None:
    """The log is capped: puts made during a long build may be trimmed before the build
    replays them. The replay finds out (XINFO) and the tenant is built again."""
    from zerda_cache.storage.keys import tenant_keys

    keys = tenant_keys("t")
    fill(make_manager, 30)
    reader = make_manager(CacheConfig(redis_timeout_s=0.05))
    release = hold_build(reader, flavour)
    assert reader.lookup("nothing", tenant="t", embedding=unit(999)) is None  # starts it
    writer = make_manager()
    for i in range(20):
        writer.put(f"late {i}", "a", tenant="t", embedding=unit(700 + i))
    redis_client.xtrim(keys.log, 5, approximate=False)
    release()
    assert reader.sync_index("t") == 50
    live = {m.decode() for m in redis_client.zrange(keys.ids, 0, -1)}
    assert reader.index_ids("t") == live


def test_the_build_inserts_off_the_event_loop(
    make_manager: Any, flavour: str, monkeypatch: Any
) -> None:
    """While one tenant's insertion is stuck, lookups of another tenant go on (for the
    asyncio flavour: the insertion runs in a worker thread, not on the loop)."""
    from zerda_cache.replica.indexes import TenantIndex

    fill(make_manager, 10)  # tenant t
    other = make_manager().put("o", "b", tenant="o", embedding=unit(5)).entry_id
    reader = make_manager(CacheConfig(redis_timeout_s=0.05))
    assert reader.sync_index("o") == 1
    gate, entered = threading.Event(), threading.Event()
    scanned = TenantIndex.scanned
    threads: list[threading.Thread] = []

    def stuck(self: TenantIndex, index: Any, vectors: Any) -> Any:
        if self.keys.tenant == "t":
            threads.append(threading.current_thread())
            entered.set()
            gate.wait(10)
        return scanned(self, index, vectors)

    monkeypatch.setattr(TenantIndex, "scanned", stuck)
    try:
        assert reader.lookup("q1", tenant="t", embedding=unit(101)) is not None  # exact
        assert entered.wait(10)
        for _ in range(5):
            hit = reader.lookup("o?", tenant="o", embedding=near(unit(5), 0.97))
            assert hit is not None and hit.entry_id == other
        assert not reader.index_ready("t")
    finally:
        gate.set()
    assert reader.sync_index("t") == 10
    assert threads and threading.main_thread() not in threads  # lookups run in main


class CountingRedis(redis.Redis):
    """A real client that counts its round trips: a command, or a pipeline however it is
    sent, takes one connection from the pool for each."""

    trips = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        take = self.connection_pool.get_connection

        def counted(*a: Any, **k: Any) -> Any:
            self.trips += 1
            return take(*a, **k)

        self.connection_pool.get_connection = counted  # type: ignore[method-assign]


def counting_manager(url: str, cfg: CacheConfig) -> tuple[CountingRedis, CacheManager]:
    """A manager on a ``CountingRedis`` client, the hit script loaded beforehand so that no
    NOSCRIPT retry enters the count."""
    client = CountingRedis.from_url(url)
    m = CacheManager(client, cfg, metrics=ReplicaMetrics(CollectorRegistry()))
    client.script_load(script_source("hit"))
    return client, m


def test_round_trips_of_a_lookup_while_building_and_once_built(
    make_manager: Any, redis_server: Any
) -> None:
    """The question asked exactly, while the index builds: the pipeline, then the hit
    script (no read of the entry's state first). A near match once built: one trip."""
    ids = fill(make_manager, 30)
    client = CountingRedis.from_url(redis_server.url)
    reader = CacheManager(
        client, CacheConfig(redis_timeout_s=0.05), metrics=ReplicaMetrics(CollectorRegistry())
    )
    client.script_load(script_source("hit"))  # no NOSCRIPT retry in the count
    release = hold_build(reader, "sync")
    try:
        # The first lookup reads the policy and the server's clock too.
        assert reader.lookup("warm", tenant="t", embedding=unit(999)) is None
        client.trips = 0
        hit = reader.lookup("q7", tenant="t", embedding=unit(107))
        assert hit is not None and hit.entry_id == ids[7] and hit.exact
        assert client.trips == 2
    finally:
        release()
    reader.sync_index("t")
    reader.lookup("q3?", tenant="t", embedding=near(unit(103), 0.97))  # a fresh policy
    client.trips = 0
    hit = reader.lookup("q3?", tenant="t", embedding=near(unit(103), 0.97))
    assert hit is not None and hit.entry_id == ids[3] and client.trips == 1
    reader.close()


class ListingRedis(redis.Redis):
    """A real client that lists the commands of each round trip it makes: a pipeline's,
    or one command on its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[list[str]] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent.append([str(args[0])])
        return super().execute_command(*args, **options)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = super().pipeline(*args, **kwargs)
        execute = pipe.execute

        def listed(*a: Any, **k: Any) -> Any:
            self.sent.append([str(cmd[0]) for cmd, _ in pipe.command_stack])
            return execute(*a, **k)

        pipe.execute = listed
        return pipe


def test_a_clear_near_match_is_one_command_the_hit_script_reading_digest_and_log(
    redis_server: Any,
) -> None:
    """The common lookup is one command, not a pipeline: the hit script, which also
    reads the question's exact-match digest and peeks at the log, so that the lookup
    sends no HGET or XREVRANGE of its own. Either way round: a near match served, and
    the question's own entry found by the script (served as an exact hit). An entry put
    meanwhile by another replica comes back in the script's peek, and the next lookup
    finds it without a read of the log of its own."""
    client = ListingRedis.from_url(redis_server.url)
    # Nothing else due in these pipelines: no policy re-read, no counts to write.
    cfg = CacheConfig(policy_refresh_s=600.0)
    m = CacheManager(client, cfg, metrics=ReplicaMetrics(CollectorRegistry()))
    own = m.put("q1", "a1", tenant="listed", embedding=unit(1)).entry_id
    m.sync_index("listed")
    m.lookup("warm", tenant="listed", embedding=unit(999))  # the policy and the clock
    m.lookup("warm q1", tenant="listed", embedding=near(unit(1), 0.97))  # loads the script
    m.stats("listed")  # writes the warm-up's miss and lookup counts
    client.sent = []
    hit = m.lookup("another q1", tenant="listed", embedding=near(unit(1), 0.97))
    assert hit is not None and hit.entry_id == own and not hit.exact
    assert client.sent == [["EVALSHA"]]
    m.stats("listed")
    client.sent = []
    hit = m.lookup("q1", tenant="listed", embedding=near(unit(1), 0.97))
    assert hit is not None and hit.entry_id == own and hit.exact and hit.similarity == 1.0
    assert client.sent == [["EVALSHA"]]
    # Another replica's put: this lookup's peek brings it, and the index catches up.
    other = CacheManager(redis.Redis.from_url(redis_server.url), cfg)
    new = other.put("q2", "a2", tenant="listed", embedding=unit(2)).entry_id
    m.stats("listed")
    client.sent = []
    hit = m.lookup("another q1 again", tenant="listed", embedding=near(unit(1), 0.97))
    assert hit is not None and hit.entry_id == own
    assert client.sent == [["EVALSHA"], ["HMGET"]]  # the script, then the new vector
    m.stats("listed")  # writes that lookup's count: nothing else due in the next
    client.sent = []
    hit = m.lookup("another q2", tenant="listed", embedding=near(unit(2), 0.97))
    assert hit is not None and hit.entry_id == new
    assert client.sent == [["EVALSHA"]]
    other.close()
    m.clear("listed")  # the server is the session's: other tests' tenants stay theirs
    m.close()


def test_one_round_trip_serves_a_clear_best_of_several_candidates(redis_server: Any) -> None:
    """Several candidates, the most similar ahead of the next by more than
    ``similarity_tie_margin``: the ranking would put it first whatever the arms say, so
    the lookup serves it in its one round trip. Within the margin, the same when the
    bandit would rank it first whatever it draws (no evidence on either: their means);
    otherwise the bandit ranks them on the states the hit script returned, and a second
    trip serves. A clear best the hit script refuses (under the serving bar) is skipped,
    as ranking skips it, and the next is served."""
    cfg = CacheConfig(similarity_threshold=0.8, rl=RLConfig(min_reward_to_serve=0.4))
    client, m = counting_manager(redis_server.url, cfg)
    a = unit(1)
    best = m.put("qa", "answer a", tenant="s", embedding=a).entry_id
    second = m.put("qb", "answer b", tenant="s", embedding=near(a, 0.95, seed=5)).entry_id
    twin = m.put("qt", "answer t", tenant="s", embedding=near(a, 0.999, seed=6)).entry_id
    query = near(a, 0.99, seed=7)
    sims = {e: float(v @ query) for e, v in ((best, a), (twin, near(a, 0.999, seed=6)))}
    sims[second] = float(near(a, 0.95, seed=5) @ query)
    assert min(sims.values()) > 0.8 and abs(sims[best] - sims[twin]) < 0.01
    m.lookup("warm", tenant="s", embedding=unit(999))  # the policy and the clock
    # A clear best: the twin is removed, so the top is ahead of the next by > 0.01.
    assert m.invalidate(twin, tenant="s")
    assert sims[best] - sims[second] > cfg.rl.similarity_tie_margin
    m.lookup("warm", tenant="s", embedding=unit(999))  # catches the invalidation up
    client.trips = 0
    hit = m.lookup("q?", tenant="s", embedding=query)
    assert hit is not None and hit.entry_id == best and client.trips == 1
    # Two within the margin, neither with evidence: the bandit scores them their means,
    # so the more similar is first whatever it draws, and the hit script serves it.
    twin = m.put("qt", "answer t", tenant="s", embedding=near(a, 0.999, seed=6)).entry_id
    assert sims[best] > float(near(a, 0.999, seed=6) @ query)
    m.lookup("warm", tenant="s", embedding=unit(999))
    client.trips = 0
    hit = m.lookup("q?", tenant="s", embedding=query)
    assert hit is not None and hit.entry_id == best and client.trips == 1
    # The twin with evidence: its draw may put it first, so the bandit ranks them here,
    # on the states the hit script returned with its refusal: two round trips.
    m.feedback(FeedbackSignal(twin, "s", True))
    m.lookup("warm", tenant="s", embedding=unit(999))
    client.trips = 0
    hit = m.lookup("q?", tenant="s", embedding=query)
    assert hit is not None and hit.entry_id in (best, twin) and client.trips == 2
    # The clear best under the serving bar (three wrong answers: 1 / 5 < 0.4): refused by
    # the hit script, and the next candidate served.
    assert m.invalidate(twin, tenant="s")
    for _ in range(3):
        m.feedback(FeedbackSignal(best, "s", False))
    m.lookup("warm", tenant="s", embedding=unit(999))
    client.trips = 0
    hit = m.lookup("q?", tenant="s", embedding=query)
    assert hit is not None and hit.entry_id == second and client.trips == 3
    m.close()
