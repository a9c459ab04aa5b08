"""How few LLM calls an error bound can cost a cache that cannot tell a wrong answer from
a right one without asking the LLM, on ``run.py``'s stream (the same workload, seed and
capacity: ``--full`` by default, every QQP pair, 60,000 requests).

The policies here are not caches anyone could build: they *know which cached question
matches* the one asked (the labels: a perfect match model), so every cost they pay comes
from the answers alone: a tenth of the seeded answers planted wrong, the LLM's mistakes,
the answers gone stale at the drift. What they do not know is whether a cached answer is
right, as no cache does; they learn it as a cache can: a verification (an LLM call whose
fresh answer agrees with the cached one), or a user's positive reaction to the answer when
it was fresh (noisy, as in the benchmark).

- ``oracle``: knows the answers too (run.py's upper bound);
- ``blind``: serves every matching cached answer;
- ``verify first``: verifies a matching answer before serving it the first time (and
  after a negative reaction);
- ``blind share b``: as ``verify first``, but serves a share ``b`` of the answers
  unverified (a seeded draw per entry): the trade between the two;
- ``blind fresh b``: as ``verify first``, but serves a share ``b`` of the answers the
  LLM gave (wrong one time in twenty) unverified, and verifies every seeded one (wrong
  one time in ten) first.

Their LLM calls at a realised error of δ (the best mix of two of them) are a floor for a
learned policy at δ: a cache with an imperfect match model pays more. (A floor for these
policies and their mixes, not a proof for every policy: one that picked better which
answers to trust unverified would pay less.)

    .venv/bin/python benchmarks/quality/floor.py            # docs: "quality-full-floor"
    .venv/bin/python benchmarks/quality/floor.py --pairs 4000 --section quality-floor
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0]))
sys.path.insert(0, str(HERE))

from _report import table, write_section  # noqa: E402
from workload import Answer, Workload, is_right, load_workload, reaction  # noqa: E402

SHARES = (0.1, 0.2, 0.3, 0.5)
FRESH_SHARES = (0.5, 1.0)
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
    n = len(w.queries)
    return {
        "hit_rate": hits / n,
        "error": wrong / n,
        "llm_calls": calls / n,
        "verifications": verifications / n,
        "correct": (hits - wrong) / n,
    }


def at_error(points: list[dict[str, float]], delta: float) -> dict[str, float] | None:
    """The fewest LLM calls (and the correct hits there) at realised error ``delta``, over
    every mix of two policies of the trade, one erring less and one more (interpolated:
    a cache could take each for a share of the requests); None when none errs that
    little. With none erring more, the least calls of those erring less."""
    under = [r for r in points if r["error"] <= delta]
    if not under:
        return None
    best = min(under, key=lambda r: r["llm_calls"])
    out = {k: best[k] for k in ("llm_calls", "correct")}
    for lo, hi in itertools.product(under, [r for r in points if r["error"] > delta]):
        f = (delta - lo["error"]) / (hi["error"] - lo["error"])
        mix = {k: lo[k] + f * (hi[k] - lo[k]) for k in ("llm_calls", "correct")}
        if mix["llm_calls"] < out["llm_calls"]:
            out = mix
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=None, help="sampled pairs (default: all)")
    parser.add_argument("--requests", type=int, default=None, help="default: 60,000 with all")
    parser.add_argument("--capacity", type=float, default=0.8, help="share of the seeded entries")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--section", default="quality-full-floor")
    args = parser.parse_args()
    requests = args.requests or (60_000 if args.pairs is None else None)
    w = load_workload(args.pairs, requests, args.seed)
    capacity = int(len(w.seed_ids) * args.capacity)
    runs = [("oracle", 0.0), ("blind", 0.0), ("verify first", 0.0)]
    runs += [("blind share", s) for s in SHARES]
    runs += [("blind fresh", s) for s in FRESH_SHARES]
    rows: list[list[str]] = []
    trade: list[dict[str, float]] = []
    oracle = 0.0
    for mode, share in runs:
        r = simulate(w, capacity, mode, share)
        oracle = r["correct"] if mode == "oracle" else oracle
        if mode != "oracle":
            trade.append(r)
        name = f"{mode} {share:.1f}" if mode.startswith("blind ") else mode
        rows.append(
            [name]
            + [f"{r[k]:.3f}" for k in ("hit_rate", "llm_calls", "verifications")]
            + [f"{r['error']:.2%}", f"{r['correct'] / oracle:.3f}" if oracle else "n/a"]
        )
        print(rows[-1], flush=True)
    floor_rows = []
    for delta in DELTAS:
        got = at_error(trade, delta)
        floor_rows.append(
            [f"{delta:.0%}"]
            + (
                ["none errs that little", ""]
                if got is None
                else [f"{got['llm_calls']:.3f}", f"{got['correct'] / oracle:.3f}"]
            )
        )
    header = ["policy (knows every match)", "hit rate", "LLM calls / request", "verifications"]
    body = "\n\n".join(
        [
            f"{len(w.queries):,} requests over {len(w.seed_ids):,} seeded pairs, capacity "
            f"{capacity:,} entries, seed {args.seed}: run.py's stream. "
            + (__doc__ or "").split("\n\n")[1].replace("\n", " "),
            table([*header, "error rate", "correct hits / oracle's"], rows),
            "At a realised error of δ, the best mix of two of these (one erring less, one "
            "more): the fewest LLM calls a cache pays at δ if it knew every match and "
            "nothing more of the answers.",
            table(["δ", "LLM calls / request", "correct hits / oracle's"], floor_rows),
        ]
    )
    write_section(args.section, "How few LLM calls a bound can cost (floor.py)", body)


if __name__ == "__main__":
    main()
