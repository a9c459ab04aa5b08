"""How few LLM calls an error bound can cost a cache that cannot tell a wrong answer from
a right one without asking the LLM, on ``run.py``'s stream (the same workload, seed and
capacity: ``--full`` by default, every QQP pair, 60,000 requests).

The policies here are not caches anyone could build: they *know which cached question
matches* the one asked (the labels: a perfect match model), so every cost they pay comes
from the answers alone: a tenth of the seeded answers planted wrong, the LLM's mistakes
(one in twenty), the seeded answers gone stale at the drift. What they do not know, as no
cache does, is whether a cached answer is right, which answers were planted or which
requests come after the drift; they learn it only as a cache can: from a verification (an
LLM call whose fresh answer agrees with the cached one only if both are right; a
disagreement does not say which one is wrong) and from users' reactions (three in ten
react, one reaction in ten the wrong way round), to served answers and to the LLM's.

The reference policy uses all of that as well as it can. Each cached answer has a
posterior P(right): its prior (a seeded answer 0.9, the LLM's 0.95: the workload's
constants) updated by Bayes on every signal, both ways: a reaction to a served answer or
to the LLM's (odds times or over 9); an agreement (both right: the entry is refreshed to
the fresh answer, which cannot go stale, and the answers that once disagreed with it are
dropped, as they were wrong); a disagreement (the joint posterior of the two answers, not
both right, with the reaction to the fresh one; both are kept as candidates unless one
falls under 5%). Staleness is learned: the seeded answers' prior is the mean of the first
signal on each seeded answer without evidence, over the last 400 such signals (each
unbiased for P(right); never above 0.9), and when it falls a seeded answer's evidence
counts for less by as much as the prior fell since it came (what was right then may have
gone stale). Of all the matching answers the likeliest right one is taken, and served when
P(wrong) < 1/λ, else verified: the Lagrangian policy of price λ on an error, traced by a
sweep of λ. The price differs on a question's first ask and on its later ones (the cache
counts its asks): serving unverified on a first ask and verifying on the next is where an
unverified answer saves the most calls for its errors, since a question asked once costs
one possible error and no call, and a popular one pays the one verification it would have
anyway.

Beside it, as rows for comparison:

- ``oracle``: knows the answers too (run.py's upper bound);
- ``exact only``: a cache without a match model, as anyone could build: serves only an
  entry of the very question asked, drops an answer on a negative reaction (a served one,
  or the LLM's, which it then does not cache);
- ``blind``: serves every matching cached answer (the newest);
- ``verify first``: verifies a matching answer before serving it the first time (and
  after a negative reaction);
- ``blind share b``: as ``verify first``, but serves a share ``b`` of the answers
  unverified (a seeded draw per entry);
- ``blind fresh b``: as ``verify first``, but serves a share ``b`` of the LLM's answers
  unverified, and verifies every seeded one first.

Their LLM calls at a realised error of δ (the best mix of two of them, over all of them
but the oracle) are the floor: a cache with an imperfect match model pays more. (A floor
for these policies and their mixes, not a proof for every policy: the reference decides
on each request by its price, and weighs what a verification teaches for later asks only
through its two prices.) It is read at the errors zerda realised too, as recorded by
``run.py`` in the section ``--zerda`` names.

    .venv/bin/python benchmarks/quality/floor.py            # docs: "quality-full-floor"
    .venv/bin/python benchmarks/quality/floor.py --pairs 4000 --section quality-floor
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0]))
sys.path.insert(0, str(HERE))

import summary  # noqa: E402
from _report import table, write_section  # noqa: E402
from workload import (  # noqa: E402
    LLM_RIGHT,
    PLANTED_WRONG_SHARE,
    REACTION_NOISE,
    Answer,
    Workload,
    is_right,
    load_workload,
    reaction,
)

SHARES = (0.1, 0.2, 0.3, 0.5)
FRESH_SHARES = (0.5, 1.0)
#: Prices of an error, one between each two of the usual 1 / P(wrong) (2 after a seeded
#: answer's negative reaction, 3.1 after the LLM's, 10 and 20 for the priors, 83 and 171
#: after a positive reaction); 1 serves every candidate.
PRICES = (1.0, 2.5, 5.0, 15.0, 50.0, 1000.0)
DELTAS = (0.01, 0.02, 0.05)


@dataclass(slots=True)
class Slot:
    """A cached answer, whether the policy trusts it, and its draw for ``blind share``."""

    ans: Answer
    vouched: bool
    draw: float


def simulate(w: Workload, capacity: int, mode: str, share: float = 0.0) -> dict[str, float]:
    """One policy over the stream (see the module's docstring): hit rate, error rate, LLM
    calls and verifications per request, correct hits."""
    store: OrderedDict[int, Slot] = OrderedDict()
    by_text: dict[int, set[int]] = {}
    rng = np.random.default_rng(0)
    keys = itertools.count()

    def put(ans: Answer, vouched: bool = False) -> int:
        if len(store) >= capacity:
            old, gone = store.popitem(last=False)
            by_text[gone.ans.text].discard(old)
        key = next(keys)
        store[key] = Slot(ans, vouched, rng.random())
        by_text.setdefault(ans.text, set()).add(key)
        return key

    for text, pair in zip(w.seed_ids, w.seed_pair, strict=True):
        put(Answer(text, pair, pair not in w.planted_wrong, True))
    calls = hits = wrong = verifications = 0
    for t, (q, p) in enumerate(zip(w.queries, w.query_pair, strict=True)):
        found = None
        for same in (q, *sorted(w.dups.get(q, ()))):
            for key in sorted(by_text.get(same, ()), reverse=True):  # the newest first
                if mode != "oracle" or is_right(store[key].ans, q, w, t):
                    found = key
                    break
            if found is not None:
                break
        if found is not None:
            store.move_to_end(found)
            slot = store[found]
            right = is_right(slot.ans, q, w, t)
            blind = mode in ("oracle", "blind") or slot.draw < share
            if mode == "blind fresh" and not slot.ans.seeded:
                blind = slot.draw < share  # the LLM's answers first: 5% wrong, not 10%
            elif mode == "blind fresh":
                blind = False
            if blind or slot.vouched:
                hits += 1
                wrong += not right
                if reaction(w, t, right) is False:
                    slot.vouched = False
                continue
            calls += 1  # a verification: the fresh answer agrees only if both are right
            verifications += 1
            fresh_ok = bool(w.llm_ok[t])
            if fresh_ok and right:
                slot.vouched = True
            elif fresh_ok:  # the cached answer was wrong: the fresh one replaces it
                by_text[slot.ans.text].discard(found)
                del store[found]
                key = put(Answer(q, p, True, False))
                store[key].vouched = reaction(w, t, True) is True
            continue
        calls += 1  # a miss: the LLM answers, the app caches it, a user may vouch for it
        ok = bool(w.llm_ok[t])
        key = put(Answer(q, p, ok, False))
        store[key].vouched = mode not in ("oracle", "blind") and reaction(w, t, ok) is True
    return rates(w, hits, wrong, calls, verifications)


# --- the reference: what a cache can know, used as well as it can be --------------------------
PRIOR_SEEDED = 1 - PLANTED_WRONG_SHARE  # a seeded answer is right 9 times in 10
PRIOR_LLM = LLM_RIGHT  # the LLM's answer 19 times in 20
LIKELIHOOD = (1 - REACTION_NOISE) / REACTION_NOISE  # a reaction's odds ratio: 9
DROP_BELOW = 0.05  # a candidate this unlikely to be right is not worth its place
WINDOW = 400  # first signals on seeded answers the learned prior is the mean of


@dataclass(slots=True)
class Belief:
    """A cached answer and what the cache believes of it: ``p``, P(right) after its
    evidence (None: no evidence yet, the prior), the seeded answers' prior when that
    evidence came, and the entries that disagreed with it (both cannot be right)."""

    ans: Answer
    p: float | None
    prior_then: float = PRIOR_SEEDED
    rivals: list[int] = field(default_factory=list)


class Store:
    """An LRU cache of ``capacity`` entries, indexed by question text."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, Belief] = OrderedDict()
        self.by_text: dict[int, set[int]] = {}
        self.keys = itertools.count()

    def put(self, item: Belief) -> int:
        if len(self.items) >= self.capacity:
            old, gone = self.items.popitem(last=False)
            self.by_text[gone.ans.text].discard(old)
        key = next(self.keys)
        self.items[key] = item
        self.by_text.setdefault(item.ans.text, set()).add(key)
        return key

    def drop(self, key: int) -> None:
        gone = self.items.pop(key, None)
        if gone is not None:
            self.by_text[gone.ans.text].discard(key)

    def seeded(self, w: Workload) -> Store:
        for text, pair in zip(w.seed_ids, w.seed_pair, strict=True):
            self.put(Belief(Answer(text, pair, pair not in w.planted_wrong, True), None))
        return self


def react(p: float, verdict: bool | None) -> float:
    """P(right) after a user's reaction to the answer (one in ten the wrong way round)."""
    if verdict is None or p in (0.0, 1.0):
        return p
    odds = p / (1 - p) * (LIKELIHOOD if verdict else 1 / LIKELIHOOD)
    return odds / (1 + odds)


def disagreement(pc: float, pf: float, verdict: bool | None) -> tuple[float, float]:
    """P(right) of the cached and of the fresh answer after they disagreed (not both are
    right) and the user reacted (or not) to the fresh one, the one they were shown."""
    f_right = f_wrong = 1.0
    if verdict is not None:
        f_right = 1 - REACTION_NOISE if verdict else REACTION_NOISE
        f_wrong = 1 - f_right
    cached_only = pc * (1 - pf) * f_wrong
    fresh_only = (1 - pc) * pf * f_right
    total = cached_only + fresh_only + (1 - pc) * (1 - pf) * f_wrong
    return cached_only / total, fresh_only / total


class SeededPrior:
    """P(right) of a seeded answer the cache has no evidence on: the mean of the first
    signal on each such answer over the last ``WINDOW`` (a verification agrees with
    P(LLM right)·p, a reaction is positive with P noise + (1 - 2·noise)·p: each signal
    unbiased for p); the workload's constant until the window fills, never above it."""

    def __init__(self) -> None:
        self.signals: deque[float] = deque(maxlen=WINDOW)
        self.total = 0.0
        self.value = PRIOR_SEEDED

    def add(self, signal: float) -> None:
        if len(self.signals) == WINDOW:
            self.total -= self.signals[0]
        self.signals.append(signal)
        self.total += signal
        if len(self.signals) == WINDOW:
            self.value = min(PRIOR_SEEDED, max(DROP_BELOW, self.total / WINDOW))

    def reaction(self, verdict: bool) -> None:
        self.add((verdict - REACTION_NOISE) / (1 - 2 * REACTION_NOISE))

    def verification(self, agreed: bool) -> None:
        self.add(agreed / PRIOR_LLM)


class Reference:
    """The Lagrangian policy (see the module's docstring): serves the matching answer most
    likely right when P(wrong) < 1 / price, else verifies it. ``prices``: the price of an
    error on a question's first ask, and on every later one."""

    def __init__(self, w: Workload, capacity: int, prices: tuple[float, float]) -> None:
        self.w, self.prices = w, prices
        self.st = Store(capacity).seeded(w)
        self.prior = SeededPrior()
        self.asked: set[int] = set()
        self.calls = self.hits = self.wrong = self.verifications = 0

    def belief(self, key: int) -> float:
        """P(right) now: a seeded answer's evidence is worth less as the seeded answers'
        prior falls (they go stale: what was right when the evidence came may not be)."""
        b = self.st.items[key]
        if b.p is None:
            return self.prior.value
        if b.ans.seeded and self.prior.value < b.prior_then:
            return b.p * self.prior.value / b.prior_then
        return b.p

    def believe(self, key: int, p: float) -> None:
        b = self.st.items[key]
        b.p, b.prior_then = p, self.prior.value
        if p < DROP_BELOW:
            self.st.drop(key)

    def run(self) -> dict[str, float]:
        w = self.w
        for t, (q, pair) in enumerate(zip(w.queries, w.query_pair, strict=True)):
            same = (q, *w.dups.get(q, ()))  # the perfect match model
            keys = sorted((k for s in same for k in self.st.by_text.get(s, ())), reverse=True)
            best = max(keys, key=self.belief, default=None)  # the newest of ties
            price = self.prices[q in self.asked]
            self.asked.add(q)
            if best is not None and (1 - self.belief(best)) * price < 1:
                self.serve(t, q, best)
                continue
            self.calls += 1  # the LLM answers; the user is shown its answer and may react
            ok = bool(w.llm_ok[t])
            verdict = reaction(w, t, ok)
            fresh = Answer(q, pair, ok, False)
            if best is None:
                self.st.put(Belief(fresh, react(PRIOR_LLM, verdict)))
            else:
                self.verify(t, q, best, fresh, verdict)
        return rates(w, self.hits, self.wrong, self.calls, self.verifications)

    def serve(self, t: int, q: int, key: int) -> None:
        self.st.items.move_to_end(key)
        b = self.st.items[key]
        right = is_right(b.ans, q, self.w, t)
        self.hits += 1
        self.wrong += not right
        verdict = reaction(self.w, t, right)
        if verdict is not None:
            if b.p is None:
                self.prior.reaction(verdict)
            self.believe(key, react(self.belief(key), verdict))

    def verify(self, t: int, q: int, key: int, fresh: Answer, verdict: bool | None) -> None:
        """The fresh answer agrees with the cached one only if both are right."""
        self.verifications += 1
        b = self.st.items[key]
        agreed = fresh.right and is_right(b.ans, q, self.w, t)
        if b.p is None:
            self.prior.verification(agreed)
        if agreed:  # right now, so right when they disagreed: its rivals were wrong
            for rival in b.rivals:
                self.st.drop(rival)
            self.st.drop(key)
            self.st.put(Belief(fresh, 1.0))  # the fresh answer: it cannot have gone stale
            return
        pc, pf = disagreement(self.belief(key), PRIOR_LLM, verdict)
        self.st.items.move_to_end(key)
        self.believe(key, pc)
        if pf >= DROP_BELOW:
            rival = self.st.put(Belief(fresh, pf, rivals=[key]))
            if key in self.st.items:
                b.rivals.append(rival)


def exact_only(w: Workload, capacity: int) -> dict[str, float]:
    """A cache without a match model: serves only an entry of the very question asked
    (the newest), drops an answer on a negative reaction (one served, or the LLM's,
    which it then does not cache)."""
    st = Store(capacity).seeded(w)
    calls = hits = wrong = 0
    for t, (q, pair) in enumerate(zip(w.queries, w.query_pair, strict=True)):
        keys = st.by_text.get(q)
        if keys:
            key = max(keys)
            st.items.move_to_end(key)
            right = is_right(st.items[key].ans, q, w, t)
            hits += 1
            wrong += not right
            if reaction(w, t, right) is False:
                st.drop(key)
            continue
        calls += 1
        ok = bool(w.llm_ok[t])
        if reaction(w, t, ok) is not False:
            st.put(Belief(Answer(q, pair, ok, False), PRIOR_LLM))
    return rates(w, hits, wrong, calls, 0)


def rates(w: Workload, hits: int, wrong: int, calls: int, verifications: int) -> dict[str, float]:
    n = len(w.queries)
    return {
        "hit_rate": hits / n,
        "error": wrong / n,
        "llm_calls": calls / n,
        "verifications": verifications / n,
        "correct": (hits - wrong) / n,
    }


@dataclass(frozen=True, slots=True)
class Reading:
    """The fewest LLM calls at an error, the correct hits there, the points mixed."""

    llm_calls: float
    correct: float
    of: tuple[int, ...]


def at_error(points: list[dict[str, float]], delta: float) -> Reading | None:
    """The fewest LLM calls (and the correct hits there) at realised error ``delta``, over
    every mix of two policies of the trade, one erring less and one more (interpolated:
    a cache could take each for a share of the requests); None when none errs that
    little. With none erring more, the least calls of those erring less."""
    under = [i for i, r in enumerate(points) if r["error"] <= delta]
    if not under:
        return None
    i = min(under, key=lambda i: points[i]["llm_calls"])
    out = Reading(points[i]["llm_calls"], points[i]["correct"], (i,))
    over = [i for i, r in enumerate(points) if r["error"] > delta]
    for i, j in itertools.product(under, over):
        lo, hi = points[i], points[j]
        f = (delta - lo["error"]) / (hi["error"] - lo["error"])
        calls = lo["llm_calls"] + f * (hi["llm_calls"] - lo["llm_calls"])
        if calls < out.llm_calls:
            out = Reading(calls, lo["correct"] + f * (hi["correct"] - lo["correct"]), (i, j))
    return out


@dataclass(slots=True)
class Run:
    name: str
    kind: str  # "oracle", "old", "exact" or "reference"
    r: dict[str, float]


def policies(w: Workload, capacity: int) -> list[Run]:
    """Every policy over the stream: the oracle, the old ones, exact-only, the reference
    at every pair of prices."""
    old = [("oracle", 0.0), ("blind", 0.0), ("verify first", 0.0)]
    old += [("blind share", s) for s in SHARES] + [("blind fresh", s) for s in FRESH_SHARES]
    runs = []
    for mode, share in old:
        name = f"{mode} {share:.1f}" if mode.startswith("blind ") else mode
        runs.append(
            Run(name, "oracle" if mode == "oracle" else "old", simulate(w, capacity, mode, share))
        )
        print(name, runs[-1].r, flush=True)
    runs.append(Run("exact only", "exact", exact_only(w, capacity)))
    for first, later in itertools.product(PRICES, PRICES):
        name = f"reference {first:g}" + ("" if first == later else f" / {later:g}")
        runs.append(Run(name, "reference", Reference(w, capacity, (first, later)).run()))
        print(name, runs[-1].r, flush=True)
    return runs


def readings(
    runs: list[Run], errors: list[float], oracle: float
) -> tuple[list[list[str]], set[int]]:
    """Per error: the floor (best mix over every policy but the oracle) and the same read
    over the reference alone, the old policies alone and exact-only; the runs used."""
    trade = [i for i, run in enumerate(runs) if run.kind != "oracle"]
    groups = [trade] + [
        [i for i in trade if runs[i].kind == k] for k in ("reference", "old", "exact")
    ]
    rows, used = [], set()
    for delta in errors:
        row = [f"{delta:.2%}"]
        for n, group in enumerate(groups):
            got = at_error([runs[i].r for i in group], delta)
            if got is None:
                row += ["none errs that little"] + ([""] * 2 if n == 0 else [])
                continue
            of = [group[i] for i in got.of]
            row.append(f"{got.llm_calls:.3f}")
            if n == 0:
                used.update(of)
                row += [f"{got.correct / oracle:.3f}", " + ".join(runs[i].name for i in of)]
        rows.append(row)
    return rows, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=None, help="sampled pairs (default: all)")
    parser.add_argument("--requests", type=int, default=None, help="default: 60,000 with all")
    parser.add_argument("--capacity", type=float, default=0.8, help="share of the seeded entries")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--section", default="quality-full-floor")
    parser.add_argument(
        "--zerda",
        default="quality-full-bound",
        help="the section of docs/BENCHMARKS.md whose bounded runs' realised errors the floor "
        "is read at too, beside their LLM calls ('' for none)",
    )
    args = parser.parse_args()
    zerda = zerda_points(args.zerda) if args.zerda else []
    at = [error for error, _ in zerda]
    requests = args.requests or (60_000 if args.pairs is None else None)
    w = load_workload(args.pairs, requests, args.seed)
    capacity = int(len(w.seed_ids) * args.capacity)
    runs = policies(w, capacity)
    oracle = runs[0].r["correct"]
    floor_rows, used = readings(runs, list(DELTAS), oracle)
    at_rows, used_at = readings(runs, at, oracle)
    for row, (_, calls) in zip(at_rows, zerda, strict=True):
        row.append(f"{calls:.3f}")
    shown = [
        run for i, run in enumerate(runs)
        if run.kind != "reference" or run.name.count("/") == 0 or i in used | used_at
    ]  # fmt: skip
    intro = (
        f"{len(w.queries):,} requests over {len(w.seed_ids):,} seeded pairs, capacity "
        f"{capacity:,} entries, seed {args.seed}: run.py's stream. "
        + prose((__doc__ or "").split("\n\n")[1:5])
    )
    write_section(args.section, "How few LLM calls a bound can cost (floor.py)",
                  report(intro, shown, oracle, floor_rows, at_rows, args.zerda))  # fmt: skip


