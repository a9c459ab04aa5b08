"""Lookup latency and throughput against the PING round trip, put throughput, and the
replica index's memory, at 10k and 100k entries of 384-d embeddings, in one run.

Data (``--data``): ``random``, seeded synthetic embeddings clustered like sentence
embeddings (2,000 topics), and ``minilm``, real all-MiniLM-L6-v2 embeddings of QQP
questions (the quality benchmark's cache ``.cache/quality``; ``make bench-quality`` makes
it). HNSW behaves very differently on the two. Hit queries are stored vectors perturbed
to cosine ~0.95 (random) or 0.97 (MiniLM, as ``bench_recall``); recall@1 is the share of
them served their source entry. Miss queries are random unit vectors (cosine well under
the 0.85 threshold). Embedding time is excluded: queries pass
``embedding=``. One process, one client, lookups interleaved with PINGs so that both see
the same machine noise, and with searches of the replica's index alone (no Redis; other
queries of the same kind): the part of the ratio that no round trip removes. Beside the
default (sync ``CacheManager``: a binary graph at 384-d), the same hits through a
float16 graph, an int8 graph (``ann_dtype="i8"``), hnswlib, exact search and
``AsyncCacheManager`` (what the HTTP service and the OpenAI proxy run; against an asyncio
PING). Targets (issue "CacheManager"):
lookup p50 <= 3x PING p50 and p99 <= 5 ms at 100k entries; index memory <= 1.2x the
raw float32 bytes. Issue "A replica serves in seconds": p50 <= 5x and p99 <= 10x PING
p50, recall@1 >= 0.995 on real embeddings.

    .venv/bin/python benchmarks/bench_lookup.py [--sizes 10000,100000] [--lookups 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import busiest_commands, table, write_section
from prometheus_client import CollectorRegistry

from zerda_cache import CacheConfig, CacheManager
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import codec
from zerda_cache.testing import RedisServer

DIM = 384
TENANT = "bench"
#: Real embeddings at most (``minilm``): QQP's questions, then their prefixes up to this.
PREFIX_TEXTS = 1_000_000


def dataset(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(2_000, DIM)).astype(np.float32)
    x = centers[rng.integers(0, len(centers), n)] + 0.7 * rng.normal(size=(n, DIM)).astype(
        np.float32
    )
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def perturb(v: np.ndarray, cos: float, rng: np.random.Generator) -> np.ndarray:
    r = rng.normal(size=len(v))
    r -= (r @ v) * v
    r /= np.linalg.norm(r)
    return cos * v + np.sqrt(1 - cos * cos) * r


def load(manager: CacheManager, x: np.ndarray, batch: int = 500) -> tuple[float, list[str]]:
    """Put every vector through the put script, pipelined; returns puts/s and the ids."""
    from _load import put_all

    texts = [f"question {j}" for j in range(len(x))]
    t0 = time.perf_counter()
    ids = put_all(manager.storage, TENANT, texts, x, batch=batch)
    return len(x) / (time.perf_counter() - t0), ids


def qqp_prefixes(questions: list[str]) -> list[str]:
    """Texts beyond QQP's distinct questions, for real embeddings past 137,551 entries: the
    questions' word prefixes of 3 words or more, not themselves a question, fewest words
    cut first over all questions (every question less its last word, then less two, ...),
    each once. A cache of a million entries holds questions more alike than QQP's: a question and
    its prefixes are near neighbours, which makes the index's search harder, not easier."""
    seen, out = set(questions), []
    words = [q.split() for q in questions]
    for cut in range(1, max(map(len, words)) - 2):
        for w in words:
            if len(w) - cut >= 3:
                text = " ".join(w[: len(w) - cut])
                if text not in seen:
                    seen.add(text)
                    out.append(text)
    return out


