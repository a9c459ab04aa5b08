"""Would a tenant-level model of P(right | features of the match) beat similarity-only
calibration at serving within an error bound delta? (research for issue 12)

Simulation: the cache holds every distinct ``text_a`` of QQP; each pair asks its
``text_b``; the candidate is the nearest cached question by cosine (over all of them).
Right = the candidate is the same text or a labelled duplicate (label-1 pair, either way
round) of the question asked. Lookups whose text is itself cached (digest match) are
served exactly and left out of the stream.

Policies, at each delta (labels arrive online in a seeded shuffled order; every decision
uses only the labels before it):

(a) ``sim``: calibration.py's rule: labels per similarity bin (0.005), serve at s >= t(delta),
    t = the lowest labelled bin edge with Wilson-95 upper error <= delta over >= 30 labels.
(b) ``model``: logistic regression over match features, refit every 2,000 labels on the
    bounded log (last ``--log`` labels); the same Wilson-bin rule over the predicted P(right)
    (bins of 0.005 over [0.5, 1] as calibration.py's). Before the first fit: rule (a).
    ``model-rescore``: at each refit the whole log is rescored with the new model and the
    bins rebuilt (what a worker would do; in-sample scores). ``model-online``: each label
    keeps the score the model in force gave it (out of sample; bins mix model versions).

Label modes: ``full`` (every lookup's outcome becomes a label after its decision) and
``cache`` (what zerda-cache would see: every unserved candidate with s >= --cand-floor is
verified; a served answer is labelled by feedback 30% of the time).

Run (from the repo root; the first run builds the features, ~6 min on 2 busy cores, and
later runs reuse the .npz):
    python benchmarks/match_features.py --emb-dir /work/main/.cache/quality \
        --features /tmp/feat/full_feats2.npz [--truth base|norm|closure] [--mode full|cache] \
        [--policies sim,model-rescore,sim/L,model-rescore/L] [--cols s,gap,crowd] \
        [--deltas 0.01,0.02,0.05]
    (--subset PREFIX runs on a small embedded sample: PREFIX_vecs.npy, PREFIX_pairs.json)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))

from workload import CACHE_DIR, corpus, read_pairs  # noqa: E402

from zerda_cache.learning import calibration as cal  # noqa: E402
from zerda_cache.learning import match_model as mm  # noqa: E402

DELTAS = (0.01, 0.02, 0.05)
TOP_K = 8  # zerda-cache's DEFAULT_TOP_K: crowding can only be seen within these
CROWD_EPS = 0.02

# ------------------------------------------------------------------ text features
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_NUM = re.compile(r"\w*\d[\w.,]*")  # tokens with a digit: 4, 2016, M605n, 3.5
_TOK = re.compile(r"[A-Za-z][A-Za-z0-9'.-]*")
_NEG = frozenset(
    [
        "not",
        "no",
        "never",
        "without",
        "don't",
        "doesn't",
        "isn't",
        "can't",
        "won't",
        "didn't",
        "aren't",
        "wasn't",
        "shouldn't",
        "cannot",
        "nor",
    ]
)
_QW = frozenset(
    [
        "what",
        "how",
        "why",
        "which",
        "when",
        "where",
        "who",
        "whom",
        "whose",
        "is",
        "are",
        "can",
        "do",
        "does",
        "should",
        "will",
        "would",
        "could",
        "did",
        "was",
        "were",
        "has",
        "have",
    ]
)


def sketch(text: str) -> tuple:
    """What a lookup needs of a question's text (could be stored per entry)."""
    low = text.lower()
    words = _WORD.findall(low)
    nums = frozenset(_NUM.findall(text))
    toks = _TOK.findall(text)
    caps = frozenset(t.lower().rstrip(".") for t in toks[1:] if t[0].isupper() and t != "I")
    neg = frozenset(w for w in words if w in _NEG)
    qw = next((w for w in words if w in _QW), "")
    first = {}
    for i, w in enumerate(words):
        first.setdefault(w, i)
    return frozenset(words), len(words), nums, caps, neg, qw, first


