"""Eviction of one tenant, planned in one pass over its entries and then executed.

1. Scan ``ids`` with ZSCAN, load each batch's learning state, and sort every entry into:
   expired; corrupt (undecodable); below ``min_reward_to_keep``
   (``CachePolicyLearner.eviction_ranking``'s -1.0 fast path); or a keeper with its
   ``eviction_score`` (with ``EvictionConfig``'s weights).
2. If the keepers are over the tenant's capacity (``max_entries`` or ``max_bytes``, Redis
   overrides first), the lowest-scored go until the tenant is at capacity minus the
   low-watermark margin.
3. Execute in batches through the evict script, which removes each entry from every
   structure and keeps any entry whose version moved since it was scored (it was served
   or got feedback meanwhile): it survives this cycle and is scored again in the next.

The scan's cost is linear in the tenant's entries; the capacity selection is a sort of
the keepers' scores. A tenant within its capacity is planned from what can have changed
instead (``EvictionPlanner.plan_incremental``). The pass also yields the tenant's
expected-reward and confidence distributions, which the worker exports as metrics.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from zerda_cache.core.errors import FencedError, StorageError
from zerda_cache.learning.bandit import CachePolicyLearner
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.metrics import Distribution
from zerda_cache.storage import EvictReason, StateArrays
from zerda_cache.storage.plans import EvictOutcome, LogInfo
from zerda_cache.storage.store import IdBatch
from zerda_cache.worker.audit import ContentAudit
from zerda_cache.worker.cycle_context import LOGGER, CycleContext
from zerda_cache.worker.decay import DecayJob, DecayReport
from zerda_cache.worker.state_scan import StateScan

log = logging.getLogger(LOGGER)


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's capacity: the worker's defaults overridden by the tenant's cfg hash."""

    max_entries: int
    max_bytes: int | None
    low_watermark: float

    @classmethod
    def of(cls, policy: TenantPolicy) -> TenantLimits:
        ev = policy.eviction
        return cls(
            max_entries=ev.max_entries, max_bytes=ev.max_bytes, low_watermark=ev.low_watermark
        )

    @property
    def target_entries(self) -> int:
        return math.floor(self.max_entries * (1 - self.low_watermark))

    @property
    def target_bytes(self) -> int | None:
        if self.max_bytes is None:
            return None
        return math.floor(self.max_bytes * (1 - self.low_watermark))


@dataclass(slots=True)
class EvictionPlan:
    """What a cycle would remove from one tenant, and why (``evict --dry-run`` shows it)."""

    tenant: str
    now: float
    limits: TenantLimits
    scanned: int = 0
    bytes_scanned: int = 0
    expired: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    low_reward: list[tuple[str, int]] = field(default_factory=list)
    capacity: list[tuple[str, int]] = field(default_factory=list)
    rewards: Distribution = field(default_factory=Distribution)
    confidences: Distribution = field(default_factory=Distribution)
    complete: bool = True  # False when a stop request cut the scan short
    reported: list[str] = field(default_factory=list)  # corrupt ids replicas reported
    #: Ids listed with no entry behind them (its hash was evicted by an allkeys-* policy,
    #: or deleted by hand): dropped from the ids, digest map and replicas' indexes.
    dangling: list[str] = field(default_factory=list)
    #: True for a plan from the expired ids and the arms that got a signal only (a
    #: tenant within its capacity); its distributions are those of the last whole scan.
    incremental: bool = False
    #: The tenant's feedback stream as far as this plan has read it: once the plan is
    #: carried out whole, the next incremental plan reads the signals after it.
    feedback_mark: LogInfo | None = None

    @property
    def total(self) -> int:
        return len(self.expired) + len(self.corrupt) + len(self.low_reward) + len(self.capacity)

    def counts(self) -> dict[str, int]:
        return {
            "expired": len(self.expired),
            "corrupt": len(self.corrupt),
            "low_reward": len(self.low_reward),
            "capacity": len(self.capacity),
        }


