"""Companion modules from the seed's context engine page (``context-guard-and-learning``).

- :class:`ContextCache`: the local LRU+TTL cache that memoises embeddings per replica.
- :class:`ContextGuard`: checks an answer before it is cached (``as_admission()`` plugs it
  into ``CacheManager``).
- :class:`AdaptiveLearningSystem`: each replica's rolling windows and budget suggestion.
- Budget allocation strategies, and :class:`RuleBasedQueryAnalyzer`.
- The types the seed uses without defining them (``QueryAnalysis``, the configs, ...).
"""

from zerda_cache.companions.context.adaptive import AdaptiveLearningSystem
from zerda_cache.companions.context.analyzer import RuleBasedQueryAnalyzer
from zerda_cache.companions.context.budget import (
    ComplexityBasedAllocation,
    EqualBudgetAllocation,
    WeightedBudgetAllocation,
)
from zerda_cache.companions.context.cache import ContextCache
from zerda_cache.companions.context.guard import ContextGuard, GuardAdmission, guard_admission
from zerda_cache.companions.context.types import (
    BudgetAllocationStrategy,
    ContextEngineConfig,
    ContextGuardStrategy,
    GuardConfig,
    QueryAnalysis,
    QueryComplexity,
)

__all__ = [
    "AdaptiveLearningSystem",
    "BudgetAllocationStrategy",
    "ComplexityBasedAllocation",
    "ContextCache",
    "ContextEngineConfig",
    "ContextGuard",
    "ContextGuardStrategy",
    "EqualBudgetAllocation",
    "GuardAdmission",
    "GuardConfig",
    "QueryAnalysis",
    "QueryComplexity",
    "RuleBasedQueryAnalyzer",
    "WeightedBudgetAllocation",
    "guard_admission",
]
