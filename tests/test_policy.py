"""One policy per tenant, in Redis (``zerda_cache/learning/tenant_policy.py``): stored
settings over each process's own configuration, versioned, validated, and applied by
every replica and worker without a restart (real servers; separate processes in the last test)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from state_support import tenant_state

from tests.conftest import Clock, near, unit
from zerda_cache import CacheConfig, FeedbackSignal, RLConfig
from zerda_cache.cli import cli
from zerda_cache.learning.tenant_policy import (
    POLICY_FIELDS,
    TenantPolicy,
    check_changes,
    flatten,
    resolve,
)
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.worker.maintenance import Maintenance

ROOT = Path(__file__).resolve().parents[1]


# --- resolution, without a server -----------------------------------------------------------
def test_stored_settings_go_over_the_process_defaults_field_by_field() -> None:
    base = CacheConfig(similarity_threshold=0.8, rl=RLConfig(prior_alpha=2.0))
    config, applied, rejected = resolve(
        base,
        {
            "similarity_threshold": "0.9",
            "rl.min_reward_to_serve": "0.4",
            "eviction.reward_weight": "0.7",
            "max_entries": "50",
            "refresh_ttl_on_hit": "true",
            "dim": "384",  # bookkeeping, not a setting
            "ver": "3",
        },
    )
    assert config.similarity_threshold == 0.9
    assert config.rl.min_reward_to_serve == 0.4
    assert config.rl.prior_alpha == 2.0  # not stored: the process's own value stays
    assert config.eviction.reward_weight == 0.7 and config.eviction.max_entries == 50
    assert config.refresh_ttl_on_hit is True
    assert rejected == {} and set(applied) == {
        "similarity_threshold",
        "rl.min_reward_to_serve",
        "eviction.reward_weight",
        "max_entries",
        "refresh_ttl_on_hit",
    }
    assert resolve(base, {})[0] is base


def test_a_stored_value_that_cannot_apply_is_left_out_and_the_rest_applies() -> None:
    # 0.3 is a valid serving bar for the defaults, but not on a process that keeps
    # entries down to 0.5: there, only that field is left out.
    strict = CacheConfig(rl=RLConfig(min_reward_to_keep=0.5))
    stored = {"rl.min_reward_to_serve": "0.3", "top_k": "3", "verify_rate": "lots"}
    config, applied, rejected = resolve(strict, stored)
    assert config.top_k == 3 and config.rl.min_reward_to_serve is None
    assert set(rejected) == {"rl.min_reward_to_serve", "verify_rate"}
    assert "min_reward_to_keep" in rejected["rl.min_reward_to_serve"]
    assert applied == {"top_k": 3}
    assert resolve(CacheConfig(), stored)[0].rl.min_reward_to_serve == 0.3


def test_changes_are_validated_and_encoded() -> None:
    base = CacheConfig()
    assert check_changes(base, {}, {"top_k": 4, "rl.prior_beta": 2, "ttl": None}) == {
        "top_k": "4",
        "rl.prior_beta": "2.0",
        "ttl": "",
    }
    for bad, word in (
        ({"colour": 1}, "unknown"),
        ({"similarity_threshold": 1.5}, "similarity_threshold"),
        ({"top_k": 2.5}, "integer"),
        ({"rl.usage_decay": "nan"}, "finite"),
        ({"max_entries": 0}, "max_entries"),
        ({"rl.min_reward_to_keep": 0.5, "rl.min_reward_to_serve": 0.2}, "min_reward_to_serve"),
        ({"refresh_ttl_on_hit": "maybe"}, "true or false"),
        ({"max_error_rate": True}, "number"),
    ):
        with pytest.raises(ValueError, match=word):
            check_changes(base, {}, bad)
    # Validated with what is stored: a serving bar under a stored keeping bar is refused.
    with pytest.raises(ValueError, match="min_reward_to_serve"):
        check_changes(base, {"rl.min_reward_to_keep": "0.5"}, {"rl.min_reward_to_serve": 0.2})
    assert flatten({"rl": {"prior_alpha": 2}, "top_k": 3}) == {"rl.prior_alpha": 2, "top_k": 3}


@pytest.mark.parametrize(
    "name",
    [
        "rl.positive_feedback_reward",
        "rl.negative_feedback_penalty",
        "rl.prior_alpha",
        "rl.prior_beta",
    ],
)
@pytest.mark.parametrize(
    "value", [1e308, 1e7, 10**400, "1e400"], ids=["1e308", "1e7", "huge", "text"]
)
def test_arm_parameters_the_arithmetic_cannot_hold_are_refused(name: str, value: object) -> None:
    """At 1e308, one signal of magnitude 1,000 turned an arm infinite: the entry was then
    corrupt and never served again. Each step and prior is capped at ``MAX_ARM_STEP``."""
    with pytest.raises(ValueError, match=name.split(".")[1]):
        check_changes(CacheConfig(), {}, {name: value})
    assert check_changes(CacheConfig(), {}, {name: 1e6}) == {name: "1000000.0"}


def test_the_cli_refuses_an_overflowing_arm_parameter(
    redis_client: redis.Redis, redis_url: str
) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "--redis-url",
            redis_url,
            "tenant",
            "set",
            "t",
            "--set",
            "rl.positive_feedback_reward=1e308",
        ],
    )
    assert result.exit_code == 2 and "positive_feedback_reward" in result.output, result.output
    assert tenant_state(RedisStorage(redis_client)).policy("t").version == 0
    assert "seed" not in {f.attr for f in POLICY_FIELDS.values() if f.section == "rl"}


# --- one process -------------------------------------------------------------------------------
def test_a_tenants_serving_settings_reach_every_replica(make_manager: Any) -> None:
    q = unit(1)
    writer = make_manager()
    other = make_manager(CacheConfig(policy_refresh_s=3600))  # reads once, then keeps it
    writer.put("how do I reset my password?", "Settings > Reset", tenant="t", embedding=q)
    near_q = near(q, 0.9)
    assert other.lookup("password reset?", tenant="t", embedding=near_q) is not None
    assert writer.lookup("password reset?", tenant="t", embedding=near_q) is not None

    policy = writer.set_tenant_policy("t", {"similarity_threshold": 0.95})
    assert isinstance(policy, TenantPolicy) and policy.version == 1
    assert policy.config.similarity_threshold == 0.95 and policy.stored == {
        "similarity_threshold": 0.95
    }
    assert writer.lookup("password reset?", tenant="t", embedding=near_q) is None
    # A replica applies what it read until its policy_refresh_s has passed...
    assert other.lookup("password reset?", tenant="t", embedding=near_q) is not None
    # ...and a fresh one from its first lookup. Other tenants keep the defaults.
    fresh = make_manager()
    assert fresh.lookup("password reset?", tenant="t", embedding=near_q) is None
    writer.put("how do I reset my password?", "Settings > Reset", tenant="u", embedding=q)
    assert fresh.lookup("password reset?", tenant="u", embedding=near_q) is not None

    cleared = writer.set_tenant_policy("t", {"similarity_threshold": None})
    assert cleared.version == 2 and cleared.config.similarity_threshold == 0.85
    assert writer.lookup("password reset?", tenant="t", embedding=near_q) is not None


def test_a_change_is_applied_once_the_refresh_interval_has_passed(make_manager: Any) -> None:
    q = unit(2)
    reader = make_manager(CacheConfig(policy_refresh_s=0.2))
    admin = make_manager()
    admin.put("q", "a", tenant="t", embedding=q)
    assert reader.lookup("q", tenant="t", embedding=q) is not None
    admin.set_tenant_policy("t", {"rl.min_reward_to_serve": 0.6})  # a fresh arm's 0.5 fails
    time.sleep(0.3)  # past the reader's refresh interval (not a timing assertion)
    assert reader.lookup("q", tenant="t", embedding=q) is None
    assert reader.tenant_policy("t").rl.serve_bar == 0.6


def test_the_scripts_apply_the_tenants_bandit_parameters(make_manager: Any) -> None:
    m = make_manager()
    m.set_tenant_policy("t", {"rl.prior_alpha": 2.0, "rl.positive_feedback_reward": 3.0})
    eid = m.put("q", "a", tenant="t", embedding=unit(3)).entry_id
    arm = m.storage.get_entry("t", eid).bandit_arm
    assert (arm.alpha, arm.beta) == (2.0, 1.0)  # the tenant's prior, not the default 1
    m.feedback(FeedbackSignal(eid, "t", True))
    assert m.storage.get_entry("t", eid).bandit_arm.alpha == pytest.approx(5.0)
    other = m.put("q", "a", tenant="u", embedding=unit(3)).entry_id
    assert m.storage.get_entry("u", other).bandit_arm.alpha == 1.0


def test_the_worker_decays_and_evicts_by_each_tenants_policy(redis_client: redis.Redis) -> None:
    clock = Clock()
    st = RedisStorage(redis_client, clock=clock)
    liked: dict[str, str] = {}
    for tenant in ("fast", "slow"):
        eid = liked[tenant] = st.put(tenant, "q", "a", unit(4)).entry_id
        for _ in range(8):
            st.feedback(FeedbackSignal(eid, tenant, True))
        for i in range(9):
            st.put(tenant, f"other {i}", "a", unit(10 + i))
    st.set_tenant_policy("fast", {"rl.usage_decay": 0.5, "rl.decay_interval_s": 10.0})
    st.set_tenant_policy("fast", {"max_entries": 5, "eviction.low_watermark": 0.0})
    clock.t += 10.0
    m = Maintenance(st)
    m.decay_tenant("fast")
    m.decay_tenant("slow")

    def excess(tenant: str) -> float:
        return st.get_entry(tenant, liked[tenant]).bandit_arm.alpha - 1.0

    assert excess("fast") == pytest.approx(4.0)  # halved once in 10 s
    assert excess("slow") == pytest.approx(8.0 * 0.995 ** (10 / 300))
    m.evict_tenant("fast")
    m.evict_tenant("slow")
    assert st.count("fast") == 5 and st.count("slow") == 10


def test_nothing_is_written_for_a_refused_change_and_bookkeeping_is_not_a_setting(
    redis_client: redis.Redis,
) -> None:
    st = RedisStorage(redis_client)
    st.put("t", "q", "a", unit(5))
    assert st.set_tenant_policy("t", {"top_k": 3}) == 1
    for bad in ({"top_k": -1}, {"colour": 3}, {"dim": 3}, {}):
        with pytest.raises(ValueError):
            st.set_tenant_policy("t", bad)
    with pytest.raises(redis.ResponseError, match="not a setting"):  # the script refuses too
        st.scripts.settings(keys=[tenant_keys("t").cfg], args=["fence", "9"])
    policy = tenant_state(st).policy("t")
    assert policy.version == 1 and policy.stored == {"top_k": 3}
    assert st.tenant_settings("t") == {"dim": 16.0, "top_k": 3.0}
    # A value written around the script is left out, and said so; the rest applies.
    redis_client.hset(tenant_keys("t").cfg, "similarity_threshold", "high")
    policy = tenant_state(st).policy("t")
    assert policy.config.top_k == 3 and "similarity_threshold" in policy.rejected


# --- the command line -------------------------------------------------------------------------
def test_the_cli_sets_shows_and_clears_any_setting(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    def run(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, ["--redis-url", redis_url, *args])
        return result.exit_code, result.output

    code, out = run("tenant", "set", "acme", "--set", "similarity_threshold=0.9", "--ttl", "60")
    assert code == 0 and "policy version 1" in out and "similarity_threshold" in out, out
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text("top_k = 4\n[rl]\nmin_reward_to_serve = 0.4\n")
    code, out = run("tenant", "set", "acme", "--from-file", str(policy_file))
    assert code == 0 and "policy version 2" in out, out
    code, out = run("tenant", "show", "acme", "--json")
    shown = json.loads(out)
    assert shown["version"] == 2 and shown["stored"] == {
        "similarity_threshold": 0.9,
        "ttl": 60.0,
        "top_k": 4,
        "rl.min_reward_to_serve": 0.4,
    }
    assert shown["effective"]["rl.prior_alpha"] == 1.0 and shown["ttl"] == 60.0
    code, out = run("tenant", "set", "acme", "--clear", "rl.min_reward_to_serve")
    assert code == 0 and "policy version 3" in out
    for args, word in (
        (("--set", "colour=3"), "unknown"),
        (("--set", "top_k"), "SETTING=VALUE"),
        (("--set", "similarity_threshold=2"), "similarity_threshold"),
        (("--clear", "colour"), "unknown"),
    ):
        code, out = run("tenant", "set", "acme", *args)
        assert code == 2 and word in out, out
    assert tenant_state(RedisStorage(redis_client)).policy("acme").version == 3
    code, out = run("tenant", "settings", "--json")
    names = {row["name"] for row in json.loads(out)}
    assert code == 0 and {"top_k", "rl.usage_decay", "eviction.reward_weight"} <= names


# --- separate processes ----------------------------------------------------------------------
REPLICA = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from zerda_cache import CacheConfig, CacheManager

    url, out = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(7)
    q = rng.normal(size=16); q /= np.linalg.norm(q)
    r = rng.normal(size=16); r -= (r @ q) * q; r /= np.linalg.norm(r)
    near = 0.9 * q + np.sqrt(1 - 0.81) * r
    m = CacheManager.from_url(url, CacheConfig(policy_refresh_s=0.5))
    with open(out, "a", buffering=1) as f:
        while True:
            hit = m.lookup("password reset?", tenant="t", embedding=near)
            f.write(("hit" if hit is not None else "miss") + "\\n")
            time.sleep(0.05)
    """
)