@dataclass(slots=True)
class EvictionReport:
    tenant: str
    removed: dict[str, int] = field(default_factory=dict)
    kept_changed: int = 0  # changed since scored: kept this cycle
    already_gone: int = 0
    seconds: float = 0.0
    tags_swept: int = 0  # ids of removed entries dropped from tags' sets

    def summary(self) -> str | None:
        """What the cycle did, in words, counting only what happened ("evicted 3 entries
        (capacity 2, expired 1); kept 1 entry that changed since it was scored"), or
        ``None`` when it removed and kept nothing (a reported id already gone is nothing).
        """
        counts = sorted(
            ((n, reason) for reason, n in self.removed.items() if n), key=lambda c: (-c[0], c[1])
        )
        parts = []
        if counts:
            total = sum(n for n, _ in counts)
            why = ", ".join(f"{reason.replace('_', ' ')} {n:,}" for n, reason in counts)
            parts.append(f"evicted {total:,} {'entry' if total == 1 else 'entries'} ({why})")
        if self.kept_changed:
            n = self.kept_changed
            what = (
                "entry that changed since it was"
                if n == 1
                else "entries that changed since they were"
            )
            parts.append(f"kept {n:,} {what} scored")
        return "; ".join(parts) or None


def _with_versions(cols: StateArrays, mask: np.ndarray) -> list[tuple[str, int]]:
    """The ids of ``cols`` where ``mask`` holds, each with the version it was scored at."""
    return [(cols.ids[i], int(cols.version[i])) for i in np.flatnonzero(mask).tolist()]


