"""The zerda-cache command line, and `make demo` in its short mode."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner
from state_support import tenant_state

from zerda_cache import FeedbackSignal
from zerda_cache.cli import cli
from zerda_cache.storage import RedisStorage

ROOT = Path(__file__).resolve().parents[1]
#: ``zerda-cache`` as its own process, run by the interpreter running the tests: the
#: checkout may have no .venv (or not yet, when this runs before the test that makes one).
ZERDA_CACHE = [sys.executable, "-m", "zerda_cache.cli"]


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
    assert "expected reward >= 0.55 (level 1 up)" in out, out
    assert tenant_state(st).calibration("acme").max_error_rate == 0.02
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
    # the threshold cache, asked the same questions, beside zerda-cache
    assert report["baseline_stats"]["hits"] > 0 and report["chart"] == "learning_curve.png"
    assert report["totals"]["baseline_wrong_rate"] is not None


def test_make_never_ends_processes_by_name() -> None:
    """`make prometheus-tools` ran `pkill -x prometheus`, ending any Prometheus on the
    host. The package's service is kept from starting instead (policy-rc.d)."""
    makefile = (ROOT / "Makefile").read_text()
    assert not re.search(r"\b(pkill|killall)\b", makefile)
    make = shutil.which("make")
    assert make is not None
    dry = subprocess.run(  # what it would run where promtool is missing
        [make, "-n", "--no-print-directory", "prometheus-tools"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert dry.returncode == 0, dry.stderr
    assert "policy-rc.d" in dry.stdout and "exit 101" in dry.stdout
    assert "pkill" not in dry.stdout and "killall" not in dry.stdout


def test_no_test_runs_the_checkouts_venv() -> None:
    """test_piped_output ran ROOT/.venv/bin/zerda-cache, so it failed in a checkout
    without .venv, or when it ran before the test that makes one. Tests run what the
    running interpreter runs (sys.executable, or the bin directory beside it)."""
    venv = re.escape(".venv")  # joined onto a path, or a path to a program in its bin/
    joined = re.compile(rf"/\s*[\"']{venv}[\"']|[\"']{venv}/bin/(?!python benchmarks/)")
    found = [
        f"{path.name}:{n}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if joined.search(line)
    ]
    assert found == [], found


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
        [*ZERDA_CACHE, "--redis-url", redis_url, "stats"],
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


def _unused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_version() -> None:
    import zerda_cache

    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and zerda_cache.__version__ in result.output, result.output


def test_keys_list_and_evict_take_json(redis_client: redis.Redis, redis_url: str) -> None:
    """The README says the read commands take --json: keys list and evict had none."""
    st = RedisStorage(redis_client)
    rng = np.random.default_rng(2)
    for i in range(12):
        st.put("acme", f"question {i}", f"a{i}", rng.normal(size=8))
    code, out = run(redis_url, "tenant", "set", "acme", "--max-entries", "5")
    assert code == 0, out
    code, out = run(redis_url, "keys", "create", "--tenant", "acme", "--name", "app")
    assert code == 0
    code, out = run(redis_url, "keys", "create", "--tenant", "other")
    assert code == 0

    code, out = run(redis_url, "keys", "list", "--tenant", "acme", "--json")
    listed = json.loads(out)
    assert code == 0 and [(k["tenant"], k["name"], k["active"]) for k in listed] == [
        ("acme", "app", True)
    ]
    assert "zk_" not in out  # never the tokens
    code, out = run(redis_url, "keys", "list", "--json")
    assert code == 0 and {k["tenant"] for k in json.loads(out)} == {"acme", "other"}

    code, out = run(redis_url, "evict", "--dry-run", "--tenant", "acme", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["dry_run"] is True, out
    (row,) = plan["tenants"]
    assert row["tenant"] == "acme" and row["entries"] == 12 and row["capacity"] == 5
    assert row["removed"] is None and row["planned"]["capacity"] >= 7
    assert st.count("acme") == 12  # a dry run removes nothing
    code, out = run(redis_url, "evict", "--tenant", "acme", "--json")
    (row,) = json.loads(out)["tenants"]
    assert code == 0 and row["removed"] == 12 - st.count("acme") > 0


def test_tenant_show_of_an_unknown_tenant_is_an_error(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """It printed the defaults and exited 0, so a typo looked like a real tenant."""
    code, out = run(redis_url, "tenant", "show", "acme")
    assert code == 1 and "no tenant 'acme'" in out, out
    code, out = run(redis_url, "tenant", "show", "acme", "--json")
    assert code == 1 and "no tenant" in out and "{" not in out
    RedisStorage(redis_client).put("acme", "q", "a", np.ones(8))  # known by its entries
    code, out = run(redis_url, "tenant", "show", "acme", "--json")
    assert code == 0 and json.loads(out)["entries"] == 1
    code, out = run(redis_url, "tenant", "set", "configured", "--ttl", "60")
    assert code == 0  # known by its settings, with no entry yet
    code, out = run(redis_url, "tenant", "show", "configured")
    assert code == 0 and "60 s" in out, out
    code, out = run(redis_url, "keys", "create", "--tenant", "keyed")
    assert code == 0  # a new tenant's API key comes first, before any put
    code, out = run(redis_url, "tenant", "show", "keyed", "--json")
    assert code == 0 and json.loads(out)["entries"] == 0, out
    code, out = run(redis_url, "tenant", "show", "bad:tenant")
    assert code == 2 and "invalid tenant" in out


def test_tenant_show_reports_what_the_bound_serves(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """Under a bound: the similarity near matches are served from, the exact repeats
    served, the estimated wrong serves per request with its 95% bound, and the labels
    behind them, as ``Calibration.serving`` (and so ``decide``) has them."""
    st = RedisStorage(redis_client)
    st.set_tenant_settings("acme", max_error_rate=0.02)
    for sim, right, wrong in ((0.96, 300, 1), (0.91, 100, 40)):
        for positive, n in ((True, right), (False, wrong)):
            for _ in range(n):
                tenant_state(st).label("acme", sim, positive)
    for _ in range(40):  # exact repeats at level 3, all right
        tenant_state(st).label("acme", 1.0, True, level=3)
    serving = tenant_state(st).policy("acme").calibration.serving(0.02)
    assert serving.threshold == pytest.approx(0.96) and serving.estimated_error > 0
    code, out = run(redis_url, "tenant", "show", "acme", "--json")
    shown = json.loads(out)["serving"]
    assert code == 0 and shown == {
        "max_error_rate": 0.02,
        "threshold": serving.threshold,
        "exact_level": serving.exact_level,
        "estimated_error": serving.estimated_error,
        "error_bound": serving.error_bound,
        "labels": 441.0,
        "exact_labels": 40.0,
    }
    code, out = run(redis_url, "tenant", "show", "acme")
    assert code == 0 and "similarity 0.960" in out, out
    wrong = f"{serving.estimated_error:.2%} estimated, {serving.error_bound:.2%} at 95%"
    assert re.search(rf"wrong serves per request\W+{re.escape(wrong)}", out), out
    assert "(bound 2.00%)" in out
    assert re.search(r"labelled outcomes\W+441 near matches, 40 exact", out), out
    # Without a bound there is nothing served by a rule.
    st.set_tenant_settings("acme", max_error_rate=None)
    code, out = run(redis_url, "tenant", "show", "acme", "--json")
    assert code == 0 and json.loads(out)["serving"] is None
    code, out = run(redis_url, "tenant", "show", "acme")
    assert "wrong serves per request" not in out and "441 near matches" in out


def test_an_unreachable_redis_has_its_own_exit_code(redis_url: str) -> None:
    """3, not 2: a script can tell a down server from a mistyped command."""
    down = f"redis://127.0.0.1:{_unused_port()}/0"
    for args in (
        ["stats"],
        ["stats", "--json"],
        ["keys", "list"],
        ["tenant", "show", "acme"],
        ["entries", "list", "--tenant", "acme"],
        ["evict", "--dry-run"],
        ["--cluster", "stats"],  # redis-py's cluster client raises its own error
    ):
        result = CliRunner().invoke(cli, ["--redis-url", down, *args])
        assert result.exit_code == 3, (args, result.output, result.exception)
        assert "Redis unreachable" in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    code, _ = run(redis_url, "stats", "--no-such-option")
    assert code == 2  # a usage error keeps its code
    shown = " ".join(CliRunner().invoke(cli, ["--help"]).output.split())
    assert "3 Redis unreachable" in shown, shown


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    import click

    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))


def test_help_is_plain_text_and_says_what_shared_options_do() -> None:
    """Help showed reStructuredText (``inspect``), and the options every command takes
    read "As before the command's name."."""
    import click

    group_help = {p.name: p.help for p in cli.params if isinstance(p, click.Option)}
    for path, command in _commands(cli):
        result = CliRunner().invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "``" not in result.output and "As before" not in result.output, result.output
        for param in command.params:
            if path and param.name and param.name.rstrip("_") in {"url", "cluster"}:
                name = param.name.rstrip("_")
                assert param.help == group_help[name], (path, param.name)
    shown = CliRunner().invoke(cli, ["entries", "--help"]).output
    assert "'inspect'" in shown


def test_the_worker_log_is_not_flooded_by_apscheduler(redis_url: str, tmp_path: Path) -> None:
    """At INFO, APScheduler logged every job it added and ran (the lease job every few
    seconds); its loggers stay at WARNING unless DEBUG is asked for."""
    import os
    import signal
    import sys
    import time

    health = tmp_path / "health"
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "workers" / "eviction_worker.py"), "--redis-url",
             redis_url, "--metrics-port", "0", "--health-file", str(health),
             "--lease-ttl", "3", "--worker-id", "log-test"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            # The health file is touched by the lease job: APScheduler has added and run
            # jobs by then, and logged it if it was going to.
            while not health.exists():
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.05)
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    text = log_path.read_text()
    assert "worker log-test starting" in text and "worker log-test stopped" in text, text
    assert " apscheduler" not in text, text

    from zerda_cache.cli import configure_logging

    try:
        configure_logging("DEBUG")  # asked for: APScheduler's debug lines too
        assert logging.getLogger("apscheduler.scheduler").getEffectiveLevel() == logging.DEBUG
        configure_logging("INFO")
        assert logging.getLogger("apscheduler.scheduler").getEffectiveLevel() == logging.WARNING
    finally:
        configure_logging("WARNING")


def test_serve_takes_its_settings_from_the_environment(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """ZERDA_PORT, ZERDA_EMBEDDER and ZERDA_SIMILARITY_THRESHOLD, as the worker's and the
    shared options have ZERDA_* variables: here the port it listens on, the service
    embeds questions itself, and a paraphrase at cosine ~0.82 (under the default 0.85)
    is a hit at 0.5."""
    import os
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    out = CliRunner().invoke(cli, ["--redis-url", redis_url, "keys", "create", "--tenant", "acme"])
    token = re.findall(r"zk_[A-Za-z0-9_-]{43}", out.output)[0]
    port = _unused_port()
    prices = tmp_path / "prices.json"
    prices.write_text('{"house-llm": [2.0, 8.0]}')
    env = {
        **os.environ,
        "ZERDA_REDIS_URL": redis_url,
        "ZERDA_PORT": str(port),
        "ZERDA_EMBEDDER": "hashing",
        "ZERDA_SIMILARITY_THRESHOLD": "0.5",
        "ZERDA_REDIS_TIMEOUT": "10",
        "ZERDA_TOKEN_PRICES": str(prices),
    }
    exe = str(Path(sys.executable).with_name("zerda-cache"))
    with subprocess.Popen([exe, "serve"], stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
                for _ in range(600):  # up to ~30 s to start, on a loaded machine
                    try:
                        if http.get("/readyz").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert proc.poll() is None, "serve exited"
                    time.sleep(0.05)
                else:
                    pytest.fail(f"nothing answered on port {port} (ZERDA_PORT)")
                headers = {"Authorization": f"Bearer {token}"}
                usage = {"model": "house-llm", "prompt_tokens": 1_000, "completion_tokens": 500}
                body = {
                    "query": "How do I reset my password?",
                    "response": "Settings.",
                    "usage": usage,
                }
                assert http.post("/v1/put", json=body, headers=headers).json()["stored"]
                near = {"query": "How can I reset my password, please?"}
                hit = http.post("/v1/lookup", json=near, headers=headers).json()
                assert hit["hit"] and hit["entry"]["response"] == "Settings.", hit
                # ZERDA_TOKEN_PRICES priced the saved call: 1,000 x $2 + 500 x $8 per 1M
                saved = http.get("/v1/stats", headers=headers).json()["savings"]["house-llm"]
                assert saved["calls"] == 1 and saved["usd"] == pytest.approx(0.006)
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


def test_keys_create_under_command_substitution_says_where_the_token_went(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """`TOKEN=$(zerda-cache keys create ...)` left the user looking at a stderr line
    ending in "the token is shown only this once:" with nothing after it: the token had
    gone to $TOKEN. The line says where the token is printed, whole on its own."""
    proc = subprocess.run(
        [*ZERDA_CACHE, "--redis-url", redis_url, "keys", "create", "--tenant", "acme"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    token = proc.stdout.strip()
    assert token.startswith("zk_") and proc.stdout.count("\n") == 1, proc.stdout
    said = " ".join(proc.stderr.split())
    assert not said.endswith(":"), said
    assert "for tenant acme" in said and "printed on stdout, only this once" in said, said
    assert token not in proc.stderr
