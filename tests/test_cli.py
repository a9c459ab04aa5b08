"""The zerda-cache command line, and `make demo` in its short mode."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner

from zerda_cache import FeedbackSignal
from zerda_cache.cli import cli
from zerda_cache.storage import RedisStorage

ROOT = Path(__file__).resolve().parents[1]


def run(url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--redis-url", url, *args])
    return result.exit_code, result.output


def test_stats_inspect_tenant_and_evict(redis_client: redis.Redis, redis_url: str) -> None:
    st = RedisStorage(redis_client)
    rng = np.random.default_rng(0)
    ids = [st.put("acme", f"q{i}", f"answer {i}", rng.normal(size=8)).entry_id for i in range(30)]
    st.feedback(FeedbackSignal(ids[0], "acme", True))
    st.feedback(FeedbackSignal(ids[1], "acme", False, similarity=0.9))  # a near miss
    st.feedback(FeedbackSignal(ids[2], "acme", False))

    code, out = run(redis_url, "stats")
    assert code == 0 and "acme" in out and "30" in out and "worker leader: none" in out

    code, out = run(redis_url, "inspect", ids[0], "--tenant", "acme")
    assert code == 0 and "answer 0" in out and "Beta(2.000, 1.000)" in out
    assert "none (not raised yet)" in out
    code, out = run(redis_url, "inspect", ids[1], "--tenant", "acme")
    assert code == 0 and "own similarity bar" in out and "0.905" in out
    code, out = run(redis_url, "inspect", ids[2], "--tenant", "acme")
    assert code == 0 and "Beta(1.000, 2.000)" in out
    assert re.search(r"complaints in a row\W+1\b", out), out
    code, out = run(redis_url, "inspect", "0" * 32, "--tenant", "acme")
    assert code == 1 and "no entry" in out

    code, out = run(redis_url, "tenant", "set", "acme", "--max-entries", "20", "--ttl", "60")
    assert code == 0 and "20" in out and "60 s" in out
    code, out = run(redis_url, "tenant", "show", "acme")
    assert code == 0 and "not set yet" not in out and "dimension" in out
    code, _ = run(redis_url, "tenant", "set", "acme")
    assert code == 2  # nothing to set
    code, out = run(redis_url, "tenant", "set", "acme", "--max-error-rate", "0.02")
    assert code == 0 and "2.00%" in out and "near matches are verified" in out, out
    # a new tenant: exact repeats of entries a positive signal confirmed
    assert "expected reward >= 0.55 (level 1)" in out, out
    assert st.calibration("acme").max_error_rate == 0.02
    code, out = run(redis_url, "tenant", "set", "acme", "--max-error-rate", "1.5")
    assert code == 2 and "max_error_rate" in out
    code, out = run(redis_url, "tenant", "set", "acme", "--clear", "max_error_rate")
    assert code == 0 and "none (no bound)" in out

    code, out = run(redis_url, "evict", "--dry-run", "--tenant", "acme")
    assert code == 0 and "dry run" in out and st.count("acme") == 30
    code, out = run(redis_url, "evict", "--tenant", "acme")
    assert code == 0 and st.count("acme") == 19

    code, out = run(redis_url, "inspect", ids[0], "--tenant", "bad:tenant")
    assert code == 2 and "invalid tenant" in out


def test_worker_check_without_server(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["worker", "--check", "--health-file", str(tmp_path / "none")])
    assert result.exit_code == 1 and "unhealthy" in result.output


def test_make_demo_short(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        ["make", "--no-print-directory", "demo", f"DEMO_ARGS=--short --out {out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (out / "learning_curve.png").stat().st_size > 10_000
    assert "| seconds | requests | hit rate |" in (out / "report.md").read_text()
    assert report["worker_cycles"] > 0 and report["metrics_samples"] > 20
    assert sum(w["requests"] for w in report["windows"]) > 300
    assert report["stats"]["puts"] > 0 and report["stats"]["hits"] > 0


def test_entries_list_and_json_output(redis_client: redis.Redis, redis_url: str) -> None:
    st = RedisStorage(redis_client)
    rng = np.random.default_rng(1)
    ids = {st.put("acme", f"question {i}", f"a{i}", rng.normal(size=8)).entry_id for i in range(7)}
    st.feedback(FeedbackSignal(sorted(ids)[0], tenant="acme", positive=True))

    code, out = run(redis_url, "entries", "list", "--tenant", "acme", "--json")
    listed = json.loads(out)
    assert code == 0 and listed["total"] == 7
    assert {e["entry_id"] for e in listed["entries"]} == ids
    assert {e["query"] for e in listed["entries"]} == {f"question {i}" for i in range(7)}
    assert sum(e["signals"] for e in listed["entries"]) == 1
    code, out = run(redis_url, "entries", "list", "--tenant", "acme", "--limit", "3")
    assert code == 0 and "3 of 7 entries" in out and sum(i in out for i in ids) == 3

    some = sorted(ids)[0]
    code, out = run(redis_url, "inspect", some, "--tenant", "acme", "--json")
    entry = json.loads(out)
    assert code == 0 and entry["signals"] == 1 and entry["served"]
    assert abs(entry["alpha"] - 2.0) < 1e-3  # decays back toward the prior over time
    code, out = run(redis_url, "stats", "--json")
    stats = json.loads(out)
    assert code == 0 and stats["tenants"][0]["tenant"] == "acme"
    assert stats["tenants"][0]["entries"] == 7 and stats["leader"] is None
    code, out = run(redis_url, "tenant", "show", "acme", "--json")
    assert code == 0 and json.loads(out)["dim"] == 8 and json.loads(out)["entries"] == 7


def test_admin_commands_refuse_without_a_redis_url(monkeypatch: Any) -> None:
    """They wrote to a throwaway embedded server and exited 0; only demo starts one."""
    monkeypatch.delenv("ZERDA_REDIS_URL", raising=False)
    for args in (["stats"], ["tenant", "set", "acme", "--max-entries", "5"], ["evict"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2 and "no Redis URL" in result.output, result.output


def test_serve_names_the_missing_extra_of_its_embedder(redis_url: str) -> None:
    """An embedder whose extra is not installed is a usage error, not a traceback."""
    pytest.importorskip("fastapi")
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("sentence-transformers is installed here")
    code, out = run(redis_url, "serve", "--embedder", "sentence-transformers:any-model")
    assert code == 2 and "sentence-transformers" in out and "Traceback" not in out, out


def test_piped_output_is_not_cut_to_80_columns(redis_client: redis.Redis, redis_url: str) -> None:
    name = "a-tenant-with-a-rather-long-name-" + "x" * 30
    RedisStorage(redis_client).put(name, "q", "a", np.ones(8))
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "zerda-cache"), "--redis-url", redis_url, "stats"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert name in out and "10,000" in out and "…" not in out


def test_the_worker_and_admin_commands_take_the_replicas_rl_config(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """The README asks every replica and worker to use the same RLConfig; the worker had
    no way to be given one. --rl-config (env ZERDA_RL_CONFIG) reads a TOML or JSON file."""
    from zerda_cache.cli import CliState

    toml = tmp_path / "rl.toml"
    toml.write_text("min_reward_to_serve = 0.4\nprior_alpha = 2.0\n")
    state = CliState(url=redis_url, cluster=False, key_prefix="zc", rl_config=str(toml))
    assert state.config.rl.min_reward_to_serve == 0.4 and state.config.rl.prior_alpha == 2.0
    as_json = tmp_path / "rl.json"
    as_json.write_text(json.dumps({"similarity_tie_margin": 0.02}))
    state = CliState(url=redis_url, cluster=False, key_prefix="zc", rl_config=str(as_json))
    assert state.config.rl.similarity_tie_margin == 0.02
    # The policy changes what the admin commands report: Beta(1, 2) is 0.33, under 0.4.
    st = RedisStorage(redis_client)
    eid = st.put("acme", "q", "a", np.ones(8)).entry_id
    st.feedback(FeedbackSignal(eid, "acme", False))
    code, out = run(redis_url, "--rl-config", str(toml), "inspect", eid, "--tenant", "acme")
    assert code == 0 and "below the serving bar" in out
    bad = tmp_path / "bad.toml"
    bad.write_text("min_reward_to_serv = 0.4\n")
    code, out = run(redis_url, "stats", "--rl-config", str(bad))
    assert code != 0 and "unknown RLConfig fields" in out
