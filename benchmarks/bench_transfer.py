"""Tags and export/import at scale: what issue 43 asks of them, measured.

* **Invalidating a tag at 1M entries**: a tenant of 1,000,000 entries, each tagged with
  one of 100,000 documents ("doc:<n>", ~10 entries a tag), plus 1,000 entries tagged
  "doc:target". One ``invalidate_tag`` call: its wall time, the server's commands and
  time (``INFO commandstats``), and whether only those entries were touched (the
  others' count, and the versions of a sample of 2,000 of them, unchanged).
* **Export and import of 100,000 entries**: ``export_tenant`` to a file, then
  ``import_tenant`` into another tenant: rates and file size; then a fresh replica asks
  2,000 exact questions and 2,000 near copies (cosine 0.97) of both tenants, and the
  answers served are compared.

Vectors are clustered random ones (64-d for the 1M tenant, 384-d for the 100k one): what
is measured is the tags index and the transfer, not search quality. Writes its tables to
docs/BENCHMARKS.md::

    .venv/bin/python benchmarks/bench_transfer.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _load import put_all
from _report import table, write_section

from zerda_cache import CacheConfig, CacheManager
from zerda_cache.flows.transfer import export_tenant, import_tenant
from zerda_cache.storage import RedisStorage
from zerda_cache.testing import RedisServer


def clustered(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(max(1, n // 50), dim)).astype(np.float32)
    x = centers[rng.integers(0, len(centers), n)] + 0.7 * rng.normal(size=(n, dim)).astype(
        np.float32
    )
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def near(v: np.ndarray, cos: float, rng: np.random.Generator) -> np.ndarray:
    r = rng.normal(size=len(v))
    r -= (r @ v) * v
    r /= np.linalg.norm(r)
    return cos * v + np.sqrt(1 - cos * cos) * r


def commandstats(client: object) -> dict[str, tuple[int, int]]:
    stats = client.info("commandstats")  # type: ignore[attr-defined]
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


def bench_tags(n: int, tagged: int) -> tuple[str, dict[str, Any]]:
    """The section's text, and its headline figures (``_targets.py`` reads them)."""
    with RedisServer() as server:
        client = server.client()
        st = RedisStorage(client, CacheConfig())
        x = clustered(n, 64, seed=1)
        rng = np.random.default_rng(2)
        target = set(rng.choice(n, tagged, replace=False).tolist())
        tags = [["doc:target"] if i in target else [f"doc:{i % (n // 10)}"] for i in range(n)]
        t0 = time.perf_counter()
        ids = put_all(st, "big", [f"question {i}" for i in range(n)], x, tags=tags)
        load_s = time.perf_counter() - t0
        others = [ids[i] for i in rng.choice(n, 2_000, replace=False) if i not in target]
        before = {e: st.get_entry("big", e, with_vector=False).version for e in others}
        used = int(client.info("memory")["used_memory"])
        client.config_resetstat()
        stats0 = commandstats(client)
        t0 = time.perf_counter()
        removed = st.invalidate_tag("big", "doc:target")
        wall = time.perf_counter() - t0
        stats1 = commandstats(client)
        after = {e: st.get_entry("big", e, with_vector=False).version for e in others}
        count = st.count("big")
        rows = []
        for name in sorted(stats1):
            calls = stats1[name][0] - stats0.get(name, (0, 0))[0]
            usec = stats1[name][1] - stats0.get(name, (0, 0))[1]
            if calls and name.split("|")[0] not in ("info", "config"):
                rows.append([name.upper(), f"{calls:,}", f"{usec / 1000:,.1f}"])
        client.close()
    untouched = after == before and count == n - tagged
    figures = {
        "tags.entries": n,
        "tags.tagged": tagged,
        "tags.removed": removed,
        "tags.wall_ms": wall * 1000,
        "tags.untouched": untouched,
    }
    text = (
        f"A tenant of {n:,} entries (64-d, loaded in {load_s:.0f} s, {used / 2**20:,.0f} MiB "
        f"in Redis), each tagged with one of {n // 10:,} documents, plus {tagged:,} tagged "
        f"`doc:target`. One `invalidate_tag('doc:target')`:\n\n"
        + table(
            ["entries removed", "wall time (ms)", "per entry (us)", "others untouched"],
            [
                [
                    f"{removed:,}",
                    f"{wall * 1000:,.1f}",
                    f"{wall * 1e6 / max(1, removed):,.0f}",
                    "yes" if untouched else "NO",
                ]
            ],
        )
        + "\n\nThe server's commands during the call (`INFO commandstats`; commands that "
        "scripts call are counted within their script's time too):\n\n"
        + table(["command", "calls", "server ms"], rows)
        + f"\n\n'Others untouched': the tenant holds {n - tagged:,} entries after, and the "
        "state versions of 2,000 other entries sampled at random did not move (a hit or "
        "a write would have bumped them)."
    )
    return text, figures


