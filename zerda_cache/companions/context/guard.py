"""``ContextGuard``: checks a context (in zerda-cache: an answer about to be cached).

``validate`` runs the seed's seven steps in the seed's order, with the same short-circuits
and the same warn-only steps:

1. ``GuardConfig.enabled`` is ``False`` -> ``(True, [])`` at once; nothing else runs.
2. ``check_empty`` and the context is blank -> ``(False, ["context is empty ⚠"])`` at once.
3. Shorter than ``min_context_length`` -> a warning and ``passed = False``; checks go on.
4. Longer than ``max_context_length`` -> a warning only.
5. ``check_source_coverage`` and neither a ``[Source:`` / ``[source:`` marker nor ``---``
   -> a warning only.
6. ``check_relevance`` with an ``embed_fn`` -> :meth:`ContextGuard._check_relevance`; a
   similarity below ``relevance_threshold`` adds a warning and sets ``passed = False``.
7. All warnings are logged together at WARNING, or a DEBUG line confirms a clean pass.

Kept from the seed by choice: the guard reports and does not block anything itself (its
caller decides; zerda-cache's ``put`` refuses to cache a failed answer), and ``analysis``
is accepted for interface conformance but unused.

Where it differs from the seed (documented defects; see ``docs/differences.md``):

- The seed's source regex ``\\[(?:|Source|source):`` has an empty alternative, so any
  ``[anything:`` counts as a source marker; ours matches only ``[Source:`` and
  ``[source:``.
- The seed skips ``check_relevance`` silently without an ``embed_fn``; here the
  constructor logs one WARNING and :attr:`ContextGuard.relevance_active` says whether the
  check runs.
- The seed passes an embedding failure silently (a DEBUG line); here it still passes, but
  is logged at WARNING and counted in :attr:`ContextGuard.embedding_failures`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from zerda_cache.companions.context.analyzer import RuleBasedQueryAnalyzer
from zerda_cache.companions.context.types import (
    ContextEngineConfig,
    ContextGuardStrategy,
    QueryAnalysis,
)

logger = logging.getLogger(__name__)

#: The embedding function: text -> a 1-D vector.
GuardEmbedFn = Callable[[str], npt.ArrayLike]

#: A source marker: ``[Source:`` or ``[source:`` (the seed's regex also matched ``[x:``).
SOURCE_MARKER_RE = re.compile(r"\[(?:Source|source):")
#: The alternative source marker: a ``---`` separator between retrieved chunks.
SOURCE_SEPARATOR = "---"
#: Characters of the context embedded by the relevance check.
RELEVANCE_PREFIX_CHARS = 512

EMPTY_WARNING = "context is empty ⚠"


class ContextGuard(ContextGuardStrategy):
    """The seed's context guard, with its documented defects fixed.

    Args:
        config: the engine config; its ``guard`` settings are validated here (the seed's
            example mutates them after construction of the config).
        embed_fn: text -> vector, needed by the relevance check.

    Raises:
        ValueError: if the guard settings are invalid.

    Thread safety: the config and ``embed_fn`` are only read; the failure counter is
    updated under a lock. ``validate`` is safe to call from many threads at once.
    """

    def __init__(self, config: ContextEngineConfig, embed_fn: GuardEmbedFn | None = None) -> None:
        config.guard.validate()
        self.config = config
        self.embed_fn = embed_fn
        self._lock = threading.Lock()
        self._embedding_failures = 0
        guard = config.guard
        self.relevance_active: bool = (
            guard.enabled and guard.check_relevance and embed_fn is not None
        )
        if guard.enabled and guard.check_relevance and embed_fn is None:
            logger.warning(
                "ContextGuard: check_relevance is enabled but no embed_fn was given; "
                "the relevance check will not run"
            )

    @property
    def embedding_failures(self) -> int:
        """How many relevance checks passed only because embedding (or the cosine) failed."""
        with self._lock:
            return self._embedding_failures

    def validate(self, context: str, query: str, analysis: QueryAnalysis) -> tuple[bool, list[str]]:
        """Run the seven checks (see the module docstring) in the seed's order.

        Args:
            context: the text to check.
            query: used only by the relevance check.
            analysis: unused (kept for interface conformance, as in the seed).

        Returns:
            ``(passed, warnings)``; ``passed`` may be ``False`` while the caller still uses
            the context: the guard only reports.
        """
        cfg = self.config.guard
        # 1. Disabled: nothing runs.
        if not cfg.enabled:
            return True, []
        # 2. Empty: fail at once.
        if cfg.check_empty and not context.strip():
            return False, [EMPTY_WARNING]
        passed = True
        warnings: list[str] = []
        n = len(context)
        # 3. Too short: fail, but keep checking.
        if n < cfg.min_context_length:
            warnings.append(f"context too short ({n} < {cfg.min_context_length} chars) ⚠")
            passed = False
        # 4. Too long: report only.
        if n > cfg.max_context_length:
            warnings.append(f"context too long ({n} > {cfg.max_context_length} chars) ⚠")
        # 5. Source coverage: report only.
        if (
            cfg.check_source_coverage
            and SOURCE_MARKER_RE.search(context) is None
            and SOURCE_SEPARATOR not in context
        ):
            warnings.append("context has no source markers ([Source: ...] or ---) ⚠")
        # 6. Relevance, when it can run.
        if cfg.check_relevance and self.embed_fn is not None:
            ok, message = self._check_relevance(context, query)
            if not ok:
                warnings.append(message)
                passed = False
        # 7. Log.
        if warnings:
            logger.warning("ContextGuard: %s", "; ".join(warnings))
        else:
            logger.debug("ContextGuard: context passed (%d chars)", n)
        return passed, warnings

    def _check_relevance(self, context: str, query: str) -> tuple[bool, str]:
        """Cosine similarity of the embedded query and the context's first 512 characters.

        Args:
            context: the context.
            query: the query.

        Returns:
            ``(True, "")`` at or above ``relevance_threshold``, else ``(False, warning)``.
            If embedding fails (``embed_fn`` raises, a zero or mismatched vector), the check
            passes, as in the seed, but the failure is logged at WARNING and counted.
        """
        threshold = self.config.guard.relevance_threshold
        embed = self.embed_fn
        if embed is None:  # pragma: no cover - validate() only calls with an embed_fn
            return True, ""
        try:
            q = np.asarray(embed(query), dtype=np.float64).ravel()
            c = np.asarray(embed(context[:RELEVANCE_PREFIX_CHARS]), dtype=np.float64).ravel()
            if q.shape != c.shape:
                raise ValueError(f"embedding shapes differ: {q.shape} vs {c.shape}")
            denom = float(np.linalg.norm(q) * np.linalg.norm(c))
            if not denom > 0.0:
                raise ValueError("zero-norm embedding")
            similarity = float(np.dot(q, c)) / denom
        except Exception as exc:
            with self._lock:
                self._embedding_failures += 1
            logger.warning(
                "ContextGuard: relevance check skipped (passes) because embedding failed: %r",
                exc,
            )
            return True, ""
        if similarity < threshold:
            message = f"context relevance {similarity:.3f} below threshold {threshold:.3f} ⚠"
            return False, message
        return True, ""

    def as_admission(self, analyzer: RuleBasedQueryAnalyzer | None = None) -> GuardAdmission:
        """This guard as a ``CacheManager`` admission check.

        Args:
            analyzer: builds the (unused) analysis of each query; default: one on this
                guard's config.

        Returns:
            A callable ``(query, response, metadata) -> (passed, warnings)`` that validates
            the response as the context.
        """
        return GuardAdmission(self, analyzer)


class GuardAdmission:
    """Adapts a :class:`ContextGuard` to ``zerda_cache.manager.AdmissionCheck``.

    Args:
        guard: the guard.
        analyzer: builds the analysis passed to ``validate``; default: a
            :class:`RuleBasedQueryAnalyzer` on the guard's config.
    """

    def __init__(self, guard: ContextGuard, analyzer: RuleBasedQueryAnalyzer | None = None) -> None:
        self.guard = guard
        self.analyzer = analyzer if analyzer is not None else RuleBasedQueryAnalyzer(guard.config)

    def __call__(
        self, query: str, response: str, metadata: Mapping[str, Any]
    ) -> tuple[bool, list[str]]:
        """Validate ``response`` as the context of ``query``; ``metadata`` is not used.

        Args:
            query: the cached question.
            response: the answer about to be cached.
            metadata: the entry's metadata (unused).

        Returns:
            The guard's ``(passed, warnings)``.
        """
        return self.guard.validate(response, query, self.analyzer.analyze(query))


def guard_admission(
    guard: ContextGuard, analyzer: RuleBasedQueryAnalyzer | None = None
) -> GuardAdmission:
    """Same as ``guard.as_admission(analyzer)``.

    Args:
        guard: the guard.
        analyzer: see :class:`GuardAdmission`.

    Returns:
        The admission check.
    """
    return GuardAdmission(guard, analyzer)


__all__ = [
    "EMPTY_WARNING",
    "RELEVANCE_PREFIX_CHARS",
    "SOURCE_MARKER_RE",
    "SOURCE_SEPARATOR",
    "ContextGuard",
    "GuardAdmission",
    "GuardEmbedFn",
    "guard_admission",
]
