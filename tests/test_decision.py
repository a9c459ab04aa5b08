"""``decide``: what a lookup decided (hit, miss or verify), why, under which bound, and the
verify token that lets a put on any replica verify the candidate held back. On both
drivers (``make_manager`` is parametrized sync / async) against real servers."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from conftest import near
from conftest import unit as _unit
from prometheus_client import CollectorRegistry
from state_support import tenant_state

from zerda_cache import CacheConfig, Decision, FeedbackSignal, InvalidEntryError, RLConfig
from zerda_cache.flows.lookup import REASONS
from zerda_cache.learning.calibration import MIN_LABELS, exact_level
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import RedisStorage

DIM = 64
BOUNDED = CacheConfig(max_error_rate=0.02, verify_rate=0.0)


def unit(seed: int) -> Any:
    return _unit(seed, DIM)


def teach(redis_client: redis.Redis, tenant: str, sim: float, right: int, wrong: int) -> None:
    """Labelled near-match outcomes at ``sim``, as earlier verifications would leave."""
    st = RedisStorage(redis_client)
    for positive, n in ((True, right), (False, wrong)):
        for _ in range(n):
            tenant_state(st).label(tenant, sim, positive)


def snapshot(redis_client: redis.Redis) -> dict[bytes, Any]:
    """Every key with its value, to show that a refused put wrote nothing."""
    out: dict[bytes, Any] = {}
    for key in redis_client.scan_iter(count=1000):
        kind = redis_client.type(key)
        if kind == b"hash":
            out[key] = redis_client.hgetall(key)
        elif kind == b"string":
            out[key] = redis_client.get(key)
        elif kind == b"zset":
            out[key] = redis_client.zrange(key, 0, -1, withscores=True)
        elif kind == b"set":
            out[key] = redis_client.smembers(key)
        elif kind == b"stream":
            out[key] = redis_client.xrange(key)
        else:
            out[key] = kind
    return out


def test_a_miss_and_a_hit_without_a_bound(make_manager: Any) -> None:
    registry = CollectorRegistry()
    m = make_manager(CacheConfig(similarity_threshold=0.9), metrics=ReplicaMetrics(registry))
    v = unit(1)
    miss = m.decide("What is Redis?", tenant="t", embedding=v)
    assert isinstance(miss, Decision) and miss.kind == "miss" and not miss
    assert miss.reason == "no_candidate" and miss.hit is None and miss.verify_token is None
    assert miss.max_error_rate is None and miss.threshold is None and miss.exact_level is None
    assert miss.estimated_error is None
    put = m.put("What is Redis?", "An in-memory data store.", tenant="t", embedding=v)
    exact = m.decide("What is Redis?", tenant="t", embedding=v)
    assert exact and exact.kind == "hit" and exact.reason == "exact"
    assert exact.hit is not None and exact.hit.entry_id == put.entry_id and exact.hit.exact
    assert exact.candidate_id is None and exact.verify_token is None
    close = m.decide("what's redis", tenant="t", embedding=near(v, 0.95, 2))
    assert close.kind == "hit" and close.reason == "near" and close.hit is not None
    assert close.hit.response == "An in-memory data store." and not close.hit.exact
    far = m.decide("What is Postgres?", tenant="t", embedding=near(v, 0.5, 3))
    assert far.kind == "miss" and far.reason == "no_candidate"
    # Counted as lookups are: two hits, two misses.
    stats = m.stats("t")
    assert (stats["hits"], stats["misses"]) == (2, 2)
    count = registry.get_sample_value
    assert count("zerda_cache_lookups_total", {"tenant": "t", "result": "hit"}) == 2
    assert count("zerda_cache_lookups_total", {"tenant": "t", "result": "miss"}) == 2
    # lookup returns the same answers
    assert m.lookup("What is Redis?", tenant="t", embedding=v).entry_id == put.entry_id
    assert m.lookup("What is Postgres?", tenant="t", embedding=near(v, 0.5, 3)) is None


def test_an_unservable_candidate_is_a_miss_with_its_reason(make_manager: Any) -> None:
    m = make_manager(CacheConfig(similarity_threshold=0.9, rl=RLConfig(min_reward_to_serve=0.4)))
    v = unit(4)
    put = m.put("q", "a wrong answer", tenant="t", embedding=v)
    for _ in range(4):  # marked wrong: under the serving bar
        m.feedback(FeedbackSignal(put.entry_id, "t", False))
    decision = m.decide("q again", tenant="t", embedding=near(v, 0.97, 5))
    assert decision.kind == "miss" and decision.reason == "unservable"
    assert decision.reason in REASONS


def test_a_verify_carries_its_candidate_reason_token_and_the_bound(make_manager: Any) -> None:
    registry = CollectorRegistry()
    m = make_manager(BOUNDED, metrics=ReplicaMetrics(registry))
    v = unit(6)
    put = m.put("What is the capital of France?", "Paris.", tenant="t", embedding=v)
    # The question itself, its entry unconfirmed: verified.
    own = m.decide("What is the capital of France?", tenant="t", embedding=v)
    assert own.kind == "verify" and not own and own.hit is None
    assert own.reason == "exact_unproven"
    assert own.candidate_id == put.entry_id and own.similarity == 1.0
    assert own.verify_token is not None and own.verify_token.startswith("zv1.")
    # What the bound serves from: a new tenant has no labels, so no near match yet, and
    # exact repeats of entries one positive signal confirmed, at no estimated error.
    assert own.max_error_rate == 0.02 and own.threshold is None
    assert own.exact_level == exact_level(0.55) == 1 and own.estimated_error == 0.0
    # A near match: no label says matches that close are right yet.
    close = m.decide("capital of france?", tenant="t", embedding=near(v, 0.95, 7))
    assert close.kind == "verify" and close.reason == "near_unproven"
    assert close.candidate_id == put.entry_id
    assert close.similarity == pytest.approx(0.95, abs=1e-3)
    assert close.verify_token not in (None, own.verify_token)
    count = registry.get_sample_value
    assert count("zerda_cache_lookups_total", {"tenant": "t", "result": "verify"}) == 2
    # the per-call bound is the one reported
    tighter = m.decide("capital of france?", tenant="t", embedding=v, max_error_rate=0.01)
    assert tighter.max_error_rate == 0.01
    # awaiting_verification says the same, for this replica
    assert m.awaiting_verification("capital of france?", tenant="t")


def test_a_bound_with_labels_reports_its_threshold_and_estimate(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    teach(redis_client, "t", 0.96, 300, 1)
    teach(redis_client, "t", 0.91, 100, 40)
    m = make_manager(BOUNDED)
    v = unit(8)
    cached = m.put("q", "a", tenant="t", embedding=v)
    hit = m.decide("close", tenant="t", embedding=near(v, 0.97, 9))
    assert hit.kind == "hit" and hit.reason == "near" and hit.hit is not None
    assert hit.hit.entry_id == cached.entry_id
    assert hit.max_error_rate == 0.02 and hit.threshold == pytest.approx(0.96)
    assert hit.estimated_error is not None and 0.0 < hit.estimated_error < 0.02
    serving = m.tenant_policy("t").calibration.serving(0.02)
    assert (hit.threshold, hit.exact_level, hit.estimated_error) == (
        serving.threshold,
        serving.exact_level,
        serving.estimated_error,
    )
    below = m.decide("farther", tenant="t", embedding=near(v, 0.92, 10))
    assert below.kind == "verify" and below.reason == "near_unproven"
    assert below.threshold == pytest.approx(0.96)
    assert sum(m.tenant_policy("t").calibration.right) >= MIN_LABELS


def test_a_per_serve_ceiling_raises_the_threshold_reported(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """``max_serve_error`` raises the bar near matches must clear: the decision reports
    the threshold the lookup applied, not the bound's alone."""
    teach(redis_client, "t", 0.98, 800, 0)
    teach(redis_client, "t", 0.96, 300, 3)
    m = make_manager(CacheConfig(max_error_rate=0.02, max_serve_error=0.005, verify_rate=0.0))
    v = unit(21)
    m.put("q", "a", tenant="t", embedding=v)
    assert m.tenant_policy("t").calibration.serving(0.02).threshold == pytest.approx(0.96)
    held = m.decide("close", tenant="t", embedding=near(v, 0.97, 22))
    assert held.kind == "verify" and held.reason == "near_unproven"
    assert held.threshold == pytest.approx(0.98) == m.tenant_policy("t").threshold()
    served = m.decide("closer", tenant="t", embedding=near(v, 0.985, 23))
    assert served.kind == "hit" and served.threshold == pytest.approx(0.98)


