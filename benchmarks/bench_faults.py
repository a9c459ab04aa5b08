"""The fault campaign: each fault once, under several replica processes, with its figures.

Every fault runs against real local processes (``tests/fault_support.py``, the code the
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

    .venv/bin/python benchmarks/bench_faults.py [--kinds redis,valkey] [--replicas 3] [--no-write]
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fault harness

import fault_support as faults
from _report import table, write_section
from cluster_support import RedisSentinelGroup

from zerda_cache.testing import SERVER_KINDS, RedisServer, find_server_binary

TIMEOUT_S = 0.25


def replica_fault(
    name: str, kind: str, replicas: int, work: Path, run: Callable[..., faults.FaultResult]
) -> dict[str, Any]:
    aof = ["--appendonly", "yes", "--appendfsync", "always"] if "AOF" in name else []
    with RedisServer(kind, aof) as server:
        fleet = faults.ReplicaFleet(server.url, work, count=replicas, redis_timeout_s=TIMEOUT_S)
        with fleet:
            result = run(server, fleet)
    return result.as_dict()


def sentinel_fault(kind: str, replicas: int, work: Path) -> dict[str, Any]:
    with RedisSentinelGroup(kind=kind) as group:
        fleet = faults.ReplicaFleet(group.url, work, count=replicas, redis_timeout_s=TIMEOUT_S)
        with fleet:
            result = faults.sentinel_failover(group, fleet)
    return result.as_dict()


def leader_fault(kind: str, sig: signal.Signals, work: Path) -> dict[str, Any]:
    with RedisServer(kind) as server:
        return faults.leader_fault(server.url, work, sig).as_dict()


def plans(kind: str, replicas: int, root: Path) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    def on_server(name: str, run: Callable[..., faults.FaultResult]) -> Any:
        return lambda: replica_fault(name, kind, replicas, root / name, run)

    return [
        (
            "Redis SIGKILL, empty restart",
            on_server("empty", lambda s, f: faults.redis_kill_restart(s, f, persistent=False)),
        ),
        (
            "Redis SIGKILL, AOF restart",
            on_server("AOF", lambda s, f: faults.redis_kill_restart(s, f, persistent=True)),
        ),
        ("Redis SIGSTOP", on_server("stop", faults.redis_pause)),
        ("FLUSHALL", on_server("flush", faults.redis_flushall)),
        ("maxmemory", on_server("full", faults.redis_full)),
        ("Sentinel", lambda: sentinel_fault(kind, replicas, root / "sentinel")),
        ("leader SIGKILL", lambda: leader_fault(kind, signal.SIGKILL, root / "leader-kill")),
        ("leader SIGTERM", lambda: leader_fault(kind, signal.SIGTERM, root / "leader-term")),
        ("leader SIGSTOP", lambda: leader_fault(kind, signal.SIGSTOP, root / "leader-stop")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--kinds", default=",".join(SERVER_KINDS), help="server kinds, comma-separated"
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs")
    args = parser.parse_args()
    kinds = []
    for kind in args.kinds.split(","):
        try:
            find_server_binary(kind)
            kinds.append(kind)
        except RuntimeError as exc:
            print(f"skipping {kind}: {exc}", file=sys.stderr)
    results: list[dict[str, Any]] = []
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix=f"zerda-faults-{kind}-") as tmp:
            for label, plan in plans(kind, args.replicas, Path(tmp)):
                started = time.perf_counter()
                try:
                    out = plan()
                except Exception as exc:  # a fault that breaks the campaign is a result too
                    out = {"fault": label, "survived": False, "error": repr(exc)[:300]}
                out["server"] = kind
                out["wall_s"] = time.perf_counter() - started
                print(json.dumps(out, default=str)[:1500], flush=True)
                results.append(out)
    body = render(results, kinds, args.replicas)
    print(body)
    if not args.no_write:
        write_section("faults", "Fault campaign (bench_faults.py)", body, figures=figures(results))


def figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's headline figures over every run (``_targets.py`` reads them)."""
    lost = [_lost(r) for r in results]
    waits = [r["outage_worst_s"] for r in results if r.get("outage") and "outage_worst_s" in r]
    return {
        "faults.runs": len(results),
        "faults.survived": sum(1 for r in results if r.get("survived")),
        "faults.lost": sum(n for n, _ in lost),
        "faults.acknowledged": sum(m for _, m in lost),
        "faults.wrong": sum(r.get("wrong_answers", 0) for r in results),
        "faults.worst_lookup_ms": max(waits, default=0.0) * 1000,
        "faults.timeout_ms": TIMEOUT_S * 1000,
    }


