"""Export a tenant to JSON lines and import it back (real servers): answers, vectors,
arms, uses, expiry and tags come back as they were, and lookups serve the same answers."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
import redis
from conftest import Clock, near

from zerda_cache import CacheConfig, CacheManager, DimensionMismatchError, FeedbackSignal
from zerda_cache.core.errors import InvalidEntryError
from zerda_cache.flows.transfer import export_tenant, import_tenant
from zerda_cache.storage import RedisStorage

DIM = 32


def _vectors(n: int, seed: int = 5) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, DIM))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _fill(m: CacheManager, x: np.ndarray) -> list[str]:
    ids = []
    for i, v in enumerate(x):
        tags = [f"doc:{i % 7}"] if i % 3 == 0 else None
        ttl = 3_600.0 if i % 5 == 0 else None
        r = m.put(f"question {i}", f"answer {i}", tenant="src", embedding=v, tags=tags,
                  ttl_s=ttl, metadata={"i": i, "blob": b"\x00\xff"})  # fmt: skip
        ids.append(r.entry_id)
    return ids


def test_a_round_trip_serves_the_same_answers_with_the_same_arms(
    redis_client: redis.Redis,
) -> None:
    cfg = CacheConfig(similarity_threshold=0.8)
    m = CacheManager(redis_client, cfg)
    x = _vectors(300)
    ids = _fill(m, x)
    for eid in ids[:40]:
        m.feedback(FeedbackSignal(eid, "src", True))
    m.feedback(FeedbackSignal(ids[41], "src", False, magnitude=5.0))
    out = io.StringIO()
    progress: list[tuple[int, int]] = []
    assert (
        export_tenant(m.storage, "src", out, progress=lambda d, t: progress.append((d, t))) == 300
    )
    assert progress[-1] == (300, 300)
    lines = out.getvalue().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "zerda-cache-export" and header["dim"] == DIM
    assert json.loads(lines[1])["query"].startswith("question ")

    report = import_tenant(m.storage, "dst", lines)
    assert (report.stored, report.skipped, report.refused) == (300, 0, [])
    st = m.storage
    for eid in ids[::17]:
        a, b = st.get_entry("src", eid), st.get_entry("dst", eid)
        assert (b.query, b.response, b.metadata, b.scope, b.tags) == (
            a.query, a.response, a.metadata, a.scope, a.tags,
        )  # fmt: skip
        assert b.bandit_arm == a.bandit_arm and b.usage_count == a.usage_count
        assert b.expires_at == a.expires_at and np.array_equal(b.embedding, a.embedding)
    assert st.tags("dst") == st.tags("src")
    fresh = CacheManager(redis_client, cfg)  # a new replica builds the imported index
    same_exact = same_near = 0
    for i in range(0, 300, 3):
        a = fresh.lookup(f"question {i}", tenant="src", embedding=x[i])
        b = fresh.lookup(f"question {i}", tenant="dst", embedding=x[i])
        same_exact += a is not None and b is not None and a.response == b.response
        q = near(x[i], 0.95, seed=i)
        a = fresh.lookup(f"asked another way {i}", tenant="src", embedding=q)
        b = fresh.lookup(f"asked another way {i}", tenant="dst", embedding=q)
        same_near += (a is None) == (b is None) and (a is None or a.entry_id == b.entry_id)
    assert same_exact == 100 and same_near == 100
    # Run again, it resumes: everything is there, nothing is written twice.
    again = import_tenant(m.storage, "dst", lines)
    assert (again.stored, again.skipped) == (0, 300)
    assert st.count("dst") == 300 and st.stats("dst")["imported"] == 300


def test_an_import_refuses_bad_lines_and_another_dimension(redis_client: redis.Redis) -> None:
    m = CacheManager(redis_client, CacheConfig())
    _fill(m, _vectors(5))
    out = io.StringIO()
    export_tenant(m.storage, "src", out)
    lines = out.getvalue().splitlines()
    row = json.loads(lines[1])
    bad_vec = dict(row, vec="AAAA")  # 3 bytes: neither float32 nor float16
    bad_id = dict(row, id="nope")
    report = import_tenant(
        m.storage,
        "dst",
        [lines[0], json.dumps(bad_vec), "{not json", json.dumps(bad_id), *lines[2:]],
    )
    assert report.stored == 4 and [n for n, _ in report.refused] == [2, 3, 4]
    with pytest.raises(InvalidEntryError, match="header"):
        import_tenant(m.storage, "dst", lines[1:])
    m.put("q", "a", tenant="other", embedding=np.ones(DIM + 1))
    with pytest.raises(DimensionMismatchError):
        import_tenant(m.storage, "other", lines)


def test_expired_entries_are_left_out(redis_client: redis.Redis) -> None:
    clock = Clock(1_000.0)
    st = RedisStorage(redis_client, CacheConfig(), clock=clock)
    x = _vectors(4)
    st.put("src", "short", "a", x[0], ttl_s=10)
    st.put("src", "long", "a", x[1], ttl_s=1_000)
    out = io.StringIO()
    assert export_tenant(st, "src", out) == 2
    clock.t += 100
    report = import_tenant(st, "dst", out.getvalue().splitlines())
    assert (report.stored, report.expired) == (1, 1)


def test_the_cli_exports_and_imports(
    redis_client: redis.Redis, redis_url: str, tmp_path: Any
) -> None:
    from click.testing import CliRunner

    from zerda_cache.cli import cli

    m = CacheManager(redis_client, CacheConfig())
    _fill(m, _vectors(20))
    path = tmp_path / "t.jsonl"
    result = CliRunner().invoke(
        cli, ["--redis-url", redis_url, "export", "--tenant", "src", "-o", str(path)]
    )
    assert result.exit_code == 0, result.output
    assert len(path.read_text().splitlines()) == 21
    result = CliRunner().invoke(
        cli, ["--redis-url", redis_url, "import", "--tenant", "dst", str(path), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stored"] == 20
    assert m.storage.count("dst") == 20


def test_tags_and_a_round_trip_on_redis_cluster(cluster_client: Any) -> None:
    """Every key of a tenant, tags' sets included, shares its hash tag: the scripts run on
    one slot, and the import sends its calls one at a time (no scripts in a cluster's
    pipelines)."""
    st = RedisStorage(cluster_client, CacheConfig())
    x = _vectors(30)
    for i, v in enumerate(x):
        st.put("src", f"q{i}", f"a{i}", v, tags=["even"] if i % 2 == 0 else ["odd"])
    out = io.StringIO()
    assert export_tenant(st, "src", out) == 30
    report = import_tenant(st, "dst", out.getvalue().splitlines())
    assert report.stored == 30 and st.tags("dst") == {"even": 15, "odd": 15}
    assert st.invalidate_tag("dst", "even") == 15
    assert st.count("dst") == 15 and st.count("src") == 30