class _Keepers:
    """The entries a whole scan keeps, batch by batch: the capacity victims are the
    lowest scores among all of them."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.scores: list[np.ndarray] = []
        self.sizes: list[np.ndarray] = []
        self.versions: list[np.ndarray] = []

    def add(self, cols: StateArrays, scores: np.ndarray, keep: np.ndarray) -> None:
        self.ids += [cols.ids[i] for i in np.flatnonzero(keep).tolist()]
        self.scores.append(scores[keep])
        self.sizes.append(cols.size[keep])
        self.versions.append(cols.version[keep])

    def choose(self, plan: EvictionPlan) -> None:
        """Lowest scores first until the keepers fit the capacity minus the margin."""
        scores = np.concatenate(self.scores) if self.scores else np.empty(0)
        sizes = np.concatenate(self.sizes) if self.sizes else np.empty(0, dtype=np.int64)
        versions = np.concatenate(self.versions) if self.versions else np.empty(0, np.int64)
        limits = plan.limits
        n_keep = len(self.ids)
        bytes_keep = int(sizes.sum())
        need_n = n_keep - limits.target_entries if n_keep > limits.max_entries else 0
        need_b = 0
        if limits.max_bytes is not None and bytes_keep > limits.max_bytes:
            need_b = bytes_keep - (limits.target_bytes or 0)
        if need_n <= 0 and need_b <= 0:
            return
        order = np.argsort(scores, kind="stable")
        freed = np.cumsum(sizes[order])
        count = max(need_n, int(np.searchsorted(freed, need_b)) + 1 if need_b > 0 else 0)
        chosen = order[: min(count, n_keep)]
        plan.capacity = [(self.ids[i], int(versions[i])) for i in chosen.tolist()]


class EvictionPlanner:
    """Owns deciding what to remove from a tenant: ``plan`` scores every entry (a whole
    scan), ``plan_incremental`` only what can have fallen under the keeping bar since.
    Keeps each tenant's last whole-scan plan (its distributions are the worker's
    metrics), when this process last scanned it whole, and how far the carried-out
    plans have read its feedback stream (``feedback_marks``)."""

    def __init__(
        self,
        context: CycleContext,
        learner: CachePolicyLearner,
        states: StateScan,
        audit: ContentAudit,
        decay: DecayJob,
    ) -> None:
        self.context = context
        self.learner = learner
        self.states = states
        self.audit = audit
        self.decay = decay
        #: The last whole-scan eviction plan of each tenant (the worker's metrics read it).
        self.last_plans: dict[str, EvictionPlan] = {}
        #: How far the eviction job has read each tenant's feedback stream: the arms
        #: that got a signal since are the only ones that can have fallen under the
        #: keeping bar (``plan_incremental``).
        self.feedback_marks: dict[str, LogInfo] = {}
        #: When this process last scanned each tenant whole (monotonic seconds).
        self._full_scans: dict[str, float] = {}

    def rescan(self, tenant: str) -> None:
        """Make the tenant's next plan a whole scan."""
        self._full_scans.pop(tenant, None)

    def carried_out(self, plan: EvictionPlan) -> None:
        """``plan`` was carried out whole: the next incremental plan reads on from its
        feedback mark."""
        if plan.feedback_mark is not None:
            self.feedback_marks[plan.tenant] = plan.feedback_mark

    def plan(
        self,
        tenant: str,
        *,
        now: float | None = None,
        progress: Callable[[int], None] | None = None,
        decay: DecayReport | None = None,
    ) -> EvictionPlan:
        """Score every entry of ``tenant`` and decide what to remove (nothing is removed,
        unless ``decay`` is given: then the same scan also persists the decay of every
        arm with evidence, and counts it there).

        Per batch: the ZSCAN step gives ids and expiry times; one HMGET of the tenant's
        state hash gives the stored states, which ``codec.state_columns`` decodes into
        columns here, off the server's thread; the learner scores the whole batch at
        once. On a server whose maxmemory-policy may evict entries' hashes (allkeys-*, or
        one that does not say), the ``state`` script reads them instead and checks that
        each hash exists, so that the ids of those Redis evicted are found.
        """
        st = self.context.storage
        policy_name = st.eviction_policy()
        check = policy_name is None or policy_name.startswith("allkeys")
        # Signals from here on are read by the incremental plans that follow this scan.
        mark = st.feedback_mark(tenant)
        now = st.now() if now is None else now
        policy = self.context.policy(tenant)
        plan = EvictionPlan(tenant=tenant, now=now, limits=TenantLimits.of(policy))
        seen = self._corrupt_first(plan)
        keepers = _Keepers()
        for batch, cols in self.states.ahead(tenant, now, set(plan.corrupt), policy.rl, check):
            fresh = self._sort(plan, batch, cols, seen, policy, keepers, decay)
            if progress is not None:
                progress(fresh)
            if self.context.halted():
                plan.complete = False
                return plan  # a partial scan must not pick capacity victims
        if decay is not None:  # every arm with evidence was seen: the list is complete
            self.decay.decay_ids(tenant, [], decay, policy.rl, complete=True)
        self._full_scans[tenant] = time.monotonic()
        plan.feedback_mark = mark
        keepers.choose(plan)
        self.last_plans[tenant] = plan
        return plan

    def _sort(
        self,
        plan: EvictionPlan,
        batch: IdBatch,
        cols: StateArrays,
        seen: set[str],
        policy: TenantPolicy,
        keepers: _Keepers,
        decay: DecayReport | None,
    ) -> int:
        """Sort one batch of a whole scan into ``plan`` and ``keepers``; returns how
        many of its ids were new to the scan."""
        fresh = [(eid, exp) for eid, exp in batch if eid not in seen]
        if len(fresh) < len(batch):  # ids seen already (reported, or a ZSCAN repeat)
            cols = cols.only({eid for eid, _ in fresh})
        seen.update(eid for eid, _ in fresh)
        live_ids = []
        for eid, expires_at in fresh:
            if expires_at <= plan.now:
                plan.expired.append(eid)
            else:
                live_ids.append(eid)
        found = {*cols.ids, *cols.corrupt}
        plan.dangling += [eid for eid in live_ids if eid not in found]
        if decay is not None:
            self.decay.decay_columns(plan.tenant, cols, decay, policy.rl)
        plan.corrupt += cols.corrupt
        plan.scanned += len(cols.ids)
        plan.bytes_scanned += int(cols.size.sum())
        scores, expected = self._scores(cols, plan.now, policy)
        low = scores < 0
        plan.low_reward += _with_versions(cols, low)
        keepers.add(cols, scores, ~low)
        plan.rewards.add(expected)
        plan.confidences.add(cols.confidence)
        return len(fresh)

    def plan_incremental(self, tenant: str, *, now: float | None = None) -> EvictionPlan | None:
        """The eviction plan of a tenant within its capacity, from what can need
        evicting without a scan: the expired ids (a range of the ids zset), the ids
        replicas reported corrupt, and the arms that got a signal since this process
        last read the tenant (its feedback stream; the only arms that can have fallen
        below ``min_reward_to_keep``: with time alone an arm decays toward its prior,
        whose mean is over the bar). If the stream cannot say (trimmed past that point:
        more signals than ``feedback_log_maxlen``), every arm with evidence is read.
        ``None`` when a whole scan is needed instead: the tenant is over capacity (the
        victims are the lowest scores of all), its evidence list is not complete yet,
        the prior's mean is itself under the keeping bar, or this process has not
        scanned it whole for ``full_scan_interval_s`` (corrupt learning state, and the
        metrics' distributions, come from whole scans)."""
        st = self.context.storage
        policy = self.context.policy(tenant)
        rl, limits = policy.rl, TenantLimits.of(policy)
        last = self._full_scans.get(tenant)
        if (
            last is None
            or time.monotonic() - last >= self.context.eviction.full_scan_interval_s
            or rl.prior_alpha / (rl.prior_alpha + rl.prior_beta) < rl.min_reward_to_keep
        ):
            return None
        count, size = st.size(tenant)
        over_bytes = limits.max_bytes is not None and size > limits.max_bytes
        if count > limits.max_entries or over_bytes or not st.evidence_complete(tenant):
            return None
        now = st.now() if now is None else now
        plan = EvictionPlan(tenant=tenant, now=now, limits=limits, incremental=True)
        previous = self.last_plans.get(tenant)
        if previous is not None:
            plan.rewards, plan.confidences = previous.rewards, previous.confidences
        seen = self._corrupt_first(plan)
        plan.expired = [eid for eid in st.expired_ids(tenant, now) if eid not in seen]
        seen.update(plan.expired)
        batch = self.context.eviction.scan_batch
        changed, mark = st.changed_arms(
            tenant, self.feedback_marks.get(tenant), limit=max(batch, limits.max_entries)
        )
        batches = (
            st.iter_evidence(tenant, batch)
            if changed is None
            else (changed[i : i + batch] for i in range(0, len(changed), batch))
        )
        for ids in batches:
            cols = self.states.arrays(tenant, [eid for eid in ids if eid not in seen], rl)
            seen.update(ids)
            plan.corrupt += cols.corrupt
            plan.scanned += len(cols.ids)
            scores, _ = self._scores(cols, now, policy)
            plan.low_reward += _with_versions(cols, scores < 0)
            if self.context.halted():
                plan.complete = False
                break
        if plan.complete:
            plan.feedback_mark = mark
        return plan

    def _corrupt_first(self, plan: EvictionPlan) -> set[str]:
        """Plan the entries replicas reported undecodable (a doc, meta or vec; a scan
        reads only the learning state) and those the audit found, as corrupt, whatever
        their score; returns their ids, the ones the scan skips."""
        plan.reported = self.audit.reported(plan.tenant)
        plan.corrupt += plan.reported
        plan.corrupt += self.audit.audit(plan.tenant, set(plan.corrupt))
        return set(plan.corrupt)

    def _scores(
        self, cols: StateArrays, now: float, policy: TenantPolicy
    ) -> tuple[np.ndarray, np.ndarray]:
        """Eviction scores and expected rewards of a batch, by the tenant's policy."""
        return self.learner.eviction_scores(
            cols.alpha,
            cols.beta,
            cols.decayed_at,
            cols.usage_count,
            cols.last_access,
            now=now,
            config=policy.rl,
            eviction=policy.eviction,
        )


