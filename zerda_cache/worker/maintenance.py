"""What the worker does each cycle: decay every arm, evict what is not worth keeping, fit
the match models. ``Maintenance`` composes the parts that do it, each in a module of its
own:

* ``decay.py`` (``DecayJob``): persisting the decay of the arms with evidence;
* ``eviction.py`` (``EvictionPlanner``, ``EvictionExecutor``): what to remove from a
  tenant, and removing it;
* ``audit.py`` (``ContentAudit``, ``Orphans``): corrupt entries, the tag sweep, entries
  whose ids were lost;
* ``fitting.py`` (``ModelFits``): the match model's fit;
* ``state_scan.py`` (``StateScan``): reading learning state in bounded calls, ahead of
  the scoring;
* ``cycle_context.py`` (``CycleContext``): the storage and the brakes they share.

``Maintenance`` keeps the cycles over every tenant, the lease's claim on them, and the
cycle log. Decay and eviction stop between batches when asked to stop.

The constants below size the parts' calls; a part takes them when ``Maintenance`` is
built (a test or benchmark that sets one here first changes it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from zerda_cache.core.config import EvictionConfig
from zerda_cache.core.errors import FencedError, StorageError, StorageUnavailable
from zerda_cache.learning.bandit import CachePolicyLearner
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.storage import RedisStorage
from zerda_cache.worker.audit import ContentAudit, Orphans
from zerda_cache.worker.cycle_context import LOGGER, CycleContext
from zerda_cache.worker.decay import DecayJob, DecayReport
from zerda_cache.worker.eviction import (
    EvictionExecutor,
    EvictionPlan,
    EvictionPlanner,
    EvictionReport,
    TenantLimits,
)
from zerda_cache.worker.fitting import FitReport, ModelFits
from zerda_cache.worker.state_scan import StateScan

log = logging.getLogger(LOGGER)
R = TypeVar("R")

#: Batches a whole scan reads ahead of the one it scores, each in its own thread: while
#: one waits for Redis, another packs its call or parses its reply, so the server is
#: never idle. From 1 on, the ZSCAN steps run ahead too, in a thread of their own. Two
#: ahead already keep the server busy: a third adds a thread, not throughput
#: (bench_worker times the whole scan at 0, 1 and 2 ahead). ``Maintenance.read_ahead``.
READ_AHEAD = 2
#: Entries removed per call of the evict script, at most (``EvictionConfig.scan_batch``
#: if smaller). A call holds the server's one thread for all of its removals (~15-20 us
#: each), every replica's lookups waiting behind it: 500 a call hold it ~20 ms, 50 a call
#: ~1 ms. bench_worker measures this (another client's GET p50 / p99 during a full
#: cycle, and Redis's own time per call).
EVICT_BATCH = 50
#: Calls of the evict script under way at once: with two, the worker packs and parses
#: one while the server runs the other, and another client's command waits behind both
#: at worst. More calls at once, or larger ones, finish a cycle's removals sooner but
#: make another client wait longer; bench_worker measures both sides.
EVICT_IN_FLIGHT = 2
#: Arms whose decay is persisted per call of the decay script, at most (``scan_batch`` if
#: smaller): rewriting an arm costs the server ~14 us, so 500 a call would hold its one
#: thread ~7 ms, the longest call of a full cycle; 100 a call hold it ~1.4 ms
#: (bench_worker measures Redis's time per call; SLOWLOG shows the longest).
DECAY_BATCH = 100
#: Entries whose state one call of the read-only ``state`` script reads, at most (each
#: ZSCAN step of ``scan_batch`` ids is read in calls of this many). Smaller calls let
#: other clients in sooner but cost the worker a round trip and a decode each: at 100 a
#: call a full cycle at 1M entries comes close to the 10 s target, while 500 a call adds
#: little to another client's wait. bench_worker measures both (``--state-batch`` sets
#: this; docs/BENCHMARKS.md has a run at 100 beside the default).
STATE_BATCH = 500
#: Entries whose content (doc, vector, meta and digest: ``Storage.audit``) is read per
#: eviction plan of a tenant, from where the last plan's audit stopped: corruption that
#: the scan of learning states cannot see (a vector of another dimension or not of unit
#: length, a meta that does not match it, a garbage digest, a key of another type) is
#: found within ``entries / AUDIT_BATCH`` plans even when no replica reads and reports it.
AUDIT_BATCH = 2_000
#: Tags whose sets each eviction of a tenant sweeps of removed entries' ids, at most
#: (``ContentAudit.sweep_tags``; every tag in turn, from where the last sweep stopped).
TAG_SWEEP = 100

#: How a cycle ended (the cycle log's ``outcome`` and the worker's metrics label).
CycleOutcome = Literal["ok", "stopped", "error"]


class Maintenance:
    """Decay, eviction and the match models' fits over every tenant of one keyspace:
    the cycles over tenants, the lease's claim on them and the cycle log, with the work
    itself done by its parts (``decay``, ``planner``, ``executor``, ``audit``,
    ``orphans``, ``fits``), whose public methods it also offers.

    Args:
        storage: the sync storage (its config carries the defaults).
        learner: scores entries (default: one built from the storage's config).
        stop: set it to finish the current batch and stop (a warm stop; of the
            removals, the calls already sent: ``EVICT_IN_FLIGHT`` at most).
        active: checked between batches too (``CycleContext``); a worker passes "I
            still hold the lease".
        fence: the fencing token (lease epoch) every decay and evict write carries
            (``CycleContext``). ``None``: writes are not fenced (the CLI's single passes).
        worker_id: written into the cycle log.
    """

    def __init__(
        self,
        storage: RedisStorage,
        learner: CachePolicyLearner | None = None,
        *,
        stop: threading.Event | None = None,
        active: Callable[[], bool] | None = None,
        fence: Callable[[], int | None] | None = None,
        worker_id: str = "",
    ) -> None:
        self.storage = storage
        cfg = storage.config
        self.eviction: EvictionConfig = cfg.eviction
        self.learner = learner if learner is not None else CachePolicyLearner(cfg.rl, cfg.eviction)
        self.context = CycleContext(storage, stop=stop, active=active, fence=fence)
        self.worker_id = worker_id
        self.states = StateScan(storage, batch=STATE_BATCH, read_ahead=READ_AHEAD)
        self.decay = DecayJob(self.context, self.states, batch=DECAY_BATCH)
        self.audit = ContentAudit(self.context, batch=AUDIT_BATCH, tag_sweep=TAG_SWEEP)
        self.planner = EvictionPlanner(
            self.context, self.learner, self.states, self.audit, self.decay
        )
        self.executor = EvictionExecutor(
            self.context, self.planner, batch=EVICT_BATCH, in_flight=EVICT_IN_FLIGHT
        )
        self.orphans = Orphans(self.context, rescan=self.planner.rescan)
        self.fits = ModelFits(storage)
        self._claimed: int | None = None  # the lease epoch written into every fence
        #: Tenants whose part of a cycle failed, counted over this object's life
        #: (``_each``): a cycle in which it grew ends as ``error`` (the cycle log, and
        #: the worker's metrics, which add the difference to its errors).
        self.failures = 0

    @property
    def fenced(self) -> bool:
        """A write of this cycle was refused by a newer leader's fence."""
        return self.context.fenced

    @fenced.setter
    def fenced(self, value: bool) -> None:
        self.context.fenced = value

    @property
    def read_ahead(self) -> int:
        """Batches a whole scan reads ahead (``READ_AHEAD``; 0: one at a time)."""
        return self.states.read_ahead

    @read_ahead.setter
    def read_ahead(self, depth: int) -> None:
        self.states.read_ahead = depth

    @property
    def last_plans(self) -> dict[str, EvictionPlan]:
        """The last whole-scan eviction plan of each tenant (the worker's metrics)."""
        return self.planner.last_plans

    def halted(self) -> bool:
        return self.context.halted()

    # -- tenants -------------------------------------------------------------------------------
    def tenants(self) -> list[str]:
        return self.storage.tenants()

    def policy(self, tenant: str) -> TenantPolicy:
        """The tenant's policy (``CycleContext.policy``)."""
        return self.context.policy(tenant)

    def limits(self, tenant: str, policy: TenantPolicy | None = None) -> TenantLimits:
        return TenantLimits.of(policy if policy is not None else self.policy(tenant))

    # -- the parts' work, one tenant at a time -------------------------------------------------
    def decay_tenant(self, tenant: str, *, complete: bool | None = None) -> DecayReport:
        """``DecayJob.decay_tenant``."""
        return self.decay.decay_tenant(tenant, complete=complete)

    def plan_eviction(
        self,
        tenant: str,
        *,
        now: float | None = None,
        progress: Callable[[int], None] | None = None,
        decay: DecayReport | None = None,
    ) -> EvictionPlan:
        """``EvictionPlanner.plan``: a whole scan."""
        return self.planner.plan(tenant, now=now, progress=progress, decay=decay)

    def plan_incremental(self, tenant: str, *, now: float | None = None) -> EvictionPlan | None:
        """``EvictionPlanner.plan_incremental``."""
        return self.planner.plan_incremental(tenant, now=now)

    def execute(self, plan: EvictionPlan) -> EvictionReport:
        """``EvictionExecutor.execute``."""
        return self.executor.execute(plan)

    def sweep_tags(self, tenant: str) -> int:
        """``ContentAudit.sweep_tags``."""
        return self.audit.sweep_tags(tenant)

    def recover_orphans(self, tenant: str) -> int:
        """``Orphans.recover``."""
        return self.orphans.recover(tenant)

    def sweep_orphans(self) -> int:
        """``Orphans.sweep``; the worker runs it every ``full_scan_interval_s`` on a
        server whose maxmemory-policy may evict any key."""
        return self.orphans.sweep()

    def calibrate_tenant(self, tenant: str, *, force: bool = False) -> FitReport | None:
        """``ModelFits.calibrate_tenant``."""
        return self.fits.calibrate_tenant(tenant, force=force)

    def evict_tenant(self, tenant: str) -> EvictionReport:
        """One tenant's eviction: incremental while it is within its capacity
        (``plan_incremental``), else a whole scan (``plan_eviction``). Entries whose ids
        zset was lost are taken back first (``recover_orphans``)."""
        self.recover_orphans(tenant)
        plan = self.plan_incremental(tenant)
        if plan is None:
            plan = self.plan_eviction(tenant)
        report = self.execute(plan)
        report.tags_swept = self.sweep_tags(tenant)
        summary = report.summary()
        if summary:
            log.info("tenant %s: %s (%.2fs)", tenant, summary, report.seconds)
        return report

    def maintain_tenant(self, tenant: str) -> tuple[DecayReport, EvictionReport]:
        """A full cycle of one tenant: a decay job's run and a whole-scan eviction, then
        its match model's fit if one is due. A tenant whose evidence list is not complete
        yet is decayed whole in the same scan (which completes the list); the report's
        seconds are then the scan's."""
        self.recover_orphans(tenant)
        if self.storage.evidence_complete(tenant):
            decay = self.decay_tenant(tenant, complete=True)
            plan = self.plan_eviction(tenant)
        else:
            decay = DecayReport(tenant)
            started = time.perf_counter()
            plan = self.plan_eviction(tenant, decay=decay)
            decay.seconds = time.perf_counter() - started
        report = self.execute(plan)
        report.tags_swept = self.sweep_tags(tenant)
        self.calibrate_tenant(tenant)
        return decay, report

    # -- cycles over every tenant ---------------------------------------------------------------
    def claim(self, tenants: list[str]) -> None:
        """Once per leadership (lease epoch), write the epoch into every tenant's fence
        before this worker's first cycle writes anything: a stalled former leader that
        wakes up is then refused on every tenant, not only on those this leader already
        wrote to (it could otherwise write between this leader's plan of a tenant and
        its first write there)."""
        epoch = self.context.fence()
        if epoch is None or epoch == self._claimed:
            return
        for tenant in tenants:
            try:
                self.storage.decay(tenant, [], fence=epoch, claim=True)
            except FencedError as exc:
                self.context.refused(tenant, exc)
                return
        self._claimed = epoch

    def run_decay(self) -> list[DecayReport]:
        return self._cycle_over_tenants("decay", self.decay_tenant)

    def run_eviction(self) -> list[EvictionReport]:
        return self._cycle_over_tenants("evict", self.evict_tenant)

    def run_calibration(self) -> list[FitReport]:
        """Fit the match model of every tenant where one is due (the eviction job runs
        it after its cycle: a fit reads two capped lists, so its cost is bounded by their
        caps)."""
        reports = self._each(self.tenants(), self.calibrate_tenant)
        return [report for report in reports if report is not None]

    def _cycle_over_tenants(self, job: str, work: Callable[[str], R]) -> list[R]:
        """A logged cycle of ``job``: the tenants claimed, then ``work`` on each."""
        self.fenced = False
        with self.cycle(job):
            tenants = self.tenants()
            self.claim(tenants)
            return self._each(tenants, work)

    def _each(self, tenants: list[str], work: Callable[[str], R]) -> list[R]:
        """``work`` on each tenant in turn, until the cycle is halted.

        One tenant's failure is that tenant's: it is logged and the cycle goes on with
        the others (a value that does not decode stopped every cycle before the tenants
        that sort after it were evicted or fitted). A reply error of Redis about that
        tenant's keys (a script's error, a key of another type: a plain
        ``StorageError``) is that tenant's failure too. Redis out of reach
        (``StorageUnavailable``) or a refused fence (``FencedError``) ends the cycle:
        the next tenant would fail the same way. Each failure is counted
        (``failures``), so that the cycle does not pass for a good one."""
        reports = []
        for tenant in tenants:
            if self.halted():
                break
            try:
                reports.append(work(tenant))
            except (StorageUnavailable, FencedError):
                raise
            except Exception:
                self.failures += 1
                log.exception("tenant %s: its part of the cycle failed; the cycle goes on", tenant)
        return reports

    def cycle(self, job: str) -> _Cycle:
        """Context manager that records a cycle's start and end in the cycle log."""
        return _Cycle(self, job)

    def record(self, job: str, phase: str, **extra: str) -> None:
        """Append a start or end record of a cycle to the worker's cycle log."""
        self.storage.record_cycle({"job": job, "phase": phase, "worker": self.worker_id, **extra})

    def recent_cycles(self, count: int = 50) -> list[dict[str, str]]:
        return self.storage.recent_cycles(count)


class _Cycle:
    def __init__(self, maintenance: Maintenance, job: str) -> None:
        self.m = maintenance
        self.job = job
        self.started = 0.0
        self.failures = 0
        self.outcome = ""

    def __enter__(self) -> _Cycle:
        self.started = time.perf_counter()
        self.failures = self.m.failures
        try:
            self.m.record(self.job, "start")
        except StorageError as exc:  # a full server refuses the XADD: evict all the same
            log.warning("could not record the start of a %s cycle: %s", self.job, exc)
        return self

    def __exit__(self, typ: object, exc: BaseException | None, tb: object) -> None:
        failed = exc is not None or self.m.failures > self.failures  # a tenant's part too
        outcome: CycleOutcome = "error" if failed else ("stopped" if self.m.halted() else "ok")
        try:
            self.m.record(
                self.job,
                "end",
                outcome=outcome,
                seconds=f"{time.perf_counter() - self.started:.6f}",
            )
        except Exception:  # the cycle's own error matters more than its record
            log.exception("could not record the end of a %s cycle", self.job)


__all__ = [
    "AUDIT_BATCH",
    "DECAY_BATCH",
    "EVICT_BATCH",
    "EVICT_IN_FLIGHT",
    "READ_AHEAD",
    "STATE_BATCH",
    "TAG_SWEEP",
    "CycleOutcome",
    "DecayReport",
    "EvictionPlan",
    "EvictionReport",
    "FitReport",
    "Maintenance",
    "TenantLimits",
]