def test_exploration_is_its_own_reason(make_manager: Any, redis_client: redis.Redis) -> None:
    teach(redis_client, "t", 0.96, 300, 0)
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=1.0))
    v = unit(11)
    m.put("q", "a", tenant="t", embedding=v)
    decision = m.decide("q2", tenant="t", embedding=near(v, 0.98, 12))
    assert decision.kind == "verify" and decision.reason == "explore"


def test_a_token_verifies_on_another_replica(make_manager: Any) -> None:
    """The lookup on replica A holds a near match back; the app's put of the LLM's answer
    goes to replica B, which has no ticket in its memory: the token carries it."""
    a, b = make_manager(BOUNDED), make_manager(BOUNDED)
    v = unit(13)
    cached = a.put("How many legs has a spider?", "Eight.", tenant="t", embedding=v)
    close = near(v, 0.95, 14)
    held = a.decide("how many legs does a spider have", tenant="t", embedding=close)
    assert held.kind == "verify" and held.verify_token is not None
    assert not b.awaiting_verification("how many legs does a spider have", tenant="t")
    result = b.put(
        "how many legs does a spider have",
        "eight",
        tenant="t",
        embedding=close,
        verify_token=held.verify_token,
    )
    assert result.stored and result.verified is True
    assert result.compared_id == cached.entry_id == held.candidate_id
    cal = tenant_state(b.storage).calibration("t")
    assert sum(cal.right) == 1 and sum(cal.wrong) == 0  # one label, from B's put
    # A verification is settled once: the same token again, or A's put with the ticket
    # A still keeps in its memory, label nothing more.
    q = "how many legs does a spider have"
    again = b.put(q, "eight", tenant="t", embedding=close, verify_token=held.verify_token)
    assert again.stored and again.verified is None
    assert a.awaiting_verification(q, tenant="t")
    assert a.put(q, "eight", tenant="t", embedding=close).verified is None
    cal = tenant_state(b.storage).calibration("t")
    assert sum(cal.right) == 1 and sum(cal.wrong) == 0
    # Without the token, B's put of a question A held back verifies nothing.
    other = near(v, 0.95, 15)
    assert a.decide("spider legs?", tenant="t", embedding=other).kind == "verify"
    plain = b.put("spider legs?", "Eight.", tenant="t", embedding=other)
    assert plain.stored and plain.verified is None and plain.compared_id is None