@pytest.mark.slow
def test_a_policy_set_with_the_cli_reaches_running_replicas_and_the_worker(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Two replica processes and a worker process run; `zerda-cache tenant set`, a
    third process, changes the tenant's policy; each applies it without a restart."""
    import numpy as np

    rng = np.random.default_rng(7)
    q = rng.normal(size=16)
    q /= np.linalg.norm(q)
    st = RedisStorage(redis_client)
    eid = st.put("t", "how do I reset my password?", "Settings > Reset", q).entry_id
    for _ in range(10):
        st.feedback(FeedbackSignal(eid, "t", True))
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    outs = [tmp_path / f"replica{i}.txt" for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, str(script), redis_url, str(out)], cwd=ROOT)
        for out in outs
    ]
    worker_cmd = [
        sys.executable, str(ROOT / "workers" / "eviction_worker.py"),
        "--redis-url", redis_url, "--worker-id", "w",
        "--decay-job-interval", "0.3", "--eviction-interval", "0.3",
        "--metrics-port", "0", "--health-file", str(tmp_path / "w.health"),
        "--log-level", "WARNING",
    ]  # fmt: skip
    worker = subprocess.Popen(worker_cmd, cwd=ROOT)

    def last(out: Path) -> str | None:
        lines = out.read_text().split() if out.exists() else []
        return lines[-1] if lines else None

    def wait(pred: Any, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                pytest.fail(f"not within {timeout} s: {what}")
            for p in (*procs, worker):
                assert p.poll() is None, "a process died"
            time.sleep(0.1)

    try:
        wait(lambda: all(last(o) == "hit" for o in outs), "replicas serving the near match")
        before = st.get_entry("t", eid).bandit_arm.alpha
        cmd = [sys.executable, "-m", "zerda_cache.cli", "--redis-url", redis_url, "tenant"]
        change = [
            "set", "t", "--set", "similarity_threshold=0.95",
            "--set", "rl.usage_decay=0.01", "--set", "rl.decay_interval_s=1",
        ]  # fmt: skip
        subprocess.run([*cmd, *change], check=True, capture_output=True, cwd=ROOT)
        wait(lambda: all(last(o) == "miss" for o in outs), "replicas applying the threshold")
        # The worker persists decay with the tenant's new rate: the praise fades fast.
        wait(
            lambda: st.get_entry("t", eid).bandit_arm.alpha - 1 < 0.5 * (before - 1),
            "the worker decaying with the tenant's rate",
        )
    finally:
        for p in (*procs, worker):
            p.terminate()
        for p in (*procs, worker):
            p.wait(10)
