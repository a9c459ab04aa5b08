"""What each replica and worker says of the settings it applies to a tenant.

A process resolves a tenant's policy as its own ``CacheConfig`` with the tenant's stored
settings on top (``learning/tenant_policy.py``): a tenant that stored no error bound is
served under the bound of each replica's own configuration, and evicted at the
``max_entries`` of the worker's. Only the processes know those values, so each one says
them: a replica when it reads a tenant's policy for its lookups, the worker when its
pass reads it, at most every ``REPORT_EVERY_S`` a tenant (never in a round trip of its
own: it rides in the one that reads the policy).

What a process applies is the same for every tenant it serves, so it is stored once a
process: ``report_process.lua`` writes the payload (its role and ``config_values``, JSON)
to ``p:proc:<process>``, at most every ``REPORT_EVERY_S`` (with the first tenant report
due after that), expiring ``PAYLOAD_TTL_S`` later. A tenant holds only which processes
serve it and when: ``report.lua`` stamps the process in the tenant's sorted set
(``p:{t}:srv``, process id -> the server's time), drops the members older than
``REPORT_TTL_S`` and lets the set expire after that, so that a process that stopped
leaves no trace. ``zerda-cache tenant show`` reads the set and the payloads of its
processes with one MGET (on Redis Cluster the payloads live in other slots than the
tenant's keys: one MGET a slot; ``TenantStore.settings_reports``) and says the values,
and where the processes disagree.
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
from zerda_cache.storage.keys import TenantKeys, process_key
from zerda_cache.storage.replies import ScriptCall

#: How long a report stands without being said again.
REPORT_TTL_S = 60.0
#: How often a process says it again, per tenant it reads the policy of; and at most
#: how often it rewrites its payload.
REPORT_EVERY_S = 15.0
#: How long a process's payload stands: the tenants' members it stamped until its next
#: rewrite (at most ``REPORT_EVERY_S`` later) stand ``REPORT_TTL_S``, and find it.
PAYLOAD_TTL_S = REPORT_TTL_S + REPORT_EVERY_S

Role = Literal["replica", "worker"]


def config_values(config: CacheConfig) -> dict[str, Any]:
    """``config``'s value of every setting a tenant may store (``POLICY_FIELDS``)."""
    out: dict[str, Any] = {}
    for name, f in POLICY_FIELDS.items():
        section = getattr(config, f.section) if f.section else config
        out[name] = getattr(section, f.attr)
    return out


class SettingsReporter:
    """One process's report (its role and ``config_values``), when it last wrote it, and
    when it last said it for each tenant. ``calls`` is used where the process reads a
    tenant's policy."""

    def __init__(self, config: CacheConfig, role: Role, *, process: str | None = None) -> None:
        self.role = role
        self.process = process or (
            f"{role} {socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        )
        report = {"role": role, "settings": config_values(config)}
        self.payload = json.dumps(report, sort_keys=True, separators=(",", ":"))
        #: tenant -> monotonic time of its last report
        self.sent: dict[str, float] = {}
        #: monotonic time the payload was last written (``None``: never yet)
        self.published: float | None = None

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

    def calls(self, keys: TenantKeys, prefix: str, now: str = "") -> list[ScriptCall[int]]:
        """What to send where this process reads ``keys``' tenant's policy: nothing when
        the tenant's report is not due; else the tenant's stamp (``plan``), after the
        payload (``publish``) when it was written ``REPORT_EVERY_S`` ago or never."""
        if not self.due(keys.tenant):
            return []
        mono = time.monotonic()
        calls = []
        if self.published is None or mono - self.published >= REPORT_EVERY_S:
            self.published = mono
            calls.append(self.publish(prefix))
        calls.append(self.plan(keys, now))
        return calls

    def plan(self, keys: TenantKeys, now: str = "") -> ScriptCall[int]:
        """The ``report.lua`` call that stamps this process in ``keys``' tenant's set
        (``now``: the storage's injected time, '' for the server's)."""
        args = [now, self.process, repr(REPORT_TTL_S)]
        return ScriptCall("report", [keys.srv], args, _count)

    def publish(self, prefix: str) -> ScriptCall[int]:
        """The ``report_process.lua`` call that writes this process's payload."""
        args = [self.payload, str(int(PAYLOAD_TTL_S * 1000))]
        return ScriptCall("report_process", [process_key(self.process, prefix)], args, _count)


def _count(res: Any) -> int:
    """A report script's reply; 0 for an error reply a batch tolerated."""
    return res if isinstance(res, int) else 0


@dataclass(frozen=True, slots=True)
class ProcessReport:
    """One process's report, as ``parse_reports`` found it."""

    process: str
    role: str
    #: seconds since the process said it
    age_s: float
    #: its value of each setting, by ``POLICY_FIELDS`` name
    settings: Mapping[str, Any]


def parse_reports(
    stamps: Sequence[tuple[Any, float]], payloads: Sequence[Any], now: float
) -> list[ProcessReport]:
    """The standing reports of a tenant: its set's members with their times, as
    ``ZRANGEBYSCORE ... WITHSCORES`` returns them, and each one's payload, as ``MGET``
    returns them, aged at ``now`` (the storage's clock). Older ones, processes whose
    payload is gone and payloads that do not read are left out."""
    out = []
    for (member, at), value in zip(stamps, payloads, strict=True):
        if value is None:
            continue
        try:
            age = now - float(at)
            report = json.loads(text(value))
            settings = report["settings"]
            role = str(report["role"])
        except (ValueError, KeyError, TypeError):
            continue
        if age <= REPORT_TTL_S and isinstance(settings, dict):
            out.append(ProcessReport(text(member), role, max(0.0, age), settings))
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
    "PAYLOAD_TTL_S",
    "REPORT_EVERY_S",
    "REPORT_TTL_S",
    "ProcessReport",
    "SettingsReporter",
    "applied_by",
    "config_values",
    "parse_reports",
    "said",
]
