"""How long loading an index snapshot holds Python's GIL: the stall other threads see.

A replica loads a large tenant's index from the worker's snapshot in a background thread
(``ScopedIndex.restore``), while lookups run in other threads. Issue 13 wants no lookup
to wait for a build longer than ``redis_timeout_s`` (0.5 s); bench_cold_start measured
615 ms at 1M entries. This takes the load apart: for ``--n`` clustered 384-d vectors in
one usearch scope (the default policy), it dumps the index as the worker does, then
times each step of the load while a ticker thread sleeps 1 ms at a time and records the
longest gap it saw (a step that holds the GIL stalls it for as long):

* ``msgpack.unpackb`` of the snapshot (it copies every binary field);
* usearch's ``Index.load`` of the graph;
* the whole ``ScopedIndex.restore`` (both, and the slot table).

    .venv/bin/python benchmarks/bench_snapshot_load.py [--n 200000]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lookup import dataset

from zerda_cache.index import IndexPolicy, ScopedIndex, UsearchIndex


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--quick", action="store_true", help="20k entries; does not write docs")
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
    blob = index.dump()
    assert blob is not None
    del index
    rows = []
    with Ticker() as ticker:
        body, s, stall = ticker.step(lambda: msgpack.unpackb(blob, raw=False))
        rows.append(["msgpack.unpackb of the snapshot", f"{s:.3f}", f"**{stall * 1e3:.0f}**"])
        graph = bytes(body["scopes"][""]["graph"])
        del body
        fresh = UsearchIndex(x.shape[1], m=policy.m, ef_construction=policy.ef_construction)
        _, s, stall = ticker.step(lambda: fresh._graph.load(graph))
        rows.append(["usearch Index.load of the graph", f"{s:.3f}", f"**{stall * 1e3:.0f}**"])
        _, s, stall = ticker.step(lambda: ScopedIndex.restore(blob, policy))
        rows.append(["ScopedIndex.restore (the whole load)", f"{s:.3f}", f"**{stall * 1e3:.0f}**"])
    text = table(["step", "seconds", "longest stall of another thread ms"], rows)
    text += (
        f"\n\n{args.n:,} clustered random 384-d vectors in one scope, the default index "
        f"policy (usearch, float16, M={policy.m}); snapshot {len(blob) / 1e6:,.0f} MB. A "
        "ticker thread sleeps 1 ms at a time; its longest gap during a step is how long "
        "that step kept every other thread (a lookup) from running. A step that releases "
        "the GIL shows a stall of a few ms."
    )
    print(text)
    if not args.quick:
        write_section(
            "snapshot-load",
            f"Loading an index snapshot: GIL stalls at {args.n:,} entries (bench_snapshot_load.py)",
            text,
        )


if __name__ == "__main__":
    main()
