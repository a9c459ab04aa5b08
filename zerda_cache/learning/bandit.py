"""The self-improving cache policy: Thompson sampling, one Beta-Bernoulli arm per entry.

Faithful to the seed's ``CachePolicyLearner`` (``../shared/seeds/cache-policy-learner.md``)
with its documented defects fixed; ``docs/differences.md`` lists each difference:

* ``rank_candidates`` draws from the learner's own seedable ``numpy.random.Generator``,
  not NumPy's global state.
* ``eviction_ranking`` passes ``EvictionConfig``'s weights through.
* ``auto_decay`` is time-based (``usage_decay ** (elapsed / decay_interval_s)`` from each
  arm's ``decayed_at``), so it is idempotent in time; the worker persists it in Redis.
* every arm change first brings the arm to ``now``.

This module knows the bandit math and nothing of Redis: the storage layer's Lua scripts
apply the same formulas to the state in Redis.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from zerda_cache.core.config import EvictionConfig, RLConfig
from zerda_cache.core.entry import (
    CONFIDENCE_WEIGHT,
    USAGE_SATURATION,
    FeedbackSignal,
    IntelligentCacheEntry,
    compute_confidence,
)

log = logging.getLogger(__name__)

#: Seed: the learner's rolling feedback log keeps the most recent 10,000 signals.
FEEDBACK_LOG_SIZE = 10_000


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    """An element of ``eviction_ranking``'s result; lower ``score`` is evicted first."""

    entry_id: str
    key: str
    score: float


Candidate = tuple[str, float, IntelligentCacheEntry]


