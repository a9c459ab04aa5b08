"""HNSW parameters against recall and search time: the replica's index alone, at size.

Issue 13 wants near-copy recall@1 >= 0.995 at 100k and 1M entries. A lookup's recall is
bounded by its index's, so this measures the index the replica builds
(``zerda_cache.replica.index.UsearchIndex``) outside any cache: for each (M, ef_construction,
graph dtype) it builds the index from ``--n`` vectors in bulk (as a replica's build
does), then searches ``--queries`` near-copies (cosine ``--cos`` of a random entry) at
every ``ef_search`` of ``--efs`` (the width searched doubles with the size past
``WIDE_FROM``, 125k entries: the "search width" column), one query at a time on one
thread, for ``--k`` (8, a lookup's ``top_k``) candidates re-scored as a lookup's.
Recall@1 is how often the source entry came first; "exact agrees" how often the index's
first result is exact search's first (float32 matrix product, the reference), which
separates the graph's misses from near-copies that have a closer neighbour than their
source.

Graph vectors: ``i8`` (int8 scaled to the range, ``UsearchIndex.quant``: the default),
``i8u`` (int8 as usearch converts floats, ``127 x`` truncated: before ``quant``),
``f16`` or ``b1`` (one bit a dimension, the signs less the centre of the first vectors,
Hamming distance; re-scored from float16 rows as ``i8``).

Data: ``random`` (the clustered synthetic vectors of ``bench_lookup``, any size) or
``minilm`` (real all-MiniLM-L6-v2 embeddings of QQP's 137,551 distinct questions, then
of their word prefixes up to 1M: ``bench_lookup.minilm``; cached in ``.cache/quality``).
The "calibrated width" is what a replica would search the index at
(``UsearchIndex.calibrate``), before the rows set their widths themselves. ``--across``
adds a table of the configurations against each other, each at that width, their
queries interleaved (build times and the first table's search times are each measured
at their own moment on a shared machine: compare them within a configuration).

    .venv/bin/python benchmarks/bench_hnsw.py --n 1000000 --configs 32:128:i8,32:128:f16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lookup import dataset, exact_first, minilm, perturb

from zerda_cache import CacheConfig
from zerda_cache.replica.ann import CALIBRATION_COSINE
from zerda_cache.replica.usearch_index import UsearchIndex


def measure(
    x: np.ndarray, m: int, efc: int, dtype: str, efs: list[int], queries: np.ndarray,
    src: np.ndarray, truth: np.ndarray, k: int,
) -> tuple[
    float, float, list[tuple[int, int, float, float, float]], tuple[int | None, float],
    UsearchIndex,
]:  # fmt: skip
    """Build seconds, bytes per entry, per ef: (ef, the width searched, recall@1, exact
    agrees, ms p50), the calibrated width (None: too small) and its seconds, and the
    index, calibrated (for ``across``)."""
    n = len(x)
    ids = [f"{i:032x}" for i in range(n)]
    t0 = time.perf_counter()
    index = UsearchIndex(
        x.shape[1], m=m, ef_construction=efc, capacity=n, dtype="i8" if dtype == "i8u" else dtype
    )
    if dtype == "i8u":  # usearch's own int8 conversion (127 x, truncated), as before quant
        index.quant = 0.0
    for start in range(0, n, 100_000):  # bulk, like a replica's build (which reads batches)
        index.add_many(ids[start : start + 100_000], x[start : start + 100_000])
        print(f"\r  M={m} efc={efc} {dtype}: {min(n, start + 100_000):,}/{n:,}", end="",
              file=sys.stderr)  # fmt: skip
    build = time.perf_counter() - t0
    print(file=sys.stderr)
    per_entry = index.nbytes() / n
    t0 = time.perf_counter()
    calibrated = index.calibrate(CacheConfig().top_k)  # a replica's, with the default top_k
    calibration = (calibrated, time.perf_counter() - t0)
    measured, floor = index.calibrated, index.ef_search
    index.calibrated = None  # the rows below set their widths themselves
    # The queries in blocks of 100, every block at every width in turn, so that no width
    # runs on a cache the others warmed (run width after width, the first one's times
    # included the graph's first reads from memory: at 250k entries, 64 once timed faster
    # than 32), and the width changes once a block, not at every query.
    hits, agree = dict.fromkeys(efs, 0), dict.fromkeys(efs, 0)
    times: dict[int, list[float]] = {ef: [] for ef in efs}
    widths = {}
    for start in range(0, len(queries), 100):
        block = slice(start, start + 100)
        for ef in efs:
            index.ef_search = ef  # the search sets the graph's width from it (search_width)
            for q, s, t in zip(queries[block], src[block], truth[block], strict=True):
                t1 = time.perf_counter()
                found = index.search(q, k, -1.0)
                times[ef].append(time.perf_counter() - t1)
                first = int(found[0][0], 16) if found else -1
                hits[ef] += first == s
                agree[ef] += first == t
            widths[ef] = index.search_width()  # ef_search, doubled past WIDE_FROM entries
    asked = len(queries)
    out = []
    for ef in efs:
        p50 = float(np.percentile(times[ef], 50)) * 1e3
        out.append((ef, widths[ef], hits[ef] / asked, agree[ef] / asked, p50))
        print(f"  ef={ef}: recall@1 {hits[ef] / asked:.3f}, exact agrees {agree[ef] / asked:.3f}",
              file=sys.stderr)  # fmt: skip
    index.calibrated, index.ef_search = measured, floor  # as a replica would search it
    return build, per_entry, out, calibration, index


def across(
    indexes: dict[str, UsearchIndex], queries: np.ndarray, src: np.ndarray, k: int
) -> dict[str, tuple[int, float, float, float]]:
    """Each index at the width a replica would search it at (calibrated, or the
    schedule's), the queries in blocks of 100 given to every index in turn, so that the
    configurations share the machine's noise: by config, (width, recall@1, ms p50,
    ms p99)."""
    times: dict[str, list[float]] = {name: [] for name in indexes}
    hits = dict.fromkeys(indexes, 0)
    for start in range(0, len(queries), 100):
        block = slice(start, start + 100)
        for name, index in indexes.items():
            for q, s in zip(queries[block], src[block], strict=True):
                t1 = time.perf_counter()
                found = index.search(q, k, -1.0)
                times[name].append(time.perf_counter() - t1)
                hits[name] += bool(found) and int(found[0][0], 16) == s
    return {
        name: (index.search_width(), hits[name] / len(queries),
               float(np.percentile(times[name], 50)) * 1e3,
               float(np.percentile(times[name], 99)) * 1e3)
        for name, index in indexes.items()
    }  # fmt: skip


def in_memory(index: UsearchIndex, huge: bool) -> UsearchIndex:
    """``index`` restored as a replica restores the worker's snapshot: its graph and rows
    copied into private anonymous memory (``RedisStorage.read_snapshot``'s), advised for
    transparent huge pages or not, and served in place from there."""
    import mmap

    from zerda_cache.replica.ann import IndexPolicy
    from zerda_cache.storage.snapshots import advise_huge_pages

    graph, rows = bytes(index.graph_bytes()), memoryview(index.rows_bytes()).cast("B")
    buf = mmap.mmap(-1, len(graph) + len(rows), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and not advise_huge_pages(buf):
        raise SystemExit("this kernel offers no transparent huge pages")
    view = memoryview(buf)
    view[: len(graph)] = graph
    view[len(graph) :] = rows
    data = {"dtype": index.dtype, **index.dump_slots()}
    policy = IndexPolicy(ef_search=index.ef_search)
    out = UsearchIndex.restore(index.dim, data, policy, view[: len(graph)], view[len(graph) :])
    out.calibrated = index.calibrated
    return out


def pages(
    index: UsearchIndex, queries: np.ndarray, src: np.ndarray, k: int
) -> dict[str, tuple[int, float, float, float]]:
    """The same graph searched where a build leaves it (usearch's memory, 4 KB pages)
    and as a replica serves a snapshot, in 4 KB and in huge pages, interleaved."""
    views = {
        "built (usearch's memory)": index,
        "snapshot view, 4 KB pages": in_memory(index, huge=False),
        "snapshot view, huge pages": in_memory(index, huge=True),
    }
    return across(views, queries, src, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--data", choices=("random", "minilm"), default="random")
    parser.add_argument(
        "--configs", default="32:128:i8,32:128:f16", help="M:ef_construction[:i8|i8u|f16|b1],..."
    )
    parser.add_argument("--k", type=int, default=8, help="candidates a search asks for")
    parser.add_argument("--efs", default="64,128,256,512")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--cos", type=float, default=0.97)
    parser.add_argument("--section", default=None, help="default: hnsw-<data>-<n>")
    parser.add_argument(
        "--across",
        action="store_true",
        help="also time the configs against each other, each at its calibrated width, "
        "interleaved (keeps every config's index in memory)",
    )
    parser.add_argument(
        "--pages",
        action="store_true",
        help="also time each i8 config's graph in 4 KB pages against huge pages "
        "(a snapshot view, as a replica serves it), interleaved",
    )
    args = parser.parse_args()
    from _report import table, write_section

    x = dataset(args.n) if args.data == "random" else minilm(args.n)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rng = np.random.default_rng(5)
    src = rng.integers(0, len(x), args.queries)
    queries = np.stack([perturb(x[i], args.cos, rng) for i in src]).astype(np.float32)
    truth = exact_first(x, queries)
    efs = [int(e) for e in args.efs.split(",")]
    rows = []
    kept: dict[str, UsearchIndex] = {}
    paged: list[list[str]] = []
    for config in args.configs.split(","):
        m, efc, dtype = (config + ":i8").split(":")[:3]
        build, per_entry, res, calibration, index = measure(
            x, int(m), int(efc), dtype, efs, queries, src, truth, args.k
        )
        if args.across:
            kept[f"{m}:{efc}:{dtype}"] = index
        if args.pages and dtype.startswith("i8"):
            for where, (width, recall, ms, p99) in pages(index, queries, src, args.k).items():
                paged.append([f"{m}:{efc}:{dtype}", where, str(width), f"**{recall:.4f}**",
                              f"{ms:.3f}", f"{p99:.3f}"])  # fmt: skip
        del index
        base = res[0][4]
        size = f"{per_entry:,.0f} ({per_entry / (4 * x.shape[1]):.2f}x)"
        chosen, took = calibration
        calibrated = "-" if chosen is None else f"{chosen} ({took:.1f} s)"
        for ef, width, recall, agree, ms in res:
            rows.append([m, efc, dtype, f"{build:.0f}", size, calibrated, str(ef), str(width),
                         f"**{recall:.3f}**", f"{agree:.3f}",
                         f"{ms:.3f} ({ms / base:.2f}x)"])  # fmt: skip
    body = table(
        ["M", "ef_construction", "graph vectors", "build s",
         "index bytes per entry (/ raw float32)", "calibrated width (s)",
         "ef_search", "search width", f"near-copy recall@1 (cosine {args.cos})",
         "exact search agrees",
         "search ms p50 (/ first ef)"],
        rows,
    )  # fmt: skip
    body += (
        f"\n\n{args.data} vectors, {len(x):,} entries, 384-d; {args.queries:,} near-copies of "
        "random entries. The index is `zerda_cache.replica.index.UsearchIndex` (usearch, inner "
        "product; i8: int8 vectors in the graph, scaled to the int8 range "
        "(`UsearchIndex.quant`), candidates re-scored from float16 rows beside it; i8u: "
        "the same with usearch's own int8 conversion, 127 x truncated, as before `quant`; "
        "f16: float16 vectors in the graph; b1: one bit a dimension, the signs of each "
        "vector less the mean of the first vectors added, Hamming distance, candidates "
        "re-scored from float16 rows as for i8) built in bulk on every core; each "
        f"search is one query on one thread for {args.k} candidates, re-scored in float64 "
        "as a lookup's, blocks of 100 queries at each width in turn (the times compare "
        "widths on the same warm graph). Build seconds are for this shared "
        '2-core machine: compare them within the table. "Exact search agrees": the index\'s '
        'first result is exact search\'s. "Calibrated width": the width a replica would '
        "search this index at (`UsearchIndex.calibrate`: 1,000 stored vectors moved to "
        f"cosine {CALIBRATION_COSINE}, from width {UsearchIndex(4).ef_search} up; "
        "how long it took), where the rows set the width themselves."
    )
    if kept:
        got = across(kept, queries, src, args.k)
        first = next(iter(got.values()))[2]
        body += "\n\n" + table(
            ["M:ef_construction:graph vectors", "width searched (calibrated)",
             f"near-copy recall@1 (cosine {args.cos})", "search ms p50 (/ first config)",
             "search ms p99"],
            [[name, str(width), f"**{recall:.4f}**", f"{ms:.3f} ({ms / first:.2f}x)",
              f"{p99:.3f}"]
             for name, (width, recall, ms, p99) in got.items()],
        )  # fmt: skip
        body += (
            "\n\nThe configurations against each other, each at the width a replica would "
            "search it at (its calibrated width, else the schedule's), the same queries in "
            "blocks of 100 given to every index in turn: these times, unlike the first "
            "table's across configurations, share the machine's noise."
        )
    if paged:
        built: dict[str, float] = {}  # each config's time against its graph as built
        for row in paged:
            first = built.setdefault(row[0], float(row[4]))
            row[4] += f" ({float(row[4]) / first:.2f}x)"
        body += "\n\n" + table(
            ["M:ef_construction:graph vectors", "memory searched", "width searched",
             f"near-copy recall@1 (cosine {args.cos})", "search ms p50 (/ as built)",
             "search ms p99"],
            paged,
        )  # fmt: skip
        body += (
            "\n\nThe same graph where the build left it and restored as a replica restores "
            "the worker's snapshot (copied into private anonymous memory and searched in "
            "place), with that memory advised for transparent huge pages "
            "(`madvise(MADV_HUGEPAGE)`, as `RedisStorage.read_snapshot` does) or not, at "
            "the width a replica would search it at; the same queries in blocks of 100 "
            "given to each in turn. An HNSW search reads one random node after another: "
            "with 4 KB pages nearly each costs a TLB miss. This kernel's setting: "
            f"`{_thp_setting()}`."
        )
    print(body)
    name = args.section or f"hnsw-{args.data}-{len(x) // 1000}k"
    write_section(name, f"HNSW parameters: recall and search time at {len(x):,} entries "
                  f"({args.data}) (bench_hnsw.py)", body)  # fmt: skip


def _thp_setting() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
