"""Lua scripts: loaded once from package data and registered once per client.

Each ``lua/<name>.lua`` opens with its KEYS/ARGV/return contract. Scripts that touch arms
are prefixed with ``lua/_lib.lua`` (static code, never values: everything variable goes
through KEYS and ARGV). ``Storage.run_flow`` sends EVALSHA itself and, on NOSCRIPT, lets
redis-py's ``Script`` object load and run the script (plain clients and Redis Cluster);
``Storage.read_flow`` does the same for scripts inside a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

#: Scripts that need the shared library of arm formulas.
_WITH_LIB = frozenset({"put", "hit", "feedback", "decay", "evict", "state", "label", "traffic"})
#: Each script's shebang flags (Redis 7 / Valkey 7.2 and later). Under ``maxmemory``
#: with ``noeviction`` a server refuses scripts that write unless they say
#: ``allow-oom``: serving, feedback, decay, eviction and the lease must keep working on
#: a full server (they rewrite values of the same size, or free memory), so that the
#: cache serves what it holds and the worker can free memory. ``put`` has a shebang and
#: no flag: a full server refuses it before it runs, so a refused put writes nothing (a
#: script without a shebang would fail at its first write, after the ones before it).
#: ``state`` reads, and moves the state of entries written before the state hash into it
#: (the same bytes, and the fields it frees).
FLAGS = {
    "put": "",
    "hit": "allow-oom",
    "feedback": "allow-oom",
    "decay": "allow-oom",
    "evict": "allow-oom",
    "state": "allow-oom",
    "lease_renew": "allow-oom",
    "lease_release": "allow-oom",
    "lease_acquire": "allow-oom",
    "lease_finish": "allow-oom",
    "label": "allow-oom",
    # A batch of lookup counts: a few fields of a fixed set, on a full server too (the
    # lookups it counts were served there).
    "traffic": "allow-oom",
    # A fitted match model and its rescored counts: a few kB; it replaces counts.
    "calibrate": "allow-oom",
    # A policy change writes a few bytes, and an operator lowering max_entries on a full
    # server must be able to.
    "settings": "allow-oom",
    # Restoring a lost dimension writes one field of the cfg hash.
    "dim": "allow-oom",
    # Sweeping a tag's set only removes members.
    "tag_sweep": "allow-oom",
    # An import writes entries: refused whole on a full server, as a put is.
    "restore_entry": "",
    # Taking back orphaned entries re-creates their ids on a full server too.
    "adopt": "allow-oom",
    # Publishing a snapshot writes a small hash; its chunks were written (or refused)
    # before. Dropping one frees memory.
    "snapshot": "allow-oom",
    # The HTTP service's keys: a new key is refused whole on a full server; a revocation
    # must work there too.
    "apikey_add": "",
    "apikey_revoke": "allow-oom",
    # A dispute stores an answer's text: refused on a full server (the label stands as
    # wrong, the conservative side). Resolving one frees it.
    "dispute": "",
    "resolve": "allow-oom",
    # A process's report of its settings: a member of a tenant's set, and its payload of
    # a few hundred bytes once a process, each rewritten in place, with their own
    # pcalls; a full server must not refuse the lookup that carries them.
    "report": "allow-oom",
    "report_process": "allow-oom",
}
SCRIPT_NAMES = (
    "put",
    "hit",
    "feedback",
    "decay",
    "evict",
    "state",
    "lease_renew",
    "lease_release",
    "lease_acquire",
    "lease_finish",
    "label",
    "traffic",
    "calibrate",
    "settings",
    "adopt",
    "snapshot",
    "apikey_add",
    "apikey_revoke",
    "dispute",
    "resolve",
    "dim",
    "tag_sweep",
    "restore_entry",
    "report",
    "report_process",
)


@cache
def script_source(name: str) -> str:
    """The full Lua source of script ``name`` (library included where it needs it)."""
    if name not in SCRIPT_NAMES:
        raise ValueError(f"unknown script {name!r}")
    pkg = resources.files("zerda_cache.storage") / "lua"
    body = (pkg / f"{name}.lua").read_text(encoding="utf-8")
    if name in _WITH_LIB:
        body = (pkg / "_lib.lua").read_text(encoding="utf-8") + "\n" + body
    flags = FLAGS.get(name)
    if flags is None:
        return body
    return f"#!lua flags={flags}\n{body}" if flags else f"#!lua\n{body}"


@dataclass(frozen=True, slots=True)
class Scripts:
    """The registered scripts of one client (sync ``redis.Redis``/``RedisCluster`` or
    ``redis.asyncio`` clients: ``register_script`` returns the matching flavour)."""

    put: Any
    hit: Any
    feedback: Any
    decay: Any
    evict: Any
    state: Any
    lease_renew: Any
    lease_release: Any
    lease_acquire: Any
    lease_finish: Any
    label: Any
    traffic: Any
    calibrate: Any
    settings: Any
    adopt: Any
    snapshot: Any
    apikey_add: Any
    apikey_revoke: Any
    dispute: Any
    resolve: Any
    dim: Any
    tag_sweep: Any
    restore_entry: Any
    report: Any
    report_process: Any

    @classmethod
    def register(cls, client: Any) -> Scripts:
        return cls(**{name: client.register_script(script_source(name)) for name in SCRIPT_NAMES})
