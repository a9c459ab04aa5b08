"""Do cached questions get their own answers back? Exact repeats and near-copies, on real
MiniLM embeddings of QQP questions, at 100k entries.

The cache holds ``--n`` distinct QQP questions (all-MiniLM-L6-v2 embeddings from the
quality benchmark's on-disk cache, ``.cache/quality``; ``make bench-quality`` makes it).
For ``--lookups`` of them, sampled:

* **exact**: the question's own text and embedding;
* **near-copy**: another text and the embedding moved to cosine 0.97 of the original;
* **index recall**: whether the replica's index alone has the source entry first.

A lookup is right when it returns the source entry. ``--baseline DIR`` runs the same
measurement with the library of another source tree (a child process with
``PYTHONPATH=DIR``), side by side.

    .venv/bin/python benchmarks/bench_recall.py [--baseline /tmp/base] [--n 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "quality"))

COSINE = 0.97


def measure(n: int, lookups: int, url: str) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry
    from workload import corpus, embed_corpus, read_pairs

    from zerda_cache import CacheConfig, CacheManager
    from zerda_cache.metrics import ReplicaMetrics

    texts, _ = corpus(read_pairs())
    vecs = embed_corpus(texts)[:n].astype(np.float64)
    texts = texts[:n]
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    cfg = CacheConfig()
    writer = CacheManager(client, cfg, metrics=ReplicaMetrics(CollectorRegistry()))
    from _load import put_all

    ids = put_all(writer.storage, "qqp", texts, vecs, progress=False)
    reader = CacheManager(client, cfg, metrics=ReplicaMetrics(CollectorRegistry()))
    t0 = time.perf_counter()
    reader.sync_index("qqp")
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(7)
    sample = rng.choice(n, size=lookups, replace=False)
    exact = near = index = 0
    ti = reader.indexes["qqp"]
    for j, i in enumerate(sample.tolist()):
        hit = reader.lookup(texts[i], tenant="qqp", embedding=vecs[i])
        exact += hit is not None and hit.entry_id == ids[i]
        r = rng.normal(size=vecs.shape[1])
        r -= (r @ vecs[i]) * vecs[i]
        r /= np.linalg.norm(r)
        v = COSINE * vecs[i] + np.sqrt(1 - COSINE * COSINE) * r
        top = ti.search(v.astype(np.float32), "", 1, 0.0)
        index += bool(top) and top[0][0] == ids[i]
        hit = reader.lookup(f"a rephrasing {j}", tenant="qqp", embedding=v)
        near += hit is not None and hit.entry_id == ids[i]
    reader.close()
    writer.close()
    return {"n": n, "lookups": lookups, "exact": exact, "near": near, "index": index,
            "build_s": build_s}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--lookups", type=int, default=1_000)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a server URL
    parser.add_argument("--quick", action="store_true", help="tiny run; does not write docs")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.n, args.lookups, args.child)))
        return
    if args.quick:
        args.n, args.lookups = 5_000, 200
    from _report import git_rev, table, write_section

    from zerda_cache.testing import RedisServer

    rows = []
    figures: dict[str, int] = {}
    with RedisServer(kind="redis") as server:
        sides: list[tuple[str, Path | None]] = [("current " + git_rev(), None)]
        if args.baseline is not None:
            rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline,
                                 capture_output=True, text=True).stdout.strip()  # fmt: skip
            sides.insert(0, (f"baseline {rev}", args.baseline))
        for name, src in sides:
            env = {**os.environ, **({"PYTHONPATH": str(src)} if src else {})}
            out = subprocess.run(
                [sys.executable, __file__, "--child", server.url, "--n", str(args.n),
                 "--lookups", str(args.lookups)],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            r = json.loads(out.stdout.strip().splitlines()[-1])
            k = r["lookups"]
            if src is None:  # this checkout's
                figures = {
                    "recall.entries": r["n"],
                    "recall.lookups": k,
                    "recall.exact_right": r["exact"],
                    "recall.near_right": r["near"],
                }
            rows.append([name, f"{r['n']:,}", f"{r['exact']}/{k}", f"{r['near']}/{k}",
                         f"{r['index']}/{k}", f"{r['build_s']:.1f}"])  # fmt: skip
            print(rows[-1], flush=True)
    body = table(
        ["library", "entries", "exact repeat: own entry", f"near-copy (cosine {COSINE}): "
         "source entry", "index alone: source first", "replica index build s"],
        rows,
    )  # fmt: skip
    body += (
        f"\n\nReal all-MiniLM-L6-v2 embeddings (int8 ONNX) of distinct QQP questions, one "
        f"tenant, default CacheConfig (threshold 0.85, HNSW above 5,000 entries), "
        f"{args.lookups:,} sampled cached questions. A near-copy is another text with the "
        f"embedding moved to cosine {COSINE} of the original; right means the source entry "
        "came back. Target (issue 'Serve only what is likely right'): exact repeats always, "
        "near-copies >= 99.5%."
    )
    print(body)
    if not args.quick:
        write_section(
            "recall",
            "Own answers back: exact repeats and near-copies (bench_recall.py)",
            body,
            figures=figures,
        )


if __name__ == "__main__":
    main()
