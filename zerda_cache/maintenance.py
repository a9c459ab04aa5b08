"""What the worker does each cycle: decay every arm, evict what is not worth keeping.

Eviction of one tenant is planned in one pass over its entries and then executed:

1. Scan ``ids`` with ZSCAN, load each batch's learning state in one round trip, and sort
   every entry into: expired; corrupt (undecodable); below ``min_reward_to_keep``
   (``CachePolicyLearner.eviction_ranking``'s -1.0 fast path); or a keeper with its
   ``eviction_score`` (with ``EvictionConfig``'s weights).
2. If the keepers are over the tenant's capacity (``max_entries`` or ``max_bytes``, Redis
   overrides first), the lowest-scored go until the tenant is at capacity minus the
   low-watermark margin.
3. Execute in batches through the evict script, which removes each entry from every
   structure and keeps any entry whose version moved since it was scored (it was served
   or got feedback meanwhile): it survives this cycle and is scored again in the next.

The scan's cost is linear in the tenant's entries (per ZSCAN step, a call of the state
script per ``STATE_BATCH`` ids, read ahead of the scoring in threads, as the steps are);
the capacity selection is a sort of the keepers' scores. Decay walks the same batches
through the decay script. Both stop between batches when asked to stop.

The pass also yields the tenant's expected-reward and confidence distributions, which the
worker exports as metrics.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np

from zerda_cache.calibration import LabelLogs, bin_of
from zerda_cache.config import EvictionConfig, RLConfig
from zerda_cache.errors import (
    CorruptEntryError,
    EntryNotFoundError,
    FencedError,
    SchemaVersionError,
    StorageError,
)
from zerda_cache.match_model import (
    HOLDOUT,
    MIN_EACH_KIND,
    MIN_FIT_LABELS,
    REFIT_EVERY,
    MatchModel,
    auc,
    fit,
)
from zerda_cache.metrics import Distribution
from zerda_cache.policy import TenantPolicy
from zerda_cache.policy_learner import CachePolicyLearner
from zerda_cache.storage import EvictReason, RedisStorage, StateArrays
from zerda_cache.storage.plans import EvictOutcome, LogInfo
from zerda_cache.storage.store import READ_ENTRIES_BATCH, IdBatch
from zerda_cache.tenant_state import TenantState

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Batches a whole scan reads ahead of the one it scores, each in its own thread: while
#: one waits for Redis, another packs its call or parses its reply, so the server is
#: never idle. From 1 on, the ZSCAN steps run ahead too, in a thread of their own, so the
#: scoring does not wait for them. Two ahead already keep the server busy: a third adds a
#: thread, not throughput (bench_worker times the whole scan at 0, 1 and 2 ahead).
#: ``Maintenance.read_ahead``.
READ_AHEAD = 2
#: Entries removed per call of the evict script, at most (``EvictionConfig.scan_batch``
#: if smaller). A removal costs the server ~15-20 us (the hash, the state, the ids, the
#: exact-match map, a log event), and a call holds the server's one thread for all of its
#: removals, every replica's lookups waiting behind it: 500 a call holds it ~20 ms, 50 a
#: call ~1 ms. bench_worker measures this (another client's GET p50 / p99 during a full
#: cycle, and Redis's own time per call).
EVICT_BATCH = 50
#: Calls of the evict script under way at once (``Maintenance.execute``): with two, the
#: worker packs and parses one while the server runs the other, and another client's
#: command waits behind both at worst, so each call is half of what one alone could be.
#: More calls at once finish a cycle's removals sooner but make another client wait
#: behind more of them; larger calls do the same. bench_worker measures both sides (the
#: full cycle's time and another client's GET p50 / p99 meanwhile).
EVICT_IN_FLIGHT = 2
#: Arms whose decay is persisted per call of the decay script, at most (``scan_batch`` if
#: smaller): rewriting an arm costs the server ~14 us (read, decode, decay, encode, write),
#: so 500 a call holds its one thread ~7 ms, which would be the longest of a full cycle's
#: calls; 100 a call holds it ~1.4 ms (bench_worker measures Redis's time per call over
#: a full cycle; SLOWLOG shows the longest).
DECAY_BATCH = 100
#: Entries whose state one call of the read-only ``state`` script reads, at most (each
#: ZSCAN step of ``scan_batch`` ids is read in calls of this many). Smaller calls let
#: other clients in sooner but cost the worker a round trip and a decode each: at 100 a
#: call a full cycle at 1M entries comes close to the 10 s target, leaving no margin on a
#: slower host, while 500 a call adds little to another client's wait. bench_worker
#: measures both (``--state-batch`` sets this; docs/BENCHMARKS.md has a run at 100
#: beside the default).
STATE_BATCH = 500
#: Entries whose content (doc, vector, meta and digest: ``Storage.audit``) is read per
#: eviction plan of a tenant, from where the last plan's audit stopped: corruption that the scan of
#: learning states cannot see (a vector of another dimension or not of unit length, a
#: meta that does not match it, a garbage digest, a key of another type) is found
#: within ``entries / AUDIT_BATCH`` plans even when no replica reads and reports it.
AUDIT_BATCH = 2_000
#: Tags whose sets each eviction of a tenant sweeps of removed entries' ids, at most
#: (``Maintenance.sweep_tags``; every tag in turn, from where the last sweep stopped).
TAG_SWEEP = 100

#: How a cycle ended (the cycle log's ``outcome`` and the worker's metrics label).
CycleOutcome = Literal["ok", "stopped", "error"]


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's capacity: the worker's defaults overridden by the tenant's cfg hash."""

    max_entries: int
    max_bytes: int | None
    low_watermark: float

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


