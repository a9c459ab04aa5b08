"""The worker's decay job: persisting the decay of the arms with evidence."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from zerda_cache.core.config import RLConfig
from zerda_cache.core.errors import FencedError
from zerda_cache.storage import StateArrays
from zerda_cache.worker.cycle_context import CycleContext
from zerda_cache.worker.state_scan import StateScan


@dataclass(slots=True)
class DecayReport:
    tenant: str
    decayed: int = 0
    missing: int = 0
    corrupt: int = 0
    seconds: float = 0.0
    #: This run reached the end of the tenant's evidence list (a sweep ended).
    swept: bool = True


class DecayJob:
    """Owns the decay job's sweep of each tenant's list of arms with evidence (where it
    stands), and the calls of the decay script, of at most ``batch`` arms each.
    ``decay_ids`` and ``decay_columns`` also serve a whole-scan eviction that decays
    what it reads (``EvictionPlanner.plan``)."""

    def __init__(self, context: CycleContext, states: StateScan, *, batch: int) -> None:
        self.context = context
        self.states = states
        self.batch = batch
        #: Where the sweep of each tenant's evidence list stands (an SSCAN cursor; 0:
        #: the next run starts a sweep).
        self._sweeps: dict[str, int] = {}

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
        ctx = self.context
        st, size = ctx.storage, ctx.eviction.scan_batch
        rl = ctx.policy(tenant).rl
        if complete is None:
            complete = st.evidence_complete(tenant)
        if complete:
            ev = ctx.eviction
            share = min(1.0, ev.decay_job_interval_s / ev.decay_sweep_s)
            budget = max(size, math.ceil(st.evidence_count(tenant) * share))
            cursor, done = self._sweeps.get(tenant, 0), 0
            while True:
                cursor, ids = st.scan_evidence(tenant, cursor, size)
                if ids:
                    self.decay_ids(tenant, ids, report, rl)
                done += len(ids)
                if cursor == 0 or done >= budget or ctx.halted():
                    break
            self._sweeps[tenant] = cursor
            report.swept = cursor == 0
        else:  # data written without the list, or its flag was lost: scan it all once
            for batch in st.iter_ids(tenant, size):
                cols = self.states.arrays(tenant, [eid for eid, _ in batch], rl)
                self.decay_columns(tenant, cols, report, rl)
                if ctx.halted():
                    break
            else:
                self.decay_ids(tenant, [], report, rl, complete=True)
        report.seconds = time.perf_counter() - started
        return report

    def decay_ids(
        self,
        tenant: str,
        ids: list[str],
        report: DecayReport,
        rl: RLConfig,
        *,
        complete: bool = False,
    ) -> None:
        """Persist the decay of ``ids`` (``complete``: flag the evidence list complete
        with the last call; with no ids, one call does only that)."""
        ctx = self.context
        step = min(ctx.eviction.scan_batch, self.batch)
        for i in range(0, max(len(ids), 1), step):
            if ctx.fenced:
                return
            chunk = ids[i : i + step]
            last = i + step >= len(ids)
            try:
                out = ctx.storage.decay(
                    tenant, chunk, fence=ctx.fence(), rl=rl, complete=complete and last
                )
            except FencedError as exc:
                ctx.refused(tenant, exc)
                return
            report.decayed += out.decayed
            report.missing += out.missing
            report.corrupt += len(out.corrupt)

    def decay_columns(
        self, tenant: str, cols: StateArrays, report: DecayReport, rl: RLConfig
    ) -> None:
        """Persist the decay of the arms of ``cols`` that hold evidence (any away from
        the prior)."""
        excess = np.abs(cols.alpha - rl.prior_alpha) + np.abs(cols.beta - rl.prior_beta)
        todo = [cols.ids[i] for i in np.flatnonzero(excess > 1e-12).tolist()]
        report.corrupt += len(cols.corrupt)
        if todo:
            self.decay_ids(tenant, todo, report, rl)
