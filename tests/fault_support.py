"""Fault campaigns against real processes: app replicas and workers under a fault.

Test tooling beside ``zerda_cache/testing.py`` (the throwaway servers), not shipped with
the package: it reads and checks raw Redis state on purpose, to judge what the library did.
The fault-injection tests (``tests/test_fault_campaign.py``) and the fault benchmark
(``benchmarks/bench_faults.py``) share this module, so the figures the benchmark reports
come from the very runs the tests assert on.

**Replica processes.** ``python tests/fault_support.py replica ...`` is one app replica:
a ``CacheManager`` in its own OS process doing puts, lookups (the exact question, or a
near copy of its embedding) and feedback against one tenant, until a stop file appears.
It appends one JSON line per call to its record file (flushed at once, so a record
survives whatever happens next): what Redis acknowledged (a put's entry id, a feedback
signal), what it failed, and what it served (the entry, its question and answer), with
the wall-clock start and duration of the call. At the stop file it syncs its index and
records the ids in it. Questions are ``q <replica> <n>``; the answer put for a question
is derived from it (``answer_to``), and its embedding too (``vector_of``), so any record
can be checked without knowing which replica put what: an answer served for question Q
is wrong when the entry it came from was put for another question.

**Analysis.** ``analyze`` reads every record file and Redis itself, and counts:
acknowledged writes lost (puts whose entry is gone, feedback signals missing from an
entry's never-decayed ``pulls``), wrong answers served, lookups during the outage (their
failures, worst latency), recovery (puts and hits of new entries after the fault), and
ghost or missing ids in the replicas' final indexes.

**Worker processes.** ``start_worker`` runs ``zerda-cache worker`` as a subprocess
(``leader_fault`` kills or terminates the leader mid-cycle and checks what the standby
does after it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import redis
from prometheus_client import CollectorRegistry

import zerda_cache
from zerda_cache import CacheConfig, CacheManager, FeedbackSignal, RLConfig, ZerdaError
from zerda_cache.core.errors import StorageError
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import RedisStorage, codec
from zerda_cache.storage.keys import leader_key, tenant_keys, tenants_key

#: The package's source root: child processes import this very zerda_cache.
SOURCE_ROOT = Path(zerda_cache.__file__).resolve().parents[1]
DIM = 32
#: Near-copy lookups ask with an embedding at this cosine to the question's own.
NEAR_COSINE = 0.97
#: The replicas' similarity threshold: random 32-d vectors of other questions never
#: reach it (cosine ~0 +- 0.18), near copies always do.
THRESHOLD = 0.9


def answer_to(question: str) -> str:
    """The answer a replica puts for ``question``."""
    return f"the answer to [{question}]"


def vector_of(question: str, dim: int = DIM) -> np.ndarray:
    """The embedding of ``question``: a unit vector seeded by its text."""
    v = np.random.default_rng(zlib.crc32(question.encode())).normal(size=dim)
    return v / np.linalg.norm(v)


def near_copy(v: np.ndarray, seed: int, cos: float = NEAR_COSINE) -> np.ndarray:
    r = np.random.default_rng(seed).normal(size=len(v))
    r -= (r @ v) * v
    r /= np.linalg.norm(r)
    return cos * v + float(np.sqrt(1 - cos * cos)) * r


def child_env() -> dict[str, str]:
    """The environment of a child process: it imports this source tree's zerda_cache."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(SOURCE_ROOT) + (os.pathsep + path if path else "")
    return env


# --------------------------------------------------------------------------- replica process


def run_replica(
    url: str,
    *,
    tenant: str,
    replica: int,
    replicas: int,
    records: Path,
    stop_file: Path,
    seed: int,
    redis_timeout_s: float,
    pace_s: float = 0.004,
) -> None:
    """The body of one replica process (see the module docstring)."""
    cfg = CacheConfig(
        similarity_threshold=THRESHOLD, redis_timeout_s=redis_timeout_s, rl=RLConfig(seed=seed)
    )
    m = CacheManager.from_url(url, cfg, metrics=ReplicaMetrics(CollectorRegistry()))
    with open(records, "a", encoding="utf-8") as out:
        traffic = ReplicaTraffic(
            m, out, tenant=tenant, replica=replica, replicas=replicas, seed=seed
        )
        traffic.record(op="start", replica=replica, t=time.time())
        while not stop_file.exists():
            if traffic.step():
                time.sleep(pace_s)
        # Every replica stops its traffic first; then each syncs its index, so that the
        # ids it reports are all of those Redis holds at the end.
        traffic.record(op="stopped", t=time.time())
        sync_file = stop_file.with_name(stop_file.name + ".sync")
        deadline = time.monotonic() + 60
        while not sync_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        traffic.report_index()
        m.close()


