"""Storage's operations on a tenant as a whole: its counters and size, its settings, its
log of index events and of feedback, its corrupt ids, the registry of tenants, and the
worker's cycle log and lease.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from zerda_cache.core.errors import (
    InvalidSettingError,
    StorageError,
)
from zerda_cache.core.settings import POLICY_FIELDS, RESERVED, check_changes
from zerda_cache.core.validation import validate_tenant
from zerda_cache.storage.codec import text
from zerda_cache.storage.driver import Flow, op
from zerda_cache.storage.keys import cycles_key, leader_key, process_key
from zerda_cache.storage.plans import (
    LogDelta,
    LogInfo,
    ReadPlan,
    ScriptCall,
)
from zerda_cache.storage.reports import (
    REPORT_TTL_S,
    ProcessReport,
    SettingsReporter,
    parse_reports,
)
from zerda_cache.storage.snapshots import SnapshotStore

log = logging.getLogger(__name__)

#: The worker's cycle log keeps about this many records.
CYCLE_LOG_MAXLEN = 1_000
#: Tenant settings that ``set_tenant_settings`` accepts (``dim`` is fixed by the first put).
TENANT_SETTINGS = tuple(POLICY_FIELDS)


class TenantStore(SnapshotStore):
    """A tenant's counters, settings, logs and registry, and the worker's keys."""

    #: Set by a replica (``CacheEngine``) and by the worker: the settings this process
    #: applies, reported to each tenant whose policy it reads (``storage/reports.py``).
    reporter: SettingsReporter | None = None

    def report_settings(self, tenant: str) -> list[ScriptCall[int]]:
        """The report of this process's settings to ``tenant``, when one is due (sent in
        the round trip that reads the tenant's policy: ``SettingsReporter.calls``);
        empty when not, or when this process reports nothing (the CLI)."""
        reporter = self.reporter
        if reporter is None:
            return []
        return reporter.calls(self.keys(tenant), self.config.key_prefix, self.now_arg())

    def settings_reports_flow(self, tenant: str) -> Flow[list[ProcessReport]]:
        """The settings the replicas and workers that read ``tenant``'s policy lately
        apply to it, one report a process (``storage/reports.py``): the tenant's set of
        processes, then their payloads in one MGET (on Redis Cluster they live in other
        slots than the tenant's keys, and in each other's: one MGET a slot)."""
        now = yield from self.now_flow()
        srv = self.keys(tenant).srv
        since = repr(now - REPORT_TTL_S)
        stamps = yield from self.command_flow(
            "settings reports", "zrangebyscore", srv, since, "+inf", withscores=True
        )
        if not stamps:
            return []
        prefix = self.config.key_prefix
        keys = [process_key(text(member), prefix) for member, _ in stamps]
        mget = "mget_nonatomic" if self.cluster else "mget"
        payloads = yield from self.command_flow("settings reports", mget, keys)
        return parse_reports(stamps, payloads, now)

    def stats_flow(self, tenant: str) -> Flow[dict[str, int]]:
        """The tenant's counters plus ``entries`` (live ids)."""
        return (yield from self.read_flow(self.read_stats(tenant)))

    def register_tenants_flow(self, tenants: Sequence[str]) -> Flow[None]:
        """Add tenants to the global registry (idempotent): the worker's sweep re-creates
        a registry an allkeys-* policy evicted."""
        if tenants:
            for tenant in tenants:
                validate_tenant(tenant)
            yield from self.command_flow("register tenant", "sadd", self.tenants_key, *tenants)

    def size_flow(self, tenant: str) -> Flow[tuple[int, int]]:
        """The tenant's live entries and stored bytes, in one round trip."""
        k = self.keys(tenant)

        def queue(pipe: Any) -> None:
            pipe.zcard(k.ids)
            pipe.hget(k.stats, "bytes")

        def parse(res: list[Any]) -> tuple[int, int]:
            try:
                size = int(res[1] or 0)
            except ValueError:
                size = 0
            return int(res[0]), size

        return (yield from self.read_flow(ReadPlan("size", queue, parse, 2)))

    def evidence_complete_flow(self, tenant: str) -> Flow[bool]:
        """True once a full decay scan has filled the tenant's evidence set (the set is
        then kept by the scripts); False for data written without it, or after the
        settings hash was lost."""
        flag = yield from self.command_flow("evidence", "hget", self.keys(tenant).cfg, "evx")
        return flag is not None

    def count_flow(self, tenant: str) -> Flow[int]:
        """Live entries of ``tenant``."""
        return int((yield from self.command_flow("count", "zcard", self.keys(tenant).ids)))

    def tenants_flow(self) -> Flow[list[str]]:
        """Every tenant that was ever put to or configured (sorted)."""
        members = yield from self.command_flow("tenants", "smembers", self.tenants_key)
        return sorted(text(t) for t in members)

    def tenant_settings_flow(self, tenant: str) -> Flow[dict[str, float]]:
        """The tenant's numeric settings stored in Redis (``policy.POLICY_FIELDS``, by
        their stored names; booleans as 1.0 / 0.0), and ``dim``, fixed by its first put.
        ``tenant_policy`` gives them applied, with their version."""
        raw = yield from self.command_flow("tenant_settings", "hgetall", self.keys(tenant).cfg)
        out: dict[str, float] = {}
        for name, value in raw.items():
            key = text(name)
            if key in RESERVED and key != "dim":
                continue
            try:
                f = POLICY_FIELDS.get(key)
                out[key] = float(f.parse(value) if f is not None else float(value))
            except ValueError:
                log.warning("tenant %s: ignoring bad setting %r=%r", tenant, name, value)
        return out

    def set_tenant_settings_flow(self, /, tenant: str, **settings: float | None) -> Flow[int]:
        """Set (a number) or clear (``None``) settings by keyword: max_entries,
        max_bytes, ttl, max_error_rate, similarity_threshold, top_k, ... (names without a
        dot; ``set_tenant_policy`` takes every name). Returns the new policy version."""
        return (yield from self.set_tenant_policy_flow(tenant, settings))

    def set_tenant_policy_flow(self, tenant: str, changes: Mapping[str, object]) -> Flow[int]:
        """Change a tenant's policy in one step (``settings.lua``): ``changes`` maps
        setting names (``policy.POLICY_FIELDS``: ``similarity_threshold``,
        ``rl.min_reward_to_serve``, ``eviction.reward_weight``, ...) to a value, or to
        ``None`` to fall back to each process's own configuration. Every replica and
        worker applies it within ``policy_refresh_s``. Returns the new version.

        Raises:
            InvalidSettingError: an unknown name or a value the configuration refuses, validated
                with what is stored on top of this storage's configuration; nothing is
                written.
        """
        k = self.keys(tenant)
        if not changes:
            raise InvalidSettingError("no settings to change")
        raw = yield from self.command_flow("tenant_settings", "hgetall", k.cfg)
        stored = {text(n): text(v) for n, v in raw.items()}
        encoded = check_changes(self.config, stored, changes)
        version = yield from self.run_flow(self.plan_settings(tenant, encoded))
        # A full server (noeviction) refuses the SADD, but must take the change itself:
        # lowering max_entries is how an operator makes the worker free memory. A tenant
        # with entries is registered already (each replica re-registers it too).
        registered = yield from self.read_flow(self.register(tenant))
        if isinstance(registered, Exception):
            log.warning("tenant %s: policy changed, not registered: %s", tenant, registered)
        return int(version)

    def reset_tenant_flow(self, tenant: str) -> Flow[None]:
        """Drop a tenant's counters, feedback log, dimension, labelled outcomes and corrupt
        reports (``clear`` calls this once its entries are gone): a tenant re-created with
        another embedding model must not inherit similarity thresholds learned on the old
        one. The index log stays: replicas still need its events."""
        k = self.keys(tenant)
        tags = [text(m) for m in (yield from self.command_flow("tags", "smembers", k.tags))]

        def queue(pipe: Any) -> None:
            pipe.unlink(k.stats, k.fb, k.cal, k.lab, k.seen, k.bad, k.ev, k.tags)
            pipe.hdel(k.cfg, "dim")
            for at in range(0, len(tags), 500):
                pipe.unlink(*(k.tag(t) for t in tags[at : at + 500]))

        size = 2 + (len(tags) + 499) // 500
        yield from self.read_flow(ReadPlan("reset_tenant", queue, _ignore, size))
        yield from self.drop_snapshot_flow(tenant)

    def feedback_log_flow(self, tenant: str, count: int = 100) -> Flow[list[dict[str, str]]]:
        """The most recent feedback signals of ``tenant``, newest first."""
        rows = yield from self.command_flow(
            "feedback_log", "xrevrange", self.keys(tenant).fb, count=count
        )
        return [{text(f): text(v) for f, v in fields.items()} for _, fields in rows]

    def log_info_flow(self, tenant: str) -> Flow[LogInfo]:
        """``XINFO STREAM`` of the tenant's index log (zeros before its first event)."""
        return (yield from self.stream_info_flow(self.keys(tenant).log))

    def read_log_flow(self, tenant: str, after: str) -> Flow[LogDelta]:
        """The tenant's log events after ``after`` (see ``read_log``)."""
        return (yield from self.read_flow(self.read_log(tenant, after)))

    def suspects_flow(self, tenant: str, count: int = 10_000) -> Flow[list[str]]:
        """Up to ``count`` ids replicas reported undecodable in ``tenant`` (read only)."""
        ids = yield from self.command_flow(
            "corrupt ids", "srandmember", self.keys(tenant).bad, count
        )
        return sorted(text(i) for i in ids or ())

    def forget_suspects_flow(self, tenant: str, entry_ids: Sequence[str]) -> Flow[None]:
        """Drop reported ids once they are evicted."""
        if entry_ids:
            yield from self.command_flow("corrupt ids", "srem", self.keys(tenant).bad, *entry_ids)

    def count_misses_flow(self, tenant: str, n: int) -> Flow[None]:
        """Add ``n`` to the tenant's miss counter."""
        yield from self.read_flow(self.count_misses(tenant, n))

    def record_cycle_flow(self, fields: dict[str, str]) -> Flow[None]:
        """Append a record to the worker's cycle log (capped at ~``CYCLE_LOG_MAXLEN``)."""
        yield from self.command_flow(
            "cycle log",
            "xadd",
            cycles_key(self.config.key_prefix),
            fields,
            maxlen=CYCLE_LOG_MAXLEN,
            approximate=True,
        )

    def recent_cycles_flow(self, count: int = 50) -> Flow[list[dict[str, str]]]:
        """The newest records of the worker's cycle log, newest first."""
        rows = yield from self.command_flow(
            "cycle log", "xrevrange", cycles_key(self.config.key_prefix), count=count
        )
        return [{"id": text(i), **{text(k): text(v) for k, v in f.items()}} for i, f in rows]

    def leader_flow(self) -> Flow[str | None]:
        """Who holds the worker lease now, if anyone."""
        raw = yield from self.command_flow("leader", "get", leader_key(self.config.key_prefix))
        return text(raw) if raw is not None else None

    def eviction_policy_flow(self) -> Flow[str | None]:
        """The server's ``maxmemory-policy`` (``None`` when CONFIG is not allowed)."""
        try:
            reply = yield from self.command_flow("config", "config_get", "maxmemory-policy")
        except StorageError:
            return None
        value = reply.get("maxmemory-policy") or reply.get(b"maxmemory-policy")
        return text(value) if value is not None else None

    stats = op(stats_flow)
    count = op(count_flow)
    evidence_complete = op(evidence_complete_flow)
    register_tenants = op(register_tenants_flow)
    size = op(size_flow)
    tenants = op(tenants_flow)
    tenant_settings = op(tenant_settings_flow)
    set_tenant_settings = op(set_tenant_settings_flow)
    set_tenant_policy = op(set_tenant_policy_flow)
    reset_tenant = op(reset_tenant_flow)
    feedback_log = op(feedback_log_flow)
    log_info = op(log_info_flow)
    suspects = op(suspects_flow)
    forget_suspects = op(forget_suspects_flow)
    eviction_policy = op(eviction_policy_flow)
    record_cycle = op(record_cycle_flow)
    recent_cycles = op(recent_cycles_flow)
    leader = op(leader_flow)
    settings_reports = op(settings_reports_flow)


def _ignore(replies: list[Any]) -> None:
    return None
