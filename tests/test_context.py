"""The context companion modules (seed page ``context-guard-and-learning``); no Redis.

One test per numbered step of ``ContextGuard.validate`` and ``suggest_budget``, each of the
page's examples, the documented defects' fixes, a model-based test of ``ContextCache``
against a reference LRU+TTL model, and a 16-thread test of the guard and the cache.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from zerda_cache.companions.context import (
    AdaptiveLearningSystem,
    BudgetAllocationStrategy,
    ComplexityBasedAllocation,
    ContextCache,
    ContextEngineConfig,
    ContextGuard,
    ContextGuardStrategy,
    EqualBudgetAllocation,
    GuardAdmission,
    GuardConfig,
    QueryAnalysis,
    QueryComplexity,
    RuleBasedQueryAnalyzer,
    WeightedBudgetAllocation,
    guard_admission,
)
from zerda_cache.companions.context.guard import EMPTY_WARNING, RELEVANCE_PREFIX_CHARS
from zerda_cache.manager import AdmissionCheck

GUARD_LOGGER = "zerda_cache.companions.context.guard"
ANALYSIS = QueryAnalysis(query="q", complexity=QueryComplexity.LOW, context_budget=1000)
LONG_TEXT = "Redis keeps the cache in memory. [Source: 1] " * 3


def make_guard(embed_fn: Callable[[str], Any] | None = None, **guard_fields: Any) -> ContextGuard:
    return ContextGuard(ContextEngineConfig(guard=GuardConfig(**guard_fields)), embed_fn=embed_fn)


def vector_embed(vectors: dict[str, list[float]], default: list[float]) -> Callable[[str], Any]:
    """An embed_fn that maps known texts to fixed vectors (and records what it saw)."""
    seen: list[str] = []

    def embed(text: str) -> Any:
        seen.append(text)
        return np.asarray(vectors.get(text, default), dtype=np.float32)

    embed.seen = seen  # type: ignore[attr-defined]
    return embed


# -- types ------------------------------------------------------------------------------------


def test_guard_config_defaults() -> None:
    cfg = GuardConfig()
    assert cfg.enabled and cfg.check_empty
    assert cfg.min_context_length == 1
    assert cfg.max_context_length == 32_000
    assert not cfg.check_source_coverage
    assert not cfg.check_relevance
    assert cfg.relevance_threshold == 0.3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enabled", 1),
        ("check_empty", "yes"),
        ("check_source_coverage", None),
        ("check_relevance", 0),
        ("min_context_length", -1),
        ("min_context_length", 2.5),
        ("min_context_length", True),
        ("max_context_length", 0),
        ("relevance_threshold", 1.5),
        ("relevance_threshold", float("nan")),
        ("relevance_threshold", "0.3"),
    ],
)
def test_guard_config_rejects_bad_values_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        GuardConfig(**{field: value})


def test_guard_config_max_below_min_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_context_length"):
        GuardConfig(min_context_length=100, max_context_length=50)


def test_engine_config_validates_budgets_and_guard() -> None:
    for name in ("low_budget", "medium_budget", "high_budget"):
        with pytest.raises(ValueError, match=name):
            ContextEngineConfig(**{name: 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="enable_adaptive"):
        ContextEngineConfig(enable_adaptive="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="guard"):
        ContextEngineConfig(guard={"enabled": True})  # type: ignore[arg-type]


def test_config_mutated_after_construction_is_checked_by_the_guard() -> None:
    cfg = ContextEngineConfig()
    cfg.guard.min_context_length = -5  # the seed's configs are mutable
    with pytest.raises(ValueError, match="min_context_length"):
        ContextGuard(cfg)


def test_query_analysis_validation() -> None:
    with pytest.raises(ValueError, match="context_budget"):
        QueryAnalysis(query="q", complexity=QueryComplexity.LOW, context_budget=-1)
    with pytest.raises(ValueError, match="complexity"):
        QueryAnalysis(query="q", complexity="low", context_budget=1)  # type: ignore[arg-type]


def test_abstract_bases() -> None:
    assert isinstance(make_guard(), ContextGuardStrategy)
    for cls in (EqualBudgetAllocation, ComplexityBasedAllocation):
        assert isinstance(cls(), BudgetAllocationStrategy)
    assert isinstance(WeightedBudgetAllocation([1.0]), BudgetAllocationStrategy)
    with pytest.raises(TypeError):
        ContextGuardStrategy()  # type: ignore[abstract]


# -- analyzer ---------------------------------------------------------------------------------


def test_analyzer_rules() -> None:
    analyzer = RuleBasedQueryAnalyzer()
    low = analyzer.analyze("What is RAG?")
    assert low.complexity is QueryComplexity.LOW
    assert low.context_budget == 1000
    assert low.is_question and low.word_count == 3
    medium = analyzer.analyze("How does caching work")  # a reasoning cue
    assert medium.complexity is QueryComplexity.MEDIUM and medium.reasoning_cues == ("how",)
    assert medium.context_budget == 2000 and medium.is_question
    assert analyzer.analyze("list the eight planets of the solar system").complexity is (
        QueryComplexity.MEDIUM
    )
    cue_long = analyzer.analyze(
        "Compare Redis and Memcached for a cache shared by many replicas of one app"
    )
    assert cue_long.complexity is QueryComplexity.HIGH and cue_long.context_budget == 4000
    assert analyzer.analyze(" ".join(["word"] * 21)).complexity is QueryComplexity.HIGH
    assert analyzer.analyze("Is it up? Is it fast?").complexity is QueryComplexity.HIGH
    assert analyzer.analyze("Neden önbellek gerekli?").complexity is QueryComplexity.MEDIUM
    empty = analyzer.analyze("")
    assert empty.complexity is QueryComplexity.LOW and not empty.is_question


def test_analyzer_uses_config_budgets() -> None:
    analyzer = RuleBasedQueryAnalyzer(ContextEngineConfig(low_budget=111))
    assert analyzer.analyze("hi").context_budget == 111


# -- ContextGuard.validate: one test per step --------------------------------------------------


def test_validate_step1_disabled_returns_at_once() -> None:
    embed = vector_embed({}, [1.0, 0.0])
    guard = make_guard(
        embed, enabled=False, min_context_length=100, check_source_coverage=True,
        check_relevance=True,
    )  # fmt: skip
    assert guard.validate("", "q", ANALYSIS) == (True, [])  # not even the empty check
    assert guard.validate("short", "q", ANALYSIS) == (True, [])
    assert embed.seen == []  # type: ignore[attr-defined]


def test_validate_step2_empty_short_circuits(caplog: pytest.LogCaptureFixture) -> None:
    embed = vector_embed({}, [1.0, 0.0])
    guard = make_guard(
        embed, min_context_length=100, check_source_coverage=True, check_relevance=True
    )
    for blank in ("", "   \n\t"):
        assert guard.validate(blank, "q", ANALYSIS) == (False, [EMPTY_WARNING])
    assert EMPTY_WARNING == "context is empty ⚠"
    assert embed.seen == []  # type: ignore[attr-defined]  # no later step ran
    # check_empty=False: a blank context goes on to the other checks.
    guard = make_guard(check_empty=False, min_context_length=1)
    passed, warnings = guard.validate("", "q", ANALYSIS)
    assert not passed and warnings == ["context too short (0 < 1 chars) ⚠"]


def test_validate_step3_too_short_fails_but_continues() -> None:
    guard = make_guard(min_context_length=50, check_source_coverage=True)
    passed, warnings = guard.validate("tiny", "q", ANALYSIS)
    assert not passed
    assert warnings[0] == "context too short (4 < 50 chars) ⚠"
    assert len(warnings) == 2 and "source" in warnings[1]  # step 5 still ran
    assert make_guard(min_context_length=4).validate("tiny", "q", ANALYSIS) == (True, [])


def test_validate_step4_too_long_only_warns() -> None:
    guard = make_guard(max_context_length=10)
    passed, warnings = guard.validate("x" * 11, "q", ANALYSIS)
    assert passed
    assert warnings == ["context too long (11 > 10 chars) ⚠"]
    assert guard.validate("x" * 10, "q", ANALYSIS) == (True, [])


@pytest.mark.parametrize(
    ("context", "has_source"),
    [
        ("Answer. [Source: doc1]", True),
        ("Answer. [source: doc1]", True),
        ("chunk one\n---\nchunk two", True),
        ("Answer without any marker.", False),
        ("Answer. [note: not a source]", False),  # the seed's regex matched this
        ("Answer. [: bare bracket-colon]", False),  # and this
        ("Answer. [SOURCE: upper]", False),
        ("Answer. (Source: parenthesised)", False),
    ],
)
def test_validate_step5_source_coverage_only_warns(context: str, has_source: bool) -> None:
    guard = make_guard(check_source_coverage=True)
    passed, warnings = guard.validate(context, "q", ANALYSIS)
    assert passed
    assert warnings == (
        [] if has_source else ["context has no source markers ([Source: ...] or ---) ⚠"]
    )
    assert make_guard().validate(context, "q", ANALYSIS) == (True, [])  # off by default


def test_validate_step6_relevance_runs_with_embed_fn() -> None:
    embed = vector_embed({"q": [1.0, 0.0], "related": [0.9, 0.1]}, [0.0, 1.0])
    guard = make_guard(embed, check_relevance=True, relevance_threshold=0.5)
    assert guard.relevance_active
    assert guard.validate("related", "q", ANALYSIS) == (True, [])
    passed, warnings = guard.validate("unrelated", "q", ANALYSIS)
    assert not passed
    assert warnings == ["context relevance 0.000 below threshold 0.500 ⚠"]
    # Relevance off: embed_fn is never called.
    embed_off = vector_embed({}, [1.0])
    assert make_guard(embed_off).validate("x", "q", ANALYSIS) == (True, [])
    assert embed_off.seen == []  # type: ignore[attr-defined]


def test_validate_step6_relevance_embeds_first_512_chars() -> None:
    embed = vector_embed({}, [1.0, 1.0])
    guard = make_guard(embed, check_relevance=True)
    context = "a" * 400 + "b" * 400
    assert guard.validate(context, "the query", ANALYSIS) == (True, [])
    assert embed.seen == ["the query", context[:RELEVANCE_PREFIX_CHARS]]  # type: ignore[attr-defined]
    assert RELEVANCE_PREFIX_CHARS == 512


def test_validate_step6_without_embed_fn_warns_once_at_construction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger=GUARD_LOGGER):
        guard = make_guard(check_relevance=True)
        construction = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(construction) == 1
        assert "no embed_fn" in construction[0].getMessage()
        assert not guard.relevance_active
        caplog.clear()
        for _ in range(3):
            assert guard.validate("some context", "q", ANALYSIS) == (True, [])
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # only once
    # No warning when relevance is off, or when the guard is disabled.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=GUARD_LOGGER):
        make_guard()
        make_guard(enabled=False, check_relevance=True)
    assert not caplog.records


def test_validate_step6_embedding_failure_passes_warns_and_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(text: str) -> Any:
        raise RuntimeError("embedding service down")

    guard = make_guard(broken, check_relevance=True)
    with caplog.at_level(logging.WARNING, logger=GUARD_LOGGER):
        assert guard.validate("some context", "q", ANALYSIS) == (True, [])
    assert guard.embedding_failures == 1
    assert any("embedding failed" in r.getMessage() for r in caplog.records)
    # A zero vector or mismatched shapes count as failures too.
    zero = make_guard(lambda t: np.zeros(3), check_relevance=True)
    assert zero.validate("ctx", "q", ANALYSIS) == (True, [])
    assert zero.embedding_failures == 1
    mismatch = make_guard(lambda t: np.ones(2 if t == "q" else 3), check_relevance=True)
    assert mismatch.validate("ctx", "q", ANALYSIS) == (True, [])
    assert mismatch.embedding_failures == 1


def test_validate_step7_logs_all_warnings_together(caplog: pytest.LogCaptureFixture) -> None:
    guard = make_guard(min_context_length=50, max_context_length=60, check_source_coverage=True)
    with caplog.at_level(logging.DEBUG, logger=GUARD_LOGGER):
        passed, warnings = guard.validate("tiny", "q", ANALYSIS)
    assert not passed and len(warnings) == 2
    records = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(records) == 1
    assert all(w in records[0].getMessage() for w in warnings)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=GUARD_LOGGER):
        assert make_guard().validate("fine", "q", ANALYSIS) == (True, [])
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_validate_ignores_analysis() -> None:
    guard = make_guard(min_context_length=10)
    other = QueryAnalysis(query="x", complexity=QueryComplexity.HIGH, context_budget=1)
    assert guard.validate("short", "q", ANALYSIS) == guard.validate("short", "q", other)


def test_guard_as_admission_check() -> None:
    guard = make_guard(min_context_length=3)
    admission = guard.as_admission()
    assert isinstance(admission, GuardAdmission)
    check: AdmissionCheck = admission  # satisfies the manager's protocol
    assert check("What is RAG?", "", {}) == (False, [EMPTY_WARNING])
    assert check("What is RAG?", "ok", {}) == (False, ["context too short (2 < 3 chars) ⚠"])
    assert check("What is RAG?", "Retrieval-augmented generation.", {"k": 1}) == (True, [])
    assert guard_admission(guard)("q", "Paris.", {}) == (True, [])
    # The default config admits a short answer.
    assert make_guard().as_admission()("Capital of France?", "Paris", {}) == (True, [])


# -- AdaptiveLearningSystem --------------------------------------------------------------------


def record_n(system: AdaptiveLearningSystem, n: int, length: int = 300, ok: bool = True) -> None:
    for i in range(n):
        system.record("q", ANALYSIS, length, 3, 10.0 + i, ok)


def test_adaptive_windows_are_bounded() -> None:
    system = AdaptiveLearningSystem(ContextEngineConfig())
    assert AdaptiveLearningSystem.WINDOW == 100
    record_n(system, 150)
    report = system.get_performance_report()
    assert report["total_queries"] == 150
    assert report["samples"] == 100
    assert report["avg_response_ms"] == pytest.approx(sum(10.0 + i for i in range(50, 150)) / 100)


def test_adaptive_record_is_a_no_op_when_disabled() -> None:
    system = AdaptiveLearningSystem(ContextEngineConfig(enable_adaptive=False))
    record_n(system, 30, length=10)
    assert system.get_performance_report() == {
        "avg_response_ms": 0.0,
        "avg_context_length": 0.0,
        "avg_chunk_count": 0.0,
        "guard_failure_rate": 0.0,
        "total_queries": 0,
        "samples": 0,
    }
    assert system.suggest_budget(ANALYSIS) == ANALYSIS.context_budget


def test_adaptive_auto_tune_every_20th_record(monkeypatch: pytest.MonkeyPatch) -> None:
    system = AdaptiveLearningSystem(ContextEngineConfig())
    calls: list[int] = []
    monkeypatch.setattr(system, "_auto_tune", lambda: calls.append(1))
    record_n(system, 59)
    assert len(calls) == 2
    record_n(system, 1)
    assert len(calls) == 3


def test_adaptive_auto_tune_only_logs(caplog: pytest.LogCaptureFixture) -> None:
    cfg = ContextEngineConfig()
    system = AdaptiveLearningSystem(cfg)
    record_n(system, 19, ok=False)
    before = (system.get_performance_report(), repr(cfg))
    with caplog.at_level(logging.INFO, logger="zerda_cache.companions.context.adaptive"):
        record_n(system, 1, ok=False)  # the 20th
    assert caplog.records and all(r.levelno == logging.INFO for r in caplog.records)
    assert "guard failures are high" in caplog.text
    after = system.get_performance_report()
    assert after["total_queries"] == before[0]["total_queries"] + 1  # only the record itself
    assert repr(cfg) == before[1]


def test_adaptive_report_fields() -> None:
    system = AdaptiveLearningSystem(ContextEngineConfig())
    system.record("q", ANALYSIS, 100, 2, 50.0, True)
    system.record("q", ANALYSIS, 300, 4, 150.0, False)
    assert system.get_performance_report() == {
        "avg_response_ms": 100.0,
        "avg_context_length": 200.0,
        "avg_chunk_count": 3.0,
        "guard_failure_rate": 0.5,
        "total_queries": 2,
        "samples": 2,
    }


def test_suggest_budget_step1_base_is_the_analysis_budget() -> None:
    system = AdaptiveLearningSystem(ContextEngineConfig())
    analysis = QueryAnalysis(query="q", complexity=QueryComplexity.MEDIUM, context_budget=777)
    assert system.suggest_budget(analysis) == 777


def test_suggest_budget_step2_needs_10_samples_and_adaptive_on() -> None:
    system = AdaptiveLearningSystem(ContextEngineConfig())
    record_n(system, 9, length=10)
    assert system.suggest_budget(ANALYSIS) == 1000
    record_n(system, 1, length=10)
    assert system.suggest_budget(ANALYSIS) == 200  # now it adapts
    system.config.enable_adaptive = False
    assert system.suggest_budget(ANALYSIS) == 1000


def test_suggest_budget_step3_shrinks_with_margin_and_floor() -> None:
    system = AdaptiveLearningSystem(ContextEngineConfig())
    record_n(system, 10, length=400)  # 400 < 1000 * 0.5
    assert system.suggest_budget(ANALYSIS) == 520  # int(400 * 1.3)
    small = AdaptiveLearningSystem(ContextEngineConfig())
    record_n(small, 10, length=100)
    assert small.suggest_budget(ANALYSIS) == 200  # max(130, 200)


def test_suggest_budget_step4_otherwise_unchanged_never_grows() -> None:
    system = AdaptiveLearningSystem(ContextEngineConfig())
    record_n(system, 10, length=500)  # exactly half: not below
    assert system.suggest_budget(ANALYSIS) == 1000
    record_n(system, 100, length=5000)  # far above the budget: still the base
    assert system.suggest_budget(ANALYSIS) == 1000


# -- budget allocation -------------------------------------------------------------------------


def test_equal_allocation_remainder_to_first() -> None:
    equal = EqualBudgetAllocation()
    assert equal.allocate(1000, 3) == [334, 333, 333]
    assert equal.allocate(900, 3) == [300, 300, 300]
    assert equal.allocate(1000, 0) == []
    assert equal.allocate(1000, -2) == []


def test_weighted_allocation() -> None:
    assert WeightedBudgetAllocation([1.0, 2.0, 3.0]).allocate(1000, 3) == [167, 333, 500]
    assert WeightedBudgetAllocation([1.0, 99.0]).allocate(50, 2) == [1, 49]  # floor at 1
    assert WeightedBudgetAllocation([]).allocate(100, 0) == []
    with pytest.raises(ValueError, match="sum to a positive"):
        WeightedBudgetAllocation([0.0, 0.0]).allocate(100, 2)
    with pytest.raises(ValueError, match=">= 0"):
        WeightedBudgetAllocation([1.0, -1.0])
    with pytest.raises(ValueError, match="finite"):
        WeightedBudgetAllocation([float("inf")])


def test_complexity_allocation_weights() -> None:
    analyses = [
        QueryAnalysis(query=c.value, complexity=c, context_budget=1) for c in QueryComplexity
    ]
    assert ComplexityBasedAllocation().allocate(5000, 3, analyses) == [1000, 1500, 2500]
    assert ComplexityBasedAllocation._COMPLEXITY_WEIGHTS == {
        QueryComplexity.LOW: 1.0,
        QueryComplexity.MEDIUM: 1.5,
        QueryComplexity.HIGH: 2.5,
    }


def test_complexity_allocation_fallback_warns(caplog: pytest.LogCaptureFixture) -> None:
    alloc = ComplexityBasedAllocation()
    with caplog.at_level(logging.WARNING, logger="zerda_cache.companions.context.budget"):
        assert alloc.allocate(1000, 3) == [334, 333, 333]
        assert alloc.allocate(1000, 3, [ANALYSIS]) == [334, 333, 333]
    assert len(caplog.records) == 2
    assert all("equal split" in r.getMessage() for r in caplog.records)


# -- the page's examples -----------------------------------------------------------------------


def test_example1_basic_guard() -> None:
    guard = ContextGuard(ContextEngineConfig())
    analysis = RuleBasedQueryAnalyzer().analyze("q")
    passed, warnings = guard.validate(context="some text", query="q", analysis=analysis)
    assert passed and warnings == []


def test_example2_guard_with_relevance_checking() -> None:
    cfg = ContextEngineConfig()
    cfg.guard.check_relevance = True
    my_embed_fn = vector_embed({"What is Redis?": [1.0, 0.2]}, [0.9, 0.3])
    guard = ContextGuard(cfg, embed_fn=my_embed_fn)
    context, query = "Redis is an in-memory data store.", "What is Redis?"
    analysis = RuleBasedQueryAnalyzer(cfg).analyze(query)
    passed, warnings = guard.validate(context, query, analysis)
    assert passed and warnings == []
    assert guard.relevance_active


def test_example3_adaptive_learning_report() -> None:
    cfg = ContextEngineConfig()
    analyzer = RuleBasedQueryAnalyzer(cfg)
    usage_log = [
        (q, analyzer.analyze(q), 100 * (i + 1), i + 1, 20.0 * (i + 1), i != 2)
        for i, q in enumerate(["What is RAG?", "How does it work?", "Compare A and B"])
    ]
    adaptive = AdaptiveLearningSystem(cfg)
    for q, a, ctx_len, n_chunks, ms, ok in usage_log:
        adaptive.record(q, a, ctx_len, n_chunks, ms, ok)
    report = adaptive.get_performance_report()
    assert report["total_queries"] == report["samples"] == 3
    assert report["avg_context_length"] == 200.0
    assert report["guard_failure_rate"] == pytest.approx(1 / 3)


def test_example4_mismatched_weights() -> None:
    with pytest.raises(ValueError) as excinfo:
        WeightedBudgetAllocation(weights=[1.0, 2.0]).allocate(total_budget=1000, n_queries=3)
    assert str(excinfo.value) == "weights length must equal n_queries."


def test_example5_complexity_aware_budgeting() -> None:
    analyzer = RuleBasedQueryAnalyzer()
    queries = [
        "What is RAG?",
        "How does semantic caching work?",
        "Compare exact and approximate nearest neighbour search for a cache of a million "
        "entries, and explain the tradeoffs in recall and latency",
    ]
    analyses = [analyzer.analyze(q) for q in queries]
    assert [a.complexity for a in analyses] == list(QueryComplexity)
    budgets = ComplexityBasedAllocation().allocate(
        total_budget=6000, n_queries=len(queries), analyses=analyses
    )
    assert budgets == [1200, 1800, 3000]
    assert sum(budgets) == 6000


# -- ContextCache: model-based test against a reference LRU+TTL --------------------------------


class ContextCacheMachine(RuleBasedStateMachine):
    """Compares ``ContextCache`` with an ``OrderedDict`` model under an injected clock."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self._setup(3, 5)

    def _setup(self, max_size: int, ttl: int) -> None:
        self.max_size, self.ttl = max_size, ttl
        self.cache = ContextCache(max_size=max_size, ttl_seconds=ttl, timer=lambda: self.now)
        self.model: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.stale: set[str] = set()  # expired-and-observed or evicted, not put since
        self.hits = self.misses = 0

    @initialize(max_size=st.integers(1, 4), ttl=st.integers(1, 6))
    def configure(self, max_size: int, ttl: int) -> None:
        self._setup(max_size, ttl)

    @rule(key=st.sampled_from("abcdef"), value=st.integers())
    def put(self, key: str, value: int) -> None:
        if key in self.model:
            self.model.move_to_end(key)  # a re-put is a use
        elif len(self.model) >= self.max_size:
            evicted, _ = self.model.popitem(last=False)
            self.stale.add(evicted)
        self.model[key] = (value, self.now)
        self.stale.discard(key)
        self.cache.put(key, value)

    @rule(key=st.sampled_from("abcdef"))
    def get(self, key: str) -> None:
        got = self.cache.get(key)
        item = self.model.get(key)
        expected: int | None = None
        if item is None:
            self.misses += 1
        elif self.now - item[1] > self.ttl:
            del self.model[key]
            self.stale.add(key)
            self.misses += 1
        else:
            self.model.move_to_end(key)
            self.hits += 1
            expected = item[0]
        assert got == expected

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 7.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def clear(self) -> None:
        self.stale |= set(self.model)
        self.model.clear()
        self.cache.clear()

    @invariant()
    def matches_model(self) -> None:
        assert self.cache.keys() == list(self.model)
        assert not self.stale & set(self.cache._store)
        assert len(self.cache) <= self.max_size
        stats = self.cache.stats
        assert (stats["hits"], stats["misses"]) == (self.hits, self.misses)


