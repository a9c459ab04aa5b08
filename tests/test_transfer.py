"""Export a tenant to JSON lines and import it back (real servers): answers, vectors,
arms, uses, expiry and tags come back as they were, and lookups serve the same answers."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from conftest import Clock, near

from zerda_cache import (
    CacheConfig,
    CacheManager,
    DimensionMismatchError,
    EntryNotFoundError,
    FeedbackSignal,
)
from zerda_cache.core.errors import InvalidEntryError
from zerda_cache.flows.transfer import export_tenant, import_tenant
from zerda_cache.storage import RedisStorage, codec
from zerda_cache.storage.keys import tenant_keys

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


# --- an import checks its file as a put checks its input (issue: "import trusts its file") ---
def _export(m: CacheManager, n: int = 6, **put: Any) -> list[str]:
    for i, v in enumerate(_vectors(n)):
        m.put(f"question {i}", f"answer {i}", tenant="src", embedding=v, **put)
    out = io.StringIO()
    export_tenant(m.storage, "src", out)
    return out.getvalue().splitlines()


def _edit(line: str, **change: Any) -> str:
    """One exported line with a stored value (``doc``, ``meta``, ``state``: a function
    of the decoded value) or a readable field (``expires_at``) changed."""
    row = json.loads(line)
    raw = {name: base64.b64decode(row[name]) for name in ("doc", "vec", "meta", "state")}
    for name, how in change.items():
        if name == "meta":
            raw["meta"] = msgpack.packb(how(msgpack.unpackb(raw["meta"])))
        elif name == "doc":
            raw["doc"] = msgpack.packb(how(msgpack.unpackb(raw["doc"])), use_bin_type=True)
        elif name == "state":
            values = list(struct.unpack("<15d", raw["state"]))
            raw["state"] = struct.pack("<15d", *how(values))
        elif name == "vec":
            raw["vec"] = how(raw["vec"])
        else:
            row[name] = how
    row.update({name: base64.b64encode(v).decode() for name, v in raw.items()})
    return json.dumps(row)


def _sized(sz: float) -> Any:
    return lambda values: [*values[:-1], sz]


def test_an_import_refuses_what_a_put_would_and_writes_nothing_of_it(
    redis_client: redis.Redis,
) -> None:
    """Untyped crashes (a 401-digit ``expires_at``, ``meta.us`` with inf), and the limits
    a put enforces did not apply (a 37 MB answer, a 100,000-character scope were
    imported and served). Each such line is refused with its line number, and nothing
    of it is written; the lines around it are imported."""
    m = CacheManager(redis_client, CacheConfig())
    header, *rows = _export(m, 12)
    q = {"v": 1, "q": "question 0", "r": "an answer", "m": {}}
    bad = {
        "expires_at of 401 digits": _edit(rows[0], expires_at=10**400),
        "expires_at NaN": rows[0].replace('"expires_at": null', '"expires_at": NaN'),
        "meta.us inf": _edit(rows[0], meta=lambda d: {**d, "us": ["m", float("inf"), 3]}),
        "answer over max_response_bytes": _edit(rows[0], doc=lambda d: {**q, "r": "x" * 300_000}),
        "query over max_query_chars": _edit(rows[0], doc=lambda d: {**q, "q": "y" * 9_000}),
        "empty query": _edit(rows[0], doc=lambda d: {**q, "q": " "}),
        "metadata over max_metadata_bytes": _edit(
            rows[0], doc=lambda d: {**q, "m": {"blob": "z" * 20_000}}
        ),
        "scope of 100,000 characters": _edit(rows[0], meta=lambda d: {**d, "sc": "s" * 100_000}),
        "17 tags": _edit(rows[0], meta=lambda d: {**d, "tg": [f"t{i}" for i in range(17)]}),
        "a tag with a space": _edit(rows[0], meta=lambda d: {**d, "tg": ["a b"]}),
        "a NaN in the vector": _edit(rows[0], vec=lambda v: np.full(DIM, np.nan, "<f4").tobytes()),
        "a vector of another dimension": _edit(rows[0], vec=lambda v: v[:-4]),
        "state sz inf": _edit(rows[0], state=_sized(float("inf"))),
    }
    lines = [header, rows[1], *bad.values(), *rows[2:]]
    report = import_tenant(m.storage, "dst", lines)
    refused = dict(report.refused)
    assert sorted(refused) == list(range(3, 3 + len(bad))), report.refused
    for number, why in refused.items():
        assert why and "\n" not in why, (number, why)
    assert report.stored == len(rows) - 1
    st = m.storage
    assert st.count("dst") == len(rows) - 1
    with pytest.raises(EntryNotFoundError):  # the refused id: nothing of it written
        st.get_entry("dst", json.loads(rows[0])["id"])
    assert not redis_client.exists(tenant_keys("dst").entry(json.loads(rows[0])["id"]))
    assert st.stats("dst")["bytes"] == st.stats("src")["bytes"] - _size(st, "src", rows[0])


def _scored(field: str, value: float) -> Any:
    """A state with one of its fields (``c``, ``ss``, ``qs``) set to ``value``."""
    at = ("a", "b", "n", "r", "t", "un", "la", "c", "v", "ss", "qs", "sb", "pm", "ns", "sz")
    return lambda values: [
        value if name == field else v for name, v in zip(at, values, strict=True)
    ]


def test_an_import_refuses_scores_a_put_never_writes(redis_client: redis.Redis) -> None:
    """The state's similarity, quality and confidence were only checked finite: a
    confidence of 7 or a quality of -3 was imported, and ranked lookups by it. A put
    writes them in [0, 1] (``unit_score``, the confidence clipped): so does an import."""
    m = CacheManager(redis_client, CacheConfig())
    header, *rows = _export(m, 8)
    bad = [
        _edit(rows[0], state=_scored("c", 7.0)),
        _edit(rows[1], state=_scored("ss", 1.5)),
        _edit(rows[2], state=_scored("qs", -3.0)),
        _edit(rows[3], state=_scored("c", -0.01)),
    ]
    fine = [_edit(rows[4], state=_scored("ss", 0.0)), _edit(rows[5], state=_scored("c", 1.0))]
    report = import_tenant(m.storage, "dst", [header, *bad, *fine, *rows[6:]])
    assert [n for n, _ in report.refused] == [2, 3, 4, 5], report.refused
    assert all("[0, 1]" in why for _, why in report.refused), report.refused
    assert report.stored == 4 and m.storage.count("dst") == 4


def test_an_import_checks_content_by_the_puts_own_checks(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The import re-listed the put's checks: a limit a put gained later would not have
    applied to an import. Both call ``codec.checked_doc``, so one added there (here by
    hand) refuses a put and an import's line alike."""
    m = CacheManager(redis_client, CacheConfig())
    header, *rows = _export(m, 3)
    real = codec.checked_doc

    def stricter(cfg: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if "question 1" in query:
            raise InvalidEntryError("a limit added to the put")
        return real(cfg, query, *args, **kwargs)

    monkeypatch.setattr(codec, "checked_doc", stricter)
    with pytest.raises(InvalidEntryError, match="a limit added"):
        m.put("question 1", "an answer", tenant="src", embedding=_vectors(1)[0])
    report = import_tenant(m.storage, "dst", [header, *rows])
    number = 2 + [json.loads(row)["query"] for row in rows].index("question 1")
    assert report.refused == [(number, "a limit added to the put")] and report.stored == 2


def _size(st: RedisStorage, tenant: str, line: str) -> int:
    return st.get_entry(tenant, json.loads(line)["id"]).size_bytes


def test_an_import_computes_sizes_itself(redis_client: redis.Redis) -> None:
    """``sz`` was taken from the file: ``sz = 1e300`` failed the script halfway (the entry
    written, not counted; "Redis unreachable", exit 3; the rest skipped) and ``sz = 2**53``
    broke the tenant's byte count for ever. The size is what a put computes."""
    m = CacheManager(redis_client, CacheConfig())
    header, *rows = _export(m, 4)
    lines = [header, _edit(rows[0], state=_sized(1e300)), _edit(rows[1], state=_sized(2.0**53))]
    report = import_tenant(m.storage, "dst", [*lines, *rows[2:]])
    assert (report.stored, report.refused) == (4, [])
    st = m.storage
    assert st.stats("dst")["bytes"] == st.stats("src")["bytes"]
    for line in rows:
        assert _size(st, "dst", line) == _size(st, "src", line)
    assert m.clear("dst") == 4
    assert st.stats("dst").get("bytes", 0) == 0


@pytest.mark.parametrize("dim", ["abc", 1e400, 2.5, True, -3, 0])
def test_a_header_of_no_dimension_is_a_clear_error(redis_client: redis.Redis, dim: Any) -> None:
    m = CacheManager(redis_client, CacheConfig())
    header, *rows = _export(m, 2)
    bad = json.dumps({**json.loads(header), "dim": dim})
    with pytest.raises(InvalidEntryError, match="header's dim"):
        import_tenant(m.storage, "dst", [bad, *rows])
    assert m.storage.count("dst") == 0


def test_the_cli_import_says_refused_lines_by_its_exit_code(
    redis_client: redis.Redis, redis_url: str, tmp_path: Any
) -> None:
    """``import`` exited 0 when it refused lines (a script had to parse ``--json``); a bad
    header was a traceback (``dim: 1e400``) or a plain ValueError (``dim: "abc"``)."""
    from click.testing import CliRunner

    from zerda_cache.cli import EXIT_REFUSED, EXIT_USAGE, cli

    m = CacheManager(redis_client, CacheConfig())
    header, *rows = _export(m, 3)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([header, _edit(rows[0], expires_at=10**400), *rows[1:]]) + "\n")
    args = ["--redis-url", redis_url, "import", "--tenant", "dst", str(path)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == EXIT_REFUSED == 4, result.output
    assert "2 stored" in result.stdout and "1 refused" in result.stdout
    assert "line 2: expires_at must be a finite number" in result.stdout
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == EXIT_REFUSED
    assert json.loads(result.stdout)["refused"][0]["line"] == 2
    for dim in ("1e400", '"abc"'):
        path.write_text(header.replace(f'"dim": {DIM}', f'"dim": {dim}') + "\n" + rows[0] + "\n")
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == EXIT_USAGE, result.output
        assert "header's dim must be a whole number" in result.stderr
        assert "Traceback" not in result.output


# --- an entry removed while the export runs is gone, not corrupt ---
def _export_of(m: CacheManager) -> tuple[int, list[str], list[str]]:
    corrupt: list[str] = []
    gone: list[str] = []
    out = io.StringIO()
    written = export_tenant(
        m.storage, "src", out, corrupt=lambda eid, why: corrupt.append(eid), gone=gone.append
    )
    return written, corrupt, gone


def test_an_entry_evicted_between_the_hash_and_state_reads_is_gone_not_corrupt(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export reads the hashes, then the states, in one pipeline: an entry the
    worker evicted between the two had a whole hash and no state, and was left out as
    corrupt ("left out ... corrupt") and reported for eviction. It is gone: not
    corrupt, not reported. Here the eviction comes between the reads by hand: the
    first read's reply is the torn one, and the entry is removed for real."""
    m = CacheManager(redis_client, CacheConfig())
    ids = _fill(m, _vectors(5))
    victim = ids[2]
    k = tenant_keys("src")
    real = m.storage.export_batch
    calls: list[list[str]] = []

    def torn(tenant: str, entry_ids: list[str]) -> list[Any]:
        rows = real(tenant, entry_ids)
        calls.append(list(entry_ids))
        if len(calls) > 1:
            return rows
        redis_client.delete(k.entry(victim))  # what the evict script removes
        redis_client.hdel(k.st, victim)
        redis_client.zrem(k.ids, victim)
        return [dataclasses.replace(r, state=None) if r.entry_id == victim else r for r in rows]

    monkeypatch.setattr(m.storage, "export_batch", torn)
    written, corrupt, gone = _export_of(m)
    assert (written, corrupt, gone) == (4, [], [victim])
    assert calls[1] == [victim]  # read once more, alone
    assert not redis_client.exists(k.bad)


def test_an_entry_whose_hash_is_gone_is_gone_and_a_key_of_another_type_corrupt(
    redis_client: redis.Redis,
) -> None:
    """An entry whose hash is gone while its state is still there (an ``allkeys-*``
    server evicted the hash) was left out as corrupt; it is gone. A key of another
    type in the entry's place is still corrupt, and reported."""
    m = CacheManager(redis_client, CacheConfig())
    ids = _fill(m, _vectors(5))
    k = tenant_keys("src")
    redis_client.delete(k.entry(ids[0]))
    redis_client.delete(k.entry(ids[1]))
    redis_client.set(k.entry(ids[1]), "not a hash")
    written, corrupt, gone = _export_of(m)
    assert (written, corrupt, gone) == (3, [ids[1]], [ids[0]])
    assert {e.decode() for e in redis_client.smembers(k.bad)} == {ids[1]}
