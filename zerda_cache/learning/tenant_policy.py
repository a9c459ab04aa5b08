"""One policy per tenant, in Redis: the bandit's parameters and the serving settings that
every replica and worker of a tenant must agree on.

A tenant's settings hash (``p:{t}:cfg``) holds its overrides, one field each, by the
names of ``settings.POLICY_FIELDS`` (the hash's schema). Every change goes through
one Lua script (``settings.lua``) that writes the fields and bumps the hash's ``ver`` in
one step, so a reader sees all of a change or none of it, with its version.

A replica or worker resolves a tenant's policy as *its own configuration with the
tenant's stored overrides on top* (``resolve``): constructor arguments are the defaults
of tenants with nothing stored, and a tenant's stored policy is the same on every
process that reads it. Replicas re-read it at most ``CacheConfig.policy_refresh_s``
after they last did (in a lookup's own pipeline while traffic flows, so without a round
trip of its own); the worker reads it at the start of every tenant's pass.

A stored value that cannot apply on a process (unparsable, out of range, or in conflict
with that process's other settings, e.g. a ``rl.min_reward_to_serve`` below its
``rl.min_reward_to_keep``) is left out there with one warning per version, and reported
in ``TenantPolicy.rejected``; ``zerda-cache tenant set`` validates every change against
the defaults before it writes it, so this takes a direct ``HSET`` or processes that were
configured differently.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zerda_cache.core.config import CacheConfig, EvictionConfig, RLConfig
from zerda_cache.core.settings import (
    POLICY_FIELDS,
    PolicyField,
    check_changes,
    flatten,
    resolve,
)
from zerda_cache.learning.calibration import Calibration, Serving, served_level

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What one process applies to one tenant: its configuration with the tenant's stored
    overrides on top, and the tenant's labelled outcomes (the error bound's evidence)."""

    tenant: str
    #: The effective configuration: the process's own, with the tenant's overrides.
    config: CacheConfig
    calibration: Calibration = field(default_factory=Calibration)
    #: Bumped by every change (``settings.lua``); 0: the tenant never had a setting.
    version: int = 0
    #: The overrides stored for the tenant and applied here (typed).
    stored: Mapping[str, Any] = field(default_factory=dict)
    #: Stored overrides left out here, with the reason.
    rejected: Mapping[str, str] = field(default_factory=dict)

    @property
    def rl(self) -> RLConfig:
        return self.config.rl

    @property
    def eviction(self) -> EvictionConfig:
        return self.config.eviction

    def bound(self, override: float | None = None) -> float | None:
        """The error bound of a lookup: the call's, else the tenant's, else none."""
        return override if override is not None else self.config.max_error_rate

    def threshold(self, override: float | None = None) -> float | None:
        """The similarity a near match needs under the bound, and under the per-serve
        ceiling ``max_serve_error`` if one is set (``None``: no bound, or no similarity
        is safe yet: tell them apart with ``bound``)."""
        bound = self.bound(override)
        if bound is None:
            return None
        threshold = self.calibration.threshold(bound)
        ceiling = self.config.max_serve_error
        if threshold is None or ceiling is None:
            return threshold
        edge = self.calibration.ceiling_threshold(ceiling)
        return None if edge is None else max(threshold, edge)

    def exact_bar(self, override: float | None = None) -> float | None:
        """The expected reward an entry needs for its exact repeats to be served under
        the bound (``Calibration.exact_plan``) and the per-serve ceiling, if one is set
        (``Calibration.ceiling_bar``); ``None``: no bound, the usual bars."""
        bound = self.bound(override)
        if bound is None:
            return None
        bar = self.calibration.exact_plan(bound)[0]
        ceiling = self.config.max_serve_error
        return bar if ceiling is None else max(bar, self.calibration.ceiling_bar(ceiling))

    def serving(self, override: float | None = None) -> Serving | None:
        """What the tenant serves under the bound as its lookups apply it: the threshold
        and the lowest exact-repeat level (``max_serve_error``'s raised bars included),
        with ``Calibration.serving``'s estimate of the bound's rule (with a ceiling
        raising the bars, an estimate from above); ``None`` without a bound."""
        bound = self.bound(override)
        if bound is None:
            return None
        rule = self.calibration.serving(bound)
        if self.config.max_serve_error is None:
            return rule
        level = served_level(self.exact_bar(override))
        return dataclasses.replace(rule, threshold=self.threshold(override), exact_level=level)

    @classmethod
    def parse(
        cls,
        tenant: str,
        base: CacheConfig,
        settings: Mapping[Any, Any],
        labels: Mapping[Any, Any],
        warn: Callable[[str, int, Mapping[str, str]], None] | None = None,
    ) -> TenantPolicy:
        """From the settings hash and the calibration hash, as ``HGETALL`` returns them."""
        raw = {_text(k): _text(v) for k, v in settings.items()}
        config, applied, rejected = resolve(base, raw)
        try:
            version = int(raw.get("ver", "0"))
        except ValueError:
            version = 0
        if rejected and warn is not None:
            warn(tenant, version, rejected)
        calibration = Calibration.parse(labels, raw.get("max_error_rate"))
        return cls(tenant, config, calibration, version, applied, rejected)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_warned: set[tuple[str, int, tuple[str, ...]]] = set()


def warn_rejected(tenant: str, version: int, rejected: Mapping[str, str]) -> None:
    """Log once per (tenant, version, fields) the stored settings this process leaves out."""
    key = (tenant, version, tuple(sorted(rejected)))
    if key in _warned:
        return
    if len(_warned) > 10_000:
        _warned.clear()
    _warned.add(key)
    log.warning(
        "tenant %s: stored settings left out here (policy version %d): %s",
        tenant,
        version,
        "; ".join(f"{k}: {v}" for k, v in sorted(rejected.items())),
    )


__all__ = [
    "POLICY_FIELDS",
    "PolicyField",
    "TenantPolicy",
    "check_changes",
    "flatten",
    "resolve",
]
