"""Budget allocation strategies: split a total context budget between several queries.

As in the seed: the first query absorbs the rounding remainder, and a weighted share is
floored at 1. Unlike the seed, ``ComplexityBasedAllocation`` without matching analyses
logs a WARNING when it falls back to an equal split, rather than doing so silently.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from zerda_cache.companions.context.types import (
    BudgetAllocationStrategy,
    QueryAnalysis,
    QueryComplexity,
)

logger = logging.getLogger(__name__)


def _absorb_remainder(budgets: list[int], total_budget: int) -> list[int]:
    budgets[0] += total_budget - sum(budgets)
    return budgets


class EqualBudgetAllocation(BudgetAllocationStrategy):
    """``total_budget // n_queries`` each; the first query gets the remainder."""

    def allocate(self, total_budget: int, n_queries: int) -> list[int]:
        """Split evenly.

        Args:
            total_budget: the characters to share.
            n_queries: how many queries share them.

        Returns:
            ``n_queries`` budgets summing to ``total_budget``, or ``[]`` if
            ``n_queries <= 0``.
        """
        if n_queries <= 0:
            return []
        return _absorb_remainder([total_budget // n_queries] * n_queries, total_budget)


class WeightedBudgetAllocation(BudgetAllocationStrategy):
    """Shares proportional to fixed weights.

    Args:
        weights: one non-negative, finite weight per query.

    Raises:
        ValueError: if a weight is negative or not finite.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
                raise ValueError(f"weights must be finite numbers, got {w!r}")
            if w < 0:
                raise ValueError(f"weights must be >= 0, got {w!r}")
        self.weights = [float(w) for w in weights]

    def allocate(self, total_budget: int, n_queries: int) -> list[int]:
        """Each query gets ``max(1, int(total_budget * weight / sum(weights)))``.

        The first query then absorbs the difference to ``total_budget``.

        Args:
            total_budget: the characters to share.
            n_queries: how many queries share them; must equal ``len(weights)``.

        Returns:
            One budget per query (``[]`` when there are no queries).

        Raises:
            ValueError: ``"weights length must equal n_queries."``, or if the weights sum
                to zero.
        """
        if len(self.weights) != n_queries:
            raise ValueError("weights length must equal n_queries.")
        if n_queries <= 0:
            return []
        total_weight = sum(self.weights)
        if not total_weight > 0:
            raise ValueError("weights must sum to a positive number.")
        budgets = [max(1, int(total_budget * w / total_weight)) for w in self.weights]
        return _absorb_remainder(budgets, total_budget)


class ComplexityBasedAllocation(BudgetAllocationStrategy):
    """Weights each query by its complexity: LOW 1.0, MEDIUM 1.5, HIGH 2.5."""

    _COMPLEXITY_WEIGHTS: ClassVar[Mapping[QueryComplexity, float]] = {
        QueryComplexity.LOW: 1.0,
        QueryComplexity.MEDIUM: 1.5,
        QueryComplexity.HIGH: 2.5,
    }

    def allocate(
        self,
        total_budget: int,
        n_queries: int,
        analyses: Sequence[QueryAnalysis] | None = None,
    ) -> list[int]:
        """Split by complexity weights (through :class:`WeightedBudgetAllocation`).

        Args:
            total_budget: the characters to share.
            n_queries: how many queries share them.
            analyses: one analysis per query.

        Returns:
            One budget per query. Without analyses, or with a count other than
            ``n_queries``, an equal split, and a WARNING says so.
        """
        if analyses is None or len(analyses) != n_queries:
            logger.warning(
                "ComplexityBasedAllocation: %s analyses for %d queries; "
                "falling back to an equal split",
                "no" if analyses is None else len(analyses),
                n_queries,
            )
            return EqualBudgetAllocation().allocate(total_budget, n_queries)
        weights = [self._COMPLEXITY_WEIGHTS[a.complexity] for a in analyses]
        return WeightedBudgetAllocation(weights).allocate(total_budget, n_queries)


__all__ = ["ComplexityBasedAllocation", "EqualBudgetAllocation", "WeightedBudgetAllocation"]
