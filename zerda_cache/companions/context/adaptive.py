"""``AdaptiveLearningSystem``: rolling windows of recent queries, and a budget suggestion.

As in the seed: four ``deque(maxlen=100)`` windows (response times, context lengths, chunk
counts, guard failures), ``record`` (a no-op when ``enable_adaptive`` is off; every 20th
call runs ``_auto_tune``), ``suggest_budget`` (which only ever shrinks the analyzer's
budget) and ``get_performance_report``. In zerda-cache each replica keeps one: the context
length is the answer's length, the chunk count the number of candidates.

``_auto_tune`` only logs, as the seed says; the seed's exact messages are on a page we do
not have, so the lines it logs (an INFO summary, and an INFO hint when guard failures or
latency are high) are ours. A lock makes ``record`` and the readers safe across threads.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from statistics import fmean
from typing import Any

from zerda_cache.companions.context.types import ContextEngineConfig, QueryAnalysis

logger = logging.getLogger(__name__)

#: ``_auto_tune`` runs on every ``AUTO_TUNE_EVERY``-th record.
AUTO_TUNE_EVERY = 20
#: ``suggest_budget`` adapts only once this many samples exist.
MIN_SAMPLES = 10
#: ``_auto_tune`` hints: guard failure rate and average latency (ms) above which it says so.
HIGH_GUARD_FAILURE_RATE = 0.2
HIGH_RESPONSE_MS = 2_000.0


def _mean(values: deque[float] | deque[int]) -> float:
    return fmean(values) if values else 0.0


class AdaptiveLearningSystem:
    """Rolling windows of the last ``WINDOW`` queries.

    Args:
        config: ``enable_adaptive`` switches recording and adaptation on or off.
    """

    WINDOW = 100

    def __init__(self, config: ContextEngineConfig) -> None:
        self.config = config
        self._response_times: deque[float] = deque(maxlen=self.WINDOW)
        self._context_lengths: deque[int] = deque(maxlen=self.WINDOW)
        self._chunk_counts: deque[int] = deque(maxlen=self.WINDOW)
        self._guard_failures: deque[bool] = deque(maxlen=self.WINDOW)
        self._total_queries = 0
        self._lock = threading.Lock()

    def record(
        self,
        query: str,
        analysis: QueryAnalysis,
        context_length: int,
        chunk_count: int,
        response_ms: float,
        guard_passed: bool,
    ) -> None:
        """Append one query's numbers to the windows.

        Args:
            query: accepted, not used (as in the seed).
            analysis: accepted, not used (as in the seed).
            context_length: characters of the composed context (here: of the answer).
            chunk_count: chunks in the context (here: candidates considered).
            response_ms: how long the query took.
            guard_passed: the guard's verdict; the window stores its failures.
        """
        if not self.config.enable_adaptive:
            return
        with self._lock:
            self._response_times.append(float(response_ms))
            self._context_lengths.append(int(context_length))
            self._chunk_counts.append(int(chunk_count))
            self._guard_failures.append(not guard_passed)
            self._total_queries += 1
            tune = self._total_queries % AUTO_TUNE_EVERY == 0
        if tune:
            self._auto_tune()

    def suggest_budget(self, analysis: QueryAnalysis) -> int:
        """The analyzer's budget, shrunk when past contexts used under half of it.

        Args:
            analysis: carries the base budget (``context_budget``).

        Returns:
            ``analysis.context_budget``, unless adaptation is on, at least 10 samples exist
            and their mean context length is under half of it: then
            ``max(int(mean * 1.3), 200)``.
        """
        base_budget = analysis.context_budget
        with self._lock:
            if not self.config.enable_adaptive or len(self._context_lengths) < MIN_SAMPLES:
                return base_budget
            avg_actual = _mean(self._context_lengths)
        if avg_actual < base_budget * 0.5:
            return max(int(avg_actual * 1.3), 200)
        return base_budget

    def get_performance_report(self) -> dict[str, Any]:
        """Averages of the four windows, ``total_queries`` and ``samples``.

        Returns:
            ``avg_response_ms``, ``avg_context_length``, ``avg_chunk_count``,
            ``guard_failure_rate`` (0.0 for empty windows), ``total_queries`` (all records
            ever) and ``samples`` (entries in the response-time window, at most ``WINDOW``).
        """
        with self._lock:
            return {
                "avg_response_ms": _mean(self._response_times),
                "avg_context_length": _mean(self._context_lengths),
                "avg_chunk_count": _mean(self._chunk_counts),
                "guard_failure_rate": (
                    sum(self._guard_failures) / len(self._guard_failures)
                    if self._guard_failures
                    else 0.0
                ),
                "total_queries": self._total_queries,
                "samples": len(self._response_times),
            }

    def _auto_tune(self) -> None:
        """Log a summary of the windows (and hints); changes no config and no state."""
        report = self.get_performance_report()
        logger.info(
            "adaptive: %d queries, %d samples, avg %.1f ms, avg context %.0f chars, "
            "avg %.1f chunks, guard failure rate %.1f%%",
            report["total_queries"],
            report["samples"],
            report["avg_response_ms"],
            report["avg_context_length"],
            report["avg_chunk_count"],
            100.0 * report["guard_failure_rate"],
        )
        if report["guard_failure_rate"] > HIGH_GUARD_FAILURE_RATE:
            logger.info("adaptive: guard failures are high; review the guard settings")
        if report["avg_response_ms"] > HIGH_RESPONSE_MS:
            logger.info("adaptive: responses are slow; a smaller context budget may help")


__all__ = ["AUTO_TUNE_EVERY", "MIN_SAMPLES", "AdaptiveLearningSystem"]
