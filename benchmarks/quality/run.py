"""Learning quality on real questions: zerda-cache against a similarity-threshold cache.

Workload (Quora Question Pairs, read from ../shared/data, never copied; seeded):

* The cache starts with the ``text_a`` question of every sampled pair; each cached
  question's answer is right for itself and for its labelled duplicates only. A fraction
  of the cached answers is planted wrong (wrong for everyone).
* Requests ask ``text_b`` questions, with Zipf popularity so questions come back:
  label-1 pairs (the cached ``text_a`` is a real duplicate) and label-0 pairs (hard
  near-misses: serving the ``text_a`` answer is wrong).
* A miss calls the "LLM" (right 95% of the time) and caches its answer.
* Users react to a served answer sometimes (30%), and 10% of reactions are wrong.
* Drift: halfway, 20% of the right answers go stale (become wrong).

Policies, at equal capacity: zerda-cache (the real system on a real Redis server, with
the worker's maintenance cycles run on the simulated clock), zerda-cache with decay off,
a similarity-threshold cache with LRU eviction (GPTCache's default policy), and an oracle
that serves a right cached answer whenever there is one (an upper bound). Thresholds are
swept. Embeddings: all-MiniLM-L6-v2 offline (``make minilm``), cached on disk.

    .venv/bin/python benchmarks/quality/run.py [--pairs 2000] [--requests 20000]

This is a first part of the quality benchmark: the threshold cache is simulated with LRU
and with S3-FIFO eviction; the peers that need their own packages or servers (GPTCache,
RedisVL, Redis allkeys-lfu) are not in it yet.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _report import table, write_section  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from rich.progress import Progress  # noqa: E402

from zerda_cache import CacheConfig, CacheManager, RLConfig  # noqa: E402
from zerda_cache.maintenance import Maintenance  # noqa: E402
from zerda_cache.metrics import ReplicaMetrics  # noqa: E402
from zerda_cache.testing import RedisServer  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "qqp_pairs.jsonl.gz"
CACHE_DIR = ROOT / ".cache" / "quality"
TENANT = "qqp"


@dataclass
class Workload:
    texts: list[str]  # every distinct text
    vecs: np.ndarray  # their embeddings
    seed_ids: list[int]  # text index of each initially cached question (text_a)
    seed_pair: list[int]
    queries: list[int]  # per request: the text index asked (a text_b)
    query_pair: list[int]  # per request: its pair
    pair_label: dict[int, int]
    planted_wrong: set[int]  # pairs whose seeded text_a answer is wrong
    stale: set[int]  # pairs whose seeded answer goes stale at the drift
    drift_at: int


def load_workload(n_pairs: int, n_requests: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    with gzip.open(DATA, "rt") as f:
        rows = [json.loads(line) for line in f]
    pos = [r for r in rows if r["label"] == 1]
    neg = [r for r in rows if r["label"] == 0]
    pick = [pos[i] for i in rng.choice(len(pos), n_pairs // 2, replace=False)] + [
        neg[i] for i in rng.choice(len(neg), n_pairs - n_pairs // 2, replace=False)
    ]
    texts: list[str] = []
    index: dict[str, int] = {}

    def tid(text: str) -> int:
        if text not in index:
            index[text] = len(texts)
            texts.append(text)
        return index[text]

    seed_ids = [tid(r["text_a"]) for r in pick]
    b_ids = [tid(r["text_b"]) for r in pick]
    pairs = [r["id"] for r in pick]
    popularity = 1.0 / np.arange(1, len(pick) + 1) ** 0.8
    order = rng.permutation(len(pick))
    weights = np.empty(len(pick))
    weights[order] = popularity / popularity.sum()
    asked = rng.choice(len(pick), n_requests, p=weights)
    right_pairs = [p for p, r in zip(pairs, pick, strict=True) if r["label"] == 1]
    planted = set(rng.choice(pairs, len(pairs) // 10, replace=False).tolist())
    stale_pool = [p for p in right_pairs if p not in planted]
    stale = set(rng.choice(stale_pool, len(stale_pool) // 5, replace=False).tolist())
    vecs = embed(texts)
    return Workload(
        texts=texts,
        vecs=vecs,
        seed_ids=seed_ids,
        seed_pair=pairs,
        queries=[b_ids[i] for i in asked],
        query_pair=[pairs[i] for i in asked],
        pair_label={r["id"]: r["label"] for r in pick},
        planted_wrong=planted,
        stale=stale,
        drift_at=n_requests // 2,
    )


def embed(texts: list[str]) -> np.ndarray:
    key = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"minilm-{key}.npy"
    if path.exists():
        return np.load(path)
    from zerda_cache.embedders import MiniLMEmbedder

    model = MiniLMEmbedder(threads=2)
    out = []
    with Progress() as progress:
        task = progress.add_task("embedding (all-MiniLM-L6-v2)", total=len(texts))
        for i in range(0, len(texts), 256):
            out.append(model.embed_many(texts[i : i + 256]))
            progress.advance(task, len(out[-1]))
    vecs = np.concatenate(out)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    np.save(path, vecs)
    return vecs


# --- the "truth" --------------------------------------------------------------------------------
@dataclass
class Answer:
    """What an entry answers: which question (text index, pair) and whether it was right."""

    text: int
    pair: int
    right: bool
    seeded: bool


def is_right(ans: Answer, query_text: int, query_pair: int, w: Workload, t: int) -> bool:
    if not ans.right:
        return False
    if ans.seeded and ans.pair in w.stale and t >= w.drift_at:
        return False  # went stale at the drift
    if ans.text == query_text:
        return True  # the same question
    return ans.pair == query_pair and w.pair_label[query_pair] == 1


def same_question(ans: Answer, query_text: int, query_pair: int, w: Workload) -> bool:
    return ans.text == query_text or (ans.pair == query_pair and w.pair_label[query_pair] == 1)


@dataclass
class Result:
    name: str
    threshold: float
    hits: int = 0
    wrong: int = 0
    requests: int = 0
    stale_serves: int = 0
    near_miss_serves: int = 0  # the served question is not the query's question
    wrong_answer_serves: int = 0  # the right question, a wrong (planted or LLM) answer
    curve: list[tuple[int, int, int]] = field(default_factory=list)  # window: n, hits, wrong
    lookup_ms: list[float] = field(default_factory=list)

    def count_wrong(self, ans: Answer, q: int, p: int, w: Workload, t: int) -> None:
        self.wrong += 1
        if ans.seeded and ans.pair in w.stale and t >= w.drift_at:
            self.stale_serves += 1
        elif not same_question(ans, q, p, w):
            self.near_miss_serves += 1
        else:
            self.wrong_answer_serves += 1

    def row(self) -> dict[str, Any]:
        n = max(1, self.requests)
        return {
            "policy": self.name,
            "threshold": self.threshold,
            "hit_rate": self.hits / n,
            "error_rate": self.wrong / n,
            "hit_precision": (self.hits - self.wrong) / self.hits if self.hits else 1.0,
            "correct_hit_rate": (self.hits - self.wrong) / n,
            "stale_serves_after_drift": self.stale_serves,
            "near_miss_serves": self.near_miss_serves,
            "wrong_answer_serves": self.wrong_answer_serves,
            "lookup_p99_ms": float(np.percentile(self.lookup_ms, 99)) if self.lookup_ms else 0.0,
            "curve": self.curve,
        }


class Users:
    def __init__(self, seed: int, rate: float = 0.3, noise: float = 0.1) -> None:
        self.rng = np.random.default_rng(seed)
        self.rate, self.noise = rate, noise

    def react(self, right: bool) -> bool | None:
        if self.rng.random() >= self.rate:
            return None
        return right if self.rng.random() >= self.noise else not right


def llm_right(rng: np.random.Generator) -> bool:
    return bool(rng.random() < 0.95)


# --- policies ---------------------------------------------------------------------------------
def run_zerda(
    w: Workload,
    threshold: float,
    capacity: int,
    url: str,
    seed: int,
    *,
    decay: bool,
    serve_bar: float | None,
    name: str,
    similarity_feedback: bool = True,
) -> Result:
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    clock = [1_000_000.0]
    rl = RLConfig(
        seed=seed,
        usage_decay=0.995 if decay else 1.0,
        decay_interval_s=60.0,
        min_reward_to_serve=serve_bar,
    )
    cfg = CacheConfig(similarity_threshold=threshold, rl=rl, top_k=8)
    m = CacheManager(
        client, cfg, clock=lambda: clock[0], metrics=ReplicaMetrics(CollectorRegistry())
    )
    m.storage.set_tenant_settings(TENANT, max_entries=capacity)
    maint = Maintenance(m.storage)
    answers: dict[str, Answer] = {}
    for text, pair in zip(w.seed_ids, w.seed_pair, strict=True):
        res = m.put(w.texts[text], f"a{text}", tenant=TENANT, embedding=w.vecs[text])
        answers[str(res.entry_id)] = Answer(text, pair, pair not in w.planted_wrong, True)
    maint.evict_tenant(TENANT)
    out = Result(name, threshold)
    users, rng = Users(seed), np.random.default_rng(seed + 1)
    window = max(1, len(w.queries) // 20)
    wn = wh = ww = 0
    for t, (q, p) in enumerate(zip(w.queries, w.query_pair, strict=True)):
        clock[0] += 1.0
        started = time.perf_counter()
        hit = m.lookup(w.texts[q], tenant=TENANT, embedding=w.vecs[q])
        out.lookup_ms.append((time.perf_counter() - started) * 1000)
        out.requests += 1
        wn += 1
        if hit is not None:
            ans = answers[hit.entry_id]
            right = is_right(ans, q, p, w, t)
            out.hits += 1
            wh += 1
            if not right:
                out.count_wrong(ans, q, p, w, t)
                ww += 1
            verdict = users.react(right)
            if verdict is not None:
                signal = hit.feedback(verdict)
                if not similarity_feedback:  # the seed's signal: no similarity
                    signal = replace(signal, similarity=None)
                m.feedback(signal)
        else:
            res = m.put(w.texts[q], f"a{q}", tenant=TENANT, embedding=w.vecs[q])
            if res.entry_id is not None:
                answers[res.entry_id] = Answer(q, p, llm_right(rng), False)
        if (t + 1) % 500 == 0:  # the worker's cycle, on the simulated clock
            maint.maintain_tenant(TENANT)
        if wn == window:
            out.curve.append((wn, wh, ww))
            wn = wh = ww = 0
    client.close()
    return out


class LRU:
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[int, None] = OrderedDict()

    def insert(self, key: int, text: int) -> None:
        self.order[key] = None

    def hit(self, key: int) -> None:
        self.order.move_to_end(key)

    def evict(self) -> int:
        return self.order.popitem(last=False)[0]


class S3FIFO:
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10%) that filters one-hit
    wonders, a main FIFO with lazy promotion (2-bit frequency), and a ghost queue of
    recently evicted questions whose return goes straight to the main FIFO."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.small: OrderedDict[int, int] = OrderedDict()  # key -> text
        self.main: OrderedDict[int, int] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()  # texts
        self.freq: dict[int, int] = {}

    def insert(self, key: int, text: int) -> None:
        self.freq[key] = 0
        if text in self.ghost:
            del self.ghost[text]
            self.main[key] = text
        else:
            self.small[key] = text

    def hit(self, key: int) -> None:
        self.freq[key] = min(3, self.freq[key] + 1)

    def evict(self) -> int:
        while True:
            if self.small and len(self.small) >= self.capacity // 10:
                key, text = self.small.popitem(last=False)
                if self.freq[key] > 0:
                    self.freq[key] = 0
                    self.main[key] = text
                    continue
                self.ghost[text] = None
                if len(self.ghost) > self.capacity:
                    self.ghost.popitem(last=False)
                del self.freq[key]
                return key
            key, text = self.main.popitem(last=False)
            if self.freq[key] > 0:
                self.freq[key] -= 1
                self.main[key] = text
                continue
            del self.freq[key]
            return key


def run_threshold(
    w: Workload, threshold: float, capacity: int, seed: int, eviction: str = "lru"
) -> Result:
    """A similarity-threshold cache (the best cosine at or above the threshold is served,
    no learning) with LRU (GPTCache's default) or S3-FIFO eviction."""
    dim = w.vecs.shape[1]
    policy: LRU | S3FIFO = LRU(capacity) if eviction == "lru" else S3FIFO(capacity)
    store: dict[int, Answer] = {}
    mat = np.zeros((capacity + 1, dim), dtype=np.float32)
    slot_of: dict[int, int] = {}
    free = list(range(capacity + 1))
    keys = np.full(capacity + 1, -1)
    next_key = [0]

    def put(text: int, ans: Answer) -> None:
        if len(store) >= capacity:
            old = policy.evict()
            del store[old]
            slot = slot_of.pop(old)
            keys[slot] = -1
            free.append(slot)
        key = next_key[0]
        next_key[0] += 1
        slot = free.pop()
        mat[slot] = w.vecs[text]
        keys[slot] = key
        slot_of[key] = slot
        store[key] = ans
        policy.insert(key, text)

    for text, pair in zip(w.seed_ids, w.seed_pair, strict=True):
        put(text, Answer(text, pair, pair not in w.planted_wrong, True))
    out = Result("threshold + " + ("LRU" if eviction == "lru" else "S3-FIFO"), threshold)
    rng = np.random.default_rng(seed + 1)
    window = max(1, len(w.queries) // 20)
    wn = wh = ww = 0
    for t, (q, p) in enumerate(zip(w.queries, w.query_pair, strict=True)):
        started = time.perf_counter()
        sims = mat @ w.vecs[q]
        sims[keys < 0] = -2.0
        best = int(np.argmax(sims))
        out.lookup_ms.append((time.perf_counter() - started) * 1000)
        out.requests += 1
        wn += 1
        if sims[best] >= threshold:
            key = int(keys[best])
            policy.hit(key)
            ans = store[key]
            right = is_right(ans, q, p, w, t)
            out.hits += 1
            wh += 1
            if not right:
                out.count_wrong(ans, q, p, w, t)
                ww += 1
        else:
            put(q, Answer(q, p, llm_right(rng), False))
        if wn == window:
            out.curve.append((wn, wh, ww))
            wn = wh = ww = 0
    return out


def run_oracle(w: Workload, capacity: int, seed: int) -> Result:
    """Knows the labels: serves a right cached answer when the cache (LRU, same capacity)
    holds one, never a wrong one."""
    store: OrderedDict[int, Answer] = OrderedDict()
    by_pair: dict[int, set[int]] = {}
    next_key = [0]

    def put(ans: Answer) -> None:
        if len(store) >= capacity:
            old, gone = store.popitem(last=False)
            by_pair[gone.pair].discard(old)
        key = next_key[0]
        next_key[0] += 1
        store[key] = ans
        by_pair.setdefault(ans.pair, set()).add(key)

    for text, pair in zip(w.seed_ids, w.seed_pair, strict=True):
        put(Answer(text, pair, pair not in w.planted_wrong, True))
    out = Result("oracle (upper bound)", 0.0)
    rng = np.random.default_rng(seed + 1)
    window = max(1, len(w.queries) // 20)
    wn = wh = 0
    for t, (q, p) in enumerate(zip(w.queries, w.query_pair, strict=True)):
        out.requests += 1
        wn += 1
        found = [k for k in by_pair.get(p, ()) if is_right(store[k], q, p, w, t)]
        if found:
            store.move_to_end(found[0])
            out.hits += 1
            wh += 1
        else:
            put(Answer(q, p, llm_right(rng), False))
        if wn == window:
            out.curve.append((wn, wh, 0))
            wn = wh = 0
    return out


# --- report ------------------------------------------------------------------------------------
def best_at(rows: list[dict[str, Any]], name: str, max_error: float) -> dict[str, Any] | None:
    ok = [r for r in rows if r["policy"] == name and r["error_rate"] <= max_error]
    return max(ok, key=lambda r: r["hit_rate"]) if ok else None


def plot(rows: list[dict[str, Any]], path: Path, n_requests: int) -> None:
    """Learning curves at one threshold (the middle of the sweep), every policy."""
    thresholds = sorted({r["threshold"] for r in rows if not r["policy"].startswith("oracle")})
    shown = thresholds[len(thresholds) // 2] if thresholds else 0.0
    rows = [r for r in rows if r["threshold"] == shown]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for r in rows:
        if not r["curve"] or r["policy"].startswith("oracle"):
            continue
        xs = np.cumsum([c[0] for c in r["curve"]])
        label = r["policy"]
        axes[0].plot(xs, [c[2] / c[0] for c in r["curve"]], label=label)
        axes[1].plot(xs, [c[1] / c[0] for c in r["curve"]], label=label)
    for ax, title in zip(
        axes,
        (f"wrong answers / requests (threshold {shown:.2f})", f"hit rate (threshold {shown:.2f})"),
        strict=True,
    ):
        ax.axvline(n_requests // 2, color="grey", linestyle=":", label="drift")
        ax.set_title(title)
        ax.set_xlabel("requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--capacity", type=float, default=0.8, help="share of the seeded entries")
    parser.add_argument("--thresholds", default="0.8,0.85,0.9,0.95")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--serve-bar", type=float, default=0.4, help="zerda-cache's min_reward_to_serve"
    )
    parser.add_argument("--quick", action="store_true", help="tiny run; does not write docs")
    parser.add_argument(
        "--replot", action="store_true", help="redraw the chart from docs/quality/quality.json"
    )
    args = parser.parse_args()
    if args.replot:
        saved = json.loads((ROOT / "docs" / "quality" / "quality.json").read_text())
        plot(
            saved["rows"],
            ROOT / "docs" / "quality" / "learning_curves.png",
            saved["args"]["requests"],
        )
        return
    if args.quick:
        args.pairs, args.requests, args.thresholds = 400, 3_000, "0.8,0.9"
    w = load_workload(args.pairs, args.requests, args.seed)
    capacity = int(len(w.seed_ids) * args.capacity)
    thresholds = [float(x) for x in args.thresholds.split(",")]
    results: list[Result] = [run_oracle(w, capacity, args.seed)]
    server = RedisServer().start()
    try:
        variants = [
            ("zerda-cache", True, args.serve_bar, True),
            ("zerda-cache (no similarity bar)", True, args.serve_bar, False),
            ("zerda-cache (seed policy)", True, None, False),
            ("zerda-cache (decay off)", False, args.serve_bar, True),
        ]
        with Progress() as progress:
            jobs = len(thresholds) * (2 + len(variants))
            task = progress.add_task("policies x thresholds", total=jobs)
            for thr in thresholds:
                for eviction in ("lru", "s3fifo"):
                    results.append(run_threshold(w, thr, capacity, args.seed, eviction))
                    progress.advance(task)
                for name, decay, bar, sim_fb in variants:
                    results.append(
                        run_zerda(
                            w, thr, capacity, server.url, args.seed,
                            decay=decay, serve_bar=bar, name=name,
                            similarity_feedback=sim_fb,
                        )
                    )  # fmt: skip
                    progress.advance(task)
    finally:
        server.stop()
    rows = [r.row() for r in results]
    out_dir = ROOT / "docs" / "quality"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "args": vars(args),
        "capacity": capacity,
        "seeded_entries": len(w.seed_ids),
        "rows": rows,
    }
    body = table(
        ["policy", "threshold", "hit rate", "error rate", "hit precision", "correct hits",
         "wrong serves: near-miss / wrong answer / stale", "lookup p99 ms"],
        [
            [r["policy"], f"{r['threshold']:.2f}", f"{r['hit_rate']:.3f}",
             f"{r['error_rate']:.3f}", f"{r['hit_precision']:.3f}",
             f"{r['correct_hit_rate']:.3f}",
             f"{r['near_miss_serves']} / {r['wrong_answer_serves']} / "
             f"{r['stale_serves_after_drift']}",
             f"{r['lookup_p99_ms']:.2f}"]
            for r in rows
        ],
    )  # fmt: skip
    lines = []
    for cap in (0.01, 0.02):
        z = best_at(rows, "zerda-cache", cap)
        b = best_at(rows, "threshold + LRU", cap) or best_at(rows, "threshold + S3-FIFO", cap)
        lines.append(
            f"- hit rate at error <= {cap:.0%}: zerda-cache "
            f"{z['hit_rate']:.3f} (threshold {z['threshold']:.2f})"
            if z
            else f"- hit rate at error <= {cap:.0%}: zerda-cache none"
        )
        lines[-1] += (
            f", threshold + LRU {b['hit_rate']:.3f} (threshold {b['threshold']:.2f})"
            if b
            else ", threshold + LRU none"
        )
    (out_dir / "quality.json").write_text(json.dumps(summary, indent=1))
    plot(rows, out_dir / "learning_curves.png", args.requests)
    body += (
        f"\n\n{args.pairs} QQP pairs (half duplicates), {args.requests} requests, capacity "
        f"{capacity} entries (80% of the seeded ones), seed {args.seed}. zerda-cache runs "
        f"with min_reward_to_serve={args.serve_bar} and the per-entry similarity bar (feedback "
        'carries the similarity); "no similarity bar" sends the seed\'s signal without it; '
        '"seed policy" also serves down to min_reward_to_keep=0.05. 10% planted wrong '
        "answers, 20% of the right ones stale after the drift (halfway); users react to "
        "30% of served answers, 10% of reactions wrong; the LLM is right 95% of the time.\n\n"
        + "\n".join(lines)
        + "\n\n![learning curves](quality/learning_curves.png)  \nNumbers: "
        "`docs/quality/quality.json`."
    )
    print(body)
    if not args.quick:
        write_section("quality", "Learning quality on QQP (benchmarks/quality/run.py)", body)


if __name__ == "__main__":
    main()
