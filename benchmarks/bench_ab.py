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

Timed ratios on a shared machine move by 5-10% between runs, more than many client-side
changes save. ``--callgrind`` counts instead: each side runs once under Valgrind's
callgrind (``apt install valgrind``), and the client process's instructions per call are
counted for the same operations, with a PING as the floor. Only the calls are counted,
not the setup: each operation's calls run inside one ``functools.reduce`` call, and
callgrind collects only inside that function (``--toggle-collect``) and writes one
profile as each ends (``--dump-after``). The counts repeat to within a fraction of a
percent, so they resolve what the timed ratios cannot; they say nothing of the server's
time or of the network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import ROOT, git_rev, table, write_section

from zerda_cache.testing import RedisServer

#: One round, run in a child process with PYTHONPATH set to the source tree under test.
ROUND = r"""
import asyncio, functools, json, sys, time
import numpy as np
import redis, redis.asyncio
from prometheus_client import CollectorRegistry
import zerda_cache
from zerda_cache import AsyncCacheManager, CacheConfig, CacheManager, FeedbackSignal
from zerda_cache.metrics import ReplicaMetrics

url, tenant, n, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
# "time": each call timed; "count": under callgrind, which collects only inside
# functools.reduce (see --callgrind): warm up, then one reduce over the calls per operation
counting = sys.argv[5] == "count"
WARM = 20
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
order = []  # count mode: the operations in the order of callgrind's profiles

def timed(name, fn, k=calls):
    if counting:
        for i in range(k, k + WARM):
            fn(i)
        functools.reduce(lambda _, i: fn(i), range(k), None)
        order.append(name)
        return
    lat, cpu = [], 0.0
    for i in range(k):
        client.ping()
        c0 = time.process_time(); t0 = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - t0); cpu += time.process_time() - c0
    out[name] = float(np.median(lat)); out["cpu " + name] = cpu / k

total = calls + WARM
hits = [near(x[i % n], 0.97) for i in range(total)]
misses = [v / np.linalg.norm(v) for v in rng.normal(size=(total, DIM))]
if counting:
    timed("ping", lambda i: client.ping())
timed("lookup hit", lambda i: m.lookup(f"ask {i}", tenant=tenant, embedding=hits[i]))
timed("lookup miss", lambda i: m.lookup(f"other {i}", tenant=tenant, embedding=misses[i]))
fresh = rng.normal(size=(total, DIM))
timed("put", lambda i: m.put(f"new {i}", "a new answer", tenant=tenant, embedding=fresh[i]))
timed("feedback", lambda i: m.feedback(FeedbackSignal(ids[i % n], tenant, i % 3 != 0)))

async def open_async():
    aclient = redis.asyncio.Redis.from_url(url)
    am = AsyncCacheManager(aclient, cfg, metrics=ReplicaMetrics(CollectorRegistry()))
    await am.sync_index(tenant)
    return aclient, am

async def timed_async(fn):
    lat, cpu = [], 0.0
    for i in range(calls):
        c0 = time.process_time(); t0 = time.perf_counter()
        await fn(i)
        lat.append(time.perf_counter() - t0); cpu += time.process_time() - c0
    return float(np.median(lat)), cpu / calls

async def each(fn, calls_range):
    for i in calls_range:
        await fn(i)

loop = asyncio.new_event_loop()
aclient, am = loop.run_until_complete(open_async())
async_ops = [
    ("async lookup hit", lambda i: am.lookup(f"ask {i}", tenant=tenant, embedding=hits[i])),
    ("async put", lambda i: am.put(f"anew {i}", "x", tenant=tenant, embedding=fresh[i])),
]
if counting:
    async_ops.insert(0, ("async ping", lambda i: aclient.ping()))
for name, fn in async_ops:
    if counting:  # the event loop's own work per call is counted too
        loop.run_until_complete(each(fn, range(calls, total)))
        functools.reduce(
            lambda _, __: loop.run_until_complete(each(fn, range(calls))), range(1), None
        )
        order.append(name)
    else:
        out[name], out["cpu " + name] = loop.run_until_complete(timed_async(fn))
loop.run_until_complete(am.aclose())
loop.close()
out["order"] = order
out["library"] = zerda_cache.__file__
print(json.dumps(out))
"""

OPS = ("lookup hit", "lookup miss", "put", "feedback", "async lookup hit", "async put")


def one_round(src: Path, url: str, tenant: str, n: int, calls: int) -> dict[str, float]:
    """One timed round: median wall time and CPU time per call of each operation."""
    result = _child(src, url, tenant, n, calls, "time", [])
    result.pop("order")
    return result


def one_count(src: Path, url: str, tenant: str, n: int, calls: int) -> dict[str, float]:
    """One counted round under callgrind: the client's instructions per call of each
    operation (PINGs included), from the profile callgrind wrote as each one's
    ``functools.reduce`` ended, in the order the child reports."""
    with tempfile.TemporaryDirectory(prefix="bench-ab-cg-") as tmp:
        valgrind = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=functools_reduce",
            "--dump-after=functools_reduce",
            f"--callgrind-out-file={tmp}/cg.%p",
        ]
        order = _child(src, url, tenant, n, calls, "count", valgrind)["order"]
        # cg.PID.1, cg.PID.2, ...: one per reduce (cg.PID, written at exit, is empty)
        dumps = sorted(
            (p for p in Path(tmp).iterdir() if p.name.count(".") == 2),
            key=lambda p: int(p.suffix[1:]),
        )
        if len(dumps) != len(order):  # another functools.reduce ran: counts unattributable
            raise RuntimeError(f"{len(dumps)} callgrind profiles for {len(order)} operations")
        return {name: _instructions(dump) / calls for name, dump in zip(order, dumps, strict=True)}