class ReplicaTraffic:
    """What one replica process asks of its ``CacheManager``, a call at a time, and the
    record file it writes each call's outcome to (a JSON line, flushed at once)."""

    def __init__(
        self, manager: Any, out: IO[str], *, tenant: str, replica: int, replicas: int, seed: int
    ) -> None:
        self.manager = manager
        self.out = out
        self.tenant = tenant
        self.replica = replica
        self.replicas = replicas
        self.rng = random.Random(seed)
        self.served: list[str] = []  # entry ids served, for feedback
        self.puts = 0  # questions put: q <replica> 0 .. q <replica> puts-1

    def record(self, **fields: Any) -> None:
        self.out.write(json.dumps(fields) + "\n")
        self.out.flush()

    def step(self) -> bool:
        """One call: a put a third of the time, else mostly lookups, some feedback about
        an entry served. False after a lookup that raised: the next call follows at
        once, without the pace."""
        r = self.rng.random()
        t0, p0 = time.time(), time.perf_counter()
        if r < 0.35:
            self.put(t0, p0)
        elif r < 0.88 or not self.served:
            return self.lookup(t0, p0)
        else:
            self.feedback(t0, p0)
        return True

    def put(self, t0: float, p0: float) -> None:
        """Put the next question of this replica, with its derived answer and vector."""
        q = f"q {self.replica} {self.puts}"
        self.puts += 1
        try:
            res = self.manager.put(q, answer_to(q), tenant=self.tenant, embedding=vector_of(q))
        except StorageError as exc:
            self.record(op="put", q=q, ok=False, err=str(exc)[:120], t=t0)
        else:
            dt = time.perf_counter() - p0
            self.record(op="put", q=q, ok=res.stored, id=res.entry_id, t=t0, dt=dt)

    def lookup(self, t0: float, p0: float) -> bool:
        """Ask a question put by this replica (half the time) or any, exactly or with a
        near copy of its embedding; False when the lookup raised (it never should)."""
        rng = self.rng
        owner = self.replica if rng.random() < 0.5 else rng.randrange(self.replicas)
        q = f"q {owner} {rng.randrange(max(1, self.puts))}"
        near = rng.random() < 0.5
        vec = vector_of(q)
        if near:
            vec = near_copy(vec, rng.randrange(1 << 30))
        try:
            hit = self.manager.lookup(
                q if not near else f"near {q}", tenant=self.tenant, embedding=vec
            )
        except Exception as exc:  # a lookup must never raise: counted as a failure
            self.record(op="lookup", q=q, near=near, error=repr(exc)[:200], t=t0)
            return False
        dt = time.perf_counter() - p0
        if hit is None:
            self.record(op="lookup", q=q, near=near, hit=None, t=t0, dt=dt)
            return True
        self.served.append(hit.entry_id)
        del self.served[:-50]
        self.record(
            op="lookup",
            q=q,
            near=near,
            hit=hit.entry_id,
            hq=hit.query,
            ha=hit.response,
            t=t0,
            dt=dt,
        )
        return True

    def feedback(self, t0: float, p0: float) -> None:
        """Positive feedback about one of the last entries served."""
        eid = self.rng.choice(self.served)
        try:
            self.manager.feedback(FeedbackSignal(eid, self.tenant, True))
        except StorageError as exc:
            self.record(op="fb", id=eid, ok=False, err=str(exc)[:120], t=t0)
        except ZerdaError as exc:  # gone (an empty restart): not acknowledged
            self.record(op="fb", id=eid, ok=False, gone=True, err=type(exc).__name__, t=t0)
        else:
            self.record(op="fb", id=eid, ok=True, t=t0, dt=time.perf_counter() - p0)

    def report_index(self) -> None:
        """Sync the index and record the ids in it (``None`` if that failed)."""
        try:
            self.manager.sync_index(self.tenant)
            self.record(op="end", index=sorted(self.manager.index_ids(self.tenant)), t=time.time())
        except Exception as exc:
            self.record(op="end", index=None, error=repr(exc)[:200], t=time.time())


