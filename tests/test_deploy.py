"""deploy/: the compose file, Prometheus config and alerts, the Grafana dashboard, checked
against a real Prometheus scraping a real worker, a real app replica and a real HTTP
service (with its proxy in front of a stand-in LLM API)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from state_support import tenant_state

from zerda_cache.cli import cli
from zerda_cache.service.testing import ServerThread, canned_upstream
from zerda_cache.storage import RedisStorage

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "zerda-cache.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: `make test` installs Prometheus from Debian")
        pytest.skip(f"{name} not installed (apt-get install prometheus)")
    return path


# --- static checks ---------------------------------------------------------------------------
def test_compose_parses_mounts_exist_and_commands_are_entry_points() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "worker", "app", "prometheus", "grafana"} <= set(services)
    assert services["worker"]["deploy"]["replicas"] == 2
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
        assert "healthcheck" in svc and "restart" in svc, name
    dockerfile = (ROOT / svc_build(compose)).read_text()
    assert 'ENTRYPOINT ["zerda-cache"]' in dockerfile and "USER zerda" in dockerfile
    scripts = re.search(
        r"zerda-cache = \"zerda_cache.cli:main\"", (ROOT / "pyproject.toml").read_text()
    )
    assert scripts, "the image's entrypoint is the package's console script"
    for name in ("worker", "app"):
        command = services[name]["command"][0]
        assert command in cli.commands, f"{name} runs `zerda-cache {command}`: not a command"
    has_compose = shutil.which("docker") and (
        subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    )
    for name in ("prometheus", "grafana", "service"):  # no auth (or keys): loopback only
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), name
    grafana_env = services["grafana"]["environment"]
    assert grafana_env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
    if has_compose:  # an engine with the compose plugin: let it validate the file too
        env = {**os.environ, "GRAFANA_ADMIN_PASSWORD": "a-test-password"}
        proc = subprocess.run(
            ["docker", "compose", "config", "-q"], cwd=ROOT, capture_output=True, env=env
        )
        assert proc.returncode == 0, proc.stderr
        env.pop("GRAFANA_ADMIN_PASSWORD")
        proc = subprocess.run(
            ["docker", "compose", "config", "-q"], cwd=ROOT, capture_output=True, env=env
        )
        assert proc.returncode != 0 and b"GRAFANA_ADMIN_PASSWORD" in proc.stderr


def svc_build(compose: dict[str, Any]) -> str:
    return str(compose["x-zerda"]["build"]["dockerfile"])


def test_promtool_checks_config_and_rules() -> None:
    promtool = tool("promtool")
    for args in (["check", "config", str(PROM_CONFIG)], ["check", "rules", str(ALERTS)]):
        proc = subprocess.run([promtool, *args], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ds = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uids = {d["uid"] for d in ds["datasources"]}
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert "tenant" in variables
    # The datasource is an input (a variable), defaulting to the provisioned one: the
    # dashboard imports into any Grafana.
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    assert source["current"]["value"] in uids
    assert variables["tenant"]["datasource"]["uid"] == "${datasource}"
    panels = list(iter_panels(dash["panels"]))
    assert len(panels) >= 10
    for panel in panels:
        assert panel.get("targets"), f"panel {panel.get('title')} has no target"
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"].strip()
            assert target.get("datasource", panel["datasource"])["uid"] == "${datasource}"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))


def test_dashboard_shows_the_service_the_proxy_and_the_error_bound() -> None:
    """Every metric the dashboard queries is in docs/metrics.md, and the HTTP service's,
    the proxy's and the error bound's series each have panels."""
    documented = set(re.findall(r"`(zerda_cache_\w+)`", (ROOT / "docs" / "metrics.md").read_text()))
    exprs = dashboard_exprs()
    queried = {
        re.sub(r"_(bucket|sum|count)$", "", n)
        for e in exprs
        for n in re.findall(r"zerda_cache_\w+", e)
    }
    assert queried <= documented, queried - documented
    for name in (
        "zerda_cache_http_requests_total",
        "zerda_cache_http_request_duration_seconds",
        "zerda_cache_http_auth_failures_total",
        "zerda_cache_proxy_requests_total",
        "zerda_cache_proxy_upstream_duration_seconds",
    ):
        assert name in queried, f"no panel reads {name}"
    assert any('result="verify"' in e and "zerda_cache_lookups_total" in e for e in exprs)
    assert any('result="kept"' in e and "zerda_cache_puts_total" in e for e in exprs)
    assert any('result="hit"' in e and "zerda_cache_proxy_requests_total" in e for e in exprs)


def iter_panels(panels: list[dict[str, Any]]) -> Any:
    for panel in panels:
        if panel.get("type") == "row":
            yield from iter_panels(panel.get("panels", []))
        else:
            yield panel


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in iter_panels(dash["panels"]) for t in p["targets"]]
    return [e.replace("$tenant", ".*").replace("$__rate_interval", "1m") for e in exprs]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


# --- a real Prometheus scraping a real worker and app replica -----------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(port: int, expr: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as exc:  # 400 with an error body: a bad expression
        return dict(json.loads(exc.read()))
    except urllib.error.URLError:  # not listening yet
        return {"status": "down", "data": {"result": []}}


def wait_for(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.5)
    return bool(pred())


@pytest.mark.slow
def test_every_dashboard_and_alert_expression_against_real_prometheus(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    prometheus = tool("prometheus")
    worker_port, app_port, prom_port = free_port(), free_port(), free_port()
    service_port = free_port()
    ports = {
        "zerda-cache-worker": worker_port,
        "zerda-cache-app": app_port,
        "zerda-cache-service": service_port,
    }
    config = yaml.safe_load(PROM_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(ALERTS)]
    for job in config["scrape_configs"]:
        port = ports.get(job["job_name"], prom_port)
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    cfg_path = tmp_path / "prometheus.yml"
    cfg_path.write_text(yaml.safe_dump(config))

    # The service's tenant runs under an error bound, so verifications have series too.
    storage = RedisStorage(redis_client)
    storage.set_tenant_settings("acme", max_error_rate=0.05, verify_rate=0.0)
    for i in range(400):  # labels enough for a threshold: the bound's gauges have series
        tenant_state(storage).label("acme", 0.97, i % 100 != 0)
    created = subprocess.run(
        [sys.executable, "-m", "zerda_cache.cli", "--redis-url", redis_url, "keys", "create",
         "--tenant", "acme"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    token = created.stdout.strip()
    upstream = ServerThread(canned_upstream(lambda question: "A canned answer.")).start()
    names = ("worker", "app", "prometheus", "service")
    logs = [open(tmp_path / f"{n}.log", "wb") for n in names]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "zerda_cache.cli", "worker", "--redis-url", redis_url,
             "--metrics-port", str(worker_port), "--metrics-host", "127.0.0.1",
             "--eviction-interval", "1", "--decay-job-interval", "1", "--metrics-interval", "1",
             "--lease-ttl", "3", "--health-file", str(tmp_path / "health")],
            stdout=logs[0], stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [sys.executable, "-m", "zerda_cache.cli", "--redis-url", redis_url, "demo-app",
             "--metrics-port", str(app_port), "--rate", "40"],
            stdout=logs[1], stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [prometheus, f"--config.file={cfg_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=logs[2], stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [sys.executable, "-m", "zerda_cache.cli", "--redis-url", redis_url, "serve",
             "--port", str(service_port), "--embedder", "hashing:64", "--redis-timeout", "10",
             "--upstream-url", upstream.url + "/v1"],
            stdout=logs[3], stderr=subprocess.STDOUT,
        ),
    ]  # fmt: skip
    try:
        drive_service(service_port, token)
        assert wait_for(
            lambda: len(query(prom_port, "up == 1").get("data", {}).get("result", [])) >= 4, 60
        ), "targets never came up"
        time.sleep(8)
        # A short Redis stall: the app's lookups fail open, so that series exists too. On
        # a loaded machine the app may not look anything up during one stall: stall again
        # until Prometheus has scraped the series.
        for _ in range(5):
            redis_client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
            time.sleep(1.6)
            if wait_for(
                lambda: query(prom_port, "count(zerda_cache_fail_open_total)")["data"]["result"],
                6,
            ):
                break
        missing = [
            e for e in dashboard_exprs() if not query(prom_port, e).get("data", {}).get("result")
        ]
        deadline = time.monotonic() + 40
        while missing and time.monotonic() < deadline:  # rates need a few scrapes
            time.sleep(2)
            missing = [e for e in missing if not query(prom_port, e)["data"]["result"]]
        assert not missing, f"dashboard expressions returning nothing: {missing}"

        for expr in alert_exprs():
            res = query(prom_port, expr)
            assert res["status"] == "success", (expr, res)
            # An alert that cannot fire is worse than none: every metric it reads exists.
            for name in set(re.findall(r"zerda_cache_\w+", expr)):
                found = query(prom_port, f"count({name})")["data"]["result"]
                assert found, f"alert expression reads {name}, which has no series"
        rules = json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/rules", timeout=10).read()
        )
        health = [r["health"] for g in rules["data"]["groups"] for r in g["rules"]]
        assert health and all(h == "ok" for h in health), rules
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:  # (a loaded machine): killed, and reaped
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        upstream.stop()


def drive_service(port: int, token: str) -> None:
    """Traffic of every kind the service's panels show: cache endpoints (a verification
    and a kept answer under the tenant's error bound), a refused key, and the proxy's
    miss, verify and hit in front of the stand-in upstream."""
    url = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: ready(url), 60), "the service never became ready"
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as http:
        fact = {"query": "What is Redis?", "response": "An in-memory data store."}
        assert http.post("/v1/put", json=fact).json()["stored"]
        held = http.post("/v1/lookup", json={"query": fact["query"]}).json()
        assert held["decision"] == "verify", held
        assert http.post("/v1/put", json=fact).status_code == 200  # the same answer: kept
        chat = {"model": "m", "messages": [{"role": "user", "content": "How do I log in?"}]}
        results = []
        for _ in range(3):
            resp = http.post("/v1/chat/completions", json=chat)
            assert resp.status_code == 200, resp.text
            results.append(resp.headers["x-zerda-cache"])
        assert results == ["miss", "verify", "hit"], results
    assert httpx.get(url + "/v1/stats").status_code == 401


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
