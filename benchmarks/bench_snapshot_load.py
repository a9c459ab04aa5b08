"""How long loading an index snapshot holds Python's GIL: the stall other threads see.

A replica loads a large tenant's index from the worker's snapshot in a background thread
(``ReplicaIndexes._from_snapshot``), while lookups run in other threads. Issue 13 wants no
lookup to wait for a build longer than ``redis_timeout_s`` (0.5 s). For ``--n`` clustered
384-d vectors in one usearch scope (the default policy), this dumps the index as the
worker does, publishes it in a real Redis server (``write_snapshot``), then times each
step of a replica's load while a ticker thread sleeps 1 ms at a time and records the
longest gap it saw (a step that holds the GIL stalls it for as long), side by side:

* format 1 (earlier versions): the chunks read and joined into one ``bytes``, one msgpack
  document unpacked (a copy of every binary field), usearch's ``Index.load`` of the graph;
* the current format (``index.dump_format`` of a dump: 4 now; 2 and 3 went the same way,
  with float16 graphs and with int8 graphs of unscaled vectors): ``read_snapshot`` gathers the
  chunks into anonymous memory a few MB at a time, and ``ScopedIndex.restore`` serves the
  graph where it lies (usearch's ``view``), and an int8 graph's float16 rows too.

    .venv/bin/python benchmarks/bench_snapshot_load.py [--n 200000] [--section NAME]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lookup import dataset

from zerda_cache import CacheConfig
from zerda_cache.core.config import DEFAULT_TOP_K
from zerda_cache.replica.ann import IndexPolicy
from zerda_cache.replica.indexes import REBASE_DRIFT
from zerda_cache.replica.scoped import ScopedIndex, dump_format
from zerda_cache.replica.usearch_index import UsearchIndex
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.store import SnapshotInfo
from zerda_cache.testing import RedisServer


class Ticker:
    """A thread that sleeps 1 ms at a time and keeps the longest gap between wake-ups."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def step(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """``fn()``, its seconds and the longest stall while it ran."""
        time.sleep(0.01)  # the ticker's gap before the step does not count
        self.longest = 0.0
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0, self.longest


def format1(index: ScopedIndex) -> bytes:
    """The snapshot as earlier versions wrote it: one msgpack document, graphs inside."""
    scopes = {scope: sub.dump() for scope, sub in index._by_scope.items()}
    return bytes(msgpack.packb({"v": 1, "dim": index.dim, "scopes": scopes}, use_bin_type=True))


def read_joined(st: RedisStorage, tenant: str, info: SnapshotInfo) -> bytes:
    """Format 1's read: every chunk, joined into one ``bytes``."""
    k = st.keys(tenant)
    return b"".join(
        bytes(st.client.get(k.snap_chunk(info.generation, i))) for i in range(info.chunks)
    )


def targets(rows: list[list[str]]) -> str:
    """Issue 13's target, from the rows: no step of a replica's load (the current format,
    what a replica runs now) stalls its other threads longer than ``redis_timeout_s``."""
    limit = CacheConfig().redis_timeout_s * 1e3
    current = next(r[0] for r in rows if r[0] != "1")
    now = max(float(r[-1].strip("*")) for r in rows if r[0] == current)
    before = max(float(r[-1].strip("*")) for r in rows if r[0] == "1")
    verdict = "met" if now <= limit else "**not met**"
    return (
        f"Target (issue 13): no lookup waits for a build longer than `redis_timeout_s` "
        f"({limit:.0f} ms): {verdict} (format {current}'s longest stall {now:.0f} ms; format 1's "
        f"{before:.0f} ms in the same run)."
    )


def figures(rows: list[list[str]], n: int) -> dict[str, Any]:
    """The headline figures (``_targets.py`` reads them): the current format's longest
    stall of another thread while a replica loads a snapshot of ``n`` entries."""
    current = next(r[0] for r in rows if r[0] != "1")
    stall = max(float(r[-1].strip("*")) for r in rows if r[0] == current)
    return {
        "snapshot-load.stall_ms": stall,
        "snapshot-load.format": int(current),
        "snapshot-load.entries": n,
    }


