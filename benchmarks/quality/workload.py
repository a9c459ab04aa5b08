"""The quality benchmark's workload and its ground truth, on one of two data sets of labelled
question pairs (``DATASETS``): Quora Question Pairs (``qqp``, the default) or fow-cache's
customer-support style question pairs (``fow``, ``data/README.md``).

* The cache starts with the ``text_a`` question of every sampled pair; each cached
  question's answer is right for itself and for its labelled duplicates only. A fraction
  of the cached answers is planted wrong (wrong for everyone).
* Requests ask ``text_b`` questions, with Zipf popularity so that questions come back:
  label-1 pairs (the cached ``text_a`` is a real duplicate) and label-0 pairs (hard
  near-misses: serving the ``text_a`` answer is wrong). Pairs are sampled in the data's
  own ratio (QQP: 37% duplicates, fow: 51%); ``--full``, or more pairs than the data set
  has, takes every pair.
* A miss calls the "LLM" (right 95% of the time) and caches its answer.
* Users react to an answer sometimes (30%), served from the cache or fresh from the LLM,
  and 10% of reactions are wrong.
* Drift: halfway, 20% of the seeded answers of duplicate pairs (those not planted wrong)
  go stale (become wrong).
* Right means the same question: the served entry's question is the query itself or one
  of its labelled duplicates (over every sampled pair: a question can be in several).
* The random outcomes of each request (does the LLM get it right, does the user react,
  is the reaction wrong) are drawn once per request, so every policy sees the same ones.

QQP is read from ``../shared/data`` and never copied; fow ships in ``data/`` (592 pairs,
CC BY 4.0). Embeddings (all-MiniLM-L6-v2, int8 ONNX, offline) of every distinct question
of the data set are computed once and kept in ``.cache/quality``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "qqp_pairs.jsonl.gz"
#: name -> (file, what the reports call it)
DATASETS = {
    "qqp": (DATA, "QQP"),
    "fow": (Path(__file__).resolve().parent / "data" / "fow_pairs.jsonl.gz", "fow-cache"),
}
CACHE_DIR = ROOT / ".cache" / "quality"

PLANTED_WRONG_SHARE = 0.10
STALE_SHARE = 0.20
LLM_RIGHT = 0.95
REACTION_RATE = 0.30
REACTION_NOISE = 0.10
ZIPF_S = 0.8


def read_pairs(dataset: str = "qqp") -> list[dict[str, Any]]:
    """Every pair of ``dataset`` (a key of ``DATASETS``), in file order."""
    path, name = DATASETS[dataset]
    if not path.exists():
        raise SystemExit(f"{path} is missing: the benchmark reads {name} from there")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def corpus(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, int]]:
    """Every distinct question, in the order of first appearance in the file."""
    texts: list[str] = []
    index: dict[str, int] = {}
    for r in rows:
        for text in (r["text_a"], r["text_b"]):
            if text not in index:
                index[text] = len(texts)
                texts.append(text)
    return texts, index


def embed_corpus(texts: list[str], dataset: str = "qqp") -> np.ndarray:
    """MiniLM embeddings of ``texts`` (normalised float32), cached on disk by content."""
    key = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"{dataset}-minilm-{key}.npy"
    if path.exists():
        vecs = np.load(path)
        if vecs.shape[0] == len(texts):
            return vecs
    from zerda_cache.embedders import MiniLMEmbedder

    model = MiniLMEmbedder(threads=2)
    order = np.argsort([len(t) for t in texts], kind="stable")  # batches of like length:
    vecs = np.zeros((len(texts), 384), dtype=np.float32)  # half the padding work
    with Progress() as progress:
        name = DATASETS[dataset][1]
        task = progress.add_task(f"embedding {name} (all-MiniLM-L6-v2)", total=len(texts))
        for i in range(0, len(texts), 256):
            rows = order[i : i + 256]
            vecs[rows] = model.embed_many([texts[j] for j in rows])
            progress.advance(task, len(rows))
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vecs)
    tmp.replace(path)
    return vecs


@dataclass
class Workload:
    texts: list[str]  # every distinct text of the data set
    vecs: np.ndarray  # their embeddings
    seed_ids: list[int]  # text index of each initially cached question (text_a)
    seed_pair: list[int]
    queries: list[int]  # per request: the text index asked (a text_b)
    query_pair: list[int]  # per request: its pair
    pair_label: dict[int, int]
    planted_wrong: set[int]  # pairs whose seeded text_a answer is wrong
    stale: set[int]  # pairs whose seeded answer goes stale at the drift
    drift_at: int
    dups: dict[int, set[int]]  # text -> the texts labelled its duplicates
    llm_ok: np.ndarray  # per request: the LLM's answer would be right
    reacts: np.ndarray  # per request: the user reacts
    noisy: np.ndarray  # per request: the reaction is the wrong one


def load_workload(
    n_pairs: int | None, n_requests: int | None, seed: int, dataset: str = "qqp"
) -> Workload:
    """``n_pairs`` sampled pairs of ``dataset`` (None, or more than it has: all of them),
    ``n_requests`` Zipf requests (None: ten per pair)."""
    rng = np.random.default_rng(seed)
    rows = read_pairs(dataset)
    texts, index = corpus(rows)
    if n_pairs is None or n_pairs >= len(rows):
        pick = rows
    else:
        pick = [rows[i] for i in sorted(rng.choice(len(rows), n_pairs, replace=False))]
    n_requests = n_requests or 10 * len(pick)
    seed_ids = [index[r["text_a"]] for r in pick]
    b_ids = [index[r["text_b"]] for r in pick]
    pairs = [r["id"] for r in pick]
    popularity = 1.0 / np.arange(1, len(pick) + 1) ** ZIPF_S
    order = rng.permutation(len(pick))
    weights = np.empty(len(pick))
    weights[order] = popularity / popularity.sum()
    asked = rng.choice(len(pick), n_requests, p=weights)
    right_pairs = [p for p, r in zip(pairs, pick, strict=True) if r["label"] == 1]
    planted = set(rng.choice(pairs, int(len(pairs) * PLANTED_WRONG_SHARE), replace=False).tolist())
    stale_pool = [p for p in right_pairs if p not in planted]
    stale = set(rng.choice(stale_pool, int(len(stale_pool) * STALE_SHARE), replace=False).tolist())
    dups: dict[int, set[int]] = {}
    for r in pick:
        if r["label"] == 1:
            a, b = index[r["text_a"]], index[r["text_b"]]
            dups.setdefault(a, set()).add(b)
            dups.setdefault(b, set()).add(a)
    draws = np.random.default_rng(seed + 1).random((3, n_requests))
    vecs = embed_corpus(texts, dataset)
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
        dups=dups,
        llm_ok=draws[0] < LLM_RIGHT,
        reacts=draws[1] < REACTION_RATE,
        noisy=draws[2] < REACTION_NOISE,
    )


# --- the truth ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """What an entry answers: which question (text index, pair) and whether it was right."""

    text: int
    pair: int
    right: bool
    seeded: bool


def went_stale(ans: Answer, w: Workload, t: int) -> bool:
    return ans.seeded and ans.pair in w.stale and t >= w.drift_at


def same_question(ans: Answer, query_text: int, w: Workload) -> bool:
    return ans.text == query_text or query_text in w.dups.get(ans.text, ())


def is_right(ans: Answer, query_text: int, w: Workload, t: int) -> bool:
    return ans.right and not went_stale(ans, w, t) and same_question(ans, query_text, w)


def reaction(w: Workload, t: int, right: bool) -> bool | None:
    """The user's reaction to request ``t``'s answer: None (most users say nothing), or
    whether they liked it (``REACTION_NOISE`` of reactions are the wrong way round)."""
    if not w.reacts[t]:
        return None
    return right != bool(w.noisy[t])