@dataclass(slots=True)
class DecayReport:
    tenant: str
    decayed: int = 0
    missing: int = 0
    corrupt: int = 0
    seconds: float = 0.0
    #: This run reached the end of the tenant's evidence list (a sweep ended).
    swept: bool = True


@dataclass(slots=True)
class FitReport:
    """What one match-model fit of a tenant did (``Maintenance.calibrate_tenant``)."""

    tenant: str
    labels: int
    #: Area under the ROC curve on the newest labels (held out): the model's, and the
    #: similarity's alone. The model is published only if it ranks them better.
    auc_model: float
    auc_similarity: float
    published: bool
    version: int
    reason: str = ""


class Maintenance:
    """Decay, eviction and the match models' fits over every tenant of one keyspace.

    Args:
        storage: the sync storage (its config carries the defaults).
        learner: scores entries (default: one built from the storage's config).
        stop: set it to finish the current batch and stop (a warm stop; of the
            removals, the calls already sent: ``EVICT_IN_FLIGHT`` at most).
        active: checked between batches too; a worker passes "I still hold the lease",
            so a leader that lost its lease mid-cycle sends no further batch (the
            fencing token refuses what is already under way, if a newer leader wrote).
        fence: the fencing token (lease epoch) every decay and evict write carries; a
            write refused because a newer leader wrote to the tenant (``FencedError``)
            stops the cycle. ``None``: writes are not fenced (the CLI's single passes).
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
        self.stop = stop if stop is not None else threading.Event()
        self.active = active if active is not None else (lambda: True)
        self.fence = fence if fence is not None else (lambda: None)
        self.fenced = False  # a write was refused: this cycle is over
        self.worker_id = worker_id
        #: The last whole-scan eviction plan of each tenant (the worker's metrics read it).
        self.last_plans: dict[str, EvictionPlan] = {}
        #: When this process last scanned each tenant whole (monotonic seconds).
        self._full_scans: dict[str, float] = {}
        #: How far the eviction job has read each tenant's feedback stream: the arms
        #: that got a signal since are the only ones that can have fallen under the
        #: keeping bar (``plan_incremental``).
        self._feedback_marks: dict[str, LogInfo] = {}
        #: Where the decay job's sweep of each tenant's evidence list stands (an SSCAN
        #: cursor; 0: the next run starts a sweep).
        self._sweeps: dict[str, int] = {}
        #: Where the audit of each tenant's entries stands (a ZSCAN cursor; ``_audit``).
        self._audits: dict[str, int] = {}
        #: Where the sweep of each tenant's tags stands (an SSCAN cursor; ``sweep_tags``).
        self._tag_sweeps: dict[str, int] = {}
        self._claimed: int | None = None  # the lease epoch written into every fence
        #: Batches a whole scan reads ahead (``READ_AHEAD``; 0: one at a time).
        self.read_ahead = READ_AHEAD

    def halted(self) -> bool:
        return self.stop.is_set() or self.fenced or not self.active()

    def _refused(self, tenant: str, exc: FencedError) -> None:
        if not self.fenced:  # once (two evict calls in flight are both refused)
            log.warning("tenant %s: %s; this worker lost the lease, its cycle stops", tenant, exc)
        self.fenced = True

    # -- tenants -------------------------------------------------------------------------------
    def tenants(self) -> list[str]:
        return self.storage.tenants()

    def policy(self, tenant: str) -> TenantPolicy:
        """The tenant's policy: this worker's configuration with the tenant's stored
        settings on top (``zerda_cache.policy``), read at the start of each pass, so a
        change made with ``zerda-cache tenant set`` applies from the next cycle."""
        return TenantState(self.storage).policy(tenant)

    def limits(self, tenant: str, policy: TenantPolicy | None = None) -> TenantLimits:
        ev = (policy if policy is not None else self.policy(tenant)).eviction
        return TenantLimits(
            max_entries=ev.max_entries,
            max_bytes=ev.max_bytes,
            low_watermark=ev.low_watermark,
        )

    # -- decay ---------------------------------------------------------------------------------
    def decay_tenant(self, tenant: str, *, complete: bool | None = None) -> DecayReport:
        """Persist the decay of the next share of ``tenant``'s arms with evidence.

        The scripts keep the list of arms with evidence (most arms of a cache never get
        a signal, and decaying them would change nothing). Each run takes the next
        ``decay_job_interval_s / decay_sweep_s`` of that list (at least one batch), where
        the last run stopped, so every arm's decay is persisted at least every
        ``decay_sweep_s`` and a run costs a share of the list, not all of it. Persisting
        changes no arm's value (readers decay to now from ``decayed_at``); it folds the
        decay in, and lets an arm whose evidence faded leave the list.

        A tenant without a complete list (data written without one, or whose flag
        was lost) is scanned whole once: that fills the list. ``complete``: whether
        the list is complete, if the caller has just read it (``evidence_complete``).
        """
        report = DecayReport(tenant)
        started = time.perf_counter()
        st, size = self.storage, self.eviction.scan_batch
        rl = self.policy(tenant).rl
        if complete is None:
            complete = st.evidence_complete(tenant)
        if complete:
            ev = self.eviction
            share = min(1.0, ev.decay_job_interval_s / ev.decay_sweep_s)
            budget = max(size, math.ceil(st.evidence_count(tenant) * share))
            cursor, done = self._sweeps.get(tenant, 0), 0
            while True:
                cursor, ids = st.scan_evidence(tenant, cursor, size)
                if ids:
                    self._decay_ids(tenant, ids, report, rl)
                done += len(ids)
                if cursor == 0 or done >= budget or self.halted():
                    break
            self._sweeps[tenant] = cursor
            report.swept = cursor == 0
        else:  # data written without the list, or its flag was lost: scan it all once
            for batch in st.iter_ids(tenant, size):
                cols = self._state_arrays(tenant, [eid for eid, _ in batch], rl)
                self._decay_columns(tenant, cols, report, rl)
                if self.halted():
                    break
            else:
                self._decay_ids(tenant, [], report, rl, complete=True)
        report.seconds = time.perf_counter() - started
        return report

    def _decay_ids(
        self,
        tenant: str,
        ids: list[str],
        report: DecayReport,
        rl: RLConfig,
        *,
        complete: bool = False,
    ) -> None:
        step = min(self.eviction.scan_batch, DECAY_BATCH)
        for i in range(0, max(len(ids), 1), step):
            if self.fenced:
                return
            chunk = ids[i : i + step]
            last = i + step >= len(ids)  # a completed list is flagged with the last call
            try:
                out = self.storage.decay(
                    tenant, chunk, fence=self.fence(), rl=rl, complete=complete and last
                )
            except FencedError as exc:
                self._refused(tenant, exc)
                return
            report.decayed += out.decayed
            report.missing += out.missing
            report.corrupt += len(out.corrupt)

    def _decay_columns(
        self, tenant: str, cols: StateArrays, report: DecayReport, rl: RLConfig
    ) -> None:
        excess = np.abs(cols.alpha - rl.prior_alpha) + np.abs(cols.beta - rl.prior_beta)
        todo = [cols.ids[i] for i in np.flatnonzero(excess > 1e-12).tolist()]
        report.corrupt += len(cols.corrupt)
        if todo:
            self._decay_ids(tenant, todo, report, rl)

    # -- eviction ------------------------------------------------------------------------------
    def plan_eviction(
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
        st = self.storage
        policy_name = st.eviction_policy()
        check = policy_name is None or policy_name.startswith("allkeys")
        # Signals from here on are read by the incremental plans that follow this scan.
        mark = st.feedback_mark(tenant)
        now = st.now() if now is None else now
        policy = self.policy(tenant)
        plan = EvictionPlan(tenant=tenant, now=now, limits=self.limits(tenant, policy))
        # Entries replicas found undecodable (a doc, meta or vec; the scan reads only
        # the learning state): evicted as corrupt, whatever their score.
        plan.reported = self._reported(tenant)
        plan.corrupt += plan.reported
        plan.corrupt += self._audit(tenant, set(plan.corrupt))
        seen: set[str] = set(plan.corrupt)
        keep_ids: list[str] = []
        keep_scores: list[np.ndarray] = []
        keep_sizes: list[np.ndarray] = []
        keep_versions: list[np.ndarray] = []
        for batch, cols in self._states_ahead(tenant, now, set(plan.corrupt), policy.rl, check):
            fresh = [(eid, exp) for eid, exp in batch if eid not in seen]
            if len(fresh) < len(batch):  # ids seen already (reported, or a ZSCAN repeat)
                cols = cols.only({eid for eid, _ in fresh})
            seen.update(eid for eid, _ in fresh)
            live_ids = []
            for eid, expires_at in fresh:
                if expires_at <= now:
                    plan.expired.append(eid)
                else:
                    live_ids.append(eid)
            found = {*cols.ids, *cols.corrupt}
            plan.dangling += [eid for eid in live_ids if eid not in found]
            if decay is not None:
                self._decay_columns(tenant, cols, decay, policy.rl)
            plan.corrupt += cols.corrupt
            plan.scanned += len(cols.ids)
            plan.bytes_scanned += int(cols.size.sum())
            scores, expected = self._scores(cols, now, policy)
            low = scores < 0
            plan.low_reward += [
                (cols.ids[i], int(cols.version[i])) for i in np.flatnonzero(low).tolist()
            ]
            keep = ~low
            keep_ids += [cols.ids[i] for i in np.flatnonzero(keep).tolist()]
            keep_scores.append(scores[keep])
            keep_sizes.append(cols.size[keep])
            keep_versions.append(cols.version[keep])
            plan.rewards.add(expected)
            plan.confidences.add(cols.confidence)
            if progress is not None:
                progress(len(fresh))
            if self.halted():
                plan.complete = False
                return plan  # a partial scan must not pick capacity victims
        if decay is not None:  # every arm with evidence was seen: the list is complete
            self._decay_ids(tenant, [], decay, policy.rl, complete=True)
        self._full_scans[tenant] = time.monotonic()
        plan.feedback_mark = mark
        self._choose_capacity(
            plan,
            keep_ids,
            np.concatenate(keep_scores) if keep_scores else np.empty(0),
            np.concatenate(keep_sizes) if keep_sizes else np.empty(0, dtype=np.int64),
            np.concatenate(keep_versions) if keep_versions else np.empty(0, dtype=np.int64),
        )
        self.last_plans[tenant] = plan
        return plan

    def _reported(self, tenant: str) -> list[str]:
        """The ids replicas reported undecodable that are: each is read whole
        (``read_entries``: doc, vector, meta and state, 200 a round trip) before it is
        planned for eviction.
        A replica of another version can report an entry this one reads (zerda-cache 0.1
        takes an entry whose state is in the state hash for corrupt, during a rolling
        upgrade): its report is dropped, and the entry kept."""
        st = self.storage
        confirmed, unfounded = [], []
        suspects = st.suspects(tenant)
        step = READ_ENTRIES_BATCH  # entries held at once: each may be large
        for at in range(0, len(suspects), step):
            chunk = suspects[at : at + step]
            for eid, read in zip(chunk, st.read_entries(tenant, chunk), strict=True):
                # Another version's entry (a schema unknown here) is not corrupt: kept.
                bad = isinstance(read, (CorruptEntryError, EntryNotFoundError))
                if bad and not isinstance(read, SchemaVersionError):
                    confirmed.append(eid)
                else:
                    unfounded.append(eid)
        if unfounded:
            st.forget_suspects(tenant, unfounded)
            log.warning(
                "tenant %s: %d entries reported corrupt read fine here; kept (a replica "
                "of another version?)",
                tenant,
                len(unfounded),
            )
        return confirmed

    def _audit(self, tenant: str, known: set[str]) -> list[str]:
        """The ids of the next ``AUDIT_BATCH`` of the tenant's entries (in ZSCAN order,
        from where the last audit stopped; a small tenant whole) whose content is
        corrupt (``StoragePlans.read_audit``), except those in ``known``."""
        st = self.storage
        cursor = self._audits.get(tenant, 0)
        ids: list[str] = []
        while len(ids) < AUDIT_BATCH and not self.halted():
            cursor, batch = st.scan_ids(tenant, cursor, min(AUDIT_BATCH, 1_000))
            ids += [eid for eid, _ in batch if eid not in known]
            if cursor == 0:
                break
        self._audits[tenant] = cursor
        bad: list[str] = []
        for at in range(0, len(ids), READ_ENTRIES_BATCH):
            bad += st.audit(tenant, ids[at : at + READ_ENTRIES_BATCH])
        if bad:
            log.warning("tenant %s: the audit found %d corrupt entries", tenant, len(bad))
        return list(dict.fromkeys(bad))  # a ZSCAN may return an id twice

    def sweep_tags(self, tenant: str) -> int:
        """Drop the ids of removed entries from the next ``TAG_SWEEP`` tags' sets of the
        tenant (in SSCAN order of its tags, from where the last sweep stopped), and tags
        left with none: an eviction does not know an entry's tags, so their sets keep
        its id until this sweep (or the tag's invalidation). Returns the ids dropped."""
        st = self.storage
        cursor = self._tag_sweeps.get(tenant, 0)
        dropped = swept = 0
        while swept < TAG_SWEEP and not self.halted():
            cursor, names = st.scan_tags(tenant, cursor, TAG_SWEEP)
            for name in names:
                dropped += st.sweep_tag(tenant, name)
            swept += len(names)
            if cursor == 0:
                break
        self._tag_sweeps[tenant] = cursor
        return dropped

    def _states_ahead(
        self, tenant: str, now: float, skip: set[str], rl: RLConfig, check: bool
    ) -> Iterator[tuple[IdBatch, StateArrays]]:
        """The ids zset in ZSCAN batches, each with the learning state of its ids that
        are live at ``now`` and not in ``skip``. The next batches' ZSCAN steps and state
        reads run in threads while the caller scores this one, so a whole scan costs
        about its reads rather than its reads plus the scoring (Redis and Python run side
        by side)."""
        st = self.storage

        def read(batch: IdBatch) -> tuple[IdBatch, StateArrays]:
            live = [eid for eid, expires_at in batch if expires_at > now and eid not in skip]
            return batch, self._state_arrays(tenant, live, rl, check)

        depth = self.read_ahead
        batches = st.iter_ids(tenant, self.eviction.scan_batch)
        if depth:  # the ZSCAN steps too, so that no read waits for the caller's turn
            batches = _read_ahead(batches, depth)
        with ThreadPoolExecutor(max(1, depth), thread_name_prefix="zerda-scan") as pool:
            ahead: deque[Future[tuple[IdBatch, StateArrays]]] = deque()
            try:
                for batch in batches:
                    ahead.append(pool.submit(read, batch))
                    if len(ahead) > depth:
                        yield ahead.popleft().result()
                while ahead:
                    yield ahead.popleft().result()
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()  # a scan stopped early: its ZSCAN thread stops too

    def _state_arrays(
        self, tenant: str, ids: list[str], rl: RLConfig, check: bool = False
    ) -> StateArrays:
        """The learning state of ``ids``, read in calls of at most ``STATE_BATCH``
        (``rl``: the tenant's prior, for an entry whose state was lost; ``check``: read
        an entry whose hash is gone as gone)."""
        step, st = STATE_BATCH, self.storage
        parts = [
            st.state_arrays(tenant, ids[i : i + step], rl=rl, check_hashes=check)
            for i in range(0, len(ids), step)
        ]
        return StateArrays.concat(parts) if parts else st.state_arrays(tenant, [])

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

    @staticmethod
    def _choose_capacity(
        plan: EvictionPlan,
        ids: list[str],
        scores: np.ndarray,
        sizes: np.ndarray,
        versions: np.ndarray,
    ) -> None:
        """Lowest scores first until the keepers fit the capacity minus the margin."""
        limits = plan.limits
        n_keep = len(ids)
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
        plan.capacity = [(ids[i], int(versions[i])) for i in chosen.tolist()]

    def execute(self, plan: EvictionPlan) -> EvictionReport:
        """Remove what ``plan`` chose, in batches, each entry only if unchanged since.

        ``EVICT_IN_FLIGHT`` calls of the evict script are sent at once, from threads:
        while the server runs one, the worker packs the next and parses the last, so the
        server is never idle waiting for the worker (each call still holds the server
        alone, and other clients' commands run between two calls)."""
        report = EvictionReport(plan.tenant)
        started = time.perf_counter()
        batch = min(self.eviction.scan_batch, EVICT_BATCH)
        # Each group in the order of its ids: the ids zset orders ids of equal expiry
        # (every entry without a TTL) by their bytes, so removals in that order walk
        # the same upper levels of its skiplist one after another, while the server's
        # caches still hold them: the ZREMs cost the server a fraction of what they
        # cost in score order (bench_worker's commandstats show their time in a full
        # cycle). Groups go in turn, each done before the next starts: a cycle stopped
        # in one has removed the groups before it whole, and of the one it stopped in,
        # ids from the start of the id order, not its lowest-scored entries first. All
        # of them are due.
        groups: list[tuple[EvictReason, list[tuple[str, int | None]]]] = [
            ("expired", [(eid, None) for eid in sorted(plan.expired)]),
            ("corrupt", [(eid, None) for eid in sorted(plan.corrupt)]),
            # nothing to remove but the id: counted as already gone, not as evicted
            ("corrupt", [(eid, None) for eid in sorted(plan.dangling)]),
            ("low_reward", sorted(plan.low_reward)),
            ("capacity", sorted(plan.capacity)),
        ]
        with ThreadPoolExecutor(EVICT_IN_FLIGHT, thread_name_prefix="zerda-evict") as pool:
            for reason, items in groups:
                sent: deque[Future[EvictOutcome]] = deque()
                stopped = False
                for i in range(0, len(items), batch):
                    if self.halted():  # before the write too: a leader that woke up late
                        stopped = True
                        break
                    sent.append(
                        pool.submit(
                            self.storage.evict,
                            plan.tenant,
                            items[i : i + batch],
                            reason,
                            fence=self.fence(),
                        )
                    )
                    if len(sent) >= EVICT_IN_FLIGHT and not self._count(
                        plan, reason, sent.popleft(), report
                    ):
                        stopped = True
                        break
                # What was sent is done: count it (when one raises, the pool's exit
                # waits for a call still under way).
                while sent:
                    stopped = not self._count(plan, reason, sent.popleft(), report) or stopped
                if stopped or self.halted():
                    report.seconds = time.perf_counter() - started
                    return report
        if plan.feedback_mark is not None:  # carried out whole: read on from its mark
            self._feedback_marks[plan.tenant] = plan.feedback_mark
        report.seconds = time.perf_counter() - started
        return report

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
            self._refused(plan.tenant, exc)
            return False
        except StorageError as exc:
            if not self.fenced:
                raise
            log.warning(
                "tenant %s: an evict call sent before the refusal failed: %s", plan.tenant, exc
            )
            return False
        report.removed[reason] = report.removed.get(reason, 0) + len(out.removed)
        if reason == "corrupt" and plan.reported:
            handled = {*out.removed, *out.gone}
            done = [e for e in plan.reported if e in handled]
            self.storage.forget_suspects(plan.tenant, done)
        report.kept_changed += len(out.changed)
        report.already_gone += len(out.gone)
        return True

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

    # -- the match model -----------------------------------------------------------------------
    def calibrate_tenant(self, tenant: str, *, force: bool = False) -> FitReport | None:
        """Fit the tenant's match model (``match_model.py``) on its label log when
        ``REFIT_EVERY`` labels were logged since the last fit (or ``force``), and publish
        it with the label and lookup counts rescored, if it ranks the newest labels
        better than similarity alone. ``None``: not due, or too few labels."""
        st = self.storage
        if not force and st.read(st.read_fit_due(tenant)) < REFIT_EVERY:
            return None
        logs = TenantState(st).label_logs(tenant)
        n = len(logs.y)
        right = int(logs.y.sum())
        if n < MIN_FIT_LABELS or min(right, n - right) < MIN_EACH_KIND:
            return None
        started = time.perf_counter()
        split = int(n * (1 - HOLDOUT))
        held_y = logs.y[split:]
        trial = fit(logs.x[:split], logs.y[:split], logs.version + 1)
        scores = np.array([trial.p_right(row) for row in logs.x[split:]])
        auc_model = auc(scores, held_y)
        auc_sim = auc(logs.x[split:, 0], held_y)
        report = FitReport(tenant, n, auc_model, auc_sim, False, logs.version)
        if auc_model <= auc_sim:
            report.reason = "no better than similarity alone on the newest labels"
            log.info(
                "tenant %s: match model not published (AUC %.3f vs similarity %.3f, %d labels)",
                tenant,
                auc_model,
                auc_sim,
                n,
            )
            TenantState(st).calibrate(tenant, logs.version, None, logs.logged, {})
            return report
        model = fit(logs.x, logs.y, logs.version + 1)  # on every label, as it ranks them better
        counts = _rescored(model, logs)
        report.published = TenantState(st).calibrate(
            tenant, logs.version, model, logs.logged, counts
        )
        report.version = model.version if report.published else logs.version
        log.info(
            "tenant %s: match model v%d %s (AUC %.3f vs similarity %.3f on the newest %d of "
            "%d labels; %.2f s)",
            tenant,
            model.version,
            "published" if report.published else "not published (another fit won)",
            auc_model,
            auc_sim,
            n - split,
            n,
            time.perf_counter() - started,
        )
        return report

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
        st = self.storage
        policy = self.policy(tenant)
        rl, limits = policy.rl, self.limits(tenant, policy)
        last = self._full_scans.get(tenant)
        if (
            last is None
            or time.monotonic() - last >= self.eviction.full_scan_interval_s
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
        plan.reported = self._reported(tenant)
        plan.corrupt += plan.reported
        plan.corrupt += self._audit(tenant, set(plan.corrupt))
        seen: set[str] = set(plan.corrupt)
        plan.expired = [eid for eid in st.expired_ids(tenant, now) if eid not in seen]
        seen.update(plan.expired)
        batch = self.eviction.scan_batch
        changed, mark = st.changed_arms(
            tenant, self._feedback_marks.get(tenant), limit=max(batch, limits.max_entries)
        )
        batches = (
            st.iter_evidence(tenant, batch)
            if changed is None
            else (changed[i : i + batch] for i in range(0, len(changed), batch))
        )
        for ids in batches:
            cols = self._state_arrays(tenant, [eid for eid in ids if eid not in seen], rl)
            seen.update(ids)
            plan.corrupt += cols.corrupt
            plan.scanned += len(cols.ids)
            scores, _ = self._scores(cols, now, policy)
            plan.low_reward += [
                (cols.ids[i], int(cols.version[i])) for i in np.flatnonzero(scores < 0).tolist()
            ]
            if self.halted():
                plan.complete = False
                break
        if plan.complete:
            plan.feedback_mark = mark
        return plan

    def recover_orphans(self, tenant: str) -> int:
        """Take back the tenant's entries if its ids zset was lost while its entry hashes
        remain (an allkeys-* eviction of the key, a DEL): the zset is empty but the
        tenant's stored bytes are not. Only then is the keyspace scanned for the
        tenant's entry hashes; each orphan gets its id, digest and index event back
        (``adopt.lua``). Returns how many were taken back."""
        count, size = self.storage.size(tenant)
        if count > 0 or size <= 0:
            return 0
        adopted = 0
        for ids in self.storage.iter_entry_keys(tenant):
            adopted += self.storage.adopt(tenant, ids)
            if self.halted():
                break
        if adopted:
            log.warning(
                "tenant %s: its ids zset was lost (an allkeys-* maxmemory policy?); "
                "took back %d entries",
                tenant,
                adopted,
            )
        return adopted

    def sweep_orphans(self) -> int:
        """Take back every entry whose id is missing from its tenant's ids zset, found by
        one SCAN of the keyspace for all tenants (``adopt.lua`` skips the entries that are
        in their zset), and register the tenants it found. Under an allkeys-* policy
        Redis may evict a tenant's zset and the next puts re-create it, so orphans can
        sit beside a non-empty zset, where ``recover_orphans`` does not look (and the
        registry may be evicted too); the worker runs this every
        ``full_scan_interval_s`` on such a server. Returns how many were taken back."""
        adopted = 0
        seen: set[str] = set()
        for batch in self.storage.iter_all_entry_keys():
            by_tenant: dict[str, list[str]] = {}
            for tenant, eid in batch:
                by_tenant.setdefault(tenant, []).append(eid)
            for tenant, ids in by_tenant.items():
                try:
                    adopted += self.storage.adopt(tenant, ids)
                except ValueError:  # a key of another shape: not a tenant of ours
                    continue
                seen.add(tenant)
            if self.halted():
                break
        # The registry may be gone too (another key of the same eviction).
        self.storage.register_tenants(sorted(seen))
        # Redis evicts entries' hashes as well: each tenant's next eviction is a whole
        # scan, which finds the ids and states whose hash went (``plan_eviction``).
        for tenant in seen:
            self._full_scans.pop(tenant, None)
        if adopted:
            log.warning("took back %d entries whose ids were lost (allkeys-* eviction?)", adopted)
        return adopted

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
        if report.removed or report.kept_changed:
            log.info(
                "tenant %s: evicted %s, kept %d changed since scored (%.2fs)",
                tenant,
                report.removed,
                report.kept_changed,
                report.seconds,
            )
        return report

    # -- cycles over every tenant ---------------------------------------------------------------
    def claim(self, tenants: list[str]) -> None:
        """Once per leadership (lease epoch), write the epoch into every tenant's fence
        before this worker's first cycle writes anything: a stalled former leader that
        wakes up is then refused on every tenant, not only on those this leader already
        wrote to (it could otherwise write between this leader's plan of a tenant and
        its first write there)."""
        epoch = self.fence()
        if epoch is None or epoch == self._claimed:
            return
        for tenant in tenants:
            try:
                self.storage.decay(tenant, [], fence=epoch, claim=True)
            except FencedError as exc:
                self._refused(tenant, exc)
                return
        self._claimed = epoch

    def run_decay(self) -> list[DecayReport]:
        self.fenced = False
        with self.cycle("decay"):
            reports = []
            tenants = self.tenants()
            self.claim(tenants)
            for tenant in tenants:
                if self.halted():
                    break
                reports.append(self.decay_tenant(tenant))
            return reports

    def run_eviction(self) -> list[EvictionReport]:
        self.fenced = False
        with self.cycle("evict"):
            reports = []
            tenants = self.tenants()
            self.claim(tenants)
            for tenant in tenants:
                if self.halted():
                    break
                reports.append(self.evict_tenant(tenant))
            return reports

    def run_calibration(self) -> list[FitReport]:
        """Fit the match model of every tenant where one is due (the eviction job runs
        it after its cycle: a fit reads two capped lists, so its cost is bounded by their
        caps)."""
        reports = []
        for tenant in self.tenants():
            if self.halted():
                break
            report = self.calibrate_tenant(tenant)
            if report is not None:
                reports.append(report)
        return reports

    def cycle(self, job: str) -> _Cycle:
        """Context manager that records a cycle's start and end in the cycle log."""
        return _Cycle(self, job)

    def record(self, job: str, phase: str, **extra: str) -> None:
        """Append a start or end record of a cycle to the worker's cycle log."""
        self.storage.record_cycle({"job": job, "phase": phase, "worker": self.worker_id, **extra})

    def recent_cycles(self, count: int = 50) -> list[dict[str, str]]:
        return self.storage.recent_cycles(count)


def _read_ahead(items: Iterator[T], depth: int) -> Iterator[T]:
    """``items``, taken in a thread of their own ahead of the caller (``depth`` waiting
    in a queue and one more in hand: the whole scan's ZSCAN steps, each waiting on a
    round trip). An error in ``items`` is raised here, after the items before it;
    closing this generator stops the thread."""
    out: queue.Queue[tuple[bool, object]] = queue.Queue(depth)
    stop = threading.Event()

    def put(entry: tuple[bool, object]) -> bool:
        while not stop.is_set():
            try:
                out.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((False, None))
        except BaseException as exc:  # handed to the caller, raised there
            put((False, exc))

    thread = threading.Thread(target=produce, name="zerda-scan-ids", daemon=True)
    thread.start()
    try:
        while True:
            more, item = out.get()
            if not more:
                if isinstance(item, BaseException):
                    # Not ``raise item``: its traceback would hold this frame, and the
                    # frame the error, a cycle that keeps the caller's whole scan alive
                    # until the cyclic collector runs.
                    exc, item = item, None
                    raise exc
                return
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        thread.join()


def _rescored(model: MatchModel, logs: LabelLogs) -> dict[str, float]:
    """The label and lookup counts of ``logs`` in ``model``'s score bins."""
    tag = str(model.version)
    counts: Counter[str] = Counter()
    for row, ok in zip(logs.x, logs.y, strict=True):
        counts[f"{'r' if ok else 'w'}{tag}:{bin_of(model.score(row))}"] += 1
    for row in logs.seen:
        near = math.isfinite(row[0])
        counts[f"t{tag}:{bin_of(model.score(row)) if near else 'x'}"] += 1
    if len(logs.seen) or logs.seen_exact:
        # From the same sample, so that the shares are of one window (untagged: exact
        # repeats have no score). Without a sample the old counts stay.
        counts["t:e"] = logs.seen_exact
        for level, n in enumerate(logs.seen_levels):
            if level and n:
                counts[f"t:e{level}"] = n
    return dict(counts)


class _Cycle:
    def __init__(self, maintenance: Maintenance, job: str) -> None:
        self.m = maintenance
        self.job = job
        self.started = 0.0
        self.outcome = ""

    def __enter__(self) -> _Cycle:
        self.started = time.perf_counter()
        try:
            self.m.record(self.job, "start")
        except StorageError as exc:  # a full server refuses the XADD: evict all the same
            log.warning("could not record the start of a %s cycle: %s", self.job, exc)
        return self

    def __exit__(self, typ: object, exc: BaseException | None, tb: object) -> None:
        outcome: CycleOutcome = (
            "error" if exc is not None else ("stopped" if self.m.halted() else "ok")
        )
        try:
            self.m.record(
                self.job,
                "end",
                outcome=outcome,
                seconds=f"{time.perf_counter() - self.started:.6f}",
            )
        except Exception:  # the cycle's own error matters more than its record
            log.exception("could not record the end of a %s cycle", self.job)