def pair_features(sa: tuple, sb: tuple) -> tuple[float, ...]:
    wa, na, numa, capa, nega, qa, fa = sa
    wb, nb, numb, capb, negb, qb, fb = sb
    union = len(wa | wb)
    jac = len(wa & wb) / union if union else 1.0
    ratio = min(na, nb) / max(na, nb) if max(na, nb) else 1.0
    num_diff = float(numa != numb)
    cap_diff = float(min(len(capa ^ capb), 3))
    neg_diff = float(nega != negb)
    qw_diff = float(qa != qb)
    # word order: share of discordant pairs among the shared words' first positions
    shared = sorted(wa & wb, key=fa.__getitem__)
    pos = [fb[w] for w in shared]
    m = len(pos)
    disc = sum(1 for i in range(m) for j in range(i + 1, m) if pos[i] > pos[j])
    order = disc / (m * (m - 1) / 2) if m > 1 else 0.0
    return jac, ratio, num_diff, cap_diff, neg_diff, qw_diff, order


FEATURES = [
    "s",
    "gap",
    "crowd",
    "jaccard",
    "len_ratio",
    "num_diff",
    "cap_diff",
    "neg_diff",
    "qword_diff",
    "order",
    "s_top",
    "same_words",
]


def derived(X: np.ndarray) -> np.ndarray:
    """Add s_top = max(0, s - 0.98) / 0.02 (lets the logit steepen near s = 1) and
    same_words = the two questions have the same set of lowercased words."""
    if X.shape[1] == len(FEATURES):
        return X
    return np.column_stack(
        [X, np.maximum(0, X[:, 0] - 0.98) / 0.02, (X[:, 3] >= 1 - 1e-9).astype(float)]
    )


# ------------------------------------------------------------------ data and search
def load(subset: str | None, emb_dir: str = str(CACHE_DIR)):
    rows = read_pairs()
    if subset:
        pick = json.loads(Path(subset + "_pairs.json").read_text())["pairs"]
        rows = [rows[i] for i in pick]
        texts, index = corpus(rows)
        vecs = np.load(subset + "_vecs.npy")
    else:
        texts, index = corpus(rows)
        found = [p for p in Path(emb_dir).glob("qqp-minilm-*.npy") if ".tmp" not in p.name]
        vecs = None
        for p in found:
            v = np.load(p, mmap_mode="r")
            if v.shape[0] == len(texts):
                vecs = np.asarray(v, dtype=np.float32)
        if vecs is None:
            raise SystemExit(f"no embeddings of {len(texts)} texts in {emb_dir}")
    assert vecs.shape[0] == len(texts)
    return rows, texts, index, vecs


def nearest(qv: np.ndarray, cv: np.ndarray, chunk: int = 1024):
    """Per query: best index, s1, s2, crowd (others within CROWD_EPS of s1 among top_k)."""
    n = qv.shape[0]
    best = np.empty(n, np.int64)
    s1 = np.empty(n, np.float32)
    s2 = np.empty(n, np.float32)
    crowd = np.empty(n, np.float32)
    crowd_all = np.empty(n, np.float32)
    for i in range(0, n, chunk):
        sims = qv[i : i + chunk] @ cv.T
        k = min(TOP_K, sims.shape[1])
        part = np.argpartition(-sims, k - 1, axis=1)[:, :k]
        ps = np.take_along_axis(sims, part, 1)
        order = np.argsort(-ps, axis=1)
        part = np.take_along_axis(part, order, 1)
        ps = np.take_along_axis(ps, order, 1)
        best[i : i + chunk] = part[:, 0]
        s1[i : i + chunk] = ps[:, 0]
        s2[i : i + chunk] = ps[:, 1]
        crowd[i : i + chunk] = (ps[:, 1:] >= ps[:, :1] - CROWD_EPS).sum(1)
        crowd_all[i : i + chunk] = (sims >= ps[:, :1] - CROWD_EPS).sum(1) - 1
    return best, s1, s2, crowd, crowd_all