def _lost(r: dict[str, Any]) -> tuple[int, int]:
    """(lost, acknowledged where Redis was to keep them) of one run."""
    if "acked_puts" in r:
        return r["lost"], r["acked_puts"] + r["acked_feedback"]
    if "arms" in r:
        return r["lost_decay"] + r["over_evicted"], r["arms"] + r["evicted"]
    return 0, 0


def render(results: list[dict[str, Any]], kinds: list[str], replicas: int) -> str:
    names = list(dict.fromkeys(r["fault"] for r in results))
    summary = []
    for fault in names:
        runs = [r for r in results if r["fault"] == fault]
        lost = [_lost(r) for r in runs]
        outage = [r for r in runs if r.get("outage") and "outage_worst_s" in r]
        worst = (
            f"{max(r['outage_worst_s'] for r in outage) * 1000:.0f} ms"
            if outage
            else ("no outage" if any("acked_puts" in r for r in runs) else "-")
        )
        summary.append(
            [
                fault,
                str(len(runs)),
                str(sum(1 for r in runs if r.get("survived"))),
                f"{sum(n for n, _ in lost)} of {sum(m for _, m in lost)}",
                str(sum(r.get("wrong_answers", 0) for r in runs))
                if any("acked_puts" in r for r in runs)
                else "-",
                worst,
            ]
        )
    details = [detail(r) for r in results]
    intro = (
        f"Servers: {', '.join(f'`{k}`' for k in kinds)}, each fault once on each. Redis "
        f"faults: {replicas} app-replica processes (puts, exact and near-copy lookups, "
        "feedback, paced 4 ms apart) against one tenant, `redis_timeout_s` "
        f"{TIMEOUT_S * 1000:.0f} ms. Worker faults: two `zerda-cache worker` processes "
        "over 30 tenants of 400 entries at capacity 300, the leader signalled with a "
        "third of them evicted. Lost counts acknowledged puts and feedback Redis no longer "
        "held where it was to keep them (worker faults: arms not decayed to their exact "
        "value, and entries evicted twice, of arms checked plus entries evicted). The "
        "worst lookup is the slowest one overlapping the fault until Redis answered "
        "again. `tests/test_fault_campaign.py` asserts the behaviour behind these rows on "
        "every server kind."
    )
    return (
        intro
        + "\n\n"
        + table(
            [
                "fault",
                "tried",
                "survived",
                "acknowledged writes lost",
                "wrong answers",
                f"worst lookup during the fault (timeout {TIMEOUT_S * 1000:.0f} ms)",
            ],
            summary,
        )
        + "\n\nEvery run:\n\n"
        + table(
            ["fault", "server", "survived", "lost", "wrong", "worst lookup", "what else"],
            details,
        )
    )


def detail(r: dict[str, Any]) -> list[str]:
    n, m = _lost(r)
    head = [r["fault"], r["server"], "yes" if r.get("survived") else "no", f"{n} of {m}"]
    if "error" in r:
        return [*head, "-", "-", r["error"][:120]]
    if "acked_puts" in r:
        notes = (
            f"{r['expected_lost']} acknowledged before it, gone as expected; "
            if r["expected_lost"]
            else ""
        )
        if r["outage"]:
            notes += (
                f"during the fault: {r['outage_hits']} of {r['outage_lookups']} lookups served, "
                f"{r['outage_refused']} writes refused; "
            )
        notes += (
            f"{r['recovered_replicas']} of {r['replicas']} replicas recovered; "
            f"{r['ghost_ids']} ghost, {r['missing_ids']} missing ids at the end; "
            f"{r['lookup_errors']} lookups raised; {r['hits']} hits in {r['lookups']} lookups"
        )
        worst = (
            f"{r['outage_worst_s'] * 1000:.0f} ms ({r['fault_lookups']} lookups)"
            if r["outage"]
            else "no outage"
        )
        return [*head, str(r["wrong_answers"]), worst, notes]
    notes = (
        f"signalled with {r['tenants_done_at_fault']} of {r['tenants']} tenants evicted; "
        f"exit {r['exit_code']}, its last ended cycle {r['last_outcome'] or '-'}; "
        f"{r['evicted']} evicted, {r['over_evicted']} twice; {r['arms']} arms checked, "
        f"{r['lost_decay']} off; overlapping cycles: {'yes' if r['overlap'] else 'no'}"
    )
    return [*head, "-", "-", notes]


if __name__ == "__main__":
    main()