def zerda_points(section: str, doc: Path = summary.BENCHMARKS_MD) -> list[tuple[float, float]]:
    """The (realised error, LLM calls per request) of each bounded zerda run of
    ``section`` (``zerda-d1``, ``-d2``, ``-d5``), as its script recorded them in
    docs/BENCHMARKS.md: the floor is read at the errors zerda reached, not at typed ones."""
    found = {s.name: s for s in summary.sections(doc.read_text())}
    if section not in found:
        raise SystemExit(f"docs/BENCHMARKS.md has no section {section!r} (run run.py first)")
    figures = found[section].figures
    points = []
    for key in sorted(figures):
        m = re.fullmatch(r"quality\.[\w-]+\.d(\d+)\.error", key)
        if m and figures.get(key.removesuffix("error") + "llm_calls") is not None:
            points.append(
                (float(figures[key]), float(figures[key.removesuffix("error") + "llm_calls"]))
            )
    if not points:
        raise SystemExit(f"section {section!r} records no bounded run's error and LLM calls")
    return sorted(points)


def prose(paragraphs: list[str]) -> str:
    """The docstring's paragraphs as Markdown: lines unwrapped, a list's items kept."""
    return "\n\n".join(re.sub(r"\n(?!- )\s*", " ", p) for p in paragraphs)