@dataclass
class ReplicaFleet:
    """Several replica processes against one tenant, with their record files."""

    url: str
    workdir: Path
    count: int = 3
    tenant: str = "faults"
    redis_timeout_s: float = 0.25
    seed: int = 1
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def stop_file(self) -> Path:
        return self.workdir / "stop"

    def record_file(self, i: int) -> Path:
        return self.workdir / f"replica-{i}.jsonl"

    def start(self) -> ReplicaFleet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stop_file.unlink(missing_ok=True)
        self.stop_file.with_name(self.stop_file.name + ".sync").unlink(missing_ok=True)
        for i in range(self.count):
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "replica",
                "--url", self.url,
                "--tenant", self.tenant,
                "--replica", str(i),
                "--replicas", str(self.count),
                "--records", str(self.record_file(i)),
                "--stop-file", str(self.stop_file),
                "--seed", str(self.seed * 1000 + i),
                "--redis-timeout", str(self.redis_timeout_s),
            ]  # fmt: skip
            with open(self.workdir / f"replica-{i}.log", "ab") as log:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
                )
        return self

    def records(self, i: int) -> list[dict[str, Any]]:
        try:
            lines = self.record_file(i).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
        return out

    def all_records(self) -> list[list[dict[str, Any]]]:
        return [self.records(i) for i in range(self.count)]

    def wait_for(
        self, pred: Callable[[list[dict[str, Any]]], bool], timeout: float, what: str
    ) -> None:
        """Until ``pred(records)`` holds for every replica."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            if all(pred(recs) for recs in self.all_records()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas: {what} not reached within {timeout:.0f} s")
            time.sleep(0.05)

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None and not self.stop_file.exists():
                log = (self.workdir / f"replica-{i}.log").read_text(errors="replace")
                raise RuntimeError(f"replica {i} exited with {p.returncode}:\n{log[-3000:]}")

    def stop(self, timeout: float = 60) -> None:
        """Stop the traffic of every replica, then let them sync and report their
        indexes, and wait for them to exit."""
        self.stop_file.touch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stopped = [
                p.poll() is not None or any(r.get("op") == "stopped" for r in self.records(i))
                for i, p in enumerate(self.procs)
            ]
            if all(stopped):
                break
            time.sleep(0.02)
        self.stop_file.with_name(self.stop_file.name + ".sync").touch()
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> ReplicaFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- analysis


@dataclass
class FaultResult:
    """What one fault did, from the replicas' records and from Redis."""

    fault: str
    redis_timeout_s: float
    outage: bool = True  # Redis was unreachable or frozen for a while (not a FLUSHALL)
    acked_puts: int = 0  # acknowledged puts that Redis was expected to keep
    lost_puts: int = 0
    acked_feedback: int = 0
    lost_feedback: int = 0
    expected_lost: int = 0  # acknowledged before a restart without persistence
    lookups: int = 0
    hits: int = 0
    wrong_answers: int = 0
    lookup_errors: int = 0  # lookups that raised instead of failing open
    outage_lookups: int = 0
    outage_hits: int = 0
    outage_worst_s: float = 0.0  # the slowest lookup overlapping the fault at all
    fault_lookups: int = 0  # lookups overlapping the fault (until Redis answered again)
    outage_refused: int = 0  # puts and feedback refused (StorageError) during the fault
    recovered_replicas: int = 0  # replicas that served a new entry after the fault
    new_puts_after: int = 0
    ghost_ids: int = 0  # indexed by a replica at the end, gone from Redis
    missing_ids: int = 0  # in Redis at the end, not indexed by a replica
    replicas: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.lost_puts + self.lost_feedback

    @property
    def survived(self) -> bool:
        return (
            self.lost == 0
            and self.wrong_answers == 0
            and self.lookup_errors == 0
            and self.recovered_replicas == self.replicas
            and self.ghost_ids == 0
            and self.missing_ids == 0
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["lost"] = self.lost
        out["survived"] = self.survived
        return out


def _ops(recs: Sequence[dict[str, Any]], op: str) -> Iterator[dict[str, Any]]:
    return (r for r in recs if r.get("op") == op)


def analyze(
    fault: str,
    records: Sequence[Sequence[dict[str, Any]]],
    client: Any,
    *,
    tenant: str,
    outage: tuple[float, float, float],
    kept_before: bool,
    redis_timeout_s: float,
) -> FaultResult:
    """Count what the fault did (see the module docstring).

    ``outage`` is three wall-clock times: the fault began, Redis was being brought back
    (a lookup wholly between the two is "during the outage"), Redis answered again
    (what is acknowledged from then on must be kept). ``kept_before``: Redis was
    expected to keep what it acknowledged before the fault (AOF, a pause), else only
    what came after.
    """
    st = RedisStorage(client)
    live = {m.decode() for m in client.zrange(tenant_keys(tenant).ids, 0, -1)}
    analysis = FaultAnalysis(
        FaultResult(fault, redis_timeout_s, replicas=len(records)),
        records,
        live,
        outage,
        kept_before,
    )
    analysis.count_puts()
    analysis.count_feedback(lambda eid: st.get_entry(tenant, eid, with_vector=False))
    analysis.count_refused()
    for i, recs in enumerate(records):
        analysis.count_lookups(i, recs)
        analysis.count_final_index(i, recs)
    st.close()
    return analysis.res


class FaultAnalysis:
    """The counts of ``analyze``, taken a kind of record at a time into ``res``.

    ``live``: the ids Redis holds at the end; ``outage``: as ``analyze`` takes it."""

    def __init__(
        self,
        res: FaultResult,
        records: Sequence[Sequence[dict[str, Any]]],
        live: set[str],
        outage: tuple[float, float, float],
        kept_before: bool,
    ) -> None:
        self.res = res
        self.records = records
        self.live = live
        self.began, self.back, self.ended = outage
        self.kept_before = kept_before
        self.acked: dict[str, str] = {}  # entry id -> question
        self.acked_at: dict[str, float] = {}
        self.before: set[str] = set()  # acknowledged before Redis answered again

    def expected(self, t: float) -> bool:
        """Whether Redis should still hold what it acknowledged at ``t``."""
        return self.kept_before or t >= self.ended

    def count_puts(self) -> None:
        """Acknowledged puts, those Redis should hold, and those it lost. First: the
        other counts read what it finds."""
        res = self.res
        for recs in self.records:
            for r in _ops(recs, "put"):
                if r.get("ok") and r.get("id"):
                    self.acked[r["id"]] = r["q"]
                    self.acked_at[r["id"]] = r["t"]
                    if r["t"] >= self.ended:
                        res.new_puts_after += 1
        self.before = {eid for eid, t in self.acked_at.items() if t < self.ended}
        for eid, q in self.acked.items():
            if not self.expected(self.acked_at[eid]):
                res.expected_lost += 1
                continue
            res.acked_puts += 1
            if eid not in self.live:
                res.lost_puts += 1
                res.notes.append(f"acknowledged put lost: {q} ({eid})")

    def count_feedback(self, entry: Callable[[str], Any]) -> None:
        """Feedback Redis should hold: every acknowledged signal about an entry it should
        hold. An entry's pulls (``entry(id).bandit_arm``) count the signals applied to
        it and never decay."""
        res = self.res
        fb_acked: dict[str, int] = {}
        for recs in self.records:
            for r in _ops(recs, "fb"):
                if r.get("ok") and r["id"] in self.acked and self.expected(self.acked_at[r["id"]]):
                    fb_acked[r["id"]] = fb_acked.get(r["id"], 0) + 1
        for eid, n in fb_acked.items():
            res.acked_feedback += n
            if eid not in self.live:
                res.lost_feedback += n
                continue
            pulls = entry(eid).bandit_arm.pulls
            if pulls < n:
                res.lost_feedback += n - pulls
                res.notes.append(f"{eid}: {n} feedback acknowledged, {pulls} applied")

    def count_refused(self) -> None:
        """Puts and feedback refused while Redis was down (not those about gone entries)."""
        for recs in self.records:
            for r in recs:
                if (
                    r.get("op") in ("put", "fb")
                    and not r.get("ok")
                    and self.began <= r["t"] <= self.back
                ):
                    self.res.outage_refused += not r.get("gone")

    def count_lookups(self, i: int, recs: Sequence[dict[str, Any]]) -> None:
        """Replica ``i``'s lookups: errors, those during and around the outage, hits,
        wrong answers, and whether it served a new entry after the fault."""
        res = self.res
        recovered = False
        for r in _ops(recs, "lookup"):
            res.lookups += 1
            if "error" in r:
                res.lookup_errors += 1
                res.notes.append(f"replica {i}: lookup raised {r['error']}")
                continue
            start, stop = r["t"], r["t"] + r["dt"]
            in_outage = start >= self.began and stop <= self.back  # Redis certainly down
            if in_outage:
                res.outage_lookups += 1
            if start < self.ended and stop > self.began:
                res.fault_lookups += 1
                res.outage_worst_s = max(res.outage_worst_s, r["dt"])
            if r["hit"] is None:
                continue
            res.hits += 1
            if in_outage:
                res.outage_hits += 1
            if self.wrong(r):
                res.wrong_answers += 1
                res.notes.append(f"replica {i}: asked {r['q']!r}, served {r['hq']!r}")
            if start >= self.ended and (self.kept_before or r["hit"] not in self.before):
                recovered = True
        res.recovered_replicas += recovered

    def wrong(self, r: dict[str, Any]) -> bool:
        """Whether a hit served another question's entry or answer."""
        wrong = r["hq"] != r["q"] or r["ha"] != answer_to(r["hq"])
        return wrong or (r["hit"] in self.acked and self.acked[r["hit"]] != r["q"])

    def count_final_index(self, i: int, recs: Sequence[dict[str, Any]]) -> None:
        """Ghost and missing ids in replica ``i``'s final index (no index: one ghost)."""
        res = self.res
        ends = list(_ops(recs, "end"))
        if not ends or ends[-1].get("index") is None:
            res.notes.append(f"replica {i}: no final index ({ends[-1] if ends else 'no end'})")
            res.ghost_ids += 1
            return
        index = set(ends[-1]["index"])
        res.ghost_ids += len(index - self.live)
        res.missing_ids += len(self.live - index)


def _before(records: Sequence[Sequence[dict[str, Any]]], t: float) -> set[str]:
    return {
        r["id"]
        for recs in records
        for r in _ops(recs, "put")
        if r.get("ok") and r.get("id") and r["t"] < t
    }


# --------------------------------------------------------------------------- Redis faults


def _acked(recs: list[dict[str, Any]], since: float = 0.0) -> int:
    return sum(1 for r in _ops(recs, "put") if r.get("ok") and r["t"] >= since)


def campaign(
    fleet: ReplicaFleet,
    fault: str,
    inject: Callable[[], None],
    restore: Callable[[], None],
    client: Callable[[], Any],
    *,
    kept_before: bool,
    warm_puts: int = 25,
    outage_lookups: int = 3,
    after_puts: int = 15,
    timeout: float = 60,
    outage: bool = True,
) -> FaultResult:
    """One fault under the fleet's traffic, and its analysis.

    Waits until every replica has ``warm_puts`` acknowledged puts and a hit; calls
    ``inject()`` (the fault); waits until every replica has made ``outage_lookups``
    lookups since; calls ``restore()`` (it returns once Redis answers again); waits until
    every replica has ``after_puts`` acknowledged puts since and served an entry put
    since; stops the fleet and analyses its records against ``client()`` (a client of
    the server that holds the data now). ``kept_before``: Redis is expected to keep what
    it acknowledged before the fault.
    """

    def hits(recs: list[dict[str, Any]]) -> bool:
        return any(r.get("hit") for r in _ops(recs, "lookup"))

    fleet.wait_for(lambda recs: _acked(recs) >= warm_puts and hits(recs), timeout, "warm-up")
    began = time.time()
    inject()
    fleet.wait_for(
        lambda recs: sum(1 for r in _ops(recs, "lookup") if r["t"] > began) >= outage_lookups,
        timeout,
        "lookups during the fault",
    )
    back = time.time()
    restore()
    ended = time.time()

    def recovered(recs: list[dict[str, Any]]) -> bool:
        others = set() if kept_before else _before(fleet.all_records(), ended)
        served_new = any(
            r.get("hit") and r["t"] >= ended and r["hit"] not in others
            for r in _ops(recs, "lookup")
        )
        return _acked(recs, ended) >= after_puts and served_new

    fleet.wait_for(recovered, timeout, "recovery after the fault")
    fleet.stop()
    with client() as c:
        res = analyze(
            fault,
            fleet.all_records(),
            c,
            tenant=fleet.tenant,
            outage=(began, back, ended),
            kept_before=kept_before,
            redis_timeout_s=fleet.redis_timeout_s,
        )
    res.outage = outage
    return res


def redis_kill_restart(server: Any, fleet: ReplicaFleet, *, persistent: bool) -> FaultResult:
    """SIGKILL ``server`` (a started ``testing.RedisServer``) under the fleet's traffic and
    restart it on the same port: with its AOF when ``persistent`` (then nothing it
    acknowledged may be lost), else empty."""

    def kill() -> None:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)

    return campaign(
        fleet,
        f"Redis SIGKILL, {'AOF' if persistent else 'empty'} restart",
        kill,
        server.restart,  # same port and directory: the AOF, if any, is read back
        server.client,
        kept_before=persistent,
    )


