"""The quality benchmark's own bookkeeping (issue 41): wrong serves caused by verification,
disputed puts, the pace, the replicas and the replay's agreement rules. In the suite's
``testpaths`` (``make test`` runs it); on its own:

    .venv/bin/python -m pytest -q benchmarks/quality/test_quality_bench.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import policies as P  # noqa: E402
import run  # noqa: E402
from _targets import TARGETS  # noqa: E402
from rich.progress import Progress  # noqa: E402
from workload import Answer, Workload  # noqa: E402

from zerda_cache.storage import entry_plans  # noqa: E402
from zerda_cache.testing import RedisServer  # noqa: E402


def tiny(n: int, *, llm_ok: bool = False) -> Workload:
    """Two unrelated questions, the first asked ``n`` times; the LLM always right or
    always wrong; nobody reacts."""
    vecs = np.random.default_rng(0).normal(size=(2, 384)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    return Workload(
        texts=["what is a fox?", "how do I reset my password?"],
        vecs=vecs,
        seed_ids=[0, 1],
        seed_pair=[0, 1],
        queries=[0] * n,
        query_pair=[0] * n,
        pair_label={0: 1, 1: 1},
        planted_wrong=set(),
        stale=set(),
        drift_at=10**9,
        dups={},
        llm_ok=np.full(n, llm_ok),
        reacts=np.zeros(n, bool),
        noisy=np.zeros(n, bool),
    )


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.stop()


def test_verification_blames_exactly_the_puts_that_put_a_wrong_answer_over_a_right_one(
    server: RedisServer,
) -> None:
    """The seeded answer is right, the LLM always wrong: under a bound the question's own
    entry is verified, the first disagreement is a dispute (not stored), a later one
    replaces it. Every put is checked against the rule independently."""
    w = tiny(12)
    pol = P.Zerda(w, 0.8, 10, server.url, 11, max_error_rate=0.02)
    try:
        pol.seed([(0, Answer(0, 0, True, True)), (1, Answer(1, 1, True, True))])
        seen: list[tuple[Any, Answer | None]] = []  # each put's result, the answer compared
        put = pol.m.put

        def watched(*args: Any, **kwargs: Any) -> Any:
            before = dict(pol.answers)
            res = put(*args, **kwargs)
            seen.append((res, before.get(res.compared_id)))
            return res

        pol.m.put = watched  # type: ignore[method-assign]
        progress = Progress(disable=True)
        out = run.drive(pol, w, progress)
        assert pol.verifications > 0, "the scenario no longer verifies: nothing was tested"
        expected = {
            res.entry_id
            for res, compared in seen
            if res.verified is not None
            and res.entry_id is not None
            and compared is not None
            and compared.right
            and not pol.answers[res.entry_id].right
        }
        assert pol.caused == expected
        disputes = sum(
            1 for res, _ in seen if not res.stored and (res.reason or "").startswith("disputed")
        )
        assert out.disputed_puts == pol.disputed == disputes
        assert out.verifications == pol.verifications
        row = out.row()
        assert row["verification_wrong_serves"] <= row["wrong_serves"]
    finally:
        pol.close()


class Stub(P.Policy):
    """Serves a wrong answer every other request; says the verification caused every
    third one; a miss's answer is 'disputed' (counted by the policy, as Zerda does)."""

    name = "stub"

    def __init__(self) -> None:
        self.disputed = 0

    def seed(self, items: list[tuple[int, Answer]]) -> None:
        pass  # an empty cache: every store is a request's

    def lookup(self, text: int, pair: int, t: int) -> tuple[Answer, Any] | None:
        return (Answer(1, 1, True, False), t) if t % 2 == 0 else None

    def store(self, text: int, ans: Answer) -> Any:
        self.disputed += 1
        return None

    def verification_caused(self, handle: Any) -> bool:
        return handle % 3 == 0


