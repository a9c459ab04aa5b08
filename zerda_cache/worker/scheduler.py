"""The eviction worker: APScheduler jobs over ``Maintenance``, led by a Redis lease.

Run it with ``zerda-cache worker`` (``python workers/eviction_worker.py`` runs the same
command). Any number of worker processes may run: the one holding the lease
(``zc:worker:leader``) runs the decay and eviction cycles, the others stand by and take
over within the lease's time to live when the leader dies. Every worker serves
``/metrics`` (``WorkerMetrics`` in ``metrics.py``).

Jobs (APScheduler 3.x ``BlockingScheduler``; coalesce, max_instances=1, misfire grace):

* ``lease`` every ``lease_ttl_s / 3``: take or renew the lease; touch the health file
  when Redis answered.
* ``decay`` every ``decay_job_interval_s`` (leader only): persist every arm's decay.
* ``evict`` every ``eviction_interval_s`` (leader only): expired, below the minimum
  reward, then over capacity; then each tenant's match model is fitted where 500
  labels were logged since its last fit (``Maintenance.calibrate_tenant``).
* ``metrics`` every ``metrics_interval_s``: read each tenant's counters and sizes.
* ``snapshot`` every ``snapshot_interval_s`` (leader only, its own thread): publish the
  index snapshot of each tenant of ``snapshot_min_entries`` or more once it is due
  (``snapshot.py``), for new replicas to load instead of building.

Decay and eviction share one single-thread executor, so a worker's cycles never overlap;
the lease keeps two workers' cycles from overlapping, and a leader that loses its lease
stops its cycle at the next batch. Signals: the first SIGTERM/SIGINT finishes the
current batch and stops (a warm stop; pair it with Kubernetes'
terminationGracePeriodSeconds); a second stops at once. The lease is released on exit.

Logging is the command line's (``cli.configure_logging``): INFO for the worker, and
APScheduler's loggers at WARNING unless DEBUG is asked for (at INFO they log every job
added and every run of the lease job, every few seconds).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.blocking import BlockingScheduler
from prometheus_client import CollectorRegistry, start_http_server

from zerda_cache.core.config import (
    DEFAULT_HEALTH_FILE,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_METRICS_HOST,
    CacheConfig,
    EvictionConfig,
)
from zerda_cache.core.errors import FencedError, StorageUnavailable, ZerdaError
from zerda_cache.metrics import TenantSnapshot, WorkerMetrics
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import leader_key
from zerda_cache.storage.lease import Lease
from zerda_cache.storage.reports import SettingsReporter
from zerda_cache.worker.maintenance import Maintenance
from zerda_cache.worker.snapshot import Snapshotter

log = logging.getLogger(__name__)

#: The worker's scheduled cycles.
Job = Literal["decay", "evict"]


class Worker:
    """One worker process: lease, scheduler, jobs, metrics and signals.

    Args:
        client: a sync redis-py client (plain or cluster).
        config: the cache configuration (intervals and capacity in ``config.eviction``).
        lease_ttl_s: the leader lease's time to live; takeover happens within it.
        metrics_port: serve ``/metrics`` here (``None``: do not serve; 0: any free port).
        health_file: touched by every lease tick that reached Redis, for ``--check``
            (a worker that cannot reach Redis goes unhealthy within the lease's TTL).
        registry: where the metrics go (default: a registry of its own).
    """

    def __init__(
        self,
        client: Any,
        config: CacheConfig | None = None,
        *,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        metrics_port: int | None = None,
        metrics_host: str = DEFAULT_METRICS_HOST,
        health_file: str | None = DEFAULT_HEALTH_FILE,
        registry: CollectorRegistry | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.config = config if config is not None else CacheConfig()
        self.client = client
        self.storage = RedisStorage(client, self.config)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        # The settings this worker applies, reported to each tenant its passes read.
        self.storage.reporter = SettingsReporter(self.config, "worker", process=self.worker_id)
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
            fence=lambda: self.lease.epoch,
            worker_id=self.worker_id,
        )
        self.snapshots = Snapshotter(self.storage)
        self._allkeys = False  # the server may evict our keys (check_server)
        self._last_sweep = -math.inf
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
                "snap": ThreadPoolExecutor(1),  # index snapshots: long, CPU-bound
            },
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30},
        )

        def every(
            job: Callable[[], None], seconds: float, name: str, executor: str, now: bool = False
        ) -> None:
            first = {"next_run_time": _now_dt()} if now else {}  # else after one interval
            scheduler.add_job(job, "interval", seconds=seconds, id=name, executor=executor, **first)

        every(self.lease_tick, self.lease_interval_s, "lease", "aux", now=True)
        every(self.decay_job, ev.decay_job_interval_s, "decay", "default")
        every(self.evict_job, ev.eviction_interval_s, "evict", "default")
        if ev.snapshot_min_entries > 0:
            every(self.snapshot_job, ev.snapshot_interval_s, "snapshot", "snap")
        every(self.metrics_job, ev.metrics_interval_s, "metrics", "aux", now=True)
        return scheduler

    # -- jobs ----------------------------------------------------------------------------------
    def lease_tick(self) -> None:
        try:
            held = self.lease.acquire_or_renew()
        except ZerdaError as exc:
            self.metrics.errors.labels("lease").inc()
            log.warning("lease tick failed: %s", exc)
            self.metrics.leader.set(0)
            return  # no touch: the health file says Redis answered recently
        self.metrics.leader.set(1 if held else 0)
        if self.health_file:
            try:
                Path(self.health_file).touch()
            except OSError as exc:
                log.warning("cannot touch health file %s: %s", self.health_file, exc)

    def _cycle(self, job: Job) -> None:
        """One decay or eviction cycle. Redis out of reach (``StorageUnavailable``,
        from the lease or from the cycle) is an outage, not a bug: one WARNING line a
        tick, as the lease tick logs it, and the next tick tries again; so is a refused
        fence. Anything else, a reply error of Redis included (a script's error,
        WRONGTYPE: the data, not the server), is logged with its traceback.

        A cycle in which some tenants' parts failed (``Maintenance.failures``: logged,
        and the cycle went on with the others) adds them to the job's errors and ends
        as ``error``, without a new last success: the alerts on both see it."""
        started = time.perf_counter()
        failures = self.maintenance.failures
        try:
            if self.stop_event.is_set() or not self.lease.acquire_or_renew():
                return
            if job == "decay":
                reports = self.maintenance.run_decay()
                self.metrics.decayed.inc(sum(r.decayed for r in reports))
            else:
                for report in self.maintenance.run_eviction():
                    for reason, n in report.removed.items():
                        self.metrics.evicted.labels(reason).inc(n)
                self._maybe_sweep()
                self.maintenance.run_calibration()
        except (StorageUnavailable, FencedError) as exc:
            self.metrics.errors.labels(job).inc()
            self.metrics.cycles.labels(job, "error").inc()
            log.warning("%s cycle skipped: Redis failed: %s", job, _one_line(exc))
            return
        except Exception:
            self.metrics.errors.labels(job).inc()
            self.metrics.cycles.labels(job, "error").inc()
            log.exception("%s cycle failed", job)
            return
        if self.maintenance.fenced:  # a newer leader wrote: this one's lease is stale
            log.warning("%s cycle fenced off: giving the lease up", job)
            self._release()
        failed = self.maintenance.failures - failures
        if failed:
            self.metrics.errors.labels(job).inc(failed)
        outcome = "error" if failed else ("stopped" if self.maintenance.halted() else "ok")
        self.metrics.cycles.labels(job, outcome).inc()
        self.metrics.cycle_seconds.labels(job).observe(time.perf_counter() - started)
        if outcome == "ok":
            self.metrics.last_success.labels(job).set(time.time())

    def _maybe_sweep(self) -> None:
        """Under an allkeys-* policy, sweep for orphaned entries every full scan interval."""
        interval = self.config.eviction.full_scan_interval_s
        if not self._allkeys or time.monotonic() - self._last_sweep < interval:
            return
        self._last_sweep = time.monotonic()
        self.maintenance.sweep_orphans()

    def decay_job(self) -> None:
        self._cycle("decay")

    def evict_job(self) -> None:
        self._cycle("evict")

    def snapshot_job(self) -> None:
        """Publish the index snapshots that are due (leader only)."""
        if self.stop_event.is_set() or not self.lease.held:
            return
        try:
            for tenant in self.storage.tenants():
                if self.stop_event.is_set() or not self.lease.held:
                    break
                self.snapshots.snapshot_tenant(tenant)
        except Exception:
            self.metrics.errors.labels("snapshot").inc()
            log.exception("index snapshot failed")

    def metrics_job(self) -> None:
        try:
            snapshot: dict[str, TenantSnapshot] = {}
            for tenant in self.storage.tenants():
                policy = self.maintenance.policy(tenant)
                limits = self.maintenance.limits(tenant, policy)
                plan = self.maintenance.last_plans.get(tenant)
                threshold = policy.threshold()
                snapshot[tenant] = TenantSnapshot(
                    stats=self.storage.stats(tenant),
                    max_entries=limits.max_entries,
                    max_bytes=limits.max_bytes,
                    rewards=plan.rewards if plan else None,
                    confidences=plan.confidences if plan else None,
                    bound=policy.bound(),
                    threshold=threshold,
                    wrong_per_request=(
                        None
                        if threshold is None
                        else policy.calibration.wrong_per_request(threshold)
                    ),
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

    def check_server(self) -> None:
        """Warn about a server that may evict zerda-cache's own keys."""
        policy = self.storage.eviction_policy()
        self._allkeys = policy is not None and policy.startswith("allkeys")
        if self._allkeys:
            log.warning(
                "the server's maxmemory-policy is %s: Redis may evict any key, the tenant "
                "registry, settings and indexes included (replicas re-create the registry "
                "and guard the dimension, and the worker sweeps the keyspace for orphaned "
                "entries every full_scan_interval_s). Use noeviction or a volatile-* "
                "policy: the worker evicts by capacity itself.",
                policy,
            )

    def run(self) -> None:
        """Run until stopped by a signal (or ``stop()``)."""
        self.check_server()
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
        self.snapshots.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.storage.close()

    def _release(self) -> None:
        try:
            if self.lease.held:
                self.lease.release()
        except ZerdaError as exc:
            log.warning("could not release the lease: %s", exc)
        self.metrics.leader.set(0)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An error's message and its cause's, on one line of at most ``limit`` characters
    (a StorageError chains the client's exception)."""
    text = str(exc)
    if exc.__cause__ is not None and str(exc.__cause__) not in text:
        text += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _now_dt() -> Any:
    from datetime import datetime

    return datetime.now()


def health_problem(health_file: str, max_age_s: float) -> str | None:
    """Why the worker is not live (``None``: it is): its health file was not touched
    within ``max_age_s`` (a lease tick touches it whenever Redis answered)."""
    try:
        age = time.time() - Path(health_file).stat().st_mtime
    except OSError as exc:
        return f"no health file {health_file} ({exc.strerror}): is the worker running?"
    if age > max_age_s:
        return (
            f"{health_file} was last touched {age:.0f} s ago, over {max_age_s:g} s: the "
            "worker is stuck or cannot reach Redis"
        )
    return None


def check_health(health_file: str, max_age_s: float) -> bool:
    """Liveness: the health file was touched within ``max_age_s``."""
    return health_problem(health_file, max_age_s) is None
