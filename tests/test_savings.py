"""Savings (zerda_cache.core.savings): hits of answers put with their LLM usage count as calls,
tokens and dollars saved; hits judged wrong count apart, so the net is honest (real
servers)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
import redis
from conftest import near, unit
from prometheus_client import CollectorRegistry

from zerda_cache import (
    CacheConfig,
    FeedbackSignal,
    InvalidEntryError,
    InvalidFeedbackError,
    LLMUsage,
)
from zerda_cache.core.savings import DEFAULT_PRICES
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import codec
from zerda_cache.storage.keys import tenant_keys

#: feedback.lua's WRONG_WINDOW: how many of an entry's last hits a wrong one may name.
WINDOW = 1024


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_hits_count_saved_calls_tokens_and_dollars_and_wrong_hits_apart(
    make_manager: Any,
) -> None:
    registry = CollectorRegistry()
    cfg = CacheConfig(similarity_threshold=0.8, token_prices={"my-model": (1.0, 4.0)})
    m = make_manager(cfg, metrics=ReplicaMetrics(registry))
    usages = [
        {"model": "my-model", "prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150},
        LLMUsage("gpt-4o-mini", 1_000, 200),
    ]
    for i, usage in enumerate(usages):
        m.put(f"question {i}", f"answer {i}", tenant="t", embedding=unit(i), usage=usage)
    m.put("no usage", "answer", tenant="t", embedding=unit(9))
    hits = []
    for _ in range(3):  # three exact hits and three near hits of each
        for i in range(2):
            hits.append(m.lookup(f"question {i}", tenant="t", embedding=unit(i)))
            hits.append(m.lookup(f"asked again {i}", tenant="t", embedding=near(unit(i), 0.95)))
    assert all(h is not None for h in hits)
    assert hits[0].usage == LLMUsage("my-model", 100, 50)
    assert m.lookup("no usage", tenant="t", embedding=unit(9)).usage is None  # counts nothing
    # The user says two of the my-model hits were wrong: bought after all.
    for hit in hits[:2]:
        m.feedback(hit.feedback(False))
    # A negative about a fresh answer (the LLM's, never served) is no wrong hit.
    fresh = m.put("question 5", "answer 5", tenant="t", embedding=unit(5), usage=usages[0])
    m.feedback(fresh.feedback(False))

    savings = m.stats("t")["savings"]
    mine, mini = savings["my-model"], savings["gpt-4o-mini"]
    assert (mine["calls"], mine["prompt_tokens"], mine["completion_tokens"]) == (6, 600, 300)
    assert mine["usd"] == pytest.approx((600 * 1.0 + 300 * 4.0) / 1e6)
    assert (mine["wrong_calls"], mine["wrong_prompt_tokens"]) == (2, 200)
    assert mine["wrong_usd"] == pytest.approx((200 * 1.0 + 100 * 4.0) / 1e6)
    assert mine["net_usd"] == pytest.approx(mine["usd"] - mine["wrong_usd"])
    p, c = DEFAULT_PRICES["gpt-4o-mini"]
    assert mini["calls"] == 6 and mini["usd"] == pytest.approx((6_000 * p + 1_200 * c) / 1e6)
    assert savings["*"]["calls"] == 12 and savings["*"]["wrong_calls"] == 2
    assert not any(k.startswith(("saved:", "wrong:")) for k in m.stats("t"))
    # The replica's metrics count the same.
    assert sample(registry, "zerda_cache_saved_calls_total", tenant="t", model="my-model") == 6
    assert (
        sample(
            registry,
            "zerda_cache_saved_tokens_total",
            tenant="t",
            model="gpt-4o-mini",
            kind="prompt",
        )
        == 6_000
    )
    assert sample(registry, "zerda_cache_wrong_hit_calls_total", tenant="t", model="my-model") == 2
    assert sample(registry, "zerda_cache_saved_usd_total", tenant="t", model="my-model") == (
        pytest.approx(mine["usd"])
    )


def test_a_hit_is_counted_saved_as_it_is_served_and_another_replica_sees_it_at_once(
    make_manager: Any,
) -> None:
    """The hit script counts the saved call in the step that serves it: nothing waits in
    the serving replica for its later traffic (an idle replica's hit was unseen), and a
    wrong hit judged at once never makes the net negative."""
    a, b = make_manager(), make_manager()
    a.put("q", "a", tenant="t", embedding=unit(1), usage=LLMUsage("gpt-4o", 10, 20))
    hits = [b.lookup("q", tenant="t", embedding=unit(1)) for _ in range(5)]
    assert all(h is not None for h in hits)
    saved = a.stats("t")["savings"]["gpt-4o"]  # b never flushed anything
    assert (saved["calls"], saved["prompt_tokens"], saved["completion_tokens"]) == (5, 50, 100)
    c = make_manager()
    hit = c.lookup("q", tenant="t", embedding=unit(1))
    c.feedback(hit.feedback(False))  # judged wrong at once, on the replica that served it
    seen = a.stats("t")["savings"]["gpt-4o"]
    assert (seen["calls"], seen["wrong_calls"], seen["net_calls"]) == (6, 1, 5)


def test_a_hit_is_counted_wrong_once_however_often_it_is_judged(make_manager: Any) -> None:
    """Repeated negatives about one served hit count it wrong once; each hit judged wrong
    counts once; a verdict on a hit that never happened counts nothing."""
    m = make_manager()
    put = m.put("q", "a", tenant="t", embedding=unit(1), usage=LLMUsage("gpt-4o", 10, 20))
    first = m.lookup("q", tenant="t", embedding=unit(1))
    for _ in range(10):
        m.feedback(first.feedback(False))
    savings = m.stats("t")["savings"]["gpt-4o"]
    assert (savings["calls"], savings["wrong_calls"], savings["net_calls"]) == (1, 1, 0)
    assert savings["wrong_prompt_tokens"] == 10
    second = m.lookup("q", tenant="t", embedding=unit(1))
    assert second is not None and second.hit_number == first.hit_number + 1
    for _ in range(3):
        m.feedback(second.feedback(False))
        m.feedback(first.feedback(False))
    # A hit number the entry was never served at (forged, or of a later hit) is no hit.
    m.feedback(FeedbackSignal(put.entry_id, "t", False, hit=second.hit_number + 5))
    savings = m.stats("t")["savings"]["gpt-4o"]
    assert (savings["calls"], savings["wrong_calls"], savings["net_calls"]) == (2, 2, 0)
    assert m.stats("t")["negative"] == 17  # every signal still teaches the entry's arm


def with_uses(client: redis.Redis, tenant: str, entry_id: str, uses: int) -> None:
    """Set the entry's use count in its stored state, as if it had been served that often."""
    key = tenant_keys(tenant).st
    values = list(codec._STATE.unpack(client.hget(key, entry_id)))
    values[codec.STATE_FIELDS.index("un")] = float(uses)
    client.hset(key, entry_id, codec._STATE.pack(*values))


def test_only_the_last_hits_may_be_counted_wrong_and_their_marks_stay_few(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """The marks of the hits counted wrong (``wh``) grew without bound, one per wrong hit
    ever, each negative reading and writing them all. Now only the entry's last
    WRONG_WINDOW hits may be named; older marks are pruned."""
    m = make_manager()
    eid = m.put("q", "a", tenant="t", embedding=unit(1), usage=LLMUsage("gpt-4o", 10, 20)).entry_id
    k = tenant_keys("t")
    with_uses(redis_client, "t", eid, 5000)
    redis_client.hincrby(k.stats, "saved:gpt-4o:calls", 5000)
    redis_client.hset(k.entry(eid), "wh", msgpack.packb([*range(1, 3001), 4500]))
    m.feedback(FeedbackSignal(eid, "t", False, hit=5000 - WINDOW))  # out of the window
    assert m.stats("t")["savings"]["gpt-4o"]["wrong_calls"] == 0
    m.feedback(FeedbackSignal(eid, "t", False, hit=5000 - WINDOW + 1))  # the oldest in it
    m.feedback(FeedbackSignal(eid, "t", False, hit=4500))  # marked already
    assert m.stats("t")["savings"]["gpt-4o"]["wrong_calls"] == 1
    marks = msgpack.unpackb(redis_client.hget(k.entry(eid), "wh"))
    assert marks == [4500, 5000 - WINDOW + 1]  # the 3,000 marks out of the window pruned


def test_a_recreated_state_counts_its_hits_afresh(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """A state recreated at the prior (its hash outlived the state hash) numbers its
    hits from 1 again, but kept the old marks: its new hit 1 was never counted wrong."""
    m = make_manager()
    m.put("q", "a", tenant="t", embedding=unit(1), usage=LLMUsage("gpt-4o", 10, 20))
    old = m.lookup("q", tenant="t", embedding=unit(1))
    m.feedback(old.feedback(False))
    redis_client.delete(tenant_keys("t").st)  # lost (an allkeys-* eviction, a DEL)
    new = m.lookup("q", tenant="t", embedding=unit(1))
    assert new is not None and new.hit_number == old.hit_number == 1
    m.feedback(new.feedback(False))
    savings = m.stats("t")["savings"]["gpt-4o"]
    assert (savings["calls"], savings["wrong_calls"]) == (2, 2)


def test_a_wrong_hit_the_cap_refused_is_counted_once_the_saved_calls_allow_it(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """The script marked a hit counted before testing the cap (wrong <= saved), so a
    verdict the cap refused could never count, however many calls were saved later."""
    m = make_manager()
    m.put("q", "a", tenant="t", embedding=unit(1), usage=LLMUsage("gpt-4o", 10, 20))
    first = m.lookup("q", tenant="t", embedding=unit(1))
    redis_client.hdel(m.storage.keys("t").stats, "saved:gpt-4o:calls")  # as if never counted
    m.feedback(first.feedback(False))  # refused by the cap: nothing saved to take back
    assert m.stats("t")["savings"]["gpt-4o"]["wrong_calls"] == 0
    assert m.lookup("q", tenant="t", embedding=unit(1)) is not None  # one call saved
    m.feedback(first.feedback(False))
    m.feedback(first.feedback(False))  # still once
    savings = m.stats("t")["savings"]["gpt-4o"]
    assert (savings["calls"], savings["wrong_calls"], savings["net_calls"]) == (1, 1, 0)


def test_wrong_hits_never_outnumber_the_saved_calls(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """An entry whose serves this Redis never counted (imported with its use count, or
    its tenant's counters reset) cannot push the net below zero."""
    m = make_manager()
    m.put("q", "a", tenant="t", embedding=unit(1), usage=LLMUsage("gpt-4o", 10, 20))
    hits = [m.lookup("q", tenant="t", embedding=unit(1)) for _ in range(3)]
    redis_client.hdel(m.storage.keys("t").stats, "saved:gpt-4o:calls")  # as if never counted
    redis_client.hincrby(m.storage.keys("t").stats, "saved:gpt-4o:calls", 1)
    for hit in hits:
        m.feedback(hit.feedback(False))
    savings = m.stats("t")["savings"]["gpt-4o"]
    assert (savings["calls"], savings["wrong_calls"], savings["net_calls"]) == (1, 1, 0)


def test_a_served_signal_names_a_real_hit_number() -> None:
    for bad in (0, -1, True, 1.0, "1", 2**53):
        with pytest.raises(InvalidFeedbackError, match="hit"):
            FeedbackSignal("e" * 32, "t", False, hit=bad)
    assert FeedbackSignal("e" * 32, "t", False, hit=3).served


def test_served_is_derived_from_the_hit_number() -> None:
    """``served`` was a field set and validated but read by nothing: two signals about
    the same put answer differed by it. It is now ``hit is not None``; the keyword is
    still accepted (the callers that pass it) and changes nothing."""
    plain = FeedbackSignal("e" * 32, "t", False, timestamp=1.0)
    assert FeedbackSignal("e" * 32, "t", False, timestamp=1.0, served=True) == plain
    assert not plain.served and "served" not in {f.name for f in dataclasses.fields(plain)}


@pytest.mark.parametrize(
    "usage",
    [
        {"model": "m", "prompt_tokens": -1, "completion_tokens": 0},
        {"model": "m", "prompt_tokens": 1.5, "completion_tokens": 0},
        {"model": "", "prompt_tokens": 1, "completion_tokens": 0},
        {"model": "m\n", "prompt_tokens": 1, "completion_tokens": 0},
        {"prompt_tokens": 1, "completion_tokens": 0},
        {"model": "m", "prompt_tokens": 1, "completion_tokens": 0, "cost": 3},
        "gpt-4o",
        {"model": "m", "prompt_tokens": 10**400, "completion_tokens": 0},
    ],
)
def test_bad_usage_is_refused(make_manager: Any, usage: Any) -> None:
    m = make_manager()
    with pytest.raises(InvalidEntryError):
        m.put("q", "a", tenant="t", embedding=unit(1), usage=usage)
    assert m.stats("t")["entries"] == 0


def test_prices_are_checked() -> None:
    with pytest.raises(ValueError, match="token_prices"):
        CacheConfig(token_prices={"m": (float("nan"), 1.0)})
    with pytest.raises(ValueError, match="token_prices"):
        CacheConfig(token_prices={"m": (-1.0, 1.0)})
    cfg = CacheConfig(token_prices={"b": (1, 2), "a": (3, 4)})
    assert cfg.token_prices == (("a", 3.0, 4.0), ("b", 1.0, 2.0))
    hash(cfg)


def test_the_cli_reports_the_savings(redis_url: str, make_manager: Any) -> None:
    import json

    from click.testing import CliRunner

    from zerda_cache.cli import cli

    m = make_manager()
    put = m.put("q", "a", tenant="t", embedding=unit(1), usage=LLMUsage("gpt-4o", 1_000, 500))
    result = CliRunner().invoke(
        cli, ["--redis-url", redis_url, "inspect", put.entry_id, "--tenant", "t", "--json"]
    )
    assert json.loads(result.stdout)["usage"] == {
        "model": "gpt-4o",
        "prompt_tokens": 1_000,
        "completion_tokens": 500,
    }
    for _ in range(4):
        m.lookup("q", tenant="t", embedding=unit(1))
    m.stats("t")  # writes the replica's pending counts
    result = CliRunner().invoke(cli, ["--redis-url", redis_url, "stats", "--tenant", "t", "--json"])
    row = json.loads(result.stdout)["tenants"][0]
    assert row["savings"]["gpt-4o"]["calls"] == 4 and "saved:gpt-4o:calls" not in row
    result = CliRunner().invoke(cli, ["--redis-url", redis_url, "stats", "--tenant", "t"])
    assert "hits saved 4 LLM calls" in result.output


def test_the_cli_prices_the_savings_as_serve_does(
    redis_url: str, make_manager: Any, tmp_path: Any
) -> None:
    """``stats`` takes ``--token-prices`` and ``ZERDA_TOKEN_PRICES`` as ``serve`` does:
    a model priced only there is not reported at $0.00."""
    import json

    from click.testing import CliRunner

    from zerda_cache.cli import cli

    m = make_manager()
    m.put("q", "a", tenant="t", embedding=unit(1), usage=LLMUsage("my-model", 1_000_000, 0))
    for _ in range(2):
        m.lookup("q", tenant="t", embedding=unit(1))
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"my-model": [3.0, 9.0]}))
    base = ["--redis-url", redis_url, "stats", "--tenant", "t"]
    by_option = CliRunner().invoke(cli, [*base, "--json", "--token-prices", str(prices)])
    row = json.loads(by_option.stdout)["tenants"][0]
    assert row["savings"]["my-model"]["usd"] == pytest.approx(6.0)
    by_env = CliRunner().invoke(cli, base, env={"ZERDA_TOKEN_PRICES": str(prices)})
    assert by_env.exit_code == 0, by_env.output
    assert "$6.00" in by_env.output
    unpriced = CliRunner().invoke(cli, base)
    assert "$0.00" in unpriced.output
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    refused = CliRunner().invoke(cli, [*base, "--token-prices", str(bad)])
    assert refused.exit_code == 2 and "token-prices" in refused.output


def test_the_replicas_and_stats_price_from_one_helper(
    make_manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The price table was built from a configuration by the same expression in the
    engine and in ``stats``: one helper builds it now (``savings.prices_of``), the
    defaults with the configuration's prices on top, and a change to it reaches both."""
    from zerda_cache import cli as cli_module
    from zerda_cache.core import savings
    from zerda_cache.flows import engine

    cfg = CacheConfig(token_prices={"my-model": (1.0, 4.0), "gpt-4o": (9.0, 9.0)})
    table = savings.prices_of(cfg)
    assert table == {**DEFAULT_PRICES, "my-model": (1.0, 4.0), "gpt-4o": (9.0, 9.0)}
    assert savings.prices_of(CacheConfig()) == dict(DEFAULT_PRICES)
    assert make_manager(cfg).prices == table
    assert engine.prices_of is savings.prices_of and cli_module.prices_of is savings.prices_of
