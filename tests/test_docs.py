"""The README's examples run as written: its Python examples (each starts its own
throwaway server) and the shell session of the HTTP service (`zerda-cache keys create`,
`zerda-cache serve` and curl, against a throwaway Redis). So do the user guide's (docs/),
which holds every README example too, and the guide builds with `mkdocs build --strict`
(no broken link or anchor, the references generated from the code)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
#: The user guide's pages (docs/BENCHMARKS.md is written by the benchmark scripts).
GUIDE = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "BENCHMARKS.md")
GUIDE_BLOCKS = [
    (page, block)
    for page in GUIDE
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
]
#: The guide's examples the README does not show (those it shows run above).
GUIDE_ONLY = [(page, block) for page, block in GUIDE_BLOCKS if block not in BLOCKS]


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(BLOCKS[index], f"README.md example {index + 1}", "exec"), {"__name__": "doc"})
    out = capsys.readouterr().out
    assert out.strip()  # every example prints what it shows
    assert "miss" not in out.splitlines()[0]


def test_the_readme_examples_are_in_the_guide() -> None:
    """The README shows a few of the guide's examples: each is in the guide as written,
    so the guide is complete on its own and the two cannot drift apart."""
    guide = "\n".join(page.read_text() for page in GUIDE)
    for block in BLOCKS + re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        assert block in guide, block[:200]


def test_the_guide_has_examples_of_its_own() -> None:
    """asyncio (library.md) is shown in the guide only; the error bound's example, with
    the decision API, in the README and the guide (concepts.md) alike."""
    pages = {page.name for page, _ in GUIDE_ONLY}
    assert "library.md" in pages, pages
    bound = [b for b in BLOCKS if "max_error_rate" in b]
    assert bound and "decide(" in bound[0] and "verify_token" in bound[0]
    assert any(b == bound[0] for page, b in GUIDE_BLOCKS if page.name == "concepts.md")


@pytest.mark.parametrize(
    "page, block",
    GUIDE_ONLY,
    ids=[f"{page.relative_to(ROOT)}-{i + 1}" for i, (page, _) in enumerate(GUIDE_ONLY)],
)
def test_guide_example_runs(page: Path, block: str, capsys: pytest.CaptureFixture[str]) -> None:
    name = f"{page.relative_to(ROOT)} example"
    exec(compile(block, name, "exec"), {"__name__": "doc"})
    out = capsys.readouterr().out
    assert out.strip()  # every example prints what it shows
    assert "miss" not in out.splitlines()[0]


@pytest.mark.slow
def test_the_user_guide_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` (what `make docs` runs): a broken link, a missing anchor or a
    docstring the reference cannot parse fails the build. The references are generated
    from the code: every manager method, the configuration's fields, every command."""
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    api = (site / "reference" / "api" / "index.html").read_text()
    for method in ("lookup", "put", "feedback", "invalidate", "stats", "clear", "close"):
        assert f'id="zerda_cache.CacheManager.{method}"' in api, method
    for name in ("AsyncCacheManager", "CacheHit", "PutResult", "FeedbackSignal"):
        assert f'id="zerda_cache.{name}"' in api, name
    assert 'id="zerda_cache.core.errors.ZerdaError"' in api
    config = (site / "reference" / "config" / "index.html").read_text()
    for name in ("CacheConfig", "RLConfig", "EvictionConfig"):
        assert f'id="zerda_cache.core.config.{name}"' in config, name
    assert "min_reward_to_serve" in config
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("worker", "serve", "stats", "tenant", "keys", "demo"):
        assert f'id="zerda-cache-{command}"' in cli, command
    for page in ("concepts", "library", "service", "integrations", "worker", "design"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "BENCHMARKS" / "index.html").is_file()


