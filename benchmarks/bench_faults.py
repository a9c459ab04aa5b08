"""The fault campaign: each fault once, under several replica processes, with its figures.

Every fault runs against real local processes (``zerda_cache.faultkit``, the code the
fault tests in ``tests/test_fault_campaign.py`` run): three app-replica processes, each a
``CacheManager`` doing puts, exact and near-copy lookups and feedback against one tenant
and recording what Redis acknowledged and what it served; and, for the worker faults,
two ``zerda-cache worker`` processes. Per fault:

* **tried / survived**: survived means no acknowledged write lost where Redis was to
  keep it, no wrong answer, no lookup raising, every replica serving new entries after
  the fault without a restart, and every replica's index equal to Redis' ids at the end
  (worker faults: the standby took over, no overlapping cycles, no double eviction, no
  decay lost or doubled);
* **acknowledged writes lost**: puts and feedback signals Redis acknowledged and no
  longer holds, where it was expected to keep them (an empty restart or a FLUSHALL is
  expected to lose what came before: shown apart);
* **wrong answers**: lookups served an entry put for another question;
* **worst lookup during the fault** against ``redis_timeout_s`` (0.25 s here): the
  slowest lookup that overlapped the fault, from its start until Redis answered again
  (restarted, resumed, promoted); "served" counts the hits among the lookups that began
  and ended while Redis was certainly down, frozen or full.

    .venv/bin/python benchmarks/bench_faults.py [--kind redis] [--replicas 3] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import table, write_section

from zerda_cache import faultkit
from zerda_cache.testing import RedisSentinelGroup, RedisServer

TIMEOUT_S = 0.25


def replica_fault(
    name: str, kind: str, replicas: int, work: Path, run: Callable[..., faultkit.FaultResult]
) -> dict[str, Any]:
    aof = ["--appendonly", "yes", "--appendfsync", "always"] if "AOF" in name else []
    with RedisServer(kind, aof) as server:
        fleet = faultkit.ReplicaFleet(server.url, work, count=replicas, redis_timeout_s=TIMEOUT_S)
        with fleet:
            result = run(server, fleet)
    return result.as_dict()


def sentinel_fault(kind: str, replicas: int, work: Path) -> dict[str, Any]:
    with RedisSentinelGroup(kind=kind) as group:
        fleet = faultkit.ReplicaFleet(group.url, work, count=replicas, redis_timeout_s=TIMEOUT_S)
        with fleet:
            result = faultkit.sentinel_failover(group, fleet)
    return result.as_dict()


def leader_fault(kind: str, sig: signal.Signals, work: Path) -> dict[str, Any]:
    with RedisServer(kind) as server:
        return faultkit.leader_fault(server.url, work, sig).as_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", default="redis", help="redis, valkey or redis8")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zerda-faults-") as tmp:
        root = Path(tmp)
        plans: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            (
                "Redis SIGKILL, empty restart",
                lambda: replica_fault(
                    "empty",
                    args.kind,
                    args.replicas,
                    root / "empty",
                    lambda s, f: faultkit.redis_kill_restart(s, f, persistent=False),
                ),
            ),
            (
                "Redis SIGKILL, AOF restart",
                lambda: replica_fault(
                    "AOF",
                    args.kind,
                    args.replicas,
                    root / "aof",
                    lambda s, f: faultkit.redis_kill_restart(s, f, persistent=True),
                ),
            ),
            (
                "Redis SIGSTOP",
                lambda: replica_fault(
                    "stop", args.kind, args.replicas, root / "stop", faultkit.redis_pause
                ),
            ),
            (
                "FLUSHALL",
                lambda: replica_fault(
                    "flush", args.kind, args.replicas, root / "flush", faultkit.redis_flushall
                ),
            ),
            (
                "maxmemory",
                lambda: replica_fault(
                    "full", args.kind, args.replicas, root / "full", faultkit.redis_full
                ),
            ),
            ("Sentinel", lambda: sentinel_fault(args.kind, args.replicas, root / "sentinel")),
            (
                "leader SIGKILL",
                lambda: leader_fault(args.kind, signal.SIGKILL, root / "leader-kill"),
            ),
            (
                "leader SIGTERM",
                lambda: leader_fault(args.kind, signal.SIGTERM, root / "leader-term"),
            ),
        ]
        for label, plan in plans:
            started = time.perf_counter()
            try:
                out = plan()
            except Exception as exc:  # a fault that breaks the campaign is a result too
                out = {"fault": label, "survived": False, "error": repr(exc)[:300]}
            out["wall_s"] = time.perf_counter() - started
            print(json.dumps(out, default=str)[:2000], flush=True)
            results.append(out)
    body = render(results, args)
    print(body)
    if not args.no_write:
        write_section("faults", "Fault campaign (bench_faults.py)", body)


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["fault"], "1", "no", "-", "-", "-", "-", r["error"][:80]])
            continue
        if "acked_puts" in r:  # a Redis fault under replica processes
            lost = f"{r['lost']} of {r['acked_puts'] + r['acked_feedback']}"
            worst = (
                f"{r['outage_worst_s'] * 1000:.0f} ms ({r['fault_lookups']} lookups)"
                if r["outage"]
                else "no outage"
            )
            notes = (
                f"{r['expected_lost']} acknowledged before it, gone as expected; "
                if r["expected_lost"]
                else ""
            )
            if r["outage"]:
                notes += (
                    f"during the fault {r['outage_hits']} of {r['outage_lookups']} lookups "
                    f"served, {r['outage_refused']} writes refused; "
                )
            notes += (
                f"{r['recovered_replicas']} of {r['replicas']} replicas recovered; "
                f"{r['ghost_ids']} ghost, {r['missing_ids']} missing ids at the end; "
                f"{r['hits']} hits in {r['lookups']} lookups"
            )
            rows.append(
                [
                    r["fault"],
                    "1",
                    "yes" if r["survived"] else "no",
                    lost,
                    str(r["wrong_answers"]),
                    worst,
                    f"{r['lookup_errors']}",
                    notes,
                ]
            )
        else:  # a worker fault
            notes = (
                f"signalled with {r['tenants_done_at_fault']} of {r['tenants']} tenants "
                f"evicted; exit {r['exit_code']}, its last ended cycle "
                f"{r['last_outcome'] or '-'}; {r['evicted']} evicted, "
                f"{r['over_evicted']} twice; {r['arms']} arms checked, "
                f"{r['lost_decay']} off; overlap: {'yes' if r['overlap'] else 'no'}"
            )
            rows.append(
                [
                    r["fault"],
                    "1",
                    "yes" if r["survived"] else "no",
                    f"{r['lost_decay'] + r['over_evicted']} (decay, evictions)",
                    "-",
                    "-",
                    "-",
                    notes,
                ]
            )
    header = [
        "fault",
        "tried",
        "survived",
        "acknowledged writes lost",
        "wrong answers",
        f"worst lookup during the fault (redis_timeout_s {TIMEOUT_S * 1000:.0f} ms)",
        "lookups that raised",
        "what else was measured",
    ]
    intro = (
        f"Server: `{args.kind}`; {args.replicas} replica processes (puts, exact and "
        "near-copy lookups, feedback, paced 4 ms apart); the worker faults run two "
        "`zerda-cache worker` processes over 30 tenants of 400 entries, capacity 300. "
        "Each fault once; a run takes a few seconds per fault. The tests in "
        "`tests/test_fault_campaign.py` assert the same figures on every server kind."
    )
    return intro + "\n\n" + table(header, rows)


if __name__ == "__main__":
    main()
