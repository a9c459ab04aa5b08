"""Tags: answers put with labels (the document they were built on, a source) and removed
together by one call, through an index of tags in Redis, never a scan (real servers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import redis
from conftest import near, unit

from zerda_cache import CacheConfig, InvalidEntryError
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.worker.maintenance import Maintenance

DIM = 16


def test_invalidating_a_tag_removes_exactly_its_entries(make_manager: Any) -> None:
    m = make_manager(CacheConfig(similarity_threshold=0.8))
    tagged = [
        m.put(f"about doc A {i}", f"A{i}", tenant="t", embedding=unit(i), tags=["doc:A", "v1"])
        for i in range(5)
    ]
    other = [
        m.put(f"about doc B {i}", f"B{i}", tenant="t", embedding=unit(100 + i), tags=["doc:B"])
        for i in range(3)
    ]
    plain = m.put("untagged", "U", tenant="t", embedding=unit(200))
    entry = m.storage.get_entry("t", tagged[0].entry_id)
    assert set(entry.tags) == {"doc:A", "v1"}
    assert m.storage.tags("t") == {"doc:A": 5, "doc:B": 3, "v1": 5}
    assert m.lookup("about doc A 0", tenant="t", embedding=unit(0)) is not None

    assert m.invalidate_tag("doc:A", tenant="t") == 5
    for r in tagged:  # gone from Redis, and from every replica's index
        assert (
            m.lookup("about doc A?", tenant="t", embedding=near(unit(tagged.index(r)), 0.97))
            is None
        )
    for i, r in enumerate(other):
        hit = m.lookup(f"about doc B {i}", tenant="t", embedding=unit(100 + i))
        assert hit is not None and hit.entry_id == r.entry_id
    assert m.lookup("untagged", tenant="t", embedding=unit(200)).entry_id == plain.entry_id
    assert m.stats("t")["entries"] == 4
    # the tag's set is gone; "v1" still lists the removed ids until the worker's sweep
    assert m.storage.tags("t") == {"doc:B": 3, "v1": 5}
    assert m.invalidate_tag("doc:A", tenant="t") == 0  # nothing left: idempotent


def test_the_worker_sweeps_removed_entries_out_of_tags(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    m = make_manager()
    ids = [
        m.put(f"q{i}", "a", tenant="t", embedding=unit(i), tags=["src:x", f"doc:{i}"]).entry_id
        for i in range(6)
    ]
    for eid in ids[:4]:
        assert m.invalidate(eid, tenant="t")
    assert m.storage.tags("t")["src:x"] == 6  # an eviction does not know an entry's tags
    report = Maintenance(RedisStorage(redis_client)).evict_tenant("t")
    assert report.tags_swept == 8  # 4 from src:x, 1 each from doc:0..3
    assert m.storage.tags("t") == {"src:x": 2, "doc:4": 1, "doc:5": 1}
    assert not redis_client.exists(tenant_keys("t").tag("doc:0"))


def test_clear_drops_the_tags(make_manager: Any, redis_client: redis.Redis) -> None:
    m = make_manager()
    m.put("q", "a", tenant="t", embedding=unit(1), tags=["doc:1"])
    assert m.clear("t") == 1
    assert m.storage.tags("t") == {}
    assert not redis_client.exists(tenant_keys("t").tag("doc:1"), tenant_keys("t").tags)


@pytest.mark.parametrize(
    "tags",
    [
        "doc:1",  # a str, not a list of them
        ["has space"],
        [""],
        ["x" * 129],
        ["\ud800"],
        ["ünïcode"],
        [1],
        [f"t{i}" for i in range(17)],
    ],
)
def test_bad_tags_are_refused_and_nothing_is_written(
    make_manager: Any, redis_client: redis.Redis, tags: Any
) -> None:
    m = make_manager()
    before = redis_client.dbsize()
    with pytest.raises(InvalidEntryError):
        m.put("q", "a", tenant="t", embedding=np.ones(DIM), tags=tags)
    assert redis_client.dbsize() == before
    with pytest.raises(InvalidEntryError):
        m.invalidate_tag("has space", tenant="t")


@pytest.mark.slow
def test_a_tag_of_1000_entries_goes_in_one_call_touching_only_them(
    redis_client: redis.Redis,
) -> None:
    """One library call removes a tag of 1,000 entries among 5,000; the other entries'
    keys are not read or written (their state's version is unchanged)."""
    st = RedisStorage(redis_client)
    rng = np.random.default_rng(3)
    tagged, others = [], []
    for i in range(5_000):
        vec = rng.normal(size=DIM)
        if i % 5 == 0:
            tagged.append(st.put("t", f"q{i}", "a", vec, tags=["doc:big"]).entry_id)
        else:
            others.append(st.put("t", f"q{i}", "a", vec).entry_id)
    before = {eid: st.get_entry("t", eid, with_vector=False).version for eid in others[:200]}
    assert st.invalidate_tag("t", "doc:big") == 1_000
    assert st.count("t") == 4_000
    after = {eid: st.get_entry("t", eid, with_vector=False).version for eid in others[:200]}
    assert after == before
    assert st.stats("t")["evicted:invalidated"] == 1_000


def test_the_cli_lists_and_invalidates_tags(redis_client: redis.Redis, redis_url: str) -> None:
    import json

    from click.testing import CliRunner

    from zerda_cache.cli import cli

    st = RedisStorage(redis_client)
    for i in range(3):
        st.put("t", f"q{i}", "a", unit(i), tags=["doc:7"])
    st.put("t", "q9", "a", unit(9))

    def run(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, ["--redis-url", redis_url, *args])
        return result.exit_code, result.output

    code, out = run("tags", "list", "--tenant", "t", "--json")
    assert code == 0 and json.loads(out) == {"tenant": "t", "tags": {"doc:7": 3}}
    code, out = run("tags", "invalidate", "--tenant", "t", "doc:7", "--json")
    assert code == 0 and json.loads(out)["removed"] == 3
    assert st.count("t") == 1
    code, out = run("tags", "invalidate", "--tenant", "t", "has space")
    assert code == 2 and "invalid tag" in out
