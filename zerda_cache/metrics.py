"""Prometheus metrics. Names are part of the API: the dashboards in deploy/ query them.

Every name starts with ``zerda_cache_``. The tenant label is bounded: a replica names the
first ``max_tenant_labels`` tenants it sees and reports the rest as ``other``, so a
runaway number of tenants cannot explode the series count. ``docs/metrics.md`` lists
every metric with its type and labels.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zerda_cache.config import DEFAULT_MAX_TENANT_LABELS

OTHER = "other"

LATENCY_BUCKETS = (
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class TenantLabels:
    """Maps tenant ids to a bounded set of label values (first come, first named)."""

    def __init__(self, max_named: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        self.max_named = max_named
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        with self._lock:
            if len(self._named) < self.max_named:
                self._named.add(tenant)
                return tenant
        return OTHER


class ReplicaMetrics:
    """What each app replica exports (serve them with ``prometheus_client`` as usual).

    Args:
        registry: where to register; one ``ReplicaMetrics`` per registry.
        max_tenant_labels: tenants named before the rest become ``other``.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS,
    ) -> None:
        reg = registry if registry is not None else REGISTRY
        self.registry = reg
        self.tenant = TenantLabels(max_tenant_labels)
        self.lookups = Counter(
            "zerda_cache_lookups",
            "Lookups by result: hit, miss or fail_open (Redis unreachable or too slow).",
            ["tenant", "result"],
            registry=reg,
        )
        self.lookup_latency = Histogram(
            "zerda_cache_lookup_latency_seconds",
            "Lookup latency, embedding excluded, by result.",
            ["result"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.fail_open = Counter(
            "zerda_cache_fail_open",
            "Lookups answered as a miss because Redis failed.",
            ["tenant"],
            registry=reg,
        )
        self.puts = Counter(
            "zerda_cache_puts",
            "Puts by result: stored or rejected.",
            ["tenant", "result"],
            registry=reg,
        )
        self.puts_rejected = Counter(
            "zerda_cache_puts_rejected",
            "Puts refused by the admission check, by reason.",
            ["reason"],
            registry=reg,
        )
        self.feedback = Counter(
            "zerda_cache_replica_feedback",
            "Feedback signals sent by this replica, by polarity.",
            ["tenant", "polarity"],
            registry=reg,
        )
        self.index_rebuilds = Counter(
            "zerda_cache_index_rebuilds",
            "Full rebuilds of a tenant's local vector index (first use or log trimmed).",
            ["tenant"],
            registry=reg,
        )
        self._adaptive = _AdaptiveCollector()
        reg.register(self._adaptive)
        self.storage_errors = Counter(
            "zerda_cache_storage_errors",
            "Redis errors seen by this replica, by operation.",
            ["operation"],
            registry=reg,
        )

    def watch(self, adaptive: Any) -> None:
        """Export ``adaptive``'s rolling windows (an ``AdaptiveLearningSystem``)."""
        self._adaptive.add(adaptive)


class _AdaptiveCollector(Collector):
    """Exports the rolling windows of the managers watched by a ``ReplicaMetrics``."""

    def __init__(self) -> None:
        # Weak: a manager that is gone stops being reported (and is not kept alive).
        self.systems: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, system: Any) -> None:
        with self._lock:
            self.systems.add(system)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            reports = [s.get_performance_report() for s in list(self.systems)]
        fams = {
            "avg_response_ms": GaugeMetricFamily(
                "zerda_cache_replica_window_latency_ms",
                "Mean lookup (and admission) time over the last 100 operations.",
            ),
            "avg_context_length": GaugeMetricFamily(
                "zerda_cache_replica_window_answer_chars",
                "Mean answer length over the last 100 lookups and puts (a miss counts 0).",
            ),
            "avg_chunk_count": GaugeMetricFamily(
                "zerda_cache_replica_window_candidates",
                "Mean candidates over the last 100 lookups and puts (a put counts 0).",
            ),
            "guard_failure_rate": GaugeMetricFamily(
                "zerda_cache_replica_window_admission_failure_ratio",
                "Share of the last 100 operations that were puts refused by the admission check.",
            ),
        }
        weights = [r["samples"] for r in reports]
        total = sum(weights)
        for key, fam in fams.items():
            value = (
                sum(r[key] * w for r, w in zip(reports, weights, strict=True)) / total
                if total
                else 0.0
            )
            fam.add_metric([], value)
        yield from fams.values()


_default: ReplicaMetrics | None = None
_default_lock = threading.Lock()


def default_replica_metrics() -> ReplicaMetrics:
    """The process-wide ``ReplicaMetrics`` on the default registry (created once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = ReplicaMetrics()
        return _default