def minilm_texts(n: int) -> list[str]:
    """The texts ``minilm(n)`` embeds: QQP's distinct questions, then their prefixes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "quality"))
    from workload import corpus, read_pairs

    texts, _ = corpus(read_pairs())
    if n <= len(texts):
        return texts[:n]
    if n > PREFIX_TEXTS:
        raise SystemExit(f"real embeddings go up to {PREFIX_TEXTS:,} entries, not {n:,}")
    return texts + qqp_prefixes(texts)[: n - len(texts)]


def minilm(n: int) -> np.ndarray:
    """MiniLM embeddings of the first ``n`` QQP questions (the quality benchmark's), and
    past its 137,551 distinct questions, of their word prefixes (``qqp_prefixes``). Some
    texts are the same question to the cache (``codec.normalize_query``: case, spacing):
    0.3% of the first million, 42 of the questions; a put of the later replaces the
    earlier, so compare served questions normalised."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "quality"))
    from workload import CACHE_DIR, corpus, embed_corpus, read_pairs

    texts, _ = corpus(read_pairs())
    if not any(CACHE_DIR.glob("qqp-minilm-*.npy")):
        raise SystemExit("no MiniLM embeddings in .cache/quality: run make bench-quality")
    base = embed_corpus(texts)
    if n <= len(texts):
        return base[:n].astype(np.float32, copy=False)
    if n > PREFIX_TEXTS:
        raise SystemExit(f"real embeddings go up to {PREFIX_TEXTS:,} entries, not {n:,}")
    more = minilm_texts(PREFIX_TEXTS)[len(texts) :]
    # Embedded once (~1 h on 2 cores), cached in .cache/quality like the questions.
    extra = embed_corpus(more)
    return np.concatenate([base, extra[: n - len(texts)]]).astype(np.float32, copy=False)


def exact_first(x: np.ndarray, queries: np.ndarray, chunk: int = 100_000) -> np.ndarray:
    """The index of each query's nearest vector, by a float32 matrix product in chunks."""
    best = np.full(len(queries), -1, dtype=np.int64)
    score = np.full(len(queries), -np.inf, dtype=np.float32)
    for start in range(0, len(x), chunk):
        sims = queries @ x[start : start + chunk].T
        arg = np.argmax(sims, axis=1)
        top = sims[np.arange(len(queries)), arg]
        better = top > score
        best[better], score[better] = arg[better] + start, top[better]
    return best


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def run_size(
    server: RedisServer, n: int, lookups: int, exact_too: bool, data: str = "random"
) -> tuple[list[list[str]], dict[str, Any]]:
    client = server.client()
    client.flushall()
    cfg = CacheConfig(similarity_threshold=0.85)
    manager = CacheManager(client, cfg, metrics=ReplicaMetrics(CollectorRegistry()))
    x = dataset(n) if data == "random" else minilm(n)
    cos = 0.95 if data == "random" else 0.97
    rng = np.random.default_rng(1)

    # Single puts through the facade (admission, validation, script): a sample.
    t0 = time.perf_counter()
    sample = 500
    for j in range(sample):
        manager.put(f"extra question {j}", "extra answer", tenant=TENANT, embedding=x[j])
    single_put_rate = sample / (time.perf_counter() - t0)
    client.flushall()
    bulk_put_rate, ids = load(manager, x)

    t0 = time.perf_counter()
    manager.sync_index(TENANT)
    build_s = time.perf_counter() - t0
    ti = manager.indexes[TENANT]
    assert ti.index is not None
    kind = ti.index.kind("")
    est = ti.index.nbytes()
    sub = ti.index._by_scope.get("")
    width = sub.search_width() if hasattr(sub, "search_width") else None
    calibrated = getattr(sub, "calibrated", None) is not None
    raw = n * DIM * 4

    sources = rng.integers(0, n, lookups)
    hit_q = [perturb(x[j], cos, rng) for j in sources]
    miss_q = [perturb(rng.normal(size=DIM) / np.sqrt(DIM), 0.0, rng) for _ in range(lookups)]
    # The index alone, no Redis: the lookup's floor beside the round trip. Other queries
    # of the same kind (searching a lookup's own query first would warm its path).
    alone_q = [codec.normalize_vector(perturb(x[j], cos, rng)) for j in rng.integers(0, n, lookups)]
    top_k, threshold, margin = cfg.top_k, cfg.similarity_threshold, cfg.rl.similarity_tie_margin
    ping, hit_lat, miss_lat, alone_lat = [], [], [], []
    several = tied = 0  # searches with several candidates; with one within the margin
    hits = misses = recalled = 0
    client.config_resetstat()  # Redis's own time per command, over the timed loop only
    for i in range(lookups):
        t = time.perf_counter()
        client.ping()
        ping.append(time.perf_counter() - t)
        t = time.perf_counter()
        found = ti.search(alone_q[i], "", top_k, threshold)
        alone_lat.append(time.perf_counter() - t)
        several += len(found) > 1
        tied += len(found) > 1 and found[1][1] >= found[0][1] - margin
        t = time.perf_counter()
        hit = manager.lookup("q", tenant=TENANT, embedding=hit_q[i])
        hit_lat.append(time.perf_counter() - t)
        hits += hit is not None
        recalled += hit is not None and hit.entry_id == ids[sources[i]]
        t = time.perf_counter()
        misses += manager.lookup("q", tenant=TENANT, embedding=miss_q[i]) is None
        miss_lat.append(time.perf_counter() - t)
        if i % 200 == 0:
            print(f"\r  {n:,}: lookups {i:,}/{lookups:,}", end="", file=sys.stderr)
    print(file=sys.stderr)
    server_time = command_times(client, lookups)
    ping50 = pct(ping, 50)
    rows = []
    for label, lat, ok in (("hit", hit_lat, hits), ("miss", miss_lat, misses)):
        rows.append(
            [
                f"{n:,} {data}",
                f"{label} ({kind})",
                f"{pct(lat, 50) * 1e3:.3f}",
                f"{pct(lat, 99) * 1e3:.3f}",
                f"{ping50 * 1e3:.3f}",
                f"**{pct(lat, 50) / ping50:.1f}x**",
                f"{1 / statistics.mean(lat):,.0f}",
                f"{ok / lookups:.3f}"
                + (f", recall@1 {recalled / lookups:.3f}" if label == "hit" else ""),
            ]
        )
    rows.append(
        [
            f"{n:,} {data}",
            f"index search alone ({kind}, no Redis)",
            f"{pct(alone_lat, 50) * 1e3:.3f}",
            f"{pct(alone_lat, 99) * 1e3:.3f}",
            f"{ping50 * 1e3:.3f}",
            f"{pct(alone_lat, 50) / ping50:.1f}x",
            f"{1 / statistics.mean(alone_lat):,.0f}",
            f"{several / lookups:.1%} with several candidates, {tied / lookups:.1%} "
            "within the tie margin",
        ]
    )
    if exact_too and kind != "exact":
        # The alternatives, side by side on the same data: a float16 usearch graph (the
        # default before int8 graphs), an int8 one (the default before binary graphs),
        # hnswlib, and exact search.
        for label, alt_cfg in (
            (
                "hit (hnsw, float16 graph)",
                CacheConfig(similarity_threshold=0.85, ann_dtype="f16"),
            ),
            (
                "hit (hnsw, int8 graph)",
                CacheConfig(similarity_threshold=0.85, ann_dtype="i8"),
            ),
            (
                "hit (hnswlib backend)",
                CacheConfig(similarity_threshold=0.85, ann_backend="hnswlib"),
            ),
            (
                "hit (exact, for comparison)",
                CacheConfig(similarity_threshold=0.85, ann_threshold=None),
            ),
        ):
            alt = CacheManager(client, alt_cfg, metrics=ReplicaMetrics(CollectorRegistry()))
            t0 = time.perf_counter()
            alt.sync_index(TENANT)
            alt_build = time.perf_counter() - t0
            alt_index = alt.indexes[TENANT].index
            assert alt_index is not None
            alt_sub = alt_index._by_scope.get("")
            alt_width = (
                f", width {alt_sub.search_width()}" if hasattr(alt_sub, "search_width") else ""
            )
            alt_lat, alt_ping = [], []
            for q in hit_q[:500]:
                t = time.perf_counter()
                client.ping()
                alt_ping.append(time.perf_counter() - t)
                t = time.perf_counter()
                alt.lookup("q", tenant=TENANT, embedding=q)
                alt_lat.append(time.perf_counter() - t)
            rows.append(
                [
                    f"{n:,} {data}",
                    label,
                    f"{pct(alt_lat, 50) * 1e3:.3f}",
                    f"{pct(alt_lat, 99) * 1e3:.3f}",
                    f"{pct(alt_ping, 50) * 1e3:.3f}",
                    f"{pct(alt_lat, 50) / pct(alt_ping, 50):.1f}x",
                    f"{1 / statistics.mean(alt_lat):,.0f}",
                    f"memory {alt_index.nbytes() / raw:.2f}x, build {alt_build:.1f} s{alt_width}",
                ]
            )
            del alt
    if exact_too and kind != "exact":
        rows += async_rows(server, cfg, n, data, hit_q[:1000], raw)
    extra = {
        "n": n,
        "data": data,
        "recall": recalled / lookups,
        "kind": kind,
        "bulk_put_rate": bulk_put_rate,
        "single_put_rate": single_put_rate,
        "build_s": build_s,
        "est_ratio": est / raw,
        "p99_ms": pct(hit_lat, 99) * 1e3,
        "p50_ratio": pct(hit_lat, 50) / ping50,
        "p99_ratio": pct(hit_lat, 99) / ping50,
        "search_ratio": pct(alone_lat, 50) / ping50,
        "rest_ratio": (pct(hit_lat, 50) - pct(alone_lat, 50)) / ping50,
        "width": width,
        "calibrated": calibrated,
        "server_time": server_time,
    }
    client.close()
    return rows, extra


def command_times(client: Any, lookups: int) -> str:
    """Redis's own account of the timed loop (``INFO commandstats``, reset before it):
    the commands that took the most of its time, each with its calls per hit-and-miss
    pair of lookups and its microseconds per call. Commands that scripts call are
    counted twice: on their own, and within their script's time."""
    return "; ".join(
        f"{name} {v['calls'] / lookups:.2f} calls x {v['usec_per_call']:.1f} us"
        for name, v in busiest_commands(client, skip=("ping",))
    )


def async_rows(
    server: RedisServer, cfg: CacheConfig, n: int, data: str, queries: list[Any], raw: int
) -> list[list[str]]:
    """The same hits through ``AsyncCacheManager`` (what the HTTP service and the proxy
    run), interleaved with an asyncio PING on the same event loop."""
    from zerda_cache.aio import AsyncCacheManager

    async def run() -> tuple[list[float], list[float], float, int]:
        manager = AsyncCacheManager.from_url(
            server.url, cfg, metrics=ReplicaMetrics(CollectorRegistry())
        )
        try:
            t0 = time.perf_counter()
            await manager.sync_index(TENANT)
            build = time.perf_counter() - t0
            index = manager.indexes[TENANT].index
            assert index is not None
            lat, ping = [], []
            for q in queries:
                t = time.perf_counter()
                await manager.storage.client.ping()
                ping.append(time.perf_counter() - t)
                t = time.perf_counter()
                await manager.lookup("q", tenant=TENANT, embedding=q)
                lat.append(time.perf_counter() - t)
            return lat, ping, build, index.nbytes()
        finally:
            await manager.aclose()

    lat, ping, build, nbytes = asyncio.run(run())
    return [
        [
            f"{n:,} {data}",
            "hit (hnsw, AsyncCacheManager)",
            f"{pct(lat, 50) * 1e3:.3f}",
            f"{pct(lat, 99) * 1e3:.3f}",
            f"{pct(ping, 50) * 1e3:.3f}",
            f"{pct(lat, 50) / pct(ping, 50):.1f}x (async PING)",
            f"{1 / statistics.mean(lat):,.0f}",
            f"memory {nbytes / raw:.2f}x, build {build:.1f} s",
        ]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--lookups", type=int, default=2_000)
    parser.add_argument("--kind", default=None, help="redis or valkey (default: redis)")
    parser.add_argument(
        "--data", default="random,minilm", help="random and/or minilm (real QQP embeddings)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny run; does not write docs")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.lookups, args.data = "2000", 200, "random"
    server = RedisServer(kind=args.kind).start()
    rows: list[list[str]] = []
    extras = []
    try:
        for data in args.data.split(","):
            for n in (int(s) for s in args.sizes.split(",")):
                r, e = run_size(server, n, args.lookups, exact_too=True, data=data)
                rows += r
                extras.append(e)
    finally:
        server.stop()
    body = table(
        [
            "entries",
            "lookup (index)",
            "p50 ms",
            "p99 ms",
            "PING p50 ms",
            "p50 / PING p50",
            "lookups/s (1 thread)",
            "hit or miss rate",
        ],
        rows,
    )
    body += "\n\n" + table(
        [
            "entries",
            "index",
            "puts/s (facade, one by one)",
            "puts/s (script, pipelined 500)",
            "index build s",
            "index memory / raw f32",
        ],
        [
            [
                f"{e['n']:,} {e['data']}",
                e["kind"],
                f"{e['single_put_rate']:,.0f}",
                f"{e['bulk_put_rate']:,.0f}",
                f"{e['build_s']:.1f}",
                f"**{e['est_ratio']:.2f}x**",
            ]
            for e in extras
        ],
    )
    body += "\n\n"
    cfg = CacheConfig()
    for last in (e for e in extras if e["n"] == max(x["n"] for x in extras)):
        body += (
            f"Targets at {last['n']:,} entries ({last['data']}): p50 <= 5x PING p50: "
            f"{'met' if last['p50_ratio'] <= 5 else '**not met**'} "
            f"({last['p50_ratio']:.1f}x); p99 <= 10x PING p50: "
            f"{'met' if last['p99_ratio'] <= 10 else '**not met**'} "
            f"({last['p99_ratio']:.1f}x); recall@1 of near-copies >= 0.995: "
            f"{'met' if last['recall'] >= 0.995 else '**not met**'} ({last['recall']:.3f}); "
            f"index memory <= 1.2x raw: {'met' if last['est_ratio'] <= 1.2 else '**not met**'} "
            f"({last['est_ratio']:.2f}x). Of the p50 ratio, the index search alone "
            f"is {last['search_ratio']:.1f}x PING p50 and the rest of the lookup (its round "
            f"trip, the scripts, the Python) {last['rest_ratio']:.1f}x. "
        )
        body += (
            "Redis's own time in the timed loop (`INFO commandstats`; per hit and miss, "
            "the busiest commands, those that scripts call counted in the script's time "
            f"too): {last['server_time']}. "
        )
        if last["width"] is not None:
            body += (
                f"The HNSW index searched at width {last['width']}"
                f"{' (calibrated by the replica)' if last['calibrated'] else ''}. "
            )
    body += (
        "A lookup with one candidate, or one ahead of the others by more than "
        "`similarity_tie_margin` (0.01), is one command, the hit script (which also "
        "reads the exact-match digest and the log's new events); with several "
        "within the margin, the same when the hit script finds that no Thompson draw "
        "could rank another first (no feedback on any of them: the closest), else two "
        "(the states the script returns, then the hit script of the best); the index search "
        "row, interleaved with the lookups on other near-copies of the same kind, counts "
        "both. The rest is Python: "
        "the command's packing (hiredis, on a connection of redis-py's pool: "
        "`zerda_cache/storage/wire.py`) and reply parsing, the search, the ranking. The index "
        "is exact below 5,000 entries per scope and HNSW above (usearch, by default "
        '(`ann_dtype="auto"`, 384-d) with one bit a dimension in the graph, the signs '
        "less the vectors' mean, and the candidates re-scored from float16 rows beside "
        f"it; M={cfg.ann_m}, ef_construction {cfg.ann_ef_construction}, "
        f"search width from {cfg.ann_ef_search}, `ann_ef_search`, as a replica calibrates "
        "it: docs/operations.md, 'Search width'); "
        "the build column is the replica's first sync (fetch every vector from Redis, "
        "then insert), "
        "as is the alternatives' build. Index memory is the index's own "
        "account: usearch's serialised graph plus 64 bytes per slot of its capacity "
        "(and the float16 rows of a binary or int8 graph) "
        "(fitted to the RSS growth measured at 20k-200k entries; the library's "
        "memory_usage counts reserved arenas it never touched) or hnswlib's layout, plus "
        "our id maps (~116 bytes per entry)."
    )
    print(body)
    if not args.quick:
        write_section(
            "lookup",
            "Lookup, put and index memory (bench_lookup.py)",
            body,
            figures=figures(extras),
        )


def figures(extras: list[dict[str, Any]]) -> dict[str, float]:
    """The headline figures of each data set and size (``_targets.py`` reads them)."""
    out = {}
    for e in extras:
        k = f"lookup.{e['data']}.{e['n']}."
        out |= {
            k + "p50_ping": e["p50_ratio"],
            k + "p99_ping": e["p99_ratio"],
            k + "recall": e["recall"],
            k + "index_memory": e["est_ratio"],
        }
    return out


if __name__ == "__main__":
    main()