def churn(loaded: ScopedIndex, viewed: ScopedIndex, x: np.ndarray, n: int) -> list[list[str]]:
    """Search time of both indexes as the same changes pile up (see the table's text)."""
    from bench_cold_start import near_copy

    rng = np.random.default_rng(11)
    order = rng.permutation(n)  # the snapshot's vectors, in the order they go
    extra = dataset(n + n // 2)[n:]  # new vectors, from the same clusters
    removed = added = 0
    rows = []
    for share in (0.0, 0.05, 0.10, 0.25):
        goal = int(share * n / 2)
        gone = [f"{int(i):032x}" for i in order[removed:goal]]
        new = {f"{n + j:032x}": (extra[j], "") for j in range(added, goal)}
        for index in (loaded, viewed):
            for eid in gone:
                index.remove(eid)
            if new:
                index.add_many(new)
        removed = added = max(removed, goal)
        live = order[removed:]
        picks = live[rng.integers(0, len(live), 1000)]
        queries = [near_copy(x[i], rng) for i in picks]
        times: dict[str, list[float]] = {"loaded": [], "in place": []}
        found = 0
        for i, q in zip(picks, queries, strict=True):
            for how, index in (("loaded", loaded), ("in place", viewed)):
                t0 = time.perf_counter()
                got = index.search(q, "", DEFAULT_TOP_K, 0.0)
                times[how].append(time.perf_counter() - t0)
                if how == "in place":
                    found += bool(got) and got[0][0] == f"{int(i):032x}"
        a, b = (float(np.median(times[f])) * 1e3 for f in ("loaded", "in place"))
        a99, b99 = (float(np.percentile(times[f], 99)) * 1e3 for f in ("loaded", "in place"))
        rows.append(
            [
                f"{share:.0%}",
                f"{a:.3f} / {a99:.3f}",
                f"{b:.3f} / {b99:.3f}",
                f"**{b / a:.2f}x** / {b99 / a99:.2f}x",
                f"{found / 1000:.3f}",
            ]
        )
        print(f"  {rows[-1]}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--quick", action="store_true", help="20k entries; does not write docs")
    parser.add_argument("--section", default="snapshot-load", help="docs/BENCHMARKS.md section")
    args = parser.parse_args()
    if args.quick:
        args.n = 20_000
    from _report import table, write_section

    x = dataset(args.n)
    policy = IndexPolicy()
    index = ScopedIndex(x.shape[1], policy)
    for start in range(0, args.n, 50_000):
        chunk = range(start, min(args.n, start + 50_000))
        index.add_many({f"{i:032x}": (x[i], "") for i in chunk})
        print(f"\r  built {chunk[-1] + 1:,}/{args.n:,}", end="", file=sys.stderr)
    print(file=sys.stderr)
    current = index.dump()
    now = dump_format(current)  # the format a worker writes today
    blobs = {"1": format1(index), now: current}
    del index
    rows = []
    restored: dict[str, ScopedIndex] = {}
    with RedisServer(kind="redis") as server, Ticker() as ticker:
        client = redis.Redis.from_url(server.url)
        st = RedisStorage(client, CacheConfig())
        for fmt, blob in blobs.items():
            assert blob is not None
            st.write_snapshot(
                "t",
                blob,
                fmt=dump_format(blob),
                last_id="1-0",
                added=1,
                entries=args.n,
                dim=x.shape[1],
            )
            info = st.snapshot_info("t")
            assert info is not None
            size = f"{len(blob) / 1e6:,.0f}"
            del blob
            if fmt == "1":
                got, s, stall = ticker.step(partial(read_joined, st, "t", info))
                rows.append([fmt, size, "chunks read and joined", f"{s:.3f}", f"{stall * 1e3:.0f}"])
                body, s, stall = ticker.step(partial(msgpack.unpackb, got, raw=False))
                rows.append([fmt, size, "msgpack.unpackb", f"{s:.3f}", f"{stall * 1e3:.0f}"])
                graph = bytes(body["scopes"][""]["graph"])
                del body
                fresh = UsearchIndex(x.shape[1], m=policy.m, ef_construction=policy.ef_construction)
                _, s, stall = ticker.step(partial(fresh._graph.load, graph))
                rows.append([fmt, size, "usearch Index.load", f"{s:.3f}", f"{stall * 1e3:.0f}"])
                del fresh, graph
            else:
                got, s, stall = ticker.step(partial(st.read_snapshot, "t", info))
                rows.append([fmt, size, "read_snapshot", f"{s:.3f}", f"{stall * 1e3:.0f}"])
            loaded, s, stall = ticker.step(partial(ScopedIndex.restore, got, policy))
            rows.append(
                [fmt, size, "**ScopedIndex.restore** (whole)", f"{s:.3f}", f"**{stall * 1e3:.0f}**"]
            )
            hit = loaded.search(x[7], "", 1, 0.5)
            assert hit and hit[0][0] == f"{7:032x}", hit
            restored[fmt] = loaded
            del loaded, got
        client.close()
    churn_rows = churn(restored["1"], restored[now], x, args.n)
    text = table(
        ["format", "snapshot MB", "step", "seconds", "longest stall of another thread ms"], rows
    )
    text += (
        f"\n\n{args.n:,} clustered random 384-d vectors in one scope, the default index "
        f"policy (usearch, {policy.dtype} graph, M={policy.m}), published in a local Redis "
        "server. A ticker thread sleeps 1 ms at a time; its longest gap during a step is how long "
        "that step kept every other thread (a lookup) from running. A step that lets go "
        "of the GIL often shows a stall of a few ms. Format 1's restore includes its "
        "unpack and load again."
    )
    text += "\n\n" + table(
        [
            "changed since the snapshot",
            "search ms p50 / p99, loaded (format 1)",
            f"search ms p50 / p99, served in place (format {now})",
            "ratio p50 / p99",
            "near-copy recall@1, in place",
        ],
        churn_rows,
    )
    text += (
        f"\n\nThen both restored indexes take the same changes, half removals of the "
        f"snapshot's vectors and half new vectors, up to the share of {args.n:,} in the "
        f"first column (a replica moves to a newer snapshot at {REBASE_DRIFT:.0%}, "
        "`replica.REBASE_DRIFT`). "
        f"Search: `ScopedIndex.search` as a lookup calls it (top {DEFAULT_TOP_K}, one "
        "thread), for near-copies (cosine 0.97) of live vectors, the two indexes "
        "alternating query by query."
    )
    text += "\n\n" + targets(rows)
    print(text)
    if not args.quick:
        write_section(
            args.section,
            f"Loading an index snapshot: GIL stalls at {args.n:,} entries (bench_snapshot_load.py)",
            text,
            figures=figures(rows, args.n),
        )


if __name__ == "__main__":
    main()
