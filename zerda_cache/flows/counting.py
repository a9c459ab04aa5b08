"""What a replica counts of its lookups for the tenant, written to Redis by a later
lookup's round trip rather than one of their own.

- Misses: at most one count pending per tenant, sent with the tenant's next lookup
  pipeline (``stats()`` and ``close()`` flush it).
- Lookup traffic, for the error bound's share of requests (``calibration.py``): every
  lookup is counted under the score bin of its best near candidate ("x": none), or as an
  exact repeat ("e", and "e<level>" for a confirmed level); under a bound, the features
  of that candidate are sampled for the worker's next fit of the match model. The counts
  are written once ``TRAFFIC_BATCH`` are pending or the oldest is ``TRAFFIC_FLUSH_S``
  old, and the tenant's counts are halved past ``TRAFFIC_WINDOWS`` label windows.

Besides, every lookup and put is counted in the replica's rolling windows
(``record_window``), which stay in the process and are exported as replica metrics.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping

from zerda_cache.companions.context import AdaptiveLearningSystem, QueryAnalysis, QueryComplexity
from zerda_cache.core.errors import StorageError
from zerda_cache.learning.calibration import bin_of
from zerda_cache.learning.match_model import Features, score_of
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.storage.driver import Flow
from zerda_cache.storage.plans import ReadPlan
from zerda_cache.storage.store import Storage

log = logging.getLogger(__name__)

TRAFFIC_BATCH = 32
TRAFFIC_FLUSH_S = 1.0
TRAFFIC_WINDOWS = 10
#: The lookup sample's marker of an exact repeat, followed by its level when above 0 (a
#: row is features, or None: no candidate).
EXACT = "e"

#: Lookup counts by (model version, score bin or "x"), and the sampled features.
Traffic = tuple[Counter[tuple[int, int | str]], list[Features | str | None]]


class LookupCounts:
    """One replica's pending lookup counts, per tenant (see the module docstring)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._misses: dict[str, int] = {}
        #: tenant -> (monotonic time of the oldest pending count, counts, sample)
        self._traffic: dict[
            str, tuple[float, Counter[tuple[int, int | str]], list[Features | str | None]]
        ] = {}

    def reset(self) -> None:
        """Forget what is pending (a forked child: the parent's counts are its own)."""
        self._misses = {}
        self._traffic = {}

    def pending_tenants(self) -> list[str]:
        return sorted({*self._misses, *self._traffic})

    # -- counting (no I/O) -----------------------------------------------------------------
    def miss(self, tenant: str) -> None:
        self._misses[tenant] = self._misses.get(tenant, 0) + 1

    def send_misses(self, tenant: str) -> ReadPlan[None] | None:
        """The tenant's pending miss count as a plan for the lookup's pipeline, taken."""
        pending = self._misses.pop(tenant, 0)
        return self.storage.count_misses(tenant, pending) if pending else None

    def exact(self, tenant: str, level: int, mono: float, sample: bool) -> None:
        """Count one lookup that asked a cached question itself: "e", and "e<level>" for
        a confirmed level; under a bound (``sample``), mark it in the lookup sample (the
        sample keeps the shares: the exact repeats' too)."""
        _, counts, samples = self._pending(tenant, mono)
        counts[(0, EXACT)] += 1
        if level:
            counts[(0, f"{EXACT}{level}")] += 1
        if sample:
            samples.append(f"{EXACT}{level}" if level else EXACT)

    def near(
        self,
        tenant: str,
        found: list[tuple[str, float]],
        feats: Mapping[str, Features],
        mono: float,
        policy: TenantPolicy,
        sample: bool,
    ) -> None:
        """Count one lookup that did not ask a cached question itself under the score
        bin of its best near candidate, or "x" without one; under a bound (``sample``),
        keep that candidate's features for the worker's next fit."""
        _, counts, samples = self._pending(tenant, mono)
        model = policy.calibration.model
        best: Features | None = None
        best_score = -math.inf
        for eid, _ in found:
            if eid in feats:
                score = score_of(model, feats[eid])
                if score > best_score:
                    best, best_score = feats[eid], score
        version = policy.calibration.model_version
        counts[(version, bin_of(best_score) if best is not None else "x")] += 1
        if sample:
            samples.append(best)

    def due(self, tenant: str, mono: float) -> Traffic | None:
        """The tenant's pending lookup counts, taken, if they are due to be written."""
        pending = self._traffic.get(tenant)
        if pending is None:
            return None
        since, counts, samples = pending
        if counts.total() < TRAFFIC_BATCH and mono - since < TRAFFIC_FLUSH_S:
            return None
        self._traffic.pop(tenant, None)
        return counts, samples

    @staticmethod
    def over_window(counted: float, policy: TenantPolicy) -> bool:
        """Has the tenant counted so many lookups that its counts are to be halved?"""
        return counted > policy.config.label_window * TRAFFIC_WINDOWS

    def _pending(
        self, tenant: str, mono: float
    ) -> tuple[float, Counter[tuple[int, int | str]], list[Features | str | None]]:
        pending = self._traffic.get(tenant)
        if pending is None:
            pending = self._traffic[tenant] = (mono, Counter(), [])
        return pending

    # -- writing (flows) -------------------------------------------------------------------
    def flush(self, tenant: str) -> Flow[None]:
        """Write the tenant's pending miss count and lookup counts now."""
        plan = self.send_misses(tenant)
        if plan is not None:
            yield from self.storage.read_flow(plan)
        pending = self._traffic.pop(tenant, None)
        if pending is not None:
            yield from self.storage.read_flow(self.storage.count_traffic(tenant, *pending[1:]))

    def halve(self, tenant: str, policy: TenantPolicy) -> Flow[None]:
        """Halve the tenant's lookup counts (old traffic fades, as old labels do)."""
        window = policy.config.label_window * TRAFFIC_WINDOWS
        try:
            yield from self.storage.run_flow(self.storage.plan_halve_traffic(tenant, window))
        except StorageError as exc:  # the next batch past the window tries again
            log.debug("tenant %s: lookup counts not halved: %s", tenant, exc)


#: What the replica tells its rolling windows of a query it does not analyse (``record``
#: keeps the numbers, not the analysis): one frozen value, not a checked dataclass made
#: per lookup.
UNANALYSED = QueryAnalysis(query="", complexity=QueryComplexity.LOW, context_budget=0)


def record_window(
    adaptive: AdaptiveLearningSystem,
    query: str,
    length: int,
    candidates: int,
    seconds: float,
    passed: bool,
) -> None:
    """Count one lookup or put in the replica's rolling windows (``AdaptiveLearningSystem``,
    the seed's): its answer's length, its candidates, how long it took, and whether the
    admission check passed (a lookup passes)."""
    adaptive.record(query, UNANALYSED, length, candidates, seconds * 1000.0, passed)


__all__ = ["EXACT", "UNANALYSED", "LookupCounts", "Traffic", "record_window"]