def test_a_token_settles_the_question_own_entry_on_another_replica(make_manager: Any) -> None:
    a, b = make_manager(BOUNDED), make_manager(BOUNDED)
    v = unit(16)
    first = a.put("q", "right", tenant="t", embedding=v)
    held = a.decide("q", tenant="t", embedding=v)
    assert held.kind == "verify" and held.reason == "exact_unproven"
    # A disagreeing answer, on B: the entry stays, disputed; nothing stored.
    slip = b.put("q", "a slip", tenant="t", embedding=v, verify_token=held.verify_token)
    assert not slip.stored and slip.verified is False and slip.compared_id == first.entry_id
    for _ in range(2):  # confirmed (level 3) all the same: held out for its dispute
        a.feedback(FeedbackSignal(first.entry_id, "t", True))
    again = a.decide("q", tenant="t", embedding=v)
    assert again.kind == "verify" and again.reason == "disputed"
    # The next answer, on B again, agrees with the cached one: kept, confirmed.
    kept = b.put("q", "right", tenant="t", embedding=v, verify_token=again.verify_token)
    assert kept.stored and kept.verified is True and kept.entry_id == first.entry_id
    served = b.decide("q", tenant="t", embedding=v)
    assert served.kind == "hit" and served.reason == "exact"
    assert served.hit is not None and served.hit.response == "right"


def test_a_token_for_another_question_or_tenant_or_garbage_writes_nothing(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    m = make_manager(BOUNDED)
    v = unit(17)
    m.put("q", "a", tenant="t", embedding=v)
    token = m.decide("q2", tenant="t", embedding=near(v, 0.95, 18)).verify_token
    assert token is not None
    before = snapshot(redis_client)
    bad: list[tuple[str, str, str | None, object]] = [
        ("another question", "t", None, token),
        ("q2", "u", None, token),  # another tenant
        ("q2", "t", "another scope", token),
        ("q2", "t", None, "not a token"),
        ("q2", "t", None, "zv1.garbage"),
        ("q2", "t", None, token[:-6]),  # cut short
        ("q2", "t", None, "zv1." + "A" * 5000),
        ("q2", "t", None, 42),
    ]
    for query, tenant, scope, wrong in bad:
        with pytest.raises(InvalidEntryError, match="verify_token"):
            m.put(
                query,
                "fresh",
                tenant=tenant,
                scope=scope,
                embedding=near(v, 0.95, 18),
                verify_token=wrong,
            )
        assert snapshot(redis_client) == before, (query, tenant, scope)
    # The right one still verifies.
    ok = m.put("q2", "a", tenant="t", embedding=near(v, 0.95, 18), verify_token=token)
    assert ok.stored and ok.verified is True


def test_decide_fails_open_as_unavailable(redis_server_factory: Any, make_manager: Any) -> None:
    server = redis_server_factory()
    m = make_manager(
        CacheConfig(redis_timeout_s=0.5, max_error_rate=0.05), url=server.url, from_url=True
    )
    v = unit(19)
    m.put("q", "a", tenant="t", embedding=v)
    server.stop()
    decision = m.decide("q", tenant="t", embedding=v)
    assert decision.kind == "miss" and decision.reason == "unavailable" and not decision
    assert decision.hit is None and decision.verify_token is None
    assert decision.max_error_rate == 0.05


def test_decide_checks_its_input_as_lookup_does(make_manager: Any) -> None:
    m = make_manager()
    with pytest.raises(InvalidEntryError):
        m.decide("", tenant="t", embedding=unit(20))
    with pytest.raises(ValueError, match="tenant"):
        m.decide("q", tenant="bad:tenant", embedding=unit(20))
    with pytest.raises(ValueError, match="max_error_rate"):
        m.decide("q", tenant="t", embedding=unit(20), max_error_rate=1.5)
