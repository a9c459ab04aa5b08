"""How a lookup orders its candidates and scores the one it serves.

A search of the replica's index (``search``) gives candidates best first, as
``(entry id, similarity)``; each has its match features (``features``, for the error
bound's match model). Ranking them needs their learning states, read from Redis: the
servable ones are scored by the bandit (``CachePolicyLearner.score_candidates``) and the
question's own entry goes first (``Ranking.candidates``). A candidate served without
ranking, by the lookup's first round trip, is scored the same way (``Ranking.spec_hit``),
so a ``CacheHit`` carries the same score whichever way it was served. Ranking compares
expiry times with the storage clock, estimated locally (``LocalClock``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from zerda_cache.core.entry import IntelligentCacheEntry
from zerda_cache.core.results import CacheHit
from zerda_cache.learning.bandit import CachePolicyLearner
from zerda_cache.learning.match_model import Features, candidate_features
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.replica.indexes import TenantIndex
from zerda_cache.storage.codec import Vector
from zerda_cache.storage.driver import Flow
from zerda_cache.storage.plans import HitOutcome, StateBatch
from zerda_cache.storage.store import Storage

#: A candidate as a search returns it: ``(entry id, similarity)``.
Near = tuple[str, float]
#: A ranked candidate: ``((id, similarity, entry), score, exact)``.
Ranked = tuple[tuple[str, float, IntelligentCacheEntry], float, bool]

#: How often the local clock re-reads the server's clock for its estimate.
CLOCK_RESYNC_S = 60.0


def clear_leader(found: Sequence[Near], margin: float) -> bool:
    """Whether the first of a search's candidates (best first) is the only one, or ahead
    of the next by more than ``margin`` (``similarity_tie_margin``): then ranking puts
    it first whatever the arms say, and a lookup serves it in its first round trip."""
    return len(found) == 1 or (len(found) > 1 and found[1][1] < found[0][1] - margin)


def search(ti: TenantIndex, vec: Vector | None, scope: str, policy: TenantPolicy) -> list[Near]:
    """The tenant's ``top_k`` nearest cached questions in ``scope`` at
    ``similarity_threshold`` or more, best first (none without a vector)."""
    if vec is None:
        return []
    cfg = policy.config
    return ti.search(vec, scope, cfg.top_k, cfg.similarity_threshold)


def features(found: list[Near], policy: TenantPolicy) -> dict[str, Features]:
    """The match features of every candidate of a search (``match_model.py``)."""
    floor = policy.config.similarity_threshold
    return {eid: f for (eid, _), f in zip(found, candidate_features(found, floor), strict=True)}


class Ranking:
    """Orders a lookup's candidates with the replica's bandit learner and makes the
    ``CacheHit`` of the one served."""

    def __init__(self, learner: CachePolicyLearner) -> None:
        self.learner = learner

    def candidates(
        self,
        found: Sequence[Near],
        exact_id: str | None,
        states: StateBatch,
        now: float,
        policy: TenantPolicy,
    ) -> list[Ranked]:
        """Rank the servable candidates: ``((id, similarity, entry), score, exact)``."""
        sims, rl = dict(found), policy.rl
        if exact_id is not None:
            sims[exact_id] = 1.0
        cands = []
        for eid, sim in sims.items():
            entry = states.entries.get(eid)
            if entry is None or entry.is_expired(now):
                continue
            entry.bandit_arm = entry.bandit_arm.at(now, rl)
            if not self.learner.is_servable(entry, rl) or sim < entry.similarity_bar:
                continue
            cands.append((eid, sim, entry))
        # A canonical order before the draws, so that a seeded learner reproduces its
        # choices whatever order the index or Redis returned the candidates in.
        cands.sort(key=lambda c: (-c[1], c[2].created_at, c[0]))
        scored = self.learner.score_candidates(cands, rl)
        # The question asked exactly is served its own answer while that is servable.
        scored.sort(key=lambda item: item[0][0] != exact_id)
        return [(cand, score, cand[0] == exact_id) for cand, score in scored]

    def spec_hit(
        self,
        tenant: str,
        cand: Near,
        outcome: HitOutcome,
        exact: bool,
        policy: TenantPolicy,
    ) -> CacheHit:
        """The hit of a candidate served without ranking, scored as ranking scores it: on
        its confidence before this use (the hit script recomputes it), so that its score
        is the same whichever way it was served."""
        served = outcome.served
        assert served is not None
        after = served.confidence_score
        if outcome.ranked_confidence is not None:
            served.confidence_score = outcome.ranked_confidence
        ((scored, score),) = self.learner.score_candidates([(cand[0], cand[1], served)], policy.rl)
        served.confidence_score = after
        return hit_of(tenant, scored, score, exact, served)


def hit_of(
    tenant: str,
    cand: tuple[str, float, IntelligentCacheEntry],
    score: float,
    exact: bool,
    served: IntelligentCacheEntry,
) -> CacheHit:
    """The ``CacheHit`` of a ranked candidate the hit script served (``served``: the
    entry as it read it)."""
    return CacheHit(
        entry_id=cand[0],
        tenant=tenant,
        response=served.response,
        query=served.query,
        similarity=cand[1],
        score=score,
        expected_reward=served.expected_reward,
        confidence=served.confidence_score,
        metadata=served.metadata,
        scope=served.scope,
        exact=exact,
        usage=served.usage,
        hit_number=int(served.usage_count),
    )


class LocalClock:
    """The storage clock, estimated locally: the server's time, measured once a minute,
    plus the local time elapsed since (ranking needs no more precision; the scripts read
    the server's clock themselves). An injected clock (tests) is read as it is."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._synced: tuple[float, float] | None = None

    def estimate(self) -> float | None:
        """Now, without I/O; ``None`` when the server's clock is to be read again
        (``now_flow``)."""
        if self.storage.clock is not None:
            return float(self.storage.clock())
        synced = self._synced
        mono = time.monotonic()
        if synced is None or mono - synced[0] > CLOCK_RESYNC_S:
            return None
        return synced[1] + (mono - synced[0])

    def now_flow(self) -> Flow[float]:
        """Now: the estimate, after reading the server's clock if it is due."""
        now = self.estimate()
        if now is not None:
            return now
        mono = time.monotonic()
        self._synced = (mono, (yield from self.storage.now_flow()))
        return self._synced[1]


__all__ = [
    "CLOCK_RESYNC_S",
    "LocalClock",
    "Near",
    "Ranked",
    "Ranking",
    "clear_leader",
    "features",
    "hit_of",
    "search",
]