TestContextCacheModel = ContextCacheMachine.TestCase
TestContextCacheModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_context_cache_lru_order_and_ttl_boundary() -> None:
    now = [0.0]
    cache = ContextCache(max_size=2, ttl_seconds=10, timer=lambda: now[0])
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3)  # evicts b, the least recently used
    assert cache.keys() == ["a", "c"]
    now[0] = 10.0
    assert cache.get("a") == 1  # age == ttl is not expired
    now[0] = 10.5
    assert cache.get("c") is None and "c" not in cache._store


# -- threads -----------------------------------------------------------------------------------


def test_16_threads_guard_and_cache() -> None:
    n_threads, iterations, fail_every = 16, 300, 10

    def embed(text: str) -> Any:
        if text.startswith("boom"):
            raise RuntimeError("embedding failed")
        return np.ones(4)

    cfg = ContextEngineConfig()
    cfg.guard.check_relevance = True
    cfg.guard.check_source_coverage = True
    cfg.guard.min_context_length = 5
    guard = ContextGuard(cfg, embed_fn=embed)
    cache = ContextCache(max_size=32, ttl_seconds=60)
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []
    gets = [0] * n_threads
    verdicts = [0] * n_threads

    def work(i: int) -> None:
        try:
            rng = random.Random(i)
            barrier.wait()
            for j in range(iterations):
                key = f"k{rng.randrange(64)}"
                if rng.random() < 0.5:
                    cache.get(key)
                    gets[i] += 1
                else:
                    cache.put(key, f"v{j}")
                context = "boom [Source: 1]" if j % fail_every == 0 else "fine [Source: 1]"
                passed, warnings = guard.validate(context, "q", ANALYSIS)
                verdicts[i] += passed and not warnings
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = cache.stats
    assert stats["hits"] + stats["misses"] == sum(gets)
    assert stats["size"] == len(cache) <= 32
    assert guard.embedding_failures == n_threads * iterations // fail_every
    assert sum(verdicts) == n_threads * iterations  # every context passed cleanly