def build(subset: str | None, emb_dir: str = str(CACHE_DIR), closure: bool = False):
    t0 = time.time()
    rows, texts, index, vecs = load(subset, emb_dir)
    a_ids = np.array([index[r["text_a"]] for r in rows])
    b_ids = np.array([index[r["text_b"]] for r in rows])
    dups: dict[int, set[int]] = {}
    for a, b, r in zip(a_ids, b_ids, rows, strict=False):
        if r["label"] == 1:
            dups.setdefault(int(a), set()).add(int(b))
            dups.setdefault(int(b), set()).add(int(a))
    if closure:  # sensitivity: duplicates of duplicates count as right too
        parent: dict[int, int] = {}

        def find(x: int) -> int:
            while parent.get(x, x) != x:
                parent[x] = parent.get(parent[x], parent[x])
                x = parent[x]
            return x

        for a, bs in dups.items():
            for b in bs:
                ra_, rb_ = find(a), find(b)
                if ra_ != rb_:
                    parent[ra_] = rb_
        groups: dict[int, set[int]] = {}
        for x in dups:
            groups.setdefault(find(x), set()).add(x)
        dups = {x: groups[find(x)] - {x} for x in dups}
    cache = list(dict.fromkeys(a_ids.tolist()))
    cached = set(cache)
    cache = np.array(cache)
    exact = np.array([b in cached for b in b_ids.tolist()])
    q = np.where(~exact)[0]  # pairs in the stream
    best, s1, s2, crowd, crowd_all = nearest(vecs[b_ids[q]], vecs[cache])
    cand = cache[best]
    qb = b_ids[q]
    right = np.array([c == b or b in dups.get(int(c), ()) for c, b in zip(cand, qb, strict=False)])
    t_search = time.time() - t0
    sk = {}
    t1 = time.perf_counter()
    feats_txt = []
    for c, b in zip(cand.tolist(), qb.tolist(), strict=False):
        if c not in sk:
            sk[c] = sketch(texts[c])
        if b not in sk:
            sk[b] = sketch(texts[b])
        feats_txt.append(pair_features(sk[b], sk[c]))
    time.perf_counter() - t1
    # per-lookup cost, cold (sketch both texts every time) on a sample
    sample = list(zip(cand.tolist(), qb.tolist(), strict=False))[:5000]
    t2 = time.perf_counter()
    for c, b in sample:
        pair_features(sketch(texts[b]), sketch(texts[c]))
    cold_us = (time.perf_counter() - t2) / len(sample) * 1e6
    t3 = time.perf_counter()
    for c, b in sample:
        pair_features(sk[b], sk[c])
    warm_us = (time.perf_counter() - t3) / len(sample) * 1e6
    ft = np.array(feats_txt, dtype=np.float64)
    X = np.column_stack([s1, s1 - s2, np.log1p(crowd), ft]).astype(np.float64)
    info = dict(
        pairs=len(rows),
        cached=len(cache),
        exact=int(exact.sum()),
        exact_right=int(exact.sum()),  # a digest match is its own question
        stream=len(q),
        right=int(right.sum()),
        search_s=round(t_search, 1),
        feat_cold_us=round(cold_us, 1),
        feat_warm_us=round(warm_us, 1),
        crowd_mean_topk=float(crowd.mean()),
        crowd_mean_all=float(crowd_all.mean()),
        crowd_capped_share=float((crowd_all > TOP_K - 1).mean()),
    )
    examples = dict(cand=cand, qb=qb, texts=texts)
    return X, right, info, examples


def _norm(text: str) -> str:
    return " ".join(_WORD.findall(text.lower().replace("\u2019", "'")))