def _instructions(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def _child(
    src: Path, url: str, tenant: str, n: int, calls: int, mode: str, prefix: list[str]
) -> dict[str, Any]:
    """Run ROUND against the source tree ``src``; its last line of output (JSON).

    ``python -c`` puts its working directory first on ``sys.path``, before PYTHONPATH: run
    from the checkout, both sides imported the checkout's library (until 2026-12-05 this
    script compared the current tree with itself). The child runs in ``src`` and says
    which library it imported."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", ROUND, url, tenant, str(n), str(calls), mode],
        env=env,
        cwd=src,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"round failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    library = Path(out.pop("library")).resolve()
    if not library.is_relative_to(src.resolve()):
        raise RuntimeError(f"the round for {src} imported the library from {library}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="baseline source tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=10_000, help="entries loaded per round")
    parser.add_argument("--calls", type=int, default=1_000, help="timed calls per operation")
    parser.add_argument("--quick", action="store_true", help="tiny run; does not write docs")
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="count the client's instructions per call under callgrind instead of timing "
        "(default --rounds 1 --n 6000 --calls 300: past ann_threshold, an HNSW index as at scale)",
    )
    args = parser.parse_args()
    if args.callgrind:
        if shutil.which("valgrind") is None:
            parser.error("--callgrind needs valgrind on PATH (apt install valgrind)")
        explicit = set(sys.argv[1:])
        for flag, value in (("--rounds", 1), ("--n", 6_000), ("--calls", 300)):
            if flag not in explicit:
                setattr(args, flag[2:], value)
    if args.quick:
        args.rounds, args.n, args.calls = 1, 500, 100
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=args.baseline,
        capture_output=True,
        text=True,
    ).stdout.strip()
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
    run = one_count if args.callgrind else one_round
    with RedisServer(kind="redis") as server:
        client = server.client()
        for r in range(args.rounds):
            for side, src in (("baseline", args.baseline), ("current", ROOT)):
                client.flushall()
                print(f"round {r + 1}/{args.rounds}: {side}", flush=True)
                runs[side].append(run(src, server.url, "ab", args.n, args.calls))
        client.close()
    if args.callgrind:
        counted(args, runs, base_rev)
        return
    rows = []
    walls: dict[str, float] = {}
    for op in OPS:
        pairs = list(zip(runs["baseline"], runs["current"], strict=True))
        wall = statistics.median(c[op] / b[op] for b, c in pairs)
        cpu = statistics.median(c["cpu " + op] / b["cpu " + op] for b, c in pairs)
        walls[op] = wall
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
        write_section(
            "ab",
            "Current against a baseline, side by side (bench_ab.py)",
            body,
            figures=worst("ab", walls, base_rev),
        )


def worst(prefix: str, ratios: dict[str, float], base: str) -> dict[str, float | str]:
    """The headline figures (``_targets.py`` reads them): the operation with the highest
    current / baseline ratio, the ratio, and the baseline's commit."""
    op = max(ratios, key=lambda k: ratios[k])
    return {f"{prefix}.worst": ratios[op], f"{prefix}.worst_op": op, f"{prefix}.baseline": base}


def counted(args: argparse.Namespace, runs: dict[str, list[dict[str, float]]], base: str) -> None:
    """The --callgrind table: instructions per call on each side, their ratio, and each
    side's count in PINGs of the same client (sync operations against the sync PING,
    async ones against the async PING)."""
    rows = []
    ratios: dict[str, float] = {}
    first = runs["baseline"][0]
    for op in [op for op in first if op not in OPS] + list(OPS):
        b = statistics.median(r[op] for r in runs["baseline"])
        c = statistics.median(r[op] for r in runs["current"])
        if op in OPS:
            ratios[op] = c / b
        ping = "async ping" if op.startswith("async") else "ping"
        b_ping = statistics.median(r[ping] for r in runs["baseline"])
        c_ping = statistics.median(r[ping] for r in runs["current"])
        rows.append(
            [
                op,
                f"{b / 1e3:,.0f}k",
                f"{c / 1e3:,.0f}k",
                f"**{c / b:.3f}**",
                f"{b / b_ping:.1f}",
                f"{c / c_ping:.1f}",
            ]
        )
    body = table(
        [
            "operation (one call)",
            f"baseline {base} instructions",
            f"current {git_rev()} instructions",
            "current / baseline",
            "baseline in PINGs",
            "current in PINGs",
        ],
        rows,
    )
    body += (
        f"\n\nThe client process's instructions per call, counted by callgrind "
        f"({args.rounds} round{'s' if args.rounds > 1 else ''} per side, median): "
        f"{args.n:,} entries of clustered 384-d vectors, {args.calls:,} counted calls per "
        "operation after 20 uncounted ones. The setup is not counted: each operation's "
        "calls run inside one `functools.reduce`, the only place callgrind collects. "
        '"In PINGs": the count over the same client\'s PING (redis-py, hiredis) on the '
        "same side, sync against sync and async against async. The server's work and the "
        "network are not in these counts; timed ratios are in 'Current against a "
        "baseline, side by side'."
    )
    print(body)
    if not args.quick:
        write_section(
            "ab-callgrind",
            "Current against a baseline: client instructions per call (bench_ab.py --callgrind)",
            body,
            figures=worst("ab-callgrind", ratios, base),
        )


if __name__ == "__main__":
    main()
