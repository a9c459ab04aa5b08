"""Worker cycle time against a bare scan, and Redis memory per entry against the payload.

For each size (one tenant of 384-d entries, 10% of them with feedback so that decay has
work to do), in one run on one server:

* baseline: a bare ``SCAN`` of the tenant's entry keys plus pipelined ``HGETALL`` of each
  (what any full pass over the data costs);
* the tenant's first decay pass, once in its life: a whole scan that fills the list of
  arms with evidence (``p:{t}:ev``) that the scripts keep from then on;
* a full cycle an hour later (``Maintenance.maintain_tenant``): a decay job's run (its
  share of that list) and a whole-scan eviction (the capacity is set 5% under the size,
  so the cycle really evicts);
* the cycle when 1% of the arms changed: an hour later, once 1% more arms got a signal,
  the decay job's run and the eviction job, which finds the tenant within its capacity
  and reads only the expired ids and the arms that got a signal since it last ran;
* Redis memory: ``INFO memory`` used_memory before and after loading, per entry, against
  the payload (query, answer and metadata as stored, plus the float32 vector).

Targets (issue 13, "A replica serves in seconds"): a full cycle over 1M entries in at
most 10 s, one where 1% of the arms changed in at most 2 s; Redis bytes per entry at most
1.3x the payload at the default server configuration.

    .venv/bin/python benchmarks/bench_worker.py [--sizes 10000,100000,1000000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import busiest_commands, table, write_section

from zerda_cache import CacheConfig, FeedbackSignal
from zerda_cache.storage import RedisStorage
from zerda_cache.testing import RedisServer
from zerda_cache.worker import maintenance
from zerda_cache.worker.maintenance import Maintenance

DIM = 384
TENANT = "bench"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def load(st: RedisStorage, n: int, batch: int = 1_000) -> tuple[list[str], int]:
    rng = np.random.default_rng(0)
    ids: list[str] = []
    payload = 0
    for start in range(0, n, batch):
        vecs = rng.normal(size=(min(batch, n - start), DIM)).astype(np.float32)
        calls = [
            st.plan_put(
                TENANT,
                f"How do I configure feature number {start + i} of the product?",
                f"Open Settings, then Features, then number {start + i}, and press Enable.",
                vecs[i],
                metadata={"model": "demo-llm", "tokens": 42},
            )
            for i in range(len(vecs))
        ]
        pipe = st.client.pipeline(transaction=False)
        for call in calls:
            st.scripts.put(keys=call.keys, args=call.args, client=pipe)
            payload += len(call.args[2]) + 4 * DIM  # doc + the float32 vector given
        for call, res in zip(calls, pipe.execute(), strict=True):
            ids.append(call.parse(res).entry_id)
        print(f"\r  loaded {len(ids):,}/{n:,}", end="", file=sys.stderr)
    print(file=sys.stderr)
    return ids, payload


def bare_scan(st: RedisStorage, batch: int = 500) -> float:
    k = st.keys(TENANT)
    client = st.client
    t0 = time.perf_counter()
    n = 0
    for keys in _chunks(client.scan_iter(match=k.entry_prefix + "*", count=batch), batch):
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        n += len(pipe.execute())
    return time.perf_counter() - t0


def redis_cpu(client: Any) -> float:
    """CPU seconds of the server's main thread so far (INFO cpu): the time every other
    client's commands wait behind."""
    cpu = client.info("cpu")
    if "used_cpu_user_main_thread" in cpu:
        return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


_BYSTANDER = """
import select, sys, time, redis
c = redis.Redis(port=int(sys.argv[1]))
c.ping()
print("ready", flush=True)
lat = []
while len(lat) % 50 or not select.select([sys.stdin], [], [], 0)[0]:  # until told to stop
    t = time.perf_counter()
    c.get("nothing")
    lat.append(time.perf_counter() - t)
    time.sleep(0.001)
print(" ".join(f"{x:.6f}" for x in lat), flush=True)
"""


