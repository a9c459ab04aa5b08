"""Two versions of the library side by side: this checkout against a baseline source tree.

For a change that should not slow anything down (a refactor), run the same facade calls
with both versions, alternating rounds against one shared server, and report the ratio
of their medians (current / baseline). Each round runs in a fresh process that imports
the library from its source tree (``PYTHONPATH``), loads a tenant of clustered 384-d
vectors, then times, one call at a time and interleaved with PINGs:

* sync lookup that hits (one candidate: one round trip), and one that misses;
* sync put (facade, admission check included) and feedback;
* the same lookup and put through ``AsyncCacheManager``.

Make a baseline tree with ``git worktree add /tmp/base <commit>``, then::

    .venv/bin/python benchmarks/bench_ab.py --baseline /tmp/base [--rounds 3] [--n 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import ROOT, git_rev, table, write_section

from zerda_cache.testing import RedisServer

#: One round, run in a child process with PYTHONPATH set to the source tree under test.
ROUND = r"""
import asyncio, json, sys, time
import numpy as np
import redis, redis.asyncio
from prometheus_client import CollectorRegistry
from zerda_cache import AsyncCacheManager, CacheConfig, CacheManager, FeedbackSignal
from zerda_cache.metrics import ReplicaMetrics

url, tenant, n, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
DIM = 384
rng = np.random.default_rng(0)
centers = rng.normal(size=(2_000, DIM))
x = centers[rng.integers(0, len(centers), n)] + 0.7 * rng.normal(size=(n, DIM))
x /= np.linalg.norm(x, axis=1, keepdims=True)

def near(v, cos):
    r = rng.normal(size=DIM); r -= (r @ v) * v; r /= np.linalg.norm(r)
    return cos * v + np.sqrt(1 - cos * cos) * r

cfg = CacheConfig(similarity_threshold=0.85)
client = redis.Redis.from_url(url)
m = CacheManager(client, cfg, metrics=ReplicaMetrics(CollectorRegistry()))
ids = [m.put(f"q{i}", f"answer {i}", tenant=tenant, embedding=x[i]).entry_id for i in range(n)]
m.sync_index(tenant)
out = {}

def timed(name, fn, k=calls):
    lat, cpu = [], 0.0
    for i in range(k):
        client.ping()
        c0 = time.process_time(); t0 = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - t0); cpu += time.process_time() - c0
    out[name] = float(np.median(lat)); out["cpu " + name] = cpu / k

hits = [near(x[i % n], 0.97) for i in range(calls)]
misses = [v / np.linalg.norm(v) for v in rng.normal(size=(calls, DIM))]
timed("lookup hit", lambda i: m.lookup(f"ask {i}", tenant=tenant, embedding=hits[i]))
timed("lookup miss", lambda i: m.lookup(f"other {i}", tenant=tenant, embedding=misses[i]))
fresh = rng.normal(size=(calls, DIM))
timed("put", lambda i: m.put(f"new {i}", "a new answer", tenant=tenant, embedding=fresh[i]))
timed("feedback", lambda i: m.feedback(FeedbackSignal(ids[i % n], tenant, i % 3 != 0)))

async def run_async():
    am = AsyncCacheManager(redis.asyncio.Redis.from_url(url), cfg,
                           metrics=ReplicaMetrics(CollectorRegistry()))
    await am.sync_index(tenant)
    for name, fn in (
        ("async lookup hit", lambda i: am.lookup(f"ask {i}", tenant=tenant, embedding=hits[i])),
        ("async put", lambda i: am.put(f"anew {i}", "x", tenant=tenant, embedding=fresh[i])),
    ):
        lat, cpu = [], 0.0
        for i in range(calls):
            c0 = time.process_time(); t0 = time.perf_counter()
            await fn(i)
            lat.append(time.perf_counter() - t0); cpu += time.process_time() - c0
        out[name] = float(np.median(lat)); out["cpu " + name] = cpu / calls
    await am.aclose()

asyncio.run(run_async())
print(json.dumps(out))
"""

OPS = ("lookup hit", "lookup miss", "put", "feedback", "async lookup hit", "async put")


def one_round(src: Path, url: str, tenant: str, n: int, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(
        [sys.executable, "-c", ROUND, url, tenant, str(n), str(calls)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="baseline source tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=10_000, help="entries loaded per round")
    parser.add_argument("--calls", type=int, default=1_000, help="timed calls per operation")
    parser.add_argument("--quick", action="store_true", help="tiny run; does not write docs")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.n, args.calls = 1, 500, 100
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=args.baseline,
        capture_output=True,
        text=True,
    ).stdout.strip()
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
    with RedisServer(kind="redis") as server:
        client = server.client()
        for r in range(args.rounds):
            for side, src in (("baseline", args.baseline), ("current", ROOT)):
                client.flushall()
                print(f"round {r + 1}/{args.rounds}: {side}", flush=True)
                runs[side].append(one_round(src, server.url, "ab", args.n, args.calls))
        client.close()
    rows = []
    for op in OPS:
        pairs = list(zip(runs["baseline"], runs["current"], strict=True))
        wall = statistics.median(c[op] / b[op] for b, c in pairs)
        cpu = statistics.median(c["cpu " + op] / b["cpu " + op] for b, c in pairs)
        rows.append(
            [
                op,
                f"{statistics.median(b[op] for b, _ in pairs) * 1e3:.3f}",
                f"{statistics.median(c[op] for _, c in pairs) * 1e3:.3f}",
                f"**{wall:.2f}**",
                f"{statistics.median(b['cpu ' + op] for b, _ in pairs) * 1e6:.0f}",
                f"{statistics.median(c['cpu ' + op] for _, c in pairs) * 1e6:.0f}",
                f"**{cpu:.2f}**",
            ]
        )
    body = table(
        [
            "operation (one call)",
            f"baseline {base_rev} p50 ms",
            f"current {git_rev()} p50 ms",
            "wall current / baseline",
            "baseline CPU us",
            "current CPU us",
            "CPU current / baseline",
        ],
        rows,
    )
    body += (
        f"\n\n{args.rounds} alternating rounds per side, each a fresh process against one "
        f"shared redis-server: {args.n:,} entries of clustered 384-d vectors, then "
        f"{args.calls:,} timed calls per operation. Ratios are the median over rounds of "
        "current / baseline (under 1 is faster): of the p50 wall time of a call, and of "
        "the client process's CPU time per call (Redis's own time excluded, and much less "
        "sensitive to the other load on a shared machine). Lookups pass their embedding; "
        "puts include the admission check."
    )
    print(body)
    if not args.quick:
        write_section("ab", "Current against a baseline, side by side (bench_ab.py)", body)


if __name__ == "__main__":
    main()