class EvictionExecutor:
    """Owns carrying a plan out: the calls of the evict script, of at most ``batch``
    entries each, ``in_flight`` of them under way at once, and counting what they did.
    A plan carried out whole is handed back to the planner (``carried_out``)."""

    def __init__(
        self, context: CycleContext, planner: EvictionPlanner, *, batch: int, in_flight: int
    ) -> None:
        self.context = context
        self.planner = planner
        self.batch = batch
        self.in_flight = in_flight

    def execute(self, plan: EvictionPlan) -> EvictionReport:
        """Remove what ``plan`` chose, in batches, each entry only if unchanged since.

        Calls are sent from threads: while the server runs one, the worker packs the
        next and parses the last, so the server is never idle waiting for the worker
        (each call still holds the server alone, and other clients' commands run
        between two calls)."""
        report = EvictionReport(plan.tenant)
        started = time.perf_counter()
        # Each group in the order of its ids: the ids zset orders ids of equal expiry
        # (every entry without a TTL) by their bytes, so removals in that order walk
        # the same upper levels of its skiplist one after another, while the server's
        # caches still hold them (bench_worker's commandstats show the ZREMs' time).
        # Groups go in turn, each done before the next starts: a cycle stopped in one
        # has removed the groups before it whole. All of them are due.
        groups: list[tuple[EvictReason, list[tuple[str, int | None]]]] = [
            ("expired", [(eid, None) for eid in sorted(plan.expired)]),
            ("corrupt", [(eid, None) for eid in sorted(plan.corrupt)]),
            # nothing to remove but the id: counted as already gone, not as evicted
            ("corrupt", [(eid, None) for eid in sorted(plan.dangling)]),
            ("low_reward", sorted(plan.low_reward)),
            ("capacity", sorted(plan.capacity)),
        ]
        with ThreadPoolExecutor(self.in_flight, thread_name_prefix="zerda-evict") as pool:
            for reason, items in groups:
                if not self._group(plan, reason, items, pool, report):
                    report.seconds = time.perf_counter() - started
                    return report
        self.planner.carried_out(plan)
        report.seconds = time.perf_counter() - started
        return report

    def _group(
        self,
        plan: EvictionPlan,
        reason: EvictReason,
        items: list[tuple[str, int | None]],
        pool: ThreadPoolExecutor,
        report: EvictionReport,
    ) -> bool:
        """Remove one group of ``plan``; False when the cycle stops."""
        ctx = self.context
        batch = min(ctx.eviction.scan_batch, self.batch)
        sent: deque[Future[EvictOutcome]] = deque()
        stopped = False
        for i in range(0, len(items), batch):
            if ctx.halted():  # before the write too: a leader that woke up late
                stopped = True
                break
            chunk = items[i : i + batch]
            sent.append(
                pool.submit(ctx.storage.evict, plan.tenant, chunk, reason, fence=ctx.fence())
            )
            if len(sent) >= self.in_flight and not self._count(
                plan, reason, sent.popleft(), report
            ):
                stopped = True
                break
        # What was sent is done: count it (when one raises, the pool's exit waits for a
        # call still under way).
        while sent:
            stopped = not self._count(plan, reason, sent.popleft(), report) or stopped
        return not (stopped or ctx.halted())

    def _count(
        self,
        plan: EvictionPlan,
        reason: EvictReason,
        sent: Future[EvictOutcome],
        report: EvictionReport,
    ) -> bool:
        """Add one evict call's outcome to ``report``; False when it was refused (a
        worker with a newer lease wrote to the tenant: this one stops), or failed after
        a refusal (the cycle is over either way: it ends as stopped, not as an error)."""
        try:
            out = sent.result()
        except FencedError as exc:
            self.context.refused(plan.tenant, exc)
            return False
        except StorageError as exc:
            if not self.context.fenced:
                raise
            log.warning(
                "tenant %s: an evict call sent before the refusal failed: %s", plan.tenant, exc
            )
            return False
        report.removed[reason] = report.removed.get(reason, 0) + len(out.removed)
        if reason == "corrupt" and plan.reported:
            handled = {*out.removed, *out.gone}
            done = [e for e in plan.reported if e in handled]
            self.context.storage.forget_suspects(plan.tenant, done)
        report.kept_changed += len(out.changed)
        report.already_gone += len(out.gone)
        return True