class Bystander:
    """Another client (its own process) sending a GET every millisecond while the worker
    runs: the latency every replica's lookups see meanwhile, queued behind the worker's
    commands in the server's one thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.result: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def __enter__(self) -> Bystander:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BYSTANDER, str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # connected
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self.proc.communicate("stop\n", timeout=60)
        lat = np.array([float(x) for x in out.split()]) * 1e3
        if len(lat):
            self.result = (
                float(np.percentile(lat, 50)),
                float(np.percentile(lat, 99)),
                float(lat.max()),
            )


def command_times(client: Any) -> str:
    """Redis's own account of the full cycle (``INFO commandstats``, reset before it):
    the commands that took the most of its time, each with its calls, its seconds in all
    and its microseconds per call. Commands that scripts call are counted twice: on
    their own, and within their script's time (EVALSHA: the decay, state and evict
    scripts together). The other client's GETs are left out."""
    return "; ".join(
        f"{name} {v['calls']:,} calls, {v['usec'] / 1e6:.2f} s ({v['usec_per_call']:.1f} us each)"
        for name, v in busiest_commands(client, skip=("get",), top=7)
    )


def _chunks(it: object, size: int) -> object:
    chunk: list[bytes] = []
    for item in it:  # type: ignore[attr-defined]
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def run_size(server: RedisServer, n: int) -> dict[str, float]:
    client = server.client()
    client.flushall()
    mem0 = int(client.info("memory")["used_memory"])
    clock = Clock(1_000_000.0)
    st = RedisStorage(client, CacheConfig(), clock=clock)
    ids, payload = load(st, n)
    mem1 = int(client.info("memory")["used_memory"])
    rng = np.random.default_rng(1)
    fb = [FeedbackSignal(ids[i], TENANT, bool(rng.random() < 0.7)) for i in range(0, n, 10)]
    for i in range(0, len(fb), 200):
        st.feedback_many(fb[i : i + 200])
    client.sadd(st.tenants_key, TENANT)
    st.set_tenant_settings(TENANT, max_entries=int(n * 0.95))

    base_s = bare_scan(st)
    m = Maintenance(st)
    first = m.decay_tenant(TENANT)  # once in a tenant's life: fills the evidence list
    # The whole scan alone (plan, no evictions), reading 0, 1 and 2 batches ahead.
    scans = []
    for ahead in (0, 1, 2):
        probe = Maintenance(st)
        probe.read_ahead = ahead
        t0 = time.perf_counter()
        probe.plan_eviction(TENANT)
        scans.append(time.perf_counter() - t0)
    clock.t += 3_600  # an hour later: every arm with evidence has decay to persist
    with Bystander(server.port) as idle:  # the same client with no worker running
        time.sleep(2.0)
    cpu0 = redis_cpu(client)
    client.config_resetstat()  # Redis's own time per command, over the full cycle only
    with Bystander(server.port) as others:
        t0 = time.perf_counter()
        decay, report = m.maintain_tenant(TENANT)
        cycle_s = time.perf_counter() - t0
    busy_s = redis_cpu(client) - cpu0
    server_time = command_times(client)
    decay_s = decay.seconds
    evict_s = cycle_s - decay_s
    # 1% more arms get a signal, an hour passes: the decay job's run, and the eviction
    # job, which finds the tenant within its capacity after the full cycle and reads
    # only the expired ids and the arms that got a signal since.
    more = [FeedbackSignal(ids[i], TENANT, True) for i in range(5, len(ids), 100)]
    for i in range(0, len(more), 200):
        st.feedback_many(more[i : i + 200])
    clock.t += 3_600
    t0 = time.perf_counter()
    job = m.decay_tenant(TENANT)
    plan = m.plan_incremental(TENANT)
    incremental = plan is not None
    m.execute(plan) if plan is not None else m.evict_tenant(TENANT)
    changed_s = time.perf_counter() - t0
    evict_job_s = changed_s - job.seconds
    changed_read = plan.scanned if plan is not None else 0
    client.close()
    print(
        f"  {n:,}: scan {base_s:.2f}s, first decay pass {first.seconds:.2f}s, cycle "
        f"{cycle_s:.2f}s (decay {decay_s:.2f}s, {decay.decayed:,} arms; evict "
        f"{evict_s:.2f}s, {sum(report.removed.values()):,} removed), 1% changed "
        f"{changed_s:.2f}s",
        file=sys.stderr,
    )
    return {
        "n": n,
        "base_s": base_s,
        "first_s": first.seconds,
        "scans": scans,
        "first_decayed": first.decayed,
        "changed_s": changed_s,
        "changed_read": changed_read,
        "decay_s": decay_s,
        "evict_s": evict_s,
        "cycle_s": cycle_s,
        "busy_s": busy_s,
        "server_time": server_time,
        "others": others.result,
        "idle": idle.result,
        "decayed": decay.decayed,
        "job_s": job.seconds,
        "job_decayed": job.decayed,
        "evict_job_s": evict_job_s,
        "incremental": incremental,
        "evicted": sum(report.removed.values()),
        "mem_per_entry": (mem1 - mem0) / n,
        "payload_per_entry": payload / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--kind", default=None, help="redis or valkey (default: redis)")
    parser.add_argument(
        "--server-args",
        default="",
        help='extra server arguments, e.g. "--hash-max-listpack-value 4096" (docs/operations.md)',
    )
    parser.add_argument(
        "--state-batch",
        type=int,
        default=None,
        help="entries per call of the state script (maintenance.STATE_BATCH; "
        "writes its own docs section)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny run; does not write docs")
    args = parser.parse_args()
    if args.quick:
        args.sizes = "2000,20000"
    if args.state_batch is not None:
        maintenance.STATE_BATCH = args.state_batch
    server = RedisServer(kind=args.kind, extra_args=args.server_args.split()).start()
    try:
        results = [run_size(server, int(s)) for s in args.sizes.split(",")]
        version = f"{server.kind} {server.version}"
    finally:
        server.stop()
    rows = [
        [
            f"{r['n']:,}",
            f"{r['base_s']:.2f}",
            f"{r['first_s']:.2f} ({r['first_decayed']:,.0f} arms)",
            " / ".join(f"{s:.2f}" for s in r["scans"]),
            f"{r['decay_s']:.2f} ({r['decayed']:,.0f} arms)",
            f"{r['evict_s']:.2f} ({r['evicted']:,.0f} removed)",
            f"**{r['cycle_s']:.2f}**",
            f"{r['busy_s']:.2f}",
            " / ".join(f"{x:.2f}" for x in r["others"])
            + " (idle: "
            + " / ".join(f"{x:.2f}" for x in r["idle"])
            + ")",
            f"{r['job_s']:.2f} ({r['job_decayed']:,.0f} arms)",
            f"{r['evict_job_s']:.2f} ({r['changed_read']:,.0f} arms read)"
            + ("" if r["incremental"] else ", whole scan"),
            f"**{r['changed_s']:.2f}**",
            f"{r['cycle_s'] / r['base_s']:.2f}x",
            f"{r['mem_per_entry']:,.0f} / {r['payload_per_entry']:,.0f}",
            f"**{r['mem_per_entry'] / r['payload_per_entry']:.2f}x**",
        ]
        for r in results
    ]
    body = table(
        [
            "entries",
            "bare SCAN + HGETALL s",
            "first decay pass s (once)",
            "whole scan alone s, 0 / 1 / 2 batches read ahead",
            "cycle: decay job s",
            "cycle: whole-scan eviction s",
            "full cycle s",
            "full cycle: Redis main thread CPU s",
            "full cycle: another client's GET ms, p50 / p99 / max",
            "1% changed: decay job s",
            "1% changed: eviction job s",
            "1% changed: cycle s",
            "full cycle / bare scan",
            "Redis bytes per entry / payload bytes",
            "ratio",
        ],
        rows,
    )
    server_conf = args.server_args or "default configuration"
    notes = [
        f"Server: {version} ({server_conf}), no persistence, default `CacheConfig` (float16 "
        f"vector storage), the state read {maintenance.STATE_BATCH} entries a call "
        "(`maintenance.STATE_BATCH`; `--state-batch`), each call one HMGET of the "
        "tenant's state hash (`p:{t}:st`; before commit a780d98, of three fields of each "
        "entry's own hash). One tenant, 384-d vectors, 10% of "
        "entries with one feedback signal; capacity 5% under the size. The first decay "
        "pass is a whole scan that fills the list of arms with evidence (`p:{t}:ev`), "
        "once in a tenant's life; the scripts keep the list from then on. The whole scan "
        "alone is `plan_eviction` (no evictions) reading 0, 1 or 2 batches ahead "
        "(`Maintenance.read_ahead`; 2 by default). The full cycle, an hour later, is "
        "`Maintenance.maintain_tenant`: a decay job's run, which persists the decay of "
        "its share of that list (`decay_job_interval_s / decay_sweep_s`, 300 s / 1 h), "
        "then a whole-scan eviction (the worker's eviction job over capacity, and at "
        "least every `full_scan_interval_s` within it). The 1% cycle, an hour later once "
        "1% more arms got a signal, is the decay job's run and the eviction job within "
        "capacity: it reads the expired ids and the arms that got a signal since it last "
        "ran (from the feedback stream; `Maintenance.plan_incremental`). Redis main "
        "thread CPU: the server's own account (INFO cpu) over the full cycle. Another "
        "client's GET: a separate process sends one every millisecond during the full "
        "cycle, what every replica's lookups wait meanwhile; idle: the same for 2 s "
        "before it, no worker running. Payload: "
        "question, answer and metadata as stored, plus the float32 vector given."
    ]
    by_n = {r["n"]: r for r in results}
    if 1_000_000 in by_n:
        big = by_n[1_000_000]
        notes.append(
            f"Targets at 1M entries: full cycle <= 10 s: "
            f"{'met' if big['cycle_s'] <= 10 else '**not met**'} ({big['cycle_s']:.1f} s); "
            f"1% changed <= 2 s: {'met' if big['changed_s'] <= 2 else '**not met**'} "
            f"({big['changed_s']:.2f} s)."
        )
    largest = results[-1]
    notes.append(
        f"Redis's own time over the full cycle at {largest['n']:,} entries (`INFO "
        f"commandstats`, reset before it; the busiest commands): {largest['server_time']}."
    )
    worst = max(r["mem_per_entry"] / r["payload_per_entry"] for r in results)
    notes.append(
        f"Redis bytes per entry <= 1.3x payload: {'met' if worst <= 1.3 else '**not met**'} "
        f"(worst {worst:.2f}x)."
    )
    body += "\n\n" + " ".join(notes)
    print(body)
    if not args.quick:
        name = "worker" if not args.server_args else "worker-tuned"
        title = "Worker cycle and Redis memory (bench_worker.py)" + (
            f", server {args.server_args}" if args.server_args else ""
        )
        if args.state_batch is not None:
            name += f"-state-{args.state_batch}"
            title += f", state read {args.state_batch} entries a call"
        # A variant's figures carry its section's name: the targets read the default's.
        figures: dict[str, float] = {f"{name}.memory_ratio": worst}
        for r in results:
            figures[f"{name}.{r['n']}.cycle_s"] = r["cycle_s"]
            figures[f"{name}.{r['n']}.changed_s"] = r["changed_s"]
        write_section(name, title, body, figures=figures)


if __name__ == "__main__":
    main()