def report(
    intro: str,
    shown: list[Run],
    oracle: float,
    floor_rows: list[list[str]],
    at_rows: list[list[str]],
    zerda: str = "",
) -> str:
    header = ["policy", "hit rate", "LLM calls / request", "verifications", "error rate"]
    rows = [
        [run.name]
        + [f"{run.r[k]:.3f}" for k in ("hit_rate", "llm_calls", "verifications")]
        + [f"{run.r['error']:.2%}", f"{run.r['correct'] / oracle:.3f}" if oracle else "n/a"]
        for run in shown
    ]
    floor_header = ["error", "floor: LLM calls / request", "correct hits / oracle's",
                    "best mix", "reference alone", "old policies alone", "exact only"]  # fmt: skip
    parts = [
        intro,
        table([*header, "correct hits / oracle's"], rows),
        f"The reference ran at the {len(PRICES)}² pairs of prices "
        f"{', '.join(f'{p:g}' for p in PRICES)} "
        "(first ask / later asks); the table shows those of one price and those a "
        "floor below mixes. At a realised error of δ, the best mix of two of all these (one "
        "erring less, one more): the fewest LLM calls a cache pays at δ if it knew every "
        "match and learned of the answers only as a cache can; beside it, the same read "
        "over the reference alone, the old policies alone, and exact-only.",
        table(floor_header, floor_rows),
    ]
    if at_rows:
        parts += [
            f"The same read at the errors zerda realised in its bounded runs (section "
            f"[{zerda}](#{zerda}), read from its recorded figures), beside zerda's LLM calls "
            "there:",
            table([*floor_header, "zerda"], at_rows),
        ]
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
