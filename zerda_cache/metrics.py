"""Prometheus metrics. Names are part of the API: the dashboards in deploy/ query them.

``ReplicaMetrics`` is what each app replica exports, ``WorkerMetrics`` what the worker
serves on ``/metrics``. Every name starts with ``zerda_cache_``. The tenant label is
bounded: a replica names the first ``max_tenant_labels`` tenants it sees and reports the
rest as ``other``, so a runaway number of tenants cannot explode the series count.
``docs/metrics.md`` lists every metric with its type and labels.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from zerda_cache.config import DEFAULT_MAX_TENANT_LABELS
from zerda_cache.storage.plans import REASONS

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
#: Index builds: milliseconds for a small tenant, minutes for millions of entries.
BUILD_BUCKETS = (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0)


#: Most (tenant, result) pairs whose lookup metrics a ``ReplicaMetrics`` keeps at hand.
_LOOKUP_CHILDREN = 4096
#: Models named in the savings metrics; the rest are counted as "other".
MAX_MODEL_LABELS = 32


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
            "Puts by result: stored, kept (the same answer as a held-back cached one) or rejected.",
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
        self.index_ready = Gauge(
            "zerda_cache_index_ready",
            "1 when this replica's index of the tenant is built, 0 while it is being built "
            "(lookups then serve exact-question matches).",
            ["tenant"],
            registry=reg,
        )
        self.index_build_seconds = Histogram(
            "zerda_cache_index_build_seconds",
            "Duration of this replica's index builds (in the background).",
            buckets=BUILD_BUCKETS,
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
        # Savings (zerda_cache.savings): hits of answers put with their usage, and hits
        # judged wrong (their call was bought after all).
        self.saved_calls = Counter(
            "zerda_cache_saved_calls",
            "LLM calls a hit avoided, by the model that made the cached answer.",
            ["tenant", "model"],
            registry=reg,
        )
        self.saved_tokens = Counter(
            "zerda_cache_saved_tokens",
            "Tokens of the LLM calls hits avoided, by kind (prompt, completion).",
            ["tenant", "model", "kind"],
            registry=reg,
        )
        self.saved_usd = Counter(
            "zerda_cache_saved_usd",
            "US dollars of the LLM calls hits avoided (CacheConfig.token_prices).",
            ["tenant", "model"],
            registry=reg,
        )
        self.wrong_calls = Counter(
            "zerda_cache_wrong_hit_calls",
            "Hits judged wrong by negative feedback: calls bought after all.",
            ["tenant", "model"],
            registry=reg,
        )
        self.wrong_tokens = Counter(
            "zerda_cache_wrong_hit_tokens",
            "Tokens of the hits judged wrong, by kind (prompt, completion).",
            ["tenant", "model", "kind"],
            registry=reg,
        )
        self.wrong_usd = Counter(
            "zerda_cache_wrong_hit_usd",
            "US dollars of the hits judged wrong.",
            ["tenant", "model"],
            registry=reg,
        )
        self._models: set[str] = set()
        self._savings_children: dict[tuple[str, str, str], tuple[Any, Any, Any, Any]] = {}

        # (tenant, result) -> the lookup counter's and the latency histogram's children:
        # ``labels()`` takes a lock and builds its key on every call, a cost every lookup
        # would pay (bench_ab compares a lookup's cost against a baseline tree).
        # Children are never removed from these metrics, so a cached one stays the one
        # exported; at most _LOOKUP_CHILDREN pairs (tenants past that are not cached).
        self._lookup_children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def lookup_done(self, tenant: str, result: str, seconds: float) -> None:
        """Count one lookup of ``tenant`` by ``result`` and observe its latency."""
        pair = self._lookup_children.get((tenant, result))
        if pair is None:
            pair = (
                self.lookups.labels(self.tenant(tenant), result),
                self.lookup_latency.labels(result),
            )
            if len(self._lookup_children) < _LOOKUP_CHILDREN:
                self._lookup_children[(tenant, result)] = pair
        pair[0].inc()
        pair[1].observe(seconds)

    def model(self, model: str) -> str:
        """A bounded model label: the first ``MAX_MODEL_LABELS`` models seen, then
        ``other``."""
        if model in self._models:
            return model
        if len(self._models) < MAX_MODEL_LABELS:
            self._models.add(model)
            return model
        return OTHER

    def savings(self, tenant: str, kind: str, usage: Any, usd: float) -> None:
        """Count one hit (``kind`` "saved") or one hit judged wrong ("wrong"). Hits of
        answers with a usage pay this on the lookup path: the label children are kept,
        as ``lookup_done`` keeps its own."""
        key = (tenant, kind, usage.model)
        children = self._savings_children.get(key)
        if children is None:
            t, m = self.tenant(tenant), self.model(usage.model)
            calls, tokens, dollars = (
                (self.saved_calls, self.saved_tokens, self.saved_usd)
                if kind == "saved"
                else (self.wrong_calls, self.wrong_tokens, self.wrong_usd)
            )
            children = (
                calls.labels(t, m),
                tokens.labels(t, m, "prompt"),
                tokens.labels(t, m, "completion"),
                dollars.labels(t, m),
            )
            if len(self._savings_children) < _LOOKUP_CHILDREN:
                self._savings_children[key] = children
        children[0].inc()
        children[1].inc(usage.prompt_tokens)
        children[2].inc(usage.completion_tokens)
        children[3].inc(usd)

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


#: Bucket upper bounds of the expected-reward and confidence distributions.
DISTRIBUTION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0)


@dataclass(slots=True)
class Distribution:
    """Cumulative bucket counts (Prometheus histogram style) and the sum."""

    buckets: tuple[float, ...] = DISTRIBUTION_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(DISTRIBUTION_BUCKETS))
    total: int = 0
    sum: float = 0.0

    def add(self, values: np.ndarray) -> None:
        if values.size == 0:
            return
        for i, bound in enumerate(self.buckets):
            self.counts[i] += int(np.count_nonzero(values <= bound))
        self.total += int(values.size)
        self.sum += float(values.sum())


# -- the worker's metrics ------------------------------------------------------------------
CYCLE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(slots=True)
class TenantSnapshot:
    stats: dict[str, int] = field(default_factory=dict)
    max_entries: int = 0
    max_bytes: int | None = None
    rewards: Distribution | None = None
    confidences: Distribution | None = None
    #: The error bound (``max_error_rate``) the tenant serves under, ``None``: none; the
    #: similarity a near match needs under it (``None``: no similarity is proven safe
    #: yet); the labels' estimate of wrong serves per request at that similarity.
    bound: float | None = None
    threshold: float | None = None
    wrong_per_request: float | None = None


class TenantCollector(Collector):
    """Exports the per-tenant snapshot the metrics job refreshes (bounded labels: the
    largest ``max_named`` tenants by entries, the rest summed as ``other``)."""

    def __init__(self, max_named: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        self.max_named = max_named
        self.snapshot: dict[str, TenantSnapshot] = {}
        self._lock = threading.Lock()

    def update(self, snapshot: dict[str, TenantSnapshot]) -> None:
        with self._lock:
            self.snapshot = snapshot

    def _grouped(self) -> dict[str, list[TenantSnapshot]]:
        with self._lock:
            items = sorted(
                self.snapshot.items(), key=lambda kv: kv[1].stats.get("entries", 0), reverse=True
            )
        groups: dict[str, list[TenantSnapshot]] = {}
        for i, (tenant, snap) in enumerate(items):
            groups.setdefault(tenant if i < self.max_named else OTHER, []).append(snap)
        return groups

    def collect(self) -> Iterator[Metric]:
        groups = self._grouped()
        gauges = {
            "entries": GaugeMetricFamily(
                "zerda_cache_tenant_entries", "Live entries per tenant.", labels=["tenant"]
            ),
            "bytes": GaugeMetricFamily(
                "zerda_cache_tenant_bytes",
                "Bytes of stored content (query, answer, metadata, vector) per tenant.",
                labels=["tenant"],
            ),
            "max_entries": GaugeMetricFamily(
                "zerda_cache_tenant_max_entries",
                "Entry capacity per tenant (the worker evicts above it).",
                labels=["tenant"],
            ),
            "max_bytes": GaugeMetricFamily(
                "zerda_cache_tenant_max_bytes",
                "Byte capacity per tenant (0: none).",
                labels=["tenant"],
            ),
        }
        counters = {
            "hits": CounterMetricFamily(
                "zerda_cache_tenant_hits", "Cached answers served, all replicas.", labels=["tenant"]
            ),
            "misses": CounterMetricFamily(
                "zerda_cache_tenant_misses", "Lookups that found no answer.", labels=["tenant"]
            ),
            "puts": CounterMetricFamily(
                "zerda_cache_tenant_puts", "Answers stored.", labels=["tenant"]
            ),
        }
        feedback = CounterMetricFamily(
            "zerda_cache_tenant_feedback",
            "Feedback signals applied, by polarity.",
            labels=["tenant", "polarity"],
        )
        evictions = CounterMetricFamily(
            "zerda_cache_tenant_evictions",
            "Entries removed, by reason.",
            labels=["tenant", "reason"],
        )
        rewards = HistogramMetricFamily(
            "zerda_cache_tenant_expected_reward",
            "Distribution of the arms' expected reward (at the last eviction scan).",
            labels=["tenant"],
        )
        confidences = HistogramMetricFamily(
            "zerda_cache_tenant_confidence",
            "Distribution of the entries' confidence (at the last eviction scan).",
            labels=["tenant"],
        )
        bound_metrics = {
            "bound": GaugeMetricFamily(
                "zerda_cache_tenant_error_bound",
                "The error bound (max_error_rate) a tenant serves under; absent: none.",
                labels=["tenant"],
            ),
            "threshold": GaugeMetricFamily(
                "zerda_cache_tenant_bound_threshold",
                "The similarity a near match needs under the bound; absent: none proven.",
                labels=["tenant"],
            ),
            "wrong_per_request": GaugeMetricFamily(
                "zerda_cache_tenant_wrong_per_request",
                "The labels' estimate of wrong serves per request at that similarity.",
                labels=["tenant"],
            ),
        }
        for label, snaps in groups.items():
            if label != OTHER:  # a tenant's own values: never summed over tenants
                for attr, gauge in bound_metrics.items():
                    value = getattr(snaps[0], attr)
                    if value is not None:
                        gauge.add_metric([label], value)
            total: dict[str, int] = {}
            for snap in snaps:
                for k, v in snap.stats.items():
                    total[k] = total.get(k, 0) + v
            gauges["entries"].add_metric([label], total.get("entries", 0))
            gauges["bytes"].add_metric([label], max(0, total.get("bytes", 0)))
            gauges["max_entries"].add_metric([label], sum(s.max_entries for s in snaps))
            gauges["max_bytes"].add_metric([label], sum(s.max_bytes or 0 for s in snaps))
            for name, fam in counters.items():
                fam.add_metric([label], total.get(name, 0))
            feedback.add_metric([label, "positive"], total.get("positive", 0))
            feedback.add_metric([label, "negative"], total.get("negative", 0))
            for reason in REASONS:
                evictions.add_metric([label, reason], total.get(f"evicted:{reason}", 0))
            for hist, attr in ((rewards, "rewards"), (confidences, "confidences")):
                dists = [getattr(s, attr) for s in snaps if getattr(s, attr) is not None]
                if not dists:
                    continue
                merged = Distribution()
                for d in dists:
                    merged.counts = [a + b for a, b in zip(merged.counts, d.counts, strict=True)]
                    merged.total += d.total
                    merged.sum += d.sum
                buckets = [(repr(b), c) for b, c in zip(merged.buckets, merged.counts, strict=True)]
                buckets.append(("+Inf", merged.total))
                hist.add_metric([label], buckets, merged.sum)
        yield from gauges.values()
        yield from counters.values()
        yield feedback
        yield evictions
        yield rewards
        yield confidences
        yield from bound_metrics.values()


class WorkerMetrics:
    """The worker's own metrics, on its own registry (served on ``/metrics``)."""

    def __init__(self, registry: CollectorRegistry, max_tenant_labels: int) -> None:
        self.registry = registry
        self.tenants = TenantCollector(max_tenant_labels)
        registry.register(self.tenants)
        self.cycle_seconds = Histogram(
            "zerda_cache_worker_cycle_duration_seconds",
            "Duration of decay and eviction cycles.",
            ["job"],
            buckets=CYCLE_BUCKETS,
            registry=registry,
        )
        self.cycles = Counter(
            "zerda_cache_worker_cycles",
            "Cycles run, by job and outcome (ok, stopped, error).",
            ["job", "outcome"],
            registry=registry,
        )
        self.last_success = Gauge(
            "zerda_cache_worker_last_success_timestamp_seconds",
            "Unix time of the last cycle that completed, by job.",
            ["job"],
            registry=registry,
        )
        self.leader = Gauge(
            "zerda_cache_worker_leader",
            "1 while this worker holds the lease and runs the cycles, else 0.",
            registry=registry,
        )
        self.errors = Counter(
            "zerda_cache_worker_errors",
            "Jobs that failed, by job.",
            ["job"],
            registry=registry,
        )
        self.evicted = Counter(
            "zerda_cache_worker_evicted",
            "Entries this worker evicted, by reason.",
            ["reason"],
            registry=registry,
        )
        self.decayed = Counter(
            "zerda_cache_worker_decayed",
            "Arms this worker decayed and persisted.",
            registry=registry,
        )
        for job in ("decay", "evict"):  # every series exists from the start
            self.cycle_seconds.labels(job)
            self.last_success.labels(job)
            self.errors.labels(job)
            for outcome in ("ok", "stopped", "error"):
                self.cycles.labels(job, outcome)
        self.errors.labels("metrics")
        self.errors.labels("lease")
        for reason in ("expired", "low_reward", "capacity", "corrupt"):
            self.evicted.labels(reason)
