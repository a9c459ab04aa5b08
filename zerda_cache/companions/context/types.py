"""Types the seed's context pages use but do not define.

The seed (``context-guard-and-learning``) names ``QueryAnalysis``, ``QueryComplexity``,
``GuardConfig``, ``ContextEngineConfig``, ``ContextGuardStrategy`` and
``BudgetAllocationStrategy`` without defining them. These are minimal definitions that fit
every use the seed shows. The configs are mutable dataclasses because the seed's own example
mutates one (``cfg.guard.check_relevance = True``); they validate on construction, and
:class:`~zerda_cache.companions.context.guard.ContextGuard` validates again when it is built,
so a bad value assigned afterwards is still caught before it is used.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum

#: Defaults of :class:`GuardConfig` (also quoted in its docstring).
DEFAULT_MIN_CONTEXT_LENGTH = 1
DEFAULT_MAX_CONTEXT_LENGTH = 32_000
DEFAULT_RELEVANCE_THRESHOLD = 0.3


class QueryComplexity(StrEnum):
    """How demanding a query is; the keys of the budget allocator's weights."""

    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


@dataclass(frozen=True)
class QueryAnalysis:
    """What :class:`~zerda_cache.companions.context.analyzer.RuleBasedQueryAnalyzer` learned of
    a query.

    Attributes:
        query: the query as given.
        complexity: its complexity class.
        context_budget: characters of context assigned to it (>= 0).
        word_count: whitespace-separated words in the query.
        is_question: ends with ``?`` or starts with a question word.
        reasoning_cues: the reasoning cue words found (e.g. ``"why"``, ``"compare"``).
    """

    query: str
    complexity: QueryComplexity
    context_budget: int
    word_count: int = 0
    is_question: bool = False
    reasoning_cues: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.complexity, QueryComplexity):
            raise ValueError(f"complexity must be a QueryComplexity, got {self.complexity!r}")
        _check_int("context_budget", self.context_budget, minimum=0)
        _check_int("word_count", self.word_count, minimum=0)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


@dataclass
class GuardConfig:
    """Settings of :class:`~zerda_cache.companions.context.guard.ContextGuard`.

    Attributes:
        enabled: run the guard at all (default ``True``); when ``False`` every context passes.
        check_empty: an empty or whitespace-only context fails at once (default ``True``).
        min_context_length: a shorter context fails (characters, >= 0; default 1, so any
            non-empty text passes: zerda-cache admits short answers such as "Paris." by
            default; raise it for a retrieval context).
        max_context_length: a longer context is reported, not failed (characters,
            >= ``min_context_length`` and >= 1; default 32,000).
        check_source_coverage: warn when no ``[Source: ...]`` marker and no ``---`` separator
            appears (default ``False``: cached answers usually carry no markers).
        check_relevance: compare the embedded query and context (default ``False``; needs an
            ``embed_fn``).
        relevance_threshold: the least cosine similarity that passes, in [-1, 1]
            (default 0.3).

    Raises:
        ValueError: on construction or :meth:`validate`, naming the field at fault.
    """

    enabled: bool = True
    check_empty: bool = True
    min_context_length: int = DEFAULT_MIN_CONTEXT_LENGTH
    max_context_length: int = DEFAULT_MAX_CONTEXT_LENGTH
    check_source_coverage: bool = False
    check_relevance: bool = False
    relevance_threshold: float = DEFAULT_RELEVANCE_THRESHOLD

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field.

        Raises:
            ValueError: naming the first field with a bad value.
        """
        for name in ("enabled", "check_empty", "check_source_coverage", "check_relevance"):
            _check_bool(name, getattr(self, name))
        _check_int("min_context_length", self.min_context_length, minimum=0)
        _check_int("max_context_length", self.max_context_length, minimum=1)
        if self.max_context_length < self.min_context_length:
            raise ValueError(
                f"max_context_length ({self.max_context_length}) must be >= "
                f"min_context_length ({self.min_context_length})"
            )
        thr = self.relevance_threshold
        if (
            isinstance(thr, bool)
            or not isinstance(thr, int | float)
            or not math.isfinite(thr)
            or not -1.0 <= thr <= 1.0
        ):
            raise ValueError(f"relevance_threshold must be a number in [-1, 1], got {thr!r}")


@dataclass
class ContextEngineConfig:
    """Settings shared by the guard, the analyzer and the adaptive learning system.

    Attributes:
        guard: the guard's settings.
        enable_adaptive: let the
            :class:`~zerda_cache.companions.context.adaptive.AdaptiveLearningSystem`
            record and adapt (default ``True``).
        low_budget: context budget (characters) of a ``LOW`` query (default 1,000).
        medium_budget: the default budget, that of a ``MEDIUM`` query (default 2,000).
        high_budget: context budget of a ``HIGH`` query (default 4,000).

    Raises:
        ValueError: on construction or :meth:`validate`, naming the field at fault.
    """

    guard: GuardConfig = field(default_factory=GuardConfig)
    enable_adaptive: bool = True
    low_budget: int = 1_000
    medium_budget: int = 2_000
    high_budget: int = 4_000

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field, the guard's too.

        Raises:
            ValueError: naming the first field with a bad value.
        """
        if not isinstance(self.guard, GuardConfig):
            raise ValueError(f"guard must be a GuardConfig, got {self.guard!r}")
        self.guard.validate()
        _check_bool("enable_adaptive", self.enable_adaptive)
        for name in ("low_budget", "medium_budget", "high_budget"):
            _check_int(name, getattr(self, name), minimum=1)

    def budget_for(self, complexity: QueryComplexity) -> int:
        """The context budget assigned to a query of this complexity."""
        return {
            QueryComplexity.LOW: self.low_budget,
            QueryComplexity.MEDIUM: self.medium_budget,
            QueryComplexity.HIGH: self.high_budget,
        }[complexity]


class ContextGuardStrategy(ABC):
    """A check of a composed context (or, in zerda-cache, of an answer about to be cached)."""

    @abstractmethod
    def validate(self, context: str, query: str, analysis: QueryAnalysis) -> tuple[bool, list[str]]:
        """Judge ``context`` for ``query``.

        Args:
            context: the text to check.
            query: the query it answers.
            analysis: the query's analysis.

        Returns:
            ``(passed, warnings)``.
        """


class BudgetAllocationStrategy(ABC):
    """Splits a total context budget between several queries."""

    @abstractmethod
    def allocate(self, total_budget: int, n_queries: int) -> list[int]:
        """Split ``total_budget`` into ``n_queries`` budgets.

        Args:
            total_budget: the characters to share.
            n_queries: how many queries share them.

        Returns:
            One budget per query (``[]`` when ``n_queries <= 0``).
        """


__all__ = [
    "DEFAULT_MAX_CONTEXT_LENGTH",
    "DEFAULT_MIN_CONTEXT_LENGTH",
    "DEFAULT_RELEVANCE_THRESHOLD",
    "BudgetAllocationStrategy",
    "ContextEngineConfig",
    "ContextGuardStrategy",
    "GuardConfig",
    "QueryAnalysis",
    "QueryComplexity",
]