def test_drive_counts_wrong_serves_caused_by_verification_and_disputes() -> None:
    w = tiny(12, llm_ok=True)
    out = run.drive(Stub(), w, Progress(disable=True))
    assert out.wrong == 6  # t = 0, 2, ..., 10: another question's answer
    assert out.verification_wrong_serves == 2  # t = 0 and 6
    assert out.disputed_puts == 6
    assert out.row()["verification_wrong_serves"] == 2


class FakeClock:
    """``run.time`` for a test: a clock that only sleeping moves."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_pace_spaces_the_requests_on_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(run, "time", clock)
    w = tiny(21, llm_ok=True)
    out = run.drive(Stub(), w, Progress(disable=True), pace=100.0)
    # each request waits for its place in the schedule: 20 waits of 10 ms
    assert len(clock.sleeps) == 20 and all(s == pytest.approx(0.01) for s in clock.sleeps)
    assert out.pace == 100.0 and out.row()["requests_per_s"] == pytest.approx(105.0)
    unpaced = FakeClock()
    monkeypatch.setattr(run, "time", unpaced)
    run.drive(Stub(), w, Progress(disable=True))
    assert unpaced.sleeps == []


def test_replicas_share_redis_and_a_request_stays_on_the_replica_that_looked_it_up(
    server: RedisServer,
) -> None:
    w = tiny(6, llm_ok=True)
    pol = P.Zerda(w, 0.8, 10, server.url, 11, replicas=3)
    try:
        assert len(pol.replicas) == 3 and len({id(m) for m in pol.replicas}) == 3
        pol.seed([(1, Answer(1, 1, True, True))])
        for t in range(6):
            pol.lookup(0, 0, t)
            assert pol.at is pol.replicas[t % 3]
            pol.store(0, Answer(0, 0, True, False))
            assert pol.at is pol.replicas[t % 3]
        assert pol.resident() == 2  # one entry a question, whichever replica put it
    finally:
        pol.close()


def test_entry_ids_come_from_the_seed_and_the_cache_gets_its_own_back(
    server: RedisServer,
) -> None:
    original = entry_plans.new_entry_id
    ids = []
    for _ in range(2):
        pol = P.Zerda(tiny(1), 0.8, 10, server.url, 11)
        pol.seed([(0, Answer(0, 0, True, True)), (1, Answer(1, 1, True, True))])
        ids.append(sorted(pol.answers))
        assert pol.ids.seeded
        pol.close()
        assert entry_plans.new_entry_id is original
    assert ids[0] == ids[1]


def row(policy: str, error: float, calls: float, pace: float = 100.0, replicas: int = 1,
        **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"policy": policy, "requests": 5_920, "error_rate": error, "hit_rate": 1 - calls,
            "llm_calls_per_request": calls, "pace": pace, "replicas": replicas,
            "requests_per_s": pace or 600.0, **extra}  # fmt: skip


D2, D5 = run.bound_name(0.02), run.bound_name(0.05)


def test_agreement_takes_ten_percent_or_the_sampling_tolerance_for_the_error() -> None:
    rows = [
        row(D2, 0.0030, 0.300),
        row(D2, 0.0040, 0.320, pace=1000.0),  # 25% apart, 0.1 point: within tolerance
        row(D2, 0.0030, 0.340, replicas=3),  # LLM calls 11.8% apart
        row(D5, 0.0300, 0.300),
        row(D5, 0.0420, 0.300, pace=1000.0),  # 1.2 points: beyond the tolerance (0.47)
        row(D5, 0.0310, 0.310),  # the control
    ]
    found = {(c.delta, c.kind): c for c in run.comparisons(rows)}
    assert set(found) == {(0.02, "speed-1000"), (0.02, "replicas-3"), (0.05, "speed-1000"),
                          (0.05, "repeat")}  # fmt: skip
    speed2 = found[(0.02, "speed-1000")]
    assert speed2.error_apart == pytest.approx(0.25)
    assert (speed2.error_agrees() or "").startswith("within the tolerance")
    assert speed2.met()
    assert not found[(0.02, "replicas-3")].met()  # the LLM calls
    assert found[(0.05, "speed-1000")].error_agrees() is None
    assert found[(0.05, "repeat")].control
    table, out = run.replay_targets(rows, {})
    assert "(noise)" in table and "within the tolerance" in table
    figures = run.replay_figures({"dataset": "fow", "rows": rows, "targets": out})
    assert figures["quality.replay.comparisons"] == 3  # the control is not judged
    assert figures["quality.replay.calls_apart"] == pytest.approx(0.04 / 0.34)
    assert figures["quality.replay.error_disagreements"] == 1
    assert "quality.fow-replay.d5.repeat.calls_apart" in figures
    replay = next(t for t in TARGETS if "1x and 10x" in t.what)
    assert set(replay.keys) <= set(figures)
    shown, met = replay.judge(figures)
    assert not met and "1 beyond its tolerance" in shown


def test_every_bounded_run_is_held_to_the_verification_share() -> None:
    rows = [
        row(D2, 0.003, 0.3, verification_wrong_serves=1, wrong_serves=20, disputed_puts=4),
        row(D5, 0.03, 0.3, verification_wrong_serves=3, wrong_serves=20, disputed_puts=9),
        row(run.ZERDA, 0.05, 0.2, verification_wrong_serves=0, wrong_serves=300),
    ]
    line, worst = run.verification_target(rows) or ([], 0.0)
    assert worst == pytest.approx(0.15)
    assert line[-1] == "**not met**" and "1 of 20 (5.0%)" in line[2]
    figures = run.replay_figures({"dataset": "fow", "rows": rows})
    shares = next(t for t in TARGETS if t.keys == ("quality.verification_wrong_share",))
    assert shares.judge(figures) == ("15.0%", False)
    assert run.verification_target([row(run.ZERDA, 0.05, 0.2)]) is None


def test_the_floor_policies_pay_for_answers_only() -> None:
    import dataclasses

    import floor

    w = dataclasses.replace(tiny(10, llm_ok=True), planted_wrong={0})
    # the seeded answer to question 0 is wrong: serving blind errs on every request,
    # verifying first pays an LLM call, replaces it with the fresh (right) answer, whose
    # next request verifies it too (nobody reacts here), then serves it
    blind = floor.simulate(w, 10, "blind")
    first = floor.simulate(w, 10, "verify first")
    oracle = floor.simulate(w, 10, "oracle")
    assert (blind["hit_rate"], blind["error"], blind["llm_calls"]) == (1.0, 1.0, 0.0)
    assert first["error"] == 0.0 and first["verifications"] == 0.2
    assert first["hit_rate"] == 0.8 and first["llm_calls"] == 0.2
    assert oracle["error"] == 0.0 and oracle["correct"] == 0.9  # a miss, then its answer
    points = [
        {"error": 0.01, "llm_calls": 0.5, "correct": 0.4},
        {"error": 0.03, "llm_calls": 0.3, "correct": 0.6},
        {"error": 0.02, "llm_calls": 0.45, "correct": 0.5},
    ]
    mix = floor.at_error(points, 0.02)
    assert mix is not None and mix.llm_calls == pytest.approx(0.4)  # beats 0.45
    assert mix.of == (0, 1) and mix.correct == pytest.approx(0.5)
    assert floor.at_error(points, 0.005) is None
    assert floor.at_error(points, 0.05) == floor.Reading(0.3, 0.6, (1,))


def stream(
    queries: list[int], *, seeded: tuple[int, ...] = (0,), dups: dict[int, set[int]] | None = None,
    **outcomes: Any,
) -> Workload:  # fmt: skip
    """Seeded answers for the questions ``seeded`` (pair = text), the requests asking
    ``queries``; ``outcomes``: any field of the workload (by default the LLM is always
    right, nobody reacts, nothing is planted and nothing goes stale)."""
    n = len(queries)
    fields: dict[str, Any] = {
        "planted_wrong": set(), "stale": set(), "drift_at": 10**9,
        "llm_ok": np.ones(n, bool), "reacts": np.zeros(n, bool), "noisy": np.zeros(n, bool),
    }  # fmt: skip
    fields.update({k: np.asarray(v) if k in ("llm_ok", "reacts", "noisy") else v
                   for k, v in outcomes.items()})  # fmt: skip
    pairs = {**{q: q for q in queries}, **dict.fromkeys(seeded, 0)}
    return Workload(
        texts=[f"q{i}" for i in range(max([*queries, *seeded]) + 1)],
        vecs=np.zeros((1, 1), np.float32),
        seed_ids=list(seeded),
        seed_pair=[0] * len(seeded),
        queries=queries,
        query_pair=[pairs[q] for q in queries],
        pair_label={0: 1},
        dups=dups or {},
        **fields,
    )


def test_a_negative_reaction_demotes_an_answer_the_reference_served() -> None:
    import floor

    # the seeded answer (wrong) is served blind at the price 5 (P(wrong) 0.1); the user
    # says so, P(right) falls to 0.5 and the next ask verifies it; blind serves it again
    w = stream([0, 0], planted_wrong={0}, reacts=[True, False])
    ref = floor.Reference(w, 10, (5.0, 5.0)).run()
    assert (ref["hit_rate"], ref["error"], ref["verifications"]) == (0.5, 0.5, 0.5)
    assert floor.simulate(w, 10, "blind")["error"] == 1.0
    # a negative reaction to the LLM's own answer (P(right) 0.95 -> 0.68): verified next
    for liked, calls in ((False, 1.0), (True, 0.5)):
        fresh = stream([3, 3], llm_ok=[liked, True], reacts=[True, False])
        assert floor.Reference(fresh, 10, (5.0, 5.0)).run()["llm_calls"] == calls


def test_an_agreement_refreshes_the_entry_to_the_fresh_answer() -> None:
    import floor

    # question 1 asks what the seeded question 0 asked; the seeded answer is right until
    # it goes stale at request 2. An agreement at request 0 keeps the LLM's answer, which
    # cannot go stale; verify first keeps the seeded one and serves it stale
    w = stream([1] * 5, dups={0: {1}, 1: {0}}, stale={0}, drift_at=2)
    ref = floor.Reference(w, 10, (15.0, 15.0)).run()
    assert (ref["llm_calls"], ref["verifications"], ref["error"]) == (0.2, 0.2, 0.0)
    assert floor.simulate(w, 10, "verify first")["error"] == 0.6
    # the seeded answer is wrong: a disagreement keeps both answers as candidates and the
    # next ask verifies the likelier right, the LLM's (0.95 * 0.1 against 0.9 * 0.05); it
    # agrees, so its rival was wrong and goes; the next two asks are served
    w = stream([1] * 4, dups={0: {1}, 1: {0}}, planted_wrong={0})
    got = floor.Reference(w, 10, (15.0, 15.0))
    assert got.run()["verifications"] == 0.5
    assert [b.p for b in got.st.items.values()] == [1.0]


def test_exact_only_serves_only_the_question_asked_and_drops_what_a_user_disliked() -> None:
    import floor

    # the seeded question 0 is a duplicate of the asked 1: the reference serves its answer
    # (a perfect match model); exact-only asks the LLM, then serves that answer until a
    # (noisy) negative reaction drops it
    w = stream([1, 1, 1, 1], dups={0: {1}, 1: {0}}, reacts=[0, 1, 0, 0], noisy=[0, 1, 0, 0])
    exact = floor.exact_only(w, 10)
    assert (exact["llm_calls"], exact["hit_rate"], exact["error"]) == (0.5, 0.5, 0.0)
    quiet = stream([1, 1, 1, 1], dups={0: {1}, 1: {0}})
    assert floor.Reference(quiet, 10, (5.0, 5.0)).run()["hit_rate"] == 1.0
    assert floor.exact_only(quiet, 10)["llm_calls"] == 0.25
    # an LLM answer the user disliked is not cached
    w = stream([2, 2], llm_ok=[False, True], reacts=[True, False])
    assert floor.exact_only(w, 10)["llm_calls"] == 1.0


def synthetic(n_pairs: int, n_requests: int, seed: int) -> Workload:
    """load_workload's stream on made-up pairs (question i seeded, n_pairs + i asked, a
    duplicate for 37% of them): Zipf asks, planted and stale answers, drawn outcomes."""
    from workload import LLM_RIGHT, REACTION_NOISE, REACTION_RATE, ZIPF_S

    rng = np.random.default_rng(seed)
    dup = rng.random(n_pairs) < 0.37
    weights = 1.0 / np.arange(1, n_pairs + 1) ** ZIPF_S
    asked = rng.choice(n_pairs, n_requests, p=weights[rng.permutation(n_pairs)] / weights.sum())
    planted = set(rng.choice(n_pairs, n_pairs // 10, replace=False).tolist())
    pool = [i for i in range(n_pairs) if dup[i] and i not in planted]
    draws = rng.random((3, n_requests))
    return Workload(
        texts=[f"q{i}" for i in range(2 * n_pairs)], vecs=np.zeros((1, 1), np.float32),
        seed_ids=list(range(n_pairs)), seed_pair=list(range(n_pairs)),
        queries=[n_pairs + int(i) for i in asked], query_pair=[int(i) for i in asked],
        pair_label={i: int(dup[i]) for i in range(n_pairs)}, planted_wrong=planted,
        stale=set(rng.choice(pool, len(pool) // 5, replace=False).tolist()),
        drift_at=n_requests // 2,
        dups={k: {v} for i in np.flatnonzero(dup) for k, v in ((i, n_pairs + i), (n_pairs + i, i))},
        llm_ok=draws[0] < LLM_RIGHT, reacts=draws[1] < REACTION_RATE,
        noisy=draws[2] < REACTION_NOISE,
    )  # fmt: skip


def test_the_reference_pays_no_more_than_the_old_policies_at_any_error() -> None:
    import floor

    w = synthetic(300, 3000, 5)
    runs = floor.policies(w, 240)
    kinds = {run.kind for run in runs}
    assert kinds == {"oracle", "old", "exact", "reference"}
    rows, _ = floor.readings(runs, [0.005, 0.01, 0.02, 0.05], runs[0].r["correct"])
    for row in rows:  # error, floor, correct, best mix, reference, old, exact
        assert row[5] == "none errs that little" or float(row[4]) <= float(row[5]), row
        assert float(row[1]) <= float(row[4]) and 0 < float(row[2]) <= 1, row
    assert rows[1][4] < rows[1][5]  # at 1%: strictly fewer calls


def test_the_floor_is_read_at_the_errors_zerda_recorded(tmp_path: Path) -> None:
    """floor.py takes zerda's realised errors and LLM calls from the figures run.py
    recorded in its section, not from numbers typed on the command line."""
    import floor

    figures = {
        "quality.qqp-full.d2.error": 0.0128,
        "quality.qqp-full.d2.llm_calls": 0.569,
        "quality.qqp-full.d1.error": 0.0026,
        "quality.qqp-full.d1.llm_calls": 0.616,
        "quality.qqp-full.d5.error": 0.0233,
        "quality.qqp-full.d5.llm_calls": None,  # a run without its calls is left out
        "quality.qqp-full.d2.hits": 0.43,
    }
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(
        "<!-- section:quality-full-bound -->\n## Bounded\n\n"
        + f"<!-- figures {json.dumps(figures)} -->\n<!-- /section:quality-full-bound -->\n"
    )
    assert floor.zerda_points("quality-full-bound", page) == [(0.0026, 0.616), (0.0128, 0.569)]
    with pytest.raises(SystemExit, match="no section"):
        floor.zerda_points("quality-other", page)