def bench_transfer(n: int, checks: int) -> tuple[str, dict[str, Any]]:
    """The section's text, and its headline figures (``_targets.py`` reads them)."""
    cfg = CacheConfig(similarity_threshold=0.9)
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        client = server.client()
        st = RedisStorage(client, cfg)
        x = clustered(n, 384, seed=3)
        put_all(st, "src", [f"question {i}" for i in range(n)], x)
        path = Path(tmp) / "src.jsonl"
        t0 = time.perf_counter()
        with path.open("w", encoding="utf-8") as out:
            exported = export_tenant(st, "src", out)
        export_s = time.perf_counter() - t0
        size = path.stat().st_size
        t0 = time.perf_counter()
        with path.open(encoding="utf-8") as lines:
            report = import_tenant(st, "dst", lines)
        import_s = time.perf_counter() - t0
        m = CacheManager(server.client(), cfg)
        m.sync_index("src")
        m.sync_index("dst")
        rng = np.random.default_rng(4)
        picks = rng.choice(n, checks, replace=False)
        same_exact = same_near = 0
        for i in picks.tolist():
            a = m.lookup(f"question {i}", tenant="src", embedding=x[i])
            b = m.lookup(f"question {i}", tenant="dst", embedding=x[i])
            same_exact += a is not None and b is not None and a.response == b.response
            q = near(x[i], 0.97, rng)
            a = m.lookup(f"another way {i}", tenant="src", embedding=q)
            b = m.lookup(f"another way {i}", tenant="dst", embedding=q)
            same_near += (a is None) == (b is None) and (a is None or a.entry_id == b.entry_id)
        m.close()
        client.close()
    figures = {
        "transfer.entries": n,
        "transfer.exported": exported,
        "transfer.imported": report.stored,
        "transfer.export_rate": exported / export_s,
        "transfer.import_rate": report.stored / import_s,
        "transfer.checks": checks,
        "transfer.same_exact": same_exact,
        "transfer.same_near": same_near,
    }
    text = (
        f"{n:,} entries (384-d, stored as float16, the default), exported to a file and "
        "imported into another "
        f"tenant; a fresh replica then asks {checks:,} exact questions and {checks:,} near "
        "copies (cosine 0.97) of both:\n\n"
        + table(
            [
                "exported",
                "export (entries/s)",
                "file (MiB)",
                "imported",
                "import (entries/s)",
                "same exact answers",
                "same near answers",
            ],
            [
                [
                    f"{exported:,}",
                    f"{exported / export_s:,.0f}",
                    f"{size / 2**20:,.0f}",
                    f"{report.stored:,}",
                    f"{report.stored / import_s:,.0f}",
                    f"{same_exact:,} of {checks:,}",
                    f"{same_near:,} of {checks:,}",
                ]
            ],
        )
        + "\n\nThe import writes one entry a script call, `transfer.IMPORT_BATCH` (200) "
        "calls a round trip, after checking each line in Python."
    )
    return text, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny run; does not write docs")
    args = parser.parse_args()
    if args.quick:
        print(bench_tags(20_000, 1_000)[0])
        print(bench_transfer(2_000, 200)[0])
        return
    body, figures = bench_tags(1_000_000, 1_000)
    write_section("tags-1m", "Invalidating a tag at 1M entries", body, figures=figures)
    print(body)
    body, figures = bench_transfer(100_000, 2_000)
    write_section("export-import-100k", "Export and import of 100k entries", body, figures=figures)
    print(body)


if __name__ == "__main__":
    main()
