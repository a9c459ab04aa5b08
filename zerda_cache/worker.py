"""The eviction worker: APScheduler jobs over ``Maintenance``, led by a Redis lease.

Run it with ``zerda-cache worker`` (or ``python workers/eviction_worker.py``). Any number
of worker processes may run: the one holding the lease (``zc:worker:leader``) runs the
decay and eviction cycles, the others stand by and take over within the lease's time to
live when the leader dies. Every worker serves ``/metrics``.

Jobs (APScheduler 3.x ``BlockingScheduler``; coalesce, max_instances=1, misfire grace):

* ``lease`` every ``lease_ttl_s / 3``: take or renew the lease; touch the health file.
* ``decay`` every ``decay_interval_s`` (leader only): persist every arm's decay.
* ``evict`` every ``eviction_interval_s`` (leader only): expired, below the minimum
  reward, then over capacity.
* ``metrics`` every ``metrics_interval_s``: read each tenant's counters and sizes.

Decay and eviction share one single-thread executor, so a worker's cycles never overlap;
the lease keeps two workers' cycles from overlapping, and a leader that loses its lease
stops its cycle at the next batch. Signals: the first SIGTERM/SIGINT finishes the
current batch and stops (a warm stop; pair it with Kubernetes'
terminationGracePeriodSeconds); a second stops at once. The lease is released on exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.blocking import BlockingScheduler
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from zerda_cache.config import DEFAULT_MAX_TENANT_LABELS, CacheConfig, EvictionConfig
from zerda_cache.errors import ZerdaError
from zerda_cache.keys import leader_key
from zerda_cache.lease import Lease
from zerda_cache.maintenance import Distribution, Maintenance
from zerda_cache.metrics import OTHER
from zerda_cache.storage import RedisStorage

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 15.0
DEFAULT_METRICS_PORT = 9108
DEFAULT_HEALTH_FILE = "/tmp/zerda-cache-worker.health"
CYCLE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(slots=True)
class TenantSnapshot:
    stats: dict[str, int] = field(default_factory=dict)
    max_entries: int = 0
    max_bytes: int | None = None
    rewards: Distribution | None = None
    confidences: Distribution | None = None


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
        for label, snaps in groups.items():
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
            for reason in (
                "expired",
                "low_reward",
                "capacity",
                "invalidated",
                "replaced",
                "corrupt",
            ):
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


class Worker:
    """One worker process: lease, scheduler, jobs, metrics and signals.

    Args:
        client: a sync redis-py client (plain or cluster).
        config: the cache configuration (intervals and capacity in ``config.eviction``).
        lease_ttl_s: the leader lease's time to live; takeover happens within it.
        metrics_port: serve ``/metrics`` here (``None``: do not serve; 0: any free port).
        health_file: touched by every lease tick, for ``--check``.
        registry: where the metrics go (default: a registry of its own).
    """

    def __init__(
        self,
        client: Any,
        config: CacheConfig | None = None,
        *,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        health_file: str | None = DEFAULT_HEALTH_FILE,
        registry: CollectorRegistry | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.config = config if config is not None else CacheConfig()
        self.client = client
        self.storage = RedisStorage(client, self.config)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.lease = Lease(
            client,
            leader_key(self.config.key_prefix),
            lease_ttl_s,
            scripts=self.storage.scripts,
            holder_id=self.worker_id,
        )
        self.stop_event = threading.Event()
        self.maintenance = Maintenance(
            self.storage,
            stop=self.stop_event,
            active=lambda: self.lease.held,
            worker_id=self.worker_id,
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry, self.config.max_tenant_labels)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.health_file = health_file
        self.lease_interval_s = lease_ttl_s / 3
        self.scheduler = self._scheduler()
        self._server: Any = None
        self._signals = 0
        self._shutdown: threading.Thread | None = None

    def _scheduler(self) -> BlockingScheduler:
        ev: EvictionConfig = self.config.eviction
        scheduler = BlockingScheduler(
            executors={
                "default": ThreadPoolExecutor(1),  # decay and evict: never at once
                "aux": ThreadPoolExecutor(2),  # lease and metrics
            },
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30},
        )
        scheduler.add_job(
            self.lease_tick,
            "interval",
            seconds=self.lease_interval_s,
            id="lease",
            executor="aux",
            next_run_time=_now_dt(),
        )
        scheduler.add_job(self.decay_job, "interval", seconds=ev.decay_interval_s, id="decay")
        scheduler.add_job(self.evict_job, "interval", seconds=ev.eviction_interval_s, id="evict")
        scheduler.add_job(
            self.metrics_job,
            "interval",
            seconds=ev.metrics_interval_s,
            id="metrics",
            executor="aux",
            next_run_time=_now_dt(),
        )
        return scheduler

    # -- jobs ----------------------------------------------------------------------------------
    def lease_tick(self) -> None:
        try:
            held = self.lease.acquire_or_renew()
        except ZerdaError as exc:
            self.metrics.errors.labels("lease").inc()
            log.warning("lease tick failed: %s", exc)
            held = False
        self.metrics.leader.set(1 if held else 0)
        if self.health_file:
            try:
                Path(self.health_file).touch()
            except OSError as exc:
                log.warning("cannot touch health file %s: %s", self.health_file, exc)

    def _cycle(self, job: str) -> None:
        if self.stop_event.is_set() or not self.lease.acquire_or_renew():
            return
        started = time.perf_counter()
        try:
            if job == "decay":
                reports = self.maintenance.run_decay()
                self.metrics.decayed.inc(sum(r.decayed for r in reports))
            else:
                for report in self.maintenance.run_eviction():
                    for reason, n in report.removed.items():
                        self.metrics.evicted.labels(reason).inc(n)
        except Exception:
            self.metrics.errors.labels(job).inc()
            self.metrics.cycles.labels(job, "error").inc()
            log.exception("%s cycle failed", job)
            return
        outcome = "stopped" if self.maintenance._halted() else "ok"
        self.metrics.cycles.labels(job, outcome).inc()
        self.metrics.cycle_seconds.labels(job).observe(time.perf_counter() - started)
        if outcome == "ok":
            self.metrics.last_success.labels(job).set(time.time())

    def decay_job(self) -> None:
        self._cycle("decay")

    def evict_job(self) -> None:
        self._cycle("evict")

    def metrics_job(self) -> None:
        try:
            snapshot: dict[str, TenantSnapshot] = {}
            for tenant in self.storage.tenants():
                limits = self.maintenance.limits(tenant)
                plan = self.maintenance.last_plans.get(tenant)
                snapshot[tenant] = TenantSnapshot(
                    stats=self.storage.stats(tenant),
                    max_entries=limits.max_entries,
                    max_bytes=limits.max_bytes,
                    rewards=plan.rewards if plan else None,
                    confidences=plan.confidences if plan else None,
                )
            self.metrics.tenants.update(snapshot)
        except Exception:
            self.metrics.errors.labels("metrics").inc()
            log.exception("metrics refresh failed")

    # -- lifecycle -----------------------------------------------------------------------------
    def serve_metrics(self) -> int:
        """Start the ``/metrics`` HTTP server; returns its port."""
        if self.metrics_port is None:
            return 0
        self._server, _thread = start_http_server(
            self.metrics_port, addr=self.metrics_host, registry=self.registry
        )
        port = int(self._server.server_port)
        log.info("serving /metrics on %s:%d", self.metrics_host, port)
        return port

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            log.warning("signal %d: finishing the current batch, then stopping", signum)
            self.stop_event.set()
            # shutdown(wait=True) waits for the running cycle (which stops at its next
            # batch); run() joins this thread before it releases the lease.
            self._shutdown = threading.Thread(
                target=self.scheduler.shutdown, kwargs={"wait": True}, daemon=True
            )
            self._shutdown.start()
        else:
            log.warning("signal %d again: stopping now", signum)
            self._release()
            os._exit(1)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def run(self) -> None:
        """Run until stopped by a signal (or ``stop()``)."""
        self.serve_metrics()
        log.info("worker %s starting (lease %s)", self.worker_id, self.lease.key)
        try:
            self.scheduler.start()
        finally:
            self.stop_event.set()
            if self._shutdown is not None:  # wait for the running cycle's last batch
                self._shutdown.join()
            self.close()
            log.info("worker %s stopped", self.worker_id)

    def stop(self) -> None:
        """Warm stop from another thread (tests, embedding the worker)."""
        self._on_signal(0, None)

    def close(self) -> None:
        """Release the lease, stop serving metrics, close the Redis client."""
        self._release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.client.close()

    def _release(self) -> None:
        try:
            if self.lease.held:
                self.lease.release()
        except ZerdaError as exc:
            log.warning("could not release the lease: %s", exc)
        self.metrics.leader.set(0)


def _now_dt() -> Any:
    from datetime import datetime

    return datetime.now()


def check_health(health_file: str, max_age_s: float) -> bool:
    """Liveness: the health file was touched within ``max_age_s``."""
    try:
        age = time.time() - Path(health_file).stat().st_mtime
    except OSError:
        return False
    return age <= max_age_s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerda-cache-worker", description=__doc__.split("\n")[0])
    p.add_argument("--redis-url", default=os.environ.get("ZERDA_REDIS_URL"))
    p.add_argument("--cluster", action="store_true", help="the URL is a Redis Cluster node")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT)
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL_S)
    p.add_argument("--decay-interval", type=float, default=None)
    p.add_argument("--eviction-interval", type=float, default=None)
    p.add_argument("--metrics-interval", type=float, default=None)
    p.add_argument("--max-entries", type=int, default=None)
    p.add_argument("--key-prefix", default=None)
    p.add_argument("--health-file", default=DEFAULT_HEALTH_FILE)
    p.add_argument("--worker-id", default=None)
    p.add_argument("--check", action="store_true", help="liveness probe: exit 0 if healthy")
    p.add_argument("--log-level", default=os.environ.get("ZERDA_LOG_LEVEL", "INFO"))
    return p


def config_from_args(args: argparse.Namespace) -> CacheConfig:
    from dataclasses import replace

    cfg = CacheConfig() if args.key_prefix is None else CacheConfig(key_prefix=args.key_prefix)
    ev = cfg.eviction
    changes: dict[str, Any] = {}
    for arg, name in (
        ("decay_interval", "decay_interval_s"),
        ("eviction_interval", "eviction_interval_s"),
        ("metrics_interval", "metrics_interval_s"),
        ("max_entries", "max_entries"),
    ):
        value = getattr(args, arg)
        if value is not None:
            changes[name] = value
    return replace(cfg, eviction=replace(ev, **changes)) if changes else cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.check:
        healthy = check_health(args.health_file, max_age_s=args.lease_ttl)
        print("healthy" if healthy else "unhealthy")
        return 0 if healthy else 1
    if not args.redis_url:
        print("zerda-cache worker: --redis-url or ZERDA_REDIS_URL is required", file=sys.stderr)
        return 2
    from zerda_cache.manager import connect

    cfg = config_from_args(args)
    client = connect(args.redis_url, cfg, cluster=args.cluster or None)
    worker = Worker(
        client,
        cfg,
        lease_ttl_s=args.lease_ttl,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        health_file=args.health_file,
        worker_id=args.worker_id,
    )
    worker.install_signal_handlers()
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
