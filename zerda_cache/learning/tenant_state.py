"""A tenant's policy and labelled outcomes, read and written through storage.

Storage (``zerda_cache.storage``) keeps a tenant's settings hash, calibration hash and
label log as Redis holds them and knows nothing of what they mean. This module is the
layer above it that does: it resolves the hashes into the ``TenantPolicy`` a process
applies (``tenant_policy.py``), bins a label as the calibration counts it (``calibration.py``,
scored by the tenant's match model, ``match_model.py``), and reads the label log the
worker fits that model from. The engine puts these plans into its own round trips and
keeps each tenant's policy a while (``PolicyCache``); the CLI, the worker and tests use
``TenantState``, their driven forms.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from zerda_cache.core.validation import validate_tenant
from zerda_cache.learning.calibration import Calibration, LabelLogs, bin_of
from zerda_cache.learning.match_model import MatchModel, score_of
from zerda_cache.learning.tenant_policy import TenantPolicy, warn_rejected
from zerda_cache.storage.driver import AsyncDriven, Flow, SyncDriven, op
from zerda_cache.storage.plans import ReadPlan, ScriptCall, TenantHashes
from zerda_cache.storage.store import Storage
from zerda_cache.storage.tenant_plans import exact_bin


def read_policy(storage: Storage, tenant: str) -> ReadPlan[TenantPolicy]:
    """The tenant's policy: ``storage``'s configuration with the tenant's stored settings
    on top, and its labelled outcomes (``TenantPolicy.parse``)."""
    plan = storage.read_tenant(tenant)
    raw_parse, config = plan.parse, storage.config

    def parse(replies: list[Any]) -> TenantPolicy:
        hashes: TenantHashes = raw_parse(replies)
        return TenantPolicy.parse(tenant, config, hashes.settings, hashes.labels, warn_rejected)

    return ReadPlan(plan.name, plan.queue, parse, plan.size)


def plan_label(
    storage: Storage,
    tenant: str,
    similarity: float,
    right: bool,
    *,
    window: int | None = None,
    features: Sequence[float] | None = None,
    model: MatchModel | None = None,
    exact: bool = False,
    level: int = 0,
) -> ScriptCall[float]:
    """Plan counting one labelled outcome of a near match and logging it for the
    worker's fit: ``features`` of the match (default: its similarity only); ``model``:
    the tenant's model the caller knows, whose score bins the label (the script counts
    it only if that is still the tenant's). ``exact``: a verification of an exact repeat
    whose entry was at ``level`` (``Calibration.exact_plan``): counted apart (``r:e``,
    ``r:e<level>``), not logged."""
    row = list(features) if features is not None else [similarity, float("nan"), float("nan")]
    bin_: int | str = exact_bin(level) if exact else bin_of(score_of(model, row))
    version = 0 if model is None else model.version
    return storage.plan_label(
        tenant, row, right, bin_, model_version=version, window=window, logged=not exact
    )


def read_label_logs(storage: Storage, tenant: str) -> ReadPlan[LabelLogs]:
    """The tenant's label log, its sample of lookups and the fit counters, decoded."""
    plan = storage.read_label_logs(tenant)
    raw_parse = plan.parse

    def parse(replies: list[Any]) -> LabelLogs:
        return LabelLogs.parse(*raw_parse(replies))

    return ReadPlan(plan.name, plan.queue, parse, plan.size)