def truth(cand: np.ndarray, qb: np.ndarray, kind: str, subset: str | None) -> np.ndarray:
    """Ground-truth variants (sensitivity to QQP's unlabelled duplicates)."""
    rows = read_pairs()
    if subset:
        rows = [rows[i] for i in json.loads(Path(subset + "_pairs.json").read_text())["pairs"]]
    texts, index = corpus(rows)
    norm = [_norm(t) for t in texts]
    key = {}  # text -> group: same normalised text
    for i, n in enumerate(norm):
        key.setdefault(n, i)
    g = [key[n] for n in norm]
    parent = list(range(len(texts)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    dup_pairs = {(g[index[r["text_a"]]], g[index[r["text_b"]]]) for r in rows if r["label"] == 1}
    if kind == "closure":
        for a, b in dup_pairs:
            ra_, rb_ = find(a), find(b)
            if ra_ != rb_:
                parent[ra_] = rb_
        return np.array([find(g[c]) == find(g[b]) for c, b in zip(cand, qb, strict=False)])
    sym = dup_pairs | {(b, a) for a, b in dup_pairs}
    return np.array([g[c] == g[b] or (g[c], g[b]) in sym for c, b in zip(cand, qb, strict=False)])


# ------------------------------------------------------------------ models
def fit_logreg(X: np.ndarray, y: np.ndarray, lam: float = 1.0, iters: int = 25):
    """The library's fit (``match_model.fit``: IRLS, ridge ``lam``) as (mu, sd, w) arrays,
    over any number of feature columns. ``iters`` is kept for the command line's sake:
    the library iterates to convergence (at most 50 steps)."""
    model = mm.fit(X, np.asarray(y).astype(bool), version=1, ridge=lam)
    return np.array(model.mu), np.array(model.sd), np.array(model.w)


def predict(model, X: np.ndarray) -> np.ndarray:
    mu, sd, w = model
    z = w[0] + ((X - mu) / sd) @ w[1:]
    return 1 / (1 + np.exp(-np.clip(z, -30, 30)))


auc = mm.auc  # the library's (ties count half)


# ------------------------------------------------------------------ the Wilson-bin rule
def wilson_vec(w: np.ndarray, n: np.ndarray, z: float = cal.Z_95) -> np.ndarray:
    n_safe = np.maximum(n, 1e-12)
    p = w / n_safe
    z2 = z * z
    centre = p + z2 / (2 * n_safe)
    margin = z * np.sqrt(np.maximum(p * (1 - p) / n_safe + z2 / (4 * n_safe**2), 0))
    out = np.minimum(1.0, (centre + margin) / (1 + z2 / n_safe))
    return np.where(n > 0, out, 1.0)


FLOORS = np.array([cal.bin_floor(i) for i in range(cal.N_BINS)])
#: Bins of the model's P(right): the same width as calibration.py's, but over [0, 1]
#: (calibration.py's start at 0.5, which would stop a per-lookup bound at P = 0.5).
P_BINS = round(1.0 / cal.BIN_WIDTH)
P_FLOORS = np.arange(P_BINS) * cal.BIN_WIDTH


def thresholds(
    r: np.ndarray, w: np.ndarray, deltas, rule: str = "S", floors: np.ndarray = FLOORS
) -> list[float | None]:
    """calibration.Calibration.threshold for every delta at once (rule "S": error among
    the labelled matches at or above t). Rule "L": wrong matches at or above t per labelled
    lookup (every labelled lookup counts in the denominator: a bound on wrong serves per
    request, the issue's "realised error rate")."""
    R = np.cumsum(r[::-1])[::-1]
    W = np.cumsum(w[::-1])[::-1]
    n = R + W
    if rule == "L":
        total = r.sum() + w.sum()
        n = np.full_like(n, total)
    up = wilson_vec(W, n)
    own = (r + w) > 0
    out = []
    for d in deltas:
        ok = np.where(own & (n >= cal.MIN_LABELS) & (up <= d))[0]
        out.append(float(floors[ok[0]]) if len(ok) else None)
    return out


def bins_of(x: np.ndarray) -> np.ndarray:
    return np.clip(np.floor((x - cal.BIN_FLOOR) / cal.BIN_WIDTH + 1e-9), 0, cal.N_BINS - 1).astype(
        np.int64
    )


def pbins_of(p: np.ndarray) -> np.ndarray:
    return np.clip(np.floor(p / cal.BIN_WIDTH + 1e-9), 0, P_BINS - 1).astype(np.int64)


def run_stream(
    X,
    y,
    order,
    policy,
    delta,
    mode,
    refit_every,
    log_size,
    cand_floor,
    react,
    lam,
    window=20000,
    refits_out=None,
):
    """One online run. Returns per-step served (bool) in stream order."""
    policy, _, rule = policy.partition("/")
    rule = rule or "S"
    n = len(order)
    Xs, ys = X[order], y[order]
    s = Xs[:, 0]
    sbin = bins_of(s)
    ra, wa = np.zeros(cal.N_BINS), np.zeros(cal.N_BINS)  # similarity bins
    rb, wb = np.zeros(P_BINS), np.zeros(P_BINS)  # score bins
    log_idx: list[int] = []  # labelled steps (bounded log)
    log_score: dict[int, float] = {}
    served = np.zeros(n, bool)
    model = None
    ta = tb = None
    since = 0
    for t in range(n):
        if model is None or policy == "sim":
            srv = ta is not None and s[t] >= ta
            p = None
        else:
            p = float(predict(model, Xs[t : t + 1])[0])
            srv = tb is not None and p >= tb
        served[t] = srv
        # does a label arrive?
        labelled = mode == "full" or (not srv and s[t] >= cand_floor) or bool(srv and react[t])
        if not labelled:
            continue
        ok = bool(ys[t])
        if s[t] < 1 - 1e-6:  # similarity-1 labels are not counted (calibration.py)
            (ra if ok else wa)[sbin[t]] += 1
            if ra.sum() + wa.sum() > window:  # label.lua: halve every count past the window
                ra *= 0.5
                wa *= 0.5
        if policy != "sim":
            log_idx.append(t)
            if model is not None:
                log_score[t] = p
                i = pbins_of(np.array([p]))[0]
                (rb if ok else wb)[i] += 1
            since += 1
            if since >= refit_every:
                since = 0
                if len(log_idx) > log_size:
                    for old in log_idx[: len(log_idx) - log_size]:
                        log_score.pop(old, None)
                    del log_idx[: len(log_idx) - log_size]
                li = np.array(log_idx)
                if ys[li].all() or not ys[li].any():
                    continue
                model = fit_logreg(Xs[li], ys[li].astype(float), lam)
                if refits_out is not None:
                    refits_out.append(model)
                rb[:] = 0
                wb[:] = 0
                if policy == "model-rescore":
                    sc = predict(model, Xs[li])
                    bi = pbins_of(sc)
                    yy = ys[li]
                    np.add.at(rb, bi[yy], 1)
                    np.add.at(wb, bi[~yy], 1)
                    for j, v in zip(log_idx, sc, strict=False):
                        log_score[j] = float(v)
                else:  # model-online: keep the scores each label got when it arrived
                    keep = [j for j in log_idx if j in log_score]
                    if keep:
                        kk = np.array(keep)
                        bi = pbins_of(np.array([log_score[j] for j in keep]))
                        yy = ys[kk]
                        np.add.at(rb, bi[yy], 1)
                        np.add.at(wb, bi[~yy], 1)
        ta = thresholds(ra, wa, [delta], rule)[0]
        if policy != "sim" and model is not None:
            tb = thresholds(rb, wb, [delta], rule, P_FLOORS)[0]
    return served


def summarise(served, y_stream):
    out = {}
    n = len(served)
    for name, sl in (("all", slice(0, n)), ("2nd half", slice(n // 2, n))):
        sv, yy = served[sl], y_stream[sl]
        k = len(sv)
        ns = int(sv.sum())
        wrong = int((sv & ~yy).sum())
        good = int((sv & yy).sum())
        oracle = int(yy.sum())
        out[name] = dict(
            served=ns / k,
            err_lookups=wrong / k,
            err_serves=(wrong / ns if ns else 0.0),
            vs_oracle=good / oracle,
            n_served=ns,
            n_wrong=wrong,
        )
    return out


def hindsight(score, y, delta):
    """Best share served by a single threshold on ``score`` with error among serves <= delta
    (an upper bound on what the score can do, with no online learning or confidence)."""
    o = np.argsort(-score, kind="stable")
    yy = y[o]
    wrong = np.cumsum(~yy)
    k = np.arange(1, len(yy) + 1)
    ok = np.where(wrong / k <= delta)[0]
    if not len(ok):
        return 0.0, 0.0
    i = ok[-1]
    return (i + 1) / len(y), float(yy[: i + 1].sum() / y.sum())


def hindsight_lookups(score, y, delta):
    """Correct serves vs oracle of the best single threshold on ``score`` whose wrong serves
    per lookup are <= delta (the per-lookup bound, no online learning or confidence)."""
    o = np.argsort(-score, kind="stable")
    yy = y[o]
    wrong = np.cumsum(~yy)
    ok = np.where(wrong / len(y) <= delta)[0]
    return float(yy[: ok[-1] + 1].sum() / y.sum()) if len(ok) else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--subset", default=None, help="prefix of *_vecs.npy/*_pairs.json")
    ap.add_argument(
        "--emb-dir",
        default=str(CACHE_DIR),
        help="where embed_corpus put qqp-minilm-*.npy (/work/main/.cache/quality)",
    )
    ap.add_argument(
        "--closure",
        action="store_true",
        help="right also for duplicates of duplicates (transitive closure)",
    )
    ap.add_argument(
        "--truth",
        default="base",
        choices=["base", "norm", "closure"],
        help="(needs --features built) norm: same text after lowercasing and "
        "dropping punctuation counts as right; closure: norm plus duplicates "
        "of duplicates",
    )
    ap.add_argument("--mode", default="full", choices=["full", "cache"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--refit", type=int, default=2000)
    ap.add_argument("--log", type=int, default=20000, help="bounded label log size")
    ap.add_argument(
        "--window",
        type=int,
        default=20000,
        help="label.lua halves the similarity bins past this many labels",
    )
    ap.add_argument("--lam", type=float, default=1.0)
    ap.add_argument("--cand-floor", type=float, default=0.5)
    ap.add_argument("--react", type=float, default=0.30)
    ap.add_argument(
        "--policies",
        default="sim,model-rescore,model-online,sim/L,model-rescore/L",
        help="/L: bound wrong serves per lookup instead of per serve",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--features", default=None, help="cache the built features in this .npz")
    ap.add_argument("--deltas", default="0.01,0.02,0.05")
    ap.add_argument(
        "--cols",
        default=None,
        help="model features, s first (default: all), "
        "e.g. s,gap,crowd: what the replica's index alone knows",
    )
    ap.add_argument(
        "--section",
        default=None,
        help="also write the printed report to docs/BENCHMARKS.md under this name",
    )
    args = ap.parse_args()
    if args.section is None:
        run(args)
        return
    import contextlib
    import io

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import write_section

    class Tee(io.StringIO):
        def write(self, text: str) -> int:
            sys.__stdout__.write(text)
            return super().write(text)

    out = Tee()
    with contextlib.redirect_stdout(out):
        run(args)
    body = (
        "A simulation, not the cache: the cache holds every distinct `text_a` of QQP, each "
        "pair asks its `text_b`, the candidate is the nearest cached question, and every "
        "lookup's outcome becomes a label after its decision (online, seeded order). "
        "`sim` is calibration.py's rule (error among serves <= delta, Wilson 95%); "
        "`model-rescore` a logistic regression over match features (similarity, gap to "
        "the second candidate, crowding, differing numbers and names, token overlap, "
        "lengths) refit every 2,000 labels from a bounded log, with the same rule over "
        "its predicted P(right); `/L` bounds wrong serves per lookup instead of per "
        "serve. Columns: share served, wrong serves per lookup, wrong among serves, "
        "correct serves against an oracle.\n\n```\n" + out.getvalue() + "```"
    )
    write_section(
        args.section,
        "Match features against similarity alone under a bound (match_features.py)",
        body,
    )


def run(args: argparse.Namespace) -> None:

    if args.features and Path(args.features).exists():
        z = np.load(args.features, allow_pickle=True)
        X, y, info = z["X"], z["y"], z["info"].item()
    else:
        X, y, info, ex = build(args.subset, args.emb_dir, args.closure)
        if args.features:
            np.savez(
                args.features,
                X=X,
                y=y,
                info=np.array(info, dtype=object),
                cand=ex["cand"],
                qb=ex["qb"],
            )
    if args.truth != "base":
        y = truth(z["cand"], z["qb"], args.truth, args.subset)
        info = dict(info, right=int(y.sum()), truth=args.truth)
    X = derived(X)
    if args.cols:
        keep = [FEATURES.index(c) for c in args.cols.split(",")]
        assert keep[0] == 0, "s must come first"
        X = X[:, keep]
        FEATURES[:] = [FEATURES[k] for k in keep]
    deltas = tuple(float(d) for d in args.deltas.split(","))
    print(json.dumps(info))
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(y))
    react = np.random.default_rng(args.seed + 1).random(len(y)) < args.react
    ys = y[order]

    # --- features: univariate AUC, coefficients, ablation (fit 1st half, test 2nd) -----
    half = len(order) // 2
    tr, te = order[:half], order[half:]
    print("\nfeature            AUC   mean|right  mean|wrong")
    for j, f in enumerate(FEATURES):
        a = auc(X[:, j], y)
        print(f"{f:<16} {a:6.3f}  {X[y, j].mean():10.3f}  {X[~y, j].mean():10.3f}")
    full_model = fit_logreg(X[tr], y[tr].astype(float), args.lam)
    p_te = predict(full_model, X[te])
    print(f"\nAUC on 2nd half: similarity {auc(X[te, 0], y[te]):.4f}, model {auc(p_te, y[te]):.4f}")
    print("standardised coefficients (fit on 1st half):")
    for f, c in zip(["(intercept)", *FEATURES], full_model[2], strict=False):
        print(f"  {f:<14} {c:+.3f}")
    print("\nhindsight, 2nd half: share served / correct vs oracle at error among serves <= delta")
    print("  score            " + "  ".join(f"d={d:.0%}".rjust(15) for d in deltas))
    rows = [("similarity", X[te, 0]), ("model", p_te)]
    for j, f in enumerate(FEATURES[1:], start=1):
        keep = [k for k in range(len(FEATURES)) if k != j]
        m = fit_logreg(X[tr][:, keep], y[tr].astype(float), args.lam)
        rows.append((f"model -{f}", predict(m, X[te][:, keep])))
    for name, sc in rows:
        cells = []
        for d in deltas:
            sh, vo = hindsight(sc, y[te], d)
            cells.append(f"{sh:6.3f}/{vo:6.3f}")
        print(f"  {name:<16} " + "  ".join(c.rjust(15) for c in cells))
    for name, cols in (
        ("s,gap,crowd", ["s", "gap", "crowd"]),
        ("s+text only", [f for f in FEATURES if f not in ("gap", "crowd")]),
    ):
        keep = [FEATURES.index(c) for c in cols if c in FEATURES]
        m = fit_logreg(X[tr][:, keep], y[tr].astype(float), args.lam)
        rows.append((name, predict(m, X[te][:, keep])))
    print("\nhindsight, 2nd half: correct serves vs oracle at wrong serves per lookup <= delta")
    print("  score            " + "  ".join(f"d={d:.0%}".rjust(8) for d in deltas))
    for name, sc in rows:
        print(
            f"  {name:<16} " + "  ".join(f"{hindsight_lookups(sc, y[te], d):8.3f}" for d in deltas)
        )

    # --- the online comparison ------------------------------------------------------------
    results = {}
    print(f"\nonline, mode={args.mode}, stream={len(y)}, oracle right={int(y.sum())}")
    hdr = ("policy", "delta", "part", "served", "err/lookups", "err/serves", "vs oracle")
    print("{:<17}{:>6}{:>10}{:>9}{:>13}{:>12}{:>11}".format(*hdr))
    for d in deltas:
        for pol in args.policies.split(","):
            t0 = time.time()
            served = run_stream(
                X,
                y,
                order,
                pol,
                d,
                args.mode,
                args.refit,
                args.log,
                args.cand_floor,
                react,
                args.lam,
                args.window,
            )
            res = summarise(served, ys)
            results[f"{pol}@{d}"] = res
            for part, r in res.items():
                print(
                    f"{pol:<17}{d:>6.0%}{part:>10}{r['served']:>9.3f}"
                    f"{r['err_lookups']:>13.4f}{r['err_serves']:>12.4f}"
                    f"{r['vs_oracle']:>11.3f}   ({time.time() - t0:.0f}s)"
                )
    if args.out:
        Path(args.out).write_text(
            json.dumps(dict(info=info, results=results, args=vars(args)), indent=1)
        )


if __name__ == "__main__":
    main()
