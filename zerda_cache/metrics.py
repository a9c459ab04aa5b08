"""Prometheus metrics. Names are part of the API: the dashboards in deploy/ query them.

``ReplicaMetrics`` is what each app replica exports, ``WorkerMetrics`` what the worker
serves on ``/metrics``. Every name starts with ``zerda_cache_``. The tenant label is
bounded: a replica names the first ``max_tenant_labels`` tenants it sees and reports the
rest as ``other``, so a runaway number of tenants cannot explode the series count.
``docs/metrics.md`` lists every metric with its type and labels.

Each class declares its metrics in a table (attribute -> ``MetricSpec``) that one loop
registers, so a metric is one row: its kind, name, help text, labels and buckets.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
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

from zerda_cache.core.config import DEFAULT_MAX_TENANT_LABELS
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


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric to register: a ``Counter``, ``Gauge`` or ``Histogram`` (``buckets``
    only for a histogram), its name, help text and label names."""

    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def make(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        if self.kind is Histogram:
            return Histogram(
                self.name, self.doc, self.labels, buckets=self.buckets, registry=registry
            )
        return self.kind(self.name, self.doc, self.labels, registry=registry)


def register(owner: object, specs: Mapping[str, MetricSpec], registry: CollectorRegistry) -> None:
    """Register every metric of ``specs`` on ``registry`` as the attribute of ``owner``
    its key names (in the table's order, which is the order ``/metrics`` lists them)."""
    for attr, spec in specs.items():
        setattr(owner, attr, spec.make(registry))


#: What a replica exports (besides the rolling windows of ``_AdaptiveCollector``).
REPLICA_METRICS: dict[str, MetricSpec] = {
    # lookups, puts and feedback
    "lookups": MetricSpec(
        Counter,
        "zerda_cache_lookups",
        "Lookups by result: hit, miss or fail_open (Redis unreachable or too slow).",
        ("tenant", "result"),
    ),
    "lookup_latency": MetricSpec(
        Histogram,
        "zerda_cache_lookup_latency_seconds",
        "Lookup latency, embedding excluded, by result.",
        ("result",),
        LATENCY_BUCKETS,
    ),
    "fail_open": MetricSpec(
        Counter,
        "zerda_cache_fail_open",
        "Lookups answered as a miss because Redis failed.",
        ("tenant",),
    ),
    "puts": MetricSpec(
        Counter,
        "zerda_cache_puts",
        "Puts by result: stored, kept (the same answer as a held-back cached one) or rejected.",
        ("tenant", "result"),
    ),
    "puts_rejected": MetricSpec(
        Counter,
        "zerda_cache_puts_rejected",
        "Puts refused by the admission check, by reason.",
        ("reason",),
    ),
    "feedback": MetricSpec(
        Counter,
        "zerda_cache_replica_feedback",
        "Feedback signals sent by this replica, by polarity.",
        ("tenant", "polarity"),
    ),
    # the local vector index
    "index_rebuilds": MetricSpec(
        Counter,
        "zerda_cache_index_rebuilds",
        "Full rebuilds of a tenant's local vector index (first use or log trimmed).",
        ("tenant",),
    ),
    "index_ready": MetricSpec(
        Gauge,
        "zerda_cache_index_ready",
        "1 when this replica's index of the tenant is built, 0 while it is being built "
        "(lookups then serve exact-question matches).",
        ("tenant",),
    ),
    "index_build_seconds": MetricSpec(
        Histogram,
        "zerda_cache_index_build_seconds",
        "Duration of this replica's index builds (in the background).",
        buckets=BUILD_BUCKETS,
    ),
    "storage_errors": MetricSpec(
        Counter,
        "zerda_cache_storage_errors",
        "Redis errors seen by this replica, by operation.",
        ("operation",),
    ),
    # Savings (zerda_cache.core.savings): hits of answers put with their usage, and hits
    # judged wrong (their call was bought after all).
    "saved_calls": MetricSpec(
        Counter,
        "zerda_cache_saved_calls",
        "LLM calls a hit avoided, by the model that made the cached answer.",
        ("tenant", "model"),
    ),
    "saved_tokens": MetricSpec(
        Counter,
        "zerda_cache_saved_tokens",
        "Tokens of the LLM calls hits avoided, by kind (prompt, completion).",
        ("tenant", "model", "kind"),
    ),
    "saved_usd": MetricSpec(
        Counter,
        "zerda_cache_saved_usd",
        "US dollars of the LLM calls hits avoided (CacheConfig.token_prices).",
        ("tenant", "model"),
    ),
    "wrong_calls": MetricSpec(
        Counter,
        "zerda_cache_wrong_hit_calls",
        "Hits judged wrong by negative feedback: calls bought after all.",
        ("tenant", "model"),
    ),
    "wrong_tokens": MetricSpec(
        Counter,
        "zerda_cache_wrong_hit_tokens",
        "Tokens of the hits judged wrong, by kind (prompt, completion).",
        ("tenant", "model", "kind"),
    ),
    "wrong_usd": MetricSpec(
        Counter,
        "zerda_cache_wrong_hit_usd",
        "US dollars of the hits judged wrong.",
        ("tenant", "model"),
    ),
}


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

    The metrics are the attributes ``REPLICA_METRICS`` names.

    Args:
        registry: where to register; one ``ReplicaMetrics`` per registry.
        max_tenant_labels: tenants named before the rest become ``other``.
    """

    lookups: Counter
    lookup_latency: Histogram
    fail_open: Counter
    puts: Counter
    puts_rejected: Counter
    feedback: Counter
    index_rebuilds: Counter
    index_ready: Gauge
    index_build_seconds: Histogram
    storage_errors: Counter
    saved_calls: Counter
    saved_tokens: Counter
    saved_usd: Counter
    wrong_calls: Counter
    wrong_tokens: Counter
    wrong_usd: Counter

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS,
    ) -> None:
        reg = registry if registry is not None else REGISTRY
        self.registry = reg
        self.tenant = TenantLabels(max_tenant_labels)
        register(self, REPLICA_METRICS, reg)
        self._adaptive = _AdaptiveCollector()
        reg.register(self._adaptive)
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


#: The rolling windows of an ``AdaptiveLearningSystem`` report a replica exports:
#: report key -> (gauge name, help).
ADAPTIVE_WINDOWS = {
    "avg_response_ms": (
        "zerda_cache_replica_window_latency_ms",
        "Mean lookup (and admission) time over the last 100 operations.",
    ),
    "avg_context_length": (
        "zerda_cache_replica_window_answer_chars",
        "Mean answer length over the last 100 lookups and puts (a miss counts 0).",
    ),
    "avg_chunk_count": (
        "zerda_cache_replica_window_candidates",
        "Mean candidates over the last 100 lookups and puts (a put counts 0).",
    ),
    "guard_failure_rate": (
        "zerda_cache_replica_window_admission_failure_ratio",
        "Share of the last 100 operations that were puts refused by the admission check.",
    ),
}


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
        """Each window averaged over the watched managers, weighted by their samples."""
        with self._lock:
            reports = [s.get_performance_report() for s in list(self.systems)]
        weights = [r["samples"] for r in reports]
        total = sum(weights)
        for key, (name, doc) in ADAPTIVE_WINDOWS.items():
            value = (
                sum(r[key] * w for r, w in zip(reports, weights, strict=True)) / total
                if total
                else 0.0
            )
            fam = GaugeMetricFamily(name, doc)
            fam.add_metric([], value)
            yield fam


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

    def merge(self, other: Distribution) -> None:
        """Add ``other``'s counts (the same buckets) to these."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total
        self.sum += other.sum

    def histogram_buckets(self) -> list[tuple[str, float]]:
        """The buckets as a ``HistogramMetricFamily`` takes them, ``+Inf`` last."""
        buckets: list[tuple[str, float]] = [
            (repr(b), c) for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        buckets.append(("+Inf", self.total))
        return buckets


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


#: The per-tenant gauges: what they read -> (name, help).
TENANT_GAUGES = {
    "entries": ("zerda_cache_tenant_entries", "Live entries per tenant."),
    "bytes": (
        "zerda_cache_tenant_bytes",
        "Bytes of stored content (query, answer, metadata, vector) per tenant.",
    ),
    "max_entries": (
        "zerda_cache_tenant_max_entries",
        "Entry capacity per tenant (the worker evicts above it).",
    ),
    "max_bytes": ("zerda_cache_tenant_max_bytes", "Byte capacity per tenant (0: none)."),
}
#: The per-tenant counters: the shared stats field they read -> (name, help).
TENANT_COUNTERS = {
    "hits": ("zerda_cache_tenant_hits", "Cached answers served, all replicas."),
    "misses": ("zerda_cache_tenant_misses", "Lookups that found no answer."),
    "puts": ("zerda_cache_tenant_puts", "Answers stored."),
}
#: The distributions of the last eviction scan: ``TenantSnapshot`` field -> (name, help).
TENANT_DISTRIBUTIONS = {
    "rewards": (
        "zerda_cache_tenant_expected_reward",
        "Distribution of the arms' expected reward (at the last eviction scan).",
    ),
    "confidences": (
        "zerda_cache_tenant_confidence",
        "Distribution of the entries' confidence (at the last eviction scan).",
    ),
}
#: A tenant's error bound and what it proves: ``TenantSnapshot`` field -> (name, help).
TENANT_BOUND = {
    "bound": (
        "zerda_cache_tenant_error_bound",
        "The error bound (max_error_rate) a tenant serves under; absent: none.",
    ),
    "threshold": (
        "zerda_cache_tenant_bound_threshold",
        "The similarity a near match needs under the bound; absent: none proven.",
    ),
    "wrong_per_request": (
        "zerda_cache_tenant_wrong_per_request",
        "The labels' estimate of wrong serves per request at that similarity.",
    ),
}


class TenantFamilies:
    """The metric families of one ``TenantCollector.collect``, filled a label at a time."""

    def __init__(self) -> None:
        tenant = ["tenant"]
        self.gauges = {k: GaugeMetricFamily(*v, labels=tenant) for k, v in TENANT_GAUGES.items()}
        self.counters = {
            k: CounterMetricFamily(*v, labels=tenant) for k, v in TENANT_COUNTERS.items()
        }
        self.feedback = CounterMetricFamily(
            "zerda_cache_tenant_feedback",
            "Feedback signals applied, by polarity.",
            labels=["tenant", "polarity"],
        )
        self.evictions = CounterMetricFamily(
            "zerda_cache_tenant_evictions",
            "Entries removed, by reason.",
            labels=["tenant", "reason"],
        )
        self.distributions = {
            k: HistogramMetricFamily(*v, labels=tenant) for k, v in TENANT_DISTRIBUTIONS.items()
        }
        self.bound = {k: GaugeMetricFamily(*v, labels=tenant) for k, v in TENANT_BOUND.items()}

    def add(self, label: str, snaps: list[TenantSnapshot]) -> None:
        """The series of ``label``: one tenant's snapshot, or the sum of those in
        ``other``."""
        if label != OTHER:  # a tenant's own values: never summed over tenants
            self._add_bound(label, snaps[0])
        self._add_totals(label, snaps)
        self._add_distributions(label, snaps)

    def _add_bound(self, label: str, snap: TenantSnapshot) -> None:
        for attr, gauge in self.bound.items():
            value = getattr(snap, attr)
            if value is not None:
                gauge.add_metric([label], value)

    def _add_totals(self, label: str, snaps: list[TenantSnapshot]) -> None:
        total: dict[str, int] = {}
        for snap in snaps:
            for k, v in snap.stats.items():
                total[k] = total.get(k, 0) + v
        self.gauges["entries"].add_metric([label], total.get("entries", 0))
        self.gauges["bytes"].add_metric([label], max(0, total.get("bytes", 0)))
        self.gauges["max_entries"].add_metric([label], sum(s.max_entries for s in snaps))
        self.gauges["max_bytes"].add_metric([label], sum(s.max_bytes or 0 for s in snaps))
        for name, fam in self.counters.items():
            fam.add_metric([label], total.get(name, 0))
        self.feedback.add_metric([label, "positive"], total.get("positive", 0))
        self.feedback.add_metric([label, "negative"], total.get("negative", 0))
        for reason in REASONS:
            self.evictions.add_metric([label, reason], total.get(f"evicted:{reason}", 0))

    def _add_distributions(self, label: str, snaps: list[TenantSnapshot]) -> None:
        for attr, hist in self.distributions.items():
            dists = [getattr(s, attr) for s in snaps if getattr(s, attr) is not None]
            if not dists:
                continue
            merged = Distribution()
            for d in dists:
                merged.merge(d)
            hist.add_metric([label], merged.histogram_buckets(), merged.sum)

    def __iter__(self) -> Iterator[Metric]:
        yield from self.gauges.values()
        yield from self.counters.values()
        yield self.feedback
        yield self.evictions
        yield from self.distributions.values()
        yield from self.bound.values()


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
        families = TenantFamilies()
        for label, snaps in self._grouped().items():
            families.add(label, snaps)
        yield from families


#: The worker's own metrics (besides the per-tenant ones of ``TenantCollector``).
WORKER_METRICS: dict[str, MetricSpec] = {
    "cycle_seconds": MetricSpec(
        Histogram,
        "zerda_cache_worker_cycle_duration_seconds",
        "Duration of decay and eviction cycles.",
        ("job",),
        CYCLE_BUCKETS,
    ),
    "cycles": MetricSpec(
        Counter,
        "zerda_cache_worker_cycles",
        "Cycles run, by job and outcome (ok, stopped, error).",
        ("job", "outcome"),
    ),
    "last_success": MetricSpec(
        Gauge,
        "zerda_cache_worker_last_success_timestamp_seconds",
        "Unix time of the last cycle that completed, by job.",
        ("job",),
    ),
    "leader": MetricSpec(
        Gauge,
        "zerda_cache_worker_leader",
        "1 while this worker holds the lease and runs the cycles, else 0.",
    ),
    "errors": MetricSpec(
        Counter, "zerda_cache_worker_errors", "Jobs that failed, by job.", ("job",)
    ),
    "evicted": MetricSpec(
        Counter,
        "zerda_cache_worker_evicted",
        "Entries this worker evicted, by reason.",
        ("reason",),
    ),
    "decayed": MetricSpec(
        Counter, "zerda_cache_worker_decayed", "Arms this worker decayed and persisted."
    ),
}


class WorkerMetrics:
    """The worker's own metrics, on its own registry (served on ``/metrics``): the
    attributes ``WORKER_METRICS`` names, and ``tenants``."""

    cycle_seconds: Histogram
    cycles: Counter
    last_success: Gauge
    leader: Gauge
    errors: Counter
    evicted: Counter
    decayed: Counter

    def __init__(self, registry: CollectorRegistry, max_tenant_labels: int) -> None:
        self.registry = registry
        self.tenants = TenantCollector(max_tenant_labels)
        registry.register(self.tenants)
        register(self, WORKER_METRICS, registry)
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