def redis_pause(server: Any, fleet: ReplicaFleet, *, lookups: int = 6) -> FaultResult:
    """SIGSTOP of ``server`` (a stuck host, a VM pause) until every replica has made
    ``lookups`` lookups against it (each one should fail open within one
    ``redis_timeout_s``), then SIGCONT: nothing acknowledged may be lost."""
    assert server.pid is not None
    pid = server.pid
    return campaign(
        fleet,
        "Redis SIGSTOP, then SIGCONT",
        lambda: os.kill(pid, signal.SIGSTOP),
        lambda: os.kill(pid, signal.SIGCONT),
        server.client,
        kept_before=True,
        outage_lookups=lookups,
    )


def redis_flushall(server: Any, fleet: ReplicaFleet) -> FaultResult:
    """FLUSHALL under live replicas (an operator's mistake): what was there is gone,
    and the replicas must notice (no ghost hits, ghosts purged) without an outage."""

    def flush() -> None:
        with server.client() as c:
            c.flushall()

    return campaign(
        fleet,
        "FLUSHALL under live replicas",
        flush,
        lambda: None,
        server.client,
        kept_before=False,
        outage_lookups=0,
        outage=False,
    )


def redis_full(server: Any, fleet: ReplicaFleet, *, lookups: int = 10) -> FaultResult:
    """maxmemory reached under ``noeviction``: ``maxmemory`` is set just under the memory
    in use until every replica has made ``lookups`` lookups (puts are refused; lookups
    and feedback go on), then lifted again (what the worker's eviction does)."""
    with server.client() as c:
        c.config_set("maxmemory-policy", "noeviction")

    def fill() -> None:
        with server.client() as c:
            used = int(c.info("memory")["used_memory"])
            c.config_set("maxmemory", max(1, used - 64 * 1024))

    def free() -> None:
        with server.client() as c:
            c.config_set("maxmemory", 0)

    return campaign(
        fleet,
        "maxmemory reached (noeviction)",
        fill,
        free,
        server.client,
        kept_before=True,
        outage_lookups=lookups,
    )