class TenantFlows:
    """The flows of this module's plans over one storage; ``TenantState`` (sync) and
    ``AsyncTenantState`` (asyncio) drive them: ``TenantState(storage).policy("acme")``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def policy_flow(self, tenant: str, *, report: bool = False) -> Flow[TenantPolicy]:
        """The tenant's policy as this storage's configuration resolves it. ``report``:
        with this process's report of its settings when due, in the same round trip
        (the worker's passes: ``worker/cycle_context.py``), best effort: a report whose
        reply is an error leaves the policy read as it is."""
        st = self.storage
        plan = read_policy(st, tenant)
        calls = st.report_settings(tenant) if report else []
        if not calls:
            return (yield from st.read_flow(plan))
        batch = st.batch("policy", [plan, *calls])
        said = tuple(range(plan.size, batch.size))  # the report's replies, after the read
        replies = yield from st.read_flow(replace(batch, tolerant=batch.tolerant + said))
        policy: TenantPolicy = replies[0]
        return policy

    def calibration_flow(self, tenant: str) -> Flow[Calibration]:
        """The tenant's labelled outcomes and stored error bound."""
        return (yield from self.policy_flow(tenant)).calibration

    def label_logs_flow(self, tenant: str) -> Flow[LabelLogs]:
        """What the worker fits the tenant's match model from (``read_label_logs``)."""
        return (yield from self.storage.read_flow(read_label_logs(self.storage, tenant)))

    def label_flow(
        self,
        tenant: str,
        similarity: float,
        right: bool,
        *,
        window: int | None = None,
        level: int | None = None,
    ) -> Flow[float]:
        """Count one labelled outcome of a near match, or with ``level``, of an exact
        repeat whose entry was at that level; returns the tenant's label count."""
        exact = level is not None
        plan = plan_label(
            self.storage, tenant, similarity, right, window=window, exact=exact, level=level or 0
        )
        return (yield from self.storage.run_flow(plan))

    def calibrate_flow(
        self,
        tenant: str,
        fitted_against: int,
        model: MatchModel | None,
        label_count: int,
        counts: Mapping[str, float],
    ) -> Flow[bool]:
        """Publish a fitted match model with its rescored counts
        (``StoragePlans.plan_calibrate``): False if another model was published since
        ``fitted_against``; ``model`` None records the fit without publishing."""
        published = None if model is None else (model.version, model.encode())
        plan = self.storage.plan_calibrate(tenant, fitted_against, published, label_count, counts)
        return (yield from self.storage.run_flow(plan))

    policy = op(policy_flow)
    calibration = op(calibration_flow)
    label_logs = op(label_logs_flow)
    label = op(label_flow)
    calibrate = op(calibrate_flow)


class PolicyCache:
    """Each tenant's policy as one process applies it, with the monotonic time it was
    read: a policy is used at most ``policy_refresh_s`` after it was read, so that a
    change made anywhere reaches this process within that time; and once a lookup saw
    the tenant's label stamp ``policy_refresh_labels`` ahead of it (``stamps``), the next
    lookup reads it again, so that decisions follow the labels whatever the pace."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.config = storage.config
        #: tenant -> (monotonic time it was read, the policy)
        self.cached: dict[str, tuple[float, TenantPolicy]] = {}
        #: tenant -> the newest label stamp a lookup's round trip saw (the lookup
        #: writes it there, on its hot path: ``LookupSteps.round_trip_flow``)
        self.stamps: dict[str, int] = {}
        self.refresh_labels = self.config.policy_refresh_labels

    def keep(self, tenant: str, mono: float, policy: TenantPolicy) -> None:
        """Keep ``policy``, read at ``mono`` (a lookup's round trip read it)."""
        self.cached[tenant] = (mono, policy)

    def policy_flow(
        self, tenant: str, *, fresh: bool = False, register: bool = False
    ) -> Flow[TenantPolicy]:
        """The tenant's policy: the configuration with the tenant's stored settings on
        top (``zerda_cache.learning.tenant_policy``), read from Redis when the cached one
        is older than ``policy_refresh_s`` (or ``fresh``). ``register``: add the tenant to
        the registry in the same round trip, and report this process's settings to it when
        due (lookups do; a refused put or feedback must write nothing)."""
        validate_tenant(tenant)
        cached = self.cached.get(tenant)
        mono = time.monotonic()
        if not fresh and cached is not None and mono - cached[0] <= self.config.policy_refresh_s:
            return cached[1]
        st = self.storage
        parts: list[ReadPlan[Any] | ScriptCall[Any]] = [read_policy(st, tenant)]
        if register:  # with the settings this process applies, when due
            parts.append(st.register(tenant))
            parts.extend(st.report_settings(tenant))
        replies = yield from st.read_flow(st.batch("policy", parts))
        policy: TenantPolicy = replies[0]
        self.cached[tenant] = (mono, policy)
        return policy

    def for_lookup(self, tenant: str) -> tuple[TenantPolicy, bool] | None:
        """The tenant's policy for a lookup, and whether the lookup should read it again
        in its own round trip; ``None`` when it is older than ``policy_refresh_s`` (or
        there is none yet): then the lookup reads it first, a round trip of its own
        (``policy_flow(tenant, fresh=True, register=True)``). Past half that age, the
        lookup's round trip reads it for the next lookups, so that a replica with steady
        traffic never pays that round trip."""
        cached = self.cached.get(tenant)
        if cached is None:
            return None
        refresh_s = self.config.policy_refresh_s
        age = time.monotonic() - cached[0]
        if age > refresh_s:
            return None
        policy, seen = cached[1], self.stamps.get(tenant)
        behind = seen is not None and seen - policy.calibration.stamp >= self.refresh_labels
        return policy, age > refresh_s / 2 or behind


class TenantState(SyncDriven, TenantFlows):
    """``TenantFlows`` over a ``RedisStorage``, run in the calling thread."""


class AsyncTenantState(AsyncDriven, TenantFlows):
    """``TenantFlows`` over an ``AsyncRedisStorage``, awaited."""


__all__ = [
    "AsyncTenantState",
    "PolicyCache",
    "TenantFlows",
    "TenantState",
    "plan_label",
    "read_label_logs",
    "read_policy",
]