class CachePolicyLearner:
    """Bandit learner over cache entries; see the module docstring.

    Args:
        config: the bandit parameters.
        eviction: weights for ``eviction_ranking`` (default ``EvictionConfig()``).
        rng: a generator to draw from; by default one seeded with ``config.seed``.
    """

    def __init__(
        self,
        config: RLConfig,
        eviction: EvictionConfig | None = None,
        *,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.config = config
        self.eviction = eviction if eviction is not None else EvictionConfig()
        # Generator methods serialise on their bit generator's lock, so one generator per
        # learner is safe to share between threads (the seed's np.random.beta is not
        # isolated from every other user of the global state).
        self._rng = rng if rng is not None else np.random.default_rng(config.seed)
        self._lock = threading.RLock()
        self._total_positive = 0
        self._total_negative = 0
        self._feedback_log: deque[FeedbackSignal] = deque(maxlen=FEEDBACK_LOG_SIZE)

    # -- feedback ------------------------------------------------------------------------
    def reward_for(self, signal: FeedbackSignal) -> float:
        """``magnitude * (positive_feedback_reward | negative_feedback_penalty)``."""
        weight = (
            self.config.positive_feedback_reward
            if signal.positive
            else self.config.negative_feedback_penalty
        )
        return float(signal.magnitude) * weight

    def record_feedback(
        self, entry: IntelligentCacheEntry, signal: FeedbackSignal, *, now: float | None = None
    ) -> None:
        """Apply one signal to ``entry``'s arm and recompute its confidence, in place.

        The arm is first brought to ``now`` (default: the current time), then updated.
        Persisting the entry is the caller's job; ``RedisStorage.feedback`` does both in
        one Lua script instead.
        """
        now = time.time() if now is None else now
        reward = self.reward_for(signal)
        self._decay_entry(entry, now)
        # An arm at its prior was not brought to now (nothing to decay): its evidence
        # starts now (the feedback script does the same).
        entry.bandit_arm.decayed_at = max(entry.bandit_arm.decayed_at, now)
        sim = signal.similarity
        if signal.positive:
            if sim is not None and sim < entry.min_positive_similarity:
                entry.min_positive_similarity = float(sim)
            entry.negative_streak = 0
        elif sim is not None and sim < 1 - 1e-6 and sim < entry.min_positive_similarity:
            # No positive at or below this similarity: blame the match more than the
            # answer. The entry's own bar rises above it; the arm keeps part of the penalty.
            bar = min(sim + self.config.similarity_bar_margin, 0.99999)  # never above its own
            entry.similarity_bar = max(entry.similarity_bar, bar)  # question's similarity
            reward *= self.config.near_miss_penalty_share
        else:
            # A complaint after a complaint: forget most of the praise the answer had
            # earned, so that an answer gone stale stops being served after two or three.
            entry.negative_streak += 1
            arm, prior = entry.bandit_arm, self.config.prior_alpha
            if entry.negative_streak >= 2 and arm.alpha > prior:
                arm.alpha = prior + (arm.alpha - prior) * self.config.negative_streak_forget
        entry.record_hit(positive=bool(signal.positive), reward=reward)
        entry.confidence_score = self._compute_confidence(entry)
        self.note_feedback(signal)
        log.debug(
            "feedback entry=%s positive=%s reward=%.3f expected=%.3f",
            entry.entry_id,
            signal.positive,
            reward,
            entry.expected_reward,
        )

    def note_feedback(self, signal: FeedbackSignal) -> None:
        """Count ``signal`` and append it to the rolling log (no arm is touched).

        ``CacheManager.feedback`` calls this after the feedback script has updated the
        arm in Redis, so ``get_stats`` covers this replica's signals.
        """
        with self._lock:
            if signal.positive:
                self._total_positive += 1
            else:
                self._total_negative += 1
            self._feedback_log.append(signal)

    def record_use(self, entry: IntelligentCacheEntry, now: float) -> None:
        """The entry was served at ``now``: decay, count the use, recompute confidence.

        The Python twin of the ``hit`` script.
        """
        self._decay_entry(entry, now)
        entry.record_use(now)
        entry.confidence_score = self._compute_confidence(entry)

    # -- ranking -------------------------------------------------------------------------
    def rank_candidates(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Sort ``(entry_id, similarity, entry)`` best first: by similarity, and by the
        composite score among candidates about as similar as the best remaining one.

        ``composite = (similarity + s * thompson_draw + 0.1 * confidence) / (1 + s + 0.1)``
        with ``s = similarity_bonus_scale``. The candidates within
        ``similarity_tie_margin`` of the most similar are equally likely to be the
        question asked, and the bandit chooses among them; the rest follow, grouped the
        same way. (The seed sorts by the composite alone, so a fresh arm's draw can
        serve another question's answer to an exact repeat: ``docs/differences.md``.)
        Arms are used as given: bring them to the current time first (``BanditArm.at``)
        when they come from storage.
        """
        return [c for c, _ in self.score_candidates(candidates)]

    def score_candidates(
        self, candidates: Sequence[Candidate], config: RLConfig | None = None
    ) -> list[tuple[Candidate, float]]:
        """``rank_candidates`` with each candidate's composite score, best first;
        ``config``: the tenant's parameters (default: the learner's)."""
        cfg = self.config if config is None else config
        s = cfg.similarity_bonus_scale
        denom = 1.0 + s + CONFIDENCE_WEIGHT
        scored: list[tuple[Candidate, float]] = []
        # An arm without a signal is its prior: a draw would only be noise against a
        # competitor's similarity (two fresh answers are equally likely to be right, and
        # the closer question is the better guess), so its mean stands in. The seed's
        # order (similarity_tie_margin 2) draws every arm.
        seed_order = cfg.similarity_tie_margin >= 2
        for cand in candidates:  # draws in the caller's order: a seeded learner repeats
            _, similarity, entry = cand
            arm = entry.bandit_arm
            drawn = arm.pulls or seed_order
            ts_reward = arm.sample_reward(self._rng) if drawn else arm.expected_reward
            composite = (
                similarity + s * ts_reward + CONFIDENCE_WEIGHT * entry.confidence_score
            ) / denom
            scored.append((cand, composite))
        if len(scored) == 1:  # a lookup's usual case (a clear leader): nothing to order
            return scored
        scored.sort(key=lambda item: item[0][1], reverse=True)
        margin = cfg.similarity_tie_margin
        ranked: list[tuple[Candidate, float]] = []
        while scored:
            floor = scored[0][0][1] - margin
            cut = next((i for i, item in enumerate(scored) if item[0][1] < floor), len(scored))
            group, scored = scored[:cut], scored[cut:]
            group.sort(key=lambda item: item[1], reverse=True)
            ranked += group
        return ranked

    def is_servable(self, entry: IntelligentCacheEntry, config: RLConfig | None = None) -> bool:
        """False once the arm's expected reward is below the serving bar
        (``min_reward_to_serve``, by default ``min_reward_to_keep``) of ``config``
        (default: the learner's)."""
        return entry.expected_reward >= (self.config if config is None else config).serve_bar

    # -- eviction and decay ----------------------------------------------------------------
    def eviction_ranking(
        self,
        entries: Iterable[tuple[str, IntelligentCacheEntry]],
        n_to_evict: int,
        *,
        now: float | None = None,
    ) -> list[EvictionCandidate]:
        """The ``n_to_evict`` entries most worth evicting, most expendable first.

        An entry whose expected reward (at ``now``) is below ``min_reward_to_keep`` scores
        -1.0 and goes first; the rest score ``entry.eviction_score`` with the weights of
        ``self.eviction``. Entries are not modified.
        """
        if n_to_evict <= 0:
            return []
        now = time.time() if now is None else now
        cfg, ev = self.config, self.eviction
        out: list[EvictionCandidate] = []
        for key, entry in entries:
            arm = entry.bandit_arm.at(now, cfg)
            if arm.expected_reward < cfg.min_reward_to_keep:
                score = -1.0
            else:
                view = IntelligentCacheEntry(
                    entry_id=entry.entry_id,
                    tenant=entry.tenant,
                    query="",
                    response="",
                    created_at=entry.created_at,
                    usage_count=entry.usage_count,
                    last_access=entry.last_access,
                    bandit_arm=arm,
                )
                score = view.eviction_score(
                    decay=cfg.usage_decay,
                    reward_w=ev.reward_weight,
                    usage_w=ev.usage_weight,
                    recency_w=ev.recency_weight,
                    now=now,
                    interval_s=cfg.decay_interval_s,
                )
            out.append(EvictionCandidate(entry_id=entry.entry_id, key=key, score=score))
        out.sort(key=lambda c: c.score)
        return out[:n_to_evict]

    def eviction_scores(
        self,
        alpha: np.ndarray,
        beta: np.ndarray,
        decayed_at: np.ndarray,
        usage_count: np.ndarray,
        last_access: np.ndarray,
        *,
        now: float,
        config: RLConfig | None = None,
        eviction: EvictionConfig | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``eviction_ranking``'s scores for many entries at once, as arrays (with a
        tenant's ``config`` and ``eviction`` weights; default: the learner's).

        Returns ``(scores, expected_rewards)``: -1.0 where the expected reward at ``now``
        is below ``min_reward_to_keep``, else the weighted eviction score. The same
        formulas as ``eviction_ranking`` (a test holds them equal); the worker scores a
        million entries this way in a fraction of a second.
        """
        cfg = self.config if config is None else config
        ev = self.eviction if eviction is None else eviction
        pa, pb = cfg.prior_alpha, cfg.prior_beta
        elapsed = np.maximum(0.0, now - decayed_at)
        excess = np.abs(alpha - pa) + np.abs(beta - pb)
        factor = np.where(excess > 1e-12, cfg.usage_decay ** (elapsed / cfg.decay_interval_s), 1.0)
        a = pa + (alpha - pa) * factor
        b = pb + (beta - pb) * factor
        expected = a / (a + b)
        usage = np.minimum(1.0, np.log(1.0 + usage_count) / math.log(1.0 + USAGE_SATURATION))
        idle = np.maximum(0.0, now - last_access)
        recency = cfg.usage_decay ** (idle / cfg.decay_interval_s)
        scores = ev.reward_weight * expected + ev.usage_weight * usage + ev.recency_weight * recency
        scores = np.where(expected < cfg.min_reward_to_keep, -1.0, scores)
        return scores, expected

    def auto_decay(
        self, entries: Iterable[IntelligentCacheEntry], *, now: float | None = None
    ) -> None:
        """Bring every entry's arm to ``now``, shrinking its excess over the prior, and
        recompute its confidence.

        Time-based and idempotent: calling it twice at one instant equals calling it once.
        """
        now = time.time() if now is None else now
        with self._lock:
            for entry in entries:
                self._decay_entry(entry, now)
                # Confidence follows the decayed expected reward (the decay script does
                # the same in Redis).
                entry.confidence_score = self._compute_confidence(entry)

    def _decay_entry(self, entry: IntelligentCacheEntry, now: float) -> None:
        cfg = self.config
        entry.bandit_arm.decay_to(
            now,
            prior_alpha=cfg.prior_alpha,
            prior_beta=cfg.prior_beta,
            usage_decay=cfg.usage_decay,
            interval_s=cfg.decay_interval_s,
        )

    # -- introspection -----------------------------------------------------------------------
    def get_stats(self) -> dict[str, object]:
        """``total_feedback``, ``positive_feedback``, ``negative_feedback``,
        ``positive_rate`` and ``recent_signals`` (the log's length, at most 10,000)."""
        with self._lock:
            pos, neg = self._total_positive, self._total_negative
            total = pos + neg
            return {
                "total_feedback": total,
                "positive_feedback": pos,
                "negative_feedback": neg,
                "positive_rate": pos / total if total else 0.0,
                "recent_signals": len(self._feedback_log),
            }

    def _compute_confidence(self, entry: IntelligentCacheEntry) -> float:
        return compute_confidence(
            entry.expected_reward, entry.similarity_score, entry.quality_score, entry.usage_count
        )


__all__ = [
    "CONFIDENCE_WEIGHT",
    "FEEDBACK_LOG_SIZE",
    "CachePolicyLearner",
    "EvictionCandidate",
    "FeedbackSignal",
]