def sentinel_failover(group: Any, fleet: ReplicaFleet) -> FaultResult:
    """SIGKILL of a Sentinel group's primary (``cluster_support.RedisSentinelGroup``, the fleet
    on its ``redis+sentinel://`` URL) until the sentinels promote the replica. Counted
    as if Redis had to keep every acknowledged write: replication is asynchronous, so
    a failover may lose the last ones (docs/operations.md)."""

    def kill() -> None:
        assert group.primary is not None and group.primary.pid is not None
        os.kill(group.primary.pid, signal.SIGKILL)

    return campaign(
        fleet,
        "Sentinel failover (primary SIGKILL)",
        kill,
        lambda: group.wait_for_failover(),
        lambda: group.replica.client(),
        kept_before=True,
    )


# --------------------------------------------------------------------------- worker processes


def start_worker(
    url: str,
    worker_id: str,
    workdir: Path,
    *extra: str,
    lease_ttl_s: float = 1.5,
    interval_s: float = 0.3,
) -> subprocess.Popen[bytes]:
    """``zerda-cache worker`` as a child process (this source tree's library)."""
    cmd = [
        sys.executable, "-m", "zerda_cache.cli", "worker",
        "--redis-url", url,
        "--worker-id", worker_id,
        "--lease-ttl", str(lease_ttl_s),
        "--decay-job-interval", str(interval_s),
        "--eviction-interval", str(interval_s),
        "--metrics-interval", "5",
        "--metrics-port", "0",
        "--health-file", str(workdir / f"{worker_id}.health"),
        "--log-level", "WARNING",
        *extra,
    ]  # fmt: skip
    with open(workdir / f"{worker_id}.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())


def leader(client: Any) -> str | None:
    raw = client.get(leader_key())
    return raw.decode().rsplit(":", 1)[0] if raw else None


def cycle_log(client: Any) -> list[dict[str, str]]:
    """The worker cycle log, oldest first (``id``: the stream id)."""
    return [
        {"id": sid.decode(), **{k.decode(): v.decode() for k, v in f.items()}}
        for sid, f in client.xrange("zc:worker:cycles")
    ]


@dataclass
class LeaderResult:
    """What killing or terminating the worker leader mid-cycle did."""

    fault: str
    tenants: int = 0
    tenants_done_at_fault: int = 0  # tenants evicted to capacity when the signal came
    mid_cycle: bool = False
    took_over: bool = False
    exit_code: int | None = None  # of the signalled leader
    last_outcome: str = ""  # how the signalled leader's last ended cycle ended
    overlap: bool = False  # a standby cycle began before the leader's last one ended
    evicted: int = 0
    over_evicted: int = 0  # entries removed below the capacity target (a double eviction)
    miscounted: int = 0  # removals and eviction counters that disagree
    arms: int = 0  # arms with evidence checked
    lost_decay: int = 0  # not decayed since the fault, or not the exact time-based value
    notes: list[str] = field(default_factory=list)

    @property
    def survived(self) -> bool:
        return (
            self.took_over
            and not self.overlap
            and self.over_evicted == 0
            and self.miscounted == 0
            and self.lost_decay == 0
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["survived"] = self.survived
        return out


#: The decay the leader-fault workers apply: fast enough to see within seconds.
FAULT_RL = {"usage_decay": 0.5, "decay_interval_s": 50.0}


def seed_tenants(
    client: Any, tenants: Sequence[str], entries: int, with_feedback: int, dim: int = 8
) -> dict[tuple[str, str], tuple[float, float]]:
    """Load ``entries`` entries into each tenant (the put script, pipelined) and give
    ``with_feedback`` of them positive evidence; returns their arms ``(alpha, t)``. The
    tenants are not registered (``zc:tenants``): workers do not see them yet."""
    st = RedisStorage(
        client,
        CacheConfig(
            rl=RLConfig(
                usage_decay=FAULT_RL["usage_decay"], decay_interval_s=FAULT_RL["decay_interval_s"]
            )
        ),
    )
    rng = np.random.default_rng(0)
    arms: dict[tuple[str, str], tuple[float, float]] = {}
    for tenant in tenants:
        pipe = client.pipeline(transaction=False)
        calls = [
            st.plan_put(tenant, f"q{i}", f"a{i}", rng.normal(size=dim)) for i in range(entries)
        ]
        for c in calls:
            st.scripts.put(keys=c.keys, args=c.args, client=pipe)
        ids = [c.parse(r).entry_id for c, r in zip(calls, pipe.execute(), strict=True)]
        liked = ids[:with_feedback]
        st.feedback_many([FeedbackSignal(e, tenant, True, magnitude=4.0) for e in liked])
        states = tenant_keys(tenant).st
        for eid in liked:
            arm = codec.unpack_state(client.hget(states, eid))[0]
            arms[(tenant, eid)] = (arm.alpha, arm.decayed_at)
    return arms


def _server_time(client: Any) -> float:
    sec, usec = client.time()
    return float(sec) + float(usec) / 1e6


def leader_fault(
    url: str,
    workdir: Path,
    sig: signal.Signals,
    *,
    tenants: int = 30,
    entries: int = 400,
    max_entries: int = 300,
    with_feedback: int = 40,
    lease_ttl_s: float = 1.5,
    timeout: float = 60,
) -> LeaderResult:
    """Two ``zerda-cache worker`` processes; ``sig`` (SIGKILL, SIGTERM or SIGSTOP) reaches
    the leader while its eviction cycle is between tenants (some evicted to capacity, some
    not yet); the standby takes over (a stopped leader gets SIGCONT then, wakes up
    mid-cycle and must write nothing more). Then: every tenant is at its capacity target
    exactly (nothing evicted twice) with as many removals as eviction counts, and every
    arm with evidence was decayed after the fault to exactly its time-based value."""
    workdir.mkdir(parents=True, exist_ok=True)
    res = LeaderResult(f"worker leader {sig.name} mid-cycle, standby takes over", tenants)
    names = [f"t{i:02d}" for i in range(tenants)]
    target = int(max_entries * 0.95)
    rl = workdir / "rl.json"
    rl.write_text(json.dumps(FAULT_RL))
    client: Any = redis.Redis.from_url(url)
    extra = ("--max-entries", str(max_entries), "--rl-config", str(rl))
    pair = WorkerPair(url, workdir, client, extra, lease_ttl_s=lease_ttl_s, timeout=timeout)
    try:
        pair.start()
        # The tenants, unregistered, then registered all at once: the leader's next
        # eviction cycle finds 30 tenants over capacity.
        arms = seed_tenants(client, names, entries, with_feedback)
        client.sadd(tenants_key(), *names)
        res.tenants_done_at_fault = pair.signal_mid_cycle(sig, names, target)
        fault_at = _server_time(client)
        if sig != signal.SIGSTOP:
            res.exit_code = pair.procs["w1"].wait(timeout)
        pair.wait(pair.standby_took_over, "the standby never took over", worker="w2")
        res.took_over = True
        resumed = len(cycle_log(client))
        if sig == signal.SIGSTOP:  # it wakes up mid-cycle, no longer the leader
            res.exit_code = pair.wake_stopped_leader(resumed)
        pair.terminate("w2")  # the state checked below is final
        _judge_cycles(res, cycle_log(client), resumed, sig)
        _judge_evictions(res, client, names, entries, target)
        _judge_decay(res, client, arms, fault_at)
    finally:
        pair.kill()
        client.close()
    return res


@dataclass
class WorkerPair:
    """The two workers of ``leader_fault``: ``w1`` leads first, ``w2`` stands by. Every
    wait shares one deadline, ``timeout`` seconds after ``w1`` started."""

    url: str
    workdir: Path
    client: Any
    extra: tuple[str, ...]
    lease_ttl_s: float
    timeout: float
    deadline: float = 0.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def launch(self, worker_id: str) -> None:
        self.procs[worker_id] = start_worker(
            self.url, worker_id, self.workdir, *self.extra, lease_ttl_s=self.lease_ttl_s
        )

    def start(self) -> None:
        """``w1`` until it leads, then ``w2`` until it is up and ticking."""
        self.launch("w1")
        self.deadline = time.monotonic() + self.timeout
        self.wait(
            lambda: leader(self.client) == "w1",
            "the first worker never led",
            worker="w1",
            exits=True,
            pause=0.01,
        )
        self.launch("w2")
        self.wait(
            lambda: (self.workdir / "w2.health").exists(),
            "the standby never started",
            worker="w2",
            exits=True,
            pause=0.01,
        )

    def wait(
        self,
        ready: Callable[[], bool],
        failure: str,
        *,
        worker: str | None = None,
        exits: bool = False,
        pause: float = 0.05,
    ) -> None:
        """Until ``ready()``; past the deadline (or, with ``exits``, once ``worker`` has
        exited) a ``RuntimeError`` that says ``failure``, with the end of ``worker``'s
        log."""
        proc = self.procs[worker] if exits and worker is not None else None
        while not ready():
            if time.monotonic() > self.deadline or (proc is not None and proc.poll() is not None):
                log = ":\n" + _log(self.workdir, worker) if worker is not None else ""
                raise RuntimeError(failure + log)
            time.sleep(pause)

    def signal_mid_cycle(self, sig: signal.Signals, names: Sequence[str], target: int) -> int:
        """Send ``sig`` to the leader once a third of the tenants, and not all, are
        evicted to ``target`` entries; how many were."""
        tenants = len(names)
        while True:  # a third of the tenants are evicted, the last ones not yet
            pipe = self.client.pipeline(transaction=False)
            for t in names:
                pipe.zcard(tenant_keys(t).ids)
            n = sum(1 for count in pipe.execute() if count <= target)
            if tenants // 3 <= n < tenants:
                self.procs["w1"].send_signal(sig)
                return n
            if n == tenants or time.monotonic() > self.deadline:
                raise RuntimeError(f"no eviction cycle caught mid-way ({n} of {tenants} done)")

    def standby_took_over(self) -> bool:
        """Whether ``w2`` has ended four cycles well, decay and eviction among them."""
        ended = [
            c
            for c in cycle_log(self.client)
            if c.get("worker") == "w2" and c.get("phase") == "end" and c.get("outcome") == "ok"
        ]
        return {c["job"] for c in ended} >= {"decay", "evict"} and len(ended) >= 4

    def wake_stopped_leader(self, resumed: int) -> int:
        """SIGCONT to the stopped ``w1``, which ends the cycle it was in (records past
        ``resumed`` in the cycle log); a while as a standby, then SIGTERM; its exit code."""
        w1 = self.procs["w1"]
        w1.send_signal(signal.SIGCONT)
        self.wait(
            lambda: any(
                c.get("worker") == "w1" and c.get("phase") == "end"
                for c in cycle_log(self.client)[resumed:]
            ),
            "the woken leader never ended its cycle",
        )
        time.sleep(2 * self.lease_ttl_s)  # a while as a standby: it must not lead again
        return self.terminate("w1")

    def terminate(self, worker_id: str) -> int:
        """SIGTERM, and its exit code."""
        self.procs[worker_id].send_signal(signal.SIGTERM)
        return self.procs[worker_id].wait(self.timeout)

    def kill(self) -> None:
        """SIGKILL to every worker still running, and reap them."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


def _judge_cycles(
    res: LeaderResult, log_: list[dict[str, str]], resumed: int, sig: signal.Signals
) -> None:
    """From the cycle log: how the signalled leader's cycles ended, whether it was
    caught mid-cycle, and whether a cycle of the standby overlapped one of the leader
    (``resumed``: the log's length when the standby had taken over)."""
    own = [c for c in log_[:resumed] if c.get("worker") == "w1"]
    woken = [c for c in log_[resumed:] if c.get("worker") == "w1"]
    res.last_outcome = next(
        (c.get("outcome", "") for c in reversed(own) if c.get("phase") == "end"), ""
    )
    # Mid-cycle: the killed leader's last record is the start of an eviction cycle;
    # the terminated one ended it as "stopped" (after the batch it was running).
    if own:
        last = own[-1]
        res.mid_cycle = last.get("job") == "evict" and (
            last.get("phase") == "start"
            if sig in (signal.SIGKILL, signal.SIGSTOP)
            else last.get("outcome") == "stopped"
        )
    first_standby = next(i for i, c in enumerate(log_) if c.get("worker") == "w2")
    last_leader = max(i for i, c in enumerate(log_) if c.get("worker") == "w1")
    if sig == signal.SIGTERM and own and own[-1].get("phase") != "end":
        res.notes.append("the terminated leader did not record the end of its cycle")
        res.overlap = True
    if sig == signal.SIGSTOP:
        # Woken: it may record the end of the cycle it was in ("stopped": fenced
        # off, or no longer holding the lease), and must start no other.
        res.last_outcome = next(
            (c.get("outcome", "") for c in reversed(woken) if c.get("phase") == "end"), ""
        )
        res.overlap = any(c.get("phase") == "start" for c in woken)
        last_leader = max(i for i, c in enumerate(log_[:resumed]) if c.get("worker") == "w1")
    res.overlap = res.overlap or first_standby < last_leader


def _judge_evictions(
    res: LeaderResult, client: Any, names: Sequence[str], entries: int, target: int
) -> None:
    """Every tenant at ``target`` entries exactly, with as many removals as its eviction
    counters count."""
    for t in names:
        stats = {k.decode(): int(v) for k, v in client.hgetall(tenant_keys(t).stats).items()}
        count = int(client.zcard(tenant_keys(t).ids))
        removed = entries - count
        counted = sum(v for k, v in stats.items() if k.startswith("evicted:"))
        res.evicted += removed
        res.over_evicted += max(0, target - count)
        if counted != removed or count > target:
            res.miscounted += abs(counted - removed) + max(0, count - target)
            res.notes.append(f"{t}: {count} left, {removed} removed, {counted} counted")


def _judge_decay(
    res: LeaderResult,
    client: Any,
    arms: dict[tuple[str, str], tuple[float, float]],
    fault_at: float,
) -> None:
    """Every arm with evidence still held decayed after ``fault_at``, to exactly its
    time-based value from ``arms`` (``(alpha, t)`` as seeded)."""
    for (t, eid), (alpha0, t0) in arms.items():
        raw = client.hget(tenant_keys(t).st, eid)
        if raw is None:
            continue  # evicted (to capacity): nothing left to decay
        state = codec.unpack_state(raw)[0]
        arm = {"a": state.alpha, "t": state.decayed_at}
        res.arms += 1
        prior = 1.0
        want = prior + (alpha0 - prior) * FAULT_RL["usage_decay"] ** (
            (arm["t"] - t0) / FAULT_RL["decay_interval_s"]
        )
        if arm["t"] <= fault_at or abs(arm["a"] - want) > 1e-9 * want:
            res.lost_decay += 1
            if len(res.notes) < 20:
                res.notes.append(f"{t}/{eid}: arm {arm}, want alpha {want} after {fault_at}")


def _log(workdir: Path, worker_id: str) -> str:
    try:
        return (workdir / f"{worker_id}.log").read_text(errors="replace")[-3000:]
    except OSError:
        return ""


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tests/fault_support.py")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("replica", help="one replica process of a fault campaign")
    rep.add_argument("--url", required=True)
    rep.add_argument("--tenant", default="faults")
    rep.add_argument("--replica", type=int, required=True)
    rep.add_argument("--replicas", type=int, required=True)
    rep.add_argument("--records", type=Path, required=True)
    rep.add_argument("--stop-file", type=Path, required=True)
    rep.add_argument("--seed", type=int, default=1)
    rep.add_argument("--redis-timeout", type=float, default=0.25)
    args = parser.parse_args(argv)
    run_replica(
        args.url,
        tenant=args.tenant,
        replica=args.replica,
        replicas=args.replicas,
        records=args.records,
        stop_file=args.stop_file,
        seed=args.seed,
        redis_timeout_s=args.redis_timeout,
    )


if __name__ == "__main__":
    _main()