# --- the README's shell example of the HTTP service ---------------------------------------
SERVICE_SECTION = README.read_text().split("## The HTTP service", 1)[1].split("\n## ", 1)[0]
SHELL = next(b for b in re.findall(r"```bash\n(.*?)```", SERVICE_SECTION, re.S) if "curl" in b)
#: The Redis URL the README's block uses, as written there; the test runs the block on a
#: throwaway server's URL instead.
README_REDIS_URL = re.search(r"ZERDA_REDIS_URL=(\S+)", SHELL).group(1)  # type: ignore[union-attr]
README_PORT = "8080"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def json_values(text: str) -> list[Any]:
    """The JSON values printed one after another (curl prints no newline after a body)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        value, i = decoder.raw_decode(text, i)
        values.append(value)
    return values


@pytest.mark.slow
def test_readme_curl_example_runs_as_written(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """The block runs in bash as the README shows it, with a real `zerda-cache` and a real
    curl: only the Redis URL and the port are this test's own (a throwaway server, a free
    port)."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    assert README_REDIS_URL in SHELL and f"--port {README_PORT}" in SHELL
    assert "$TOKEN" in SHELL and "TOKEN=$(zerda-cache keys create" in SHELL
    script = SHELL.replace(README_REDIS_URL, redis_url).replace(README_PORT, str(free_port()))
    bin_dir = str(Path(sys.executable).parent)  # where `zerda-cache` is installed
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    # Files, not pipes: the backgrounded `serve` holds them open after bash exits.
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        proc = subprocess.Popen(
            ["bash", "-e", "-c", script],
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,  # `serve` too: the group is stopped below
        )
        try:
            proc.wait(timeout=180)
        finally:
            stop_group(proc.pid)
            proc.wait()
    err = (tmp_path / "err").read_text()
    assert proc.returncode == 0, err
    out = (tmp_path / "out").read_text()
    # uvicorn's access log shares stdout with curl, whose bodies end without a newline
    put, lookup = json_values(re.sub(r"INFO: [^\n]*\n?", "", out))
    assert put["stored"] is True, (put, err)
    assert lookup["hit"] is True and lookup["decision"] == "hit", (lookup, err)
    assert lookup["entry"]["response"] == "An in-memory data store."
    assert not lookup["entry"]["exact"]  # "what is redis" is a near duplicate
    # the key the block made is acme's, and the put wrote acme's keys
    assert any(k.startswith(b"zc:{acme}:e:") for k in redis_client.scan_iter("zc:{acme}:*"))


def test_readme_curl_example_stops_when_serve_does(redis_url: str, tmp_path: Path) -> None:
    """A newcomer without the minilm extra: `serve --embedder minilm` exited 2 and the
    block's `until curl ... readyz` loop waited for ever. The wait ends when serve has
    stopped: here serve is given an embedder that does not exist, and the block ends
    (in error: the curls after it fail) with serve's message on stderr."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    assert "--embedder minilm" in SHELL
    script = SHELL.replace(README_REDIS_URL, redis_url).replace(README_PORT, str(free_port()))
    script = script.replace("--embedder minilm", "--embedder no-such-embedder")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    with (tmp_path / "err").open("w") as err:
        proc = subprocess.Popen(
            ["bash", "-e", "-c", script],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_group(proc.pid)
            proc.wait()
    said = (tmp_path / "err").read_text()
    assert code is not None, "the wait loop outlived serve: " + said[-2000:]
    assert code != 0 and "no-such-embedder" in said, said[-2000:]


def stop_group(pgid: int) -> None:
    """Stop the process group this test started (bash and the `serve` it left running)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(300):  # serve shuts down gracefully; give it up to 30 s
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        threading.Event().wait(0.1)
    os.killpg(pgid, signal.SIGKILL)


# --- docs/metrics.md lists every metric of the code ---------------------------------------
def documented_metrics() -> dict[str, str]:
    """name -> type, from the tables of docs/metrics.md."""
    rows = re.findall(r"^\| `(zerda_cache_\w+)` \| (\w+) \|", METRICS_DOC.read_text(), re.M)
    return dict(rows)


def test_every_metric_in_the_code_is_in_docs_metrics_md() -> None:
    """Every metric name in the source (a string literal ``"zerda_cache_..."``) has a row
    in docs/metrics.md, and every metric the worker, an app replica and the service
    register is there with its type: a new metric cannot ship undocumented."""
    from prometheus_client import CollectorRegistry

    from zerda_cache.metrics import ReplicaMetrics, WorkerMetrics
    from zerda_cache.service.app import ServiceMetrics

    documented = documented_metrics()
    in_code = {
        name
        for path in (ROOT / "zerda_cache").rglob("*.py")
        for name in re.findall(r"[\"'](zerda_cache_\w+)[\"']", path.read_text())
    }
    assert len(in_code) >= 30
    missing = {n for n in in_code if n not in documented and n + "_total" not in documented}
    assert not missing, f"metrics in the code but not in docs/metrics.md: {sorted(missing)}"

    registry = CollectorRegistry()
    ReplicaMetrics(registry)
    WorkerMetrics(registry, 50)
    ServiceMetrics(registry)
    registered = {
        fam.name + ("_total" if fam.type == "counter" else ""): fam.type
        for fam in registry.collect()
    }
    assert {n for n in in_code if n in registered or n + "_total" in registered} == in_code
    for name, kind in registered.items():
        assert documented.get(name) == kind, (
            f"{name}: {kind}, docs/metrics.md: {documented.get(name)}"
        )
    stale = set(documented) - set(registered)
    assert not stale, f"in docs/metrics.md but not in the code: {sorted(stale)}"
