"""What each replica and worker says of the settings it applies to a tenant.

A process resolves a tenant's policy as its own ``CacheConfig`` with the tenant's stored
settings on top (``learning/tenant_policy.py``): a tenant that stored no error bound is
served under the bound of each replica's own configuration, and evicted at the
``max_entries`` of the worker's. Only the processes know those values, so each one says
them: a replica when it reads a tenant's policy for its lookups, the worker when its
pass reads it, at most every ``REPORT_EVERY_S`` a tenant (never on a lookup's own: a
policy refresh carries it). ``report.lua`` writes a process's report into the tenant's
report hash (``p:{t}:rep``, one field a process, stamped with the server's time), drops
the reports older than ``REPORT_TTL_S`` and lets the hash expire after that, so that a
process that stopped leaves no trace. ``zerda-cache tenant show`` reads them
(``TenantStore.settings_reports``) and says the values, and where the processes disagree.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from zerda_cache.core.config import CacheConfig
from zerda_cache.core.settings import POLICY_FIELDS
from zerda_cache.storage.codec import text
from zerda_cache.storage.keys import TenantKeys
from zerda_cache.storage.replies import ScriptCall

#: How long a report stands without being said again.
REPORT_TTL_S = 60.0
#: How often a process says it again, per tenant it reads the policy of.
REPORT_EVERY_S = 15.0

Role = Literal["replica", "worker"]


def config_values(config: CacheConfig) -> dict[str, Any]:
    """``config``'s value of every setting a tenant may store (``POLICY_FIELDS``)."""
    out: dict[str, Any] = {}
    for name, f in POLICY_FIELDS.items():
        section = getattr(config, f.section) if f.section else config
        out[name] = getattr(section, f.attr)
    return out


class SettingsReporter:
    """One process's report (its role and ``config_values``), and when it last said it
    for each tenant. ``due`` is called where the process reads a tenant's policy."""

    def __init__(self, config: CacheConfig, role: Role, *, process: str | None = None) -> None:
        self.role = role
        self.process = process or (
            f"{role} {socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        )
        report = {"role": role, "settings": config_values(config)}
        self.payload = json.dumps(report, sort_keys=True, separators=(",", ":"))
        #: tenant -> monotonic time of its last report
        self.sent: dict[str, float] = {}

    def due(self, tenant: str) -> bool:
        """Whether to say it for ``tenant`` now (then it counts as said)."""
        mono = time.monotonic()
        last = self.sent.get(tenant)
        if last is not None and mono - last < REPORT_EVERY_S:
            return False
        if len(self.sent) >= 10_000:
            self.sent.clear()
        self.sent[tenant] = mono
        return True

    def plan(self, keys: TenantKeys, now: str = "") -> ScriptCall[int]:
        """The ``report.lua`` call that says it for ``keys``' tenant (``now``: the
        storage's injected time, '' for the server's)."""
        args = [now, self.process, self.payload, repr(REPORT_TTL_S)]
        return ScriptCall("report", [keys.rep], args, lambda res: int(res or 0))


@dataclass(frozen=True, slots=True)
class ProcessReport:
    """One process's report, as ``parse_reports`` found it."""

    process: str
    role: str
    #: seconds since the process said it
    age_s: float
    #: its value of each setting, by ``POLICY_FIELDS`` name
    settings: Mapping[str, Any]


def parse_reports(raw: Mapping[Any, Any], now: float) -> list[ProcessReport]:
    """The standing reports of a report hash as ``HGETALL`` returns it, aged at ``now``
    (the storage's clock; older ones and fields that do not read are left out)."""
    out = []
    for field, value in raw.items():
        at, _, body = text(value).partition(" ")
        try:
            age = now - float(at)
            report = json.loads(body)
            settings = report["settings"]
            role = str(report["role"])
        except (ValueError, KeyError, TypeError):
            continue
        if age <= REPORT_TTL_S and isinstance(settings, dict):
            out.append(ProcessReport(text(field), role, max(0.0, age), settings))
    return sorted(out, key=lambda r: r.process)


def applied_by(role: str, name: str) -> bool:
    """Whether a process of ``role`` applies setting ``name``: the worker evicts (the
    eviction settings), replicas serve (the others); both apply the bandit's (rl.*)."""
    section = POLICY_FIELDS[name].section
    if section == "rl":
        return True
    return (role == "worker") == (section == "eviction")


def said(reports: Sequence[ProcessReport], name: str) -> list[tuple[Any, list[str]]]:
    """The values of setting ``name`` the processes that apply it reported, each with
    those processes, the most common first; one value: they agree; none: none said."""
    groups: dict[str, tuple[Any, list[str]]] = {}
    for r in reports:
        if name in r.settings and applied_by(r.role, name):
            value = r.settings[name]
            groups.setdefault(json.dumps(value), (value, []))[1].append(r.process)
    return sorted(groups.values(), key=lambda g: (-len(g[1]), g[1]))


__all__ = [
    "REPORT_EVERY_S",
    "REPORT_TTL_S",
    "ProcessReport",
    "SettingsReporter",
    "applied_by",
    "config_values",
    "parse_reports",
    "said",
]
