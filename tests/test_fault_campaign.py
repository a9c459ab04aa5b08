"""Faults under traffic from several processes: Redis SIGKILL (empty and AOF restarts) with
three replica processes, and the worker leader killed or terminated mid-cycle with a
standby worker process taking over.

Every process is real (``fault_support``: the replicas record what Redis
acknowledged and what they served; ``benchmarks/bench_faults.py`` runs the same code
and reports its figures, lookup latency included). Assertions are about behaviour: what
was lost, what was served, whether the replicas recovered; never about how long anything
took.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import fault_support as faults
import pytest
from conftest import unit


@pytest.mark.slow
@pytest.mark.parametrize("restart", ["empty", "aof"])
def test_redis_sigkill_under_traffic_from_replica_processes(
    restart: str, redis_server_factory: Any, tmp_path: Path
) -> None:
    """SIGKILL of redis-server while three replica processes put, look up and send
    feedback; then a restart on the same port, with nothing (no persistence) or with
    its AOF (``appendfsync always``). With AOF, no acknowledged put or feedback signal
    is lost. Either way no replica serves an answer put for another question, no lookup
    raises (they fail open while Redis is gone), every replica serves entries put after
    the restart without being restarted itself, and at the end every replica's index
    holds exactly the ids Redis holds (the ghosts of an empty restart are purged)."""
    aof = ["--appendonly", "yes", "--appendfsync", "always"] if restart == "aof" else []
    server = redis_server_factory(aof)
    fleet = faults.ReplicaFleet(server.url, tmp_path / "fleet", count=3)
    with fleet:
        result = faults.redis_kill_restart(server, fleet, persistent=restart == "aof")
    notes = "\n".join(result.notes[:20])
    assert result.acked_puts > 0 and result.lookups > 0 and result.hits > 0, notes
    assert result.lost == 0, notes  # AOF: all of it; empty: everything put since
    if restart == "empty":
        assert result.expected_lost > 0  # what went with the process was acknowledged
    assert result.wrong_answers == 0, notes
    assert result.lookup_errors == 0, notes  # failed open, never raised
    assert result.outage_lookups >= 3 * 3 and result.outage_hits == 0, notes
    assert result.recovered_replicas == 3, notes
    assert result.new_puts_after > 0
    assert (result.ghost_ids, result.missing_ids) == (0, 0), notes


def test_a_replica_idle_through_an_empty_restart_drops_every_ghost(
    make_manager: Any, redis_server_factory: Any
) -> None:
    """A replica that sat idle while Redis was SIGKILLed, restarted empty and refilled by
    other replicas with more entries than it had read: its next read found the new log
    longer than what it had consumed, took it for its own and kept the old ids in its
    index for good (25 indexed for 15 live). A log whose trimmed events are not the ones
    this replica consumed is another log: it rebuilds."""
    server = redis_server_factory()
    idle, busy = make_manager(url=server.url), make_manager(url=server.url)
    for i in range(10):
        idle.put(f"old {i}", "a", tenant="t", embedding=unit(i))
    assert idle.sync_index("t") == 10
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    server.restart()  # nothing persisted: an empty server on the same port
    fresh = {busy.put(f"new {i}", "b", tenant="t", embedding=unit(100 + i)).entry_id
             for i in range(15)}  # fmt: skip
    for _ in range(5):  # the first call may meet a socket of the killed server
        hit = idle.lookup("new 3", tenant="t", embedding=unit(103))
        if hit is not None:
            break
    assert hit is not None and hit.query == "new 3"
    idle.sync_index("t")
    assert idle.index_ids("t") == fresh


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP], ids=["SIGKILL", "SIGTERM", "SIGSTOP"]
)
def test_the_worker_leader_dies_mid_cycle_and_the_standby_process_takes_over(
    sig: signal.Signals, redis_server_factory: Any, tmp_path: Path
) -> None:
    """Two ``zerda-cache worker`` processes; the leader gets SIGKILL, SIGTERM or SIGSTOP
    (then SIGCONT once the standby leads) while its eviction cycle is half-way through 30
    tenants over capacity. The standby process
    leads (SIGTERM: once the leader finished its batch, recorded its cycle as stopped and
    released the lease, exiting 0). Its cycles never overlap the old leader's; every
    tenant ends at its capacity target exactly, with one eviction counted per entry
    removed (nothing evicted twice); and every arm with evidence was decayed after the
    fault to exactly the value time-based decay gives (no decay lost, none doubled)."""
    server = redis_server_factory()
    result = faults.leader_fault(server.url, tmp_path, sig)
    notes = "\n".join(result.notes)
    assert result.mid_cycle and 0 < result.tenants_done_at_fault < result.tenants
    assert result.took_over and not result.overlap, notes
    if sig in (signal.SIGTERM, signal.SIGSTOP):  # SIGSTOP: woken, then a SIGTERM
        assert result.exit_code == 0 and result.last_outcome == "stopped", notes
    else:
        assert result.exit_code == -signal.SIGKILL
    assert result.evicted == result.tenants * (400 - 285)
    assert (result.over_evicted, result.miscounted) == (0, 0), notes
    assert result.arms > 0 and result.lost_decay == 0, notes
