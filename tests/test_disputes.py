"""Disputes (design.md, "Disputes"): a verification whose fresh answer disagrees with the
question's own entry keeps that entry and records the fresh answer on it. The entry is
held out until the dispute is settled, and the user's reaction to the disputed answer
is kept: it settles the dispute."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import msgpack
import pytest
import redis
from conftest import near, unit
from prometheus_client import CollectorRegistry
from service_support import UpstreamState, ask, openai_client, running_service
from state_support import tenant_state

from zerda_cache import CacheConfig
from zerda_cache.core.entry import LLMUsage
from zerda_cache.core.errors import StorageError
from zerda_cache.core.results import DisputeSignal
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.storage import RedisStorage, codec
from zerda_cache.storage.keys import tenant_keys
from zerda_cache.storage.tenant_plans import DisputeSettled, exact_bin

ASKED = "Do I need to verify my identity?"
OTHER = "Do I have to verify my identity?"


def teach_near(redis_client: redis.Redis, tenant: str) -> None:
    """Near matches at 0.96 proven safe, as if earlier verifications had labelled them."""
    st = RedisStorage(redis_client)
    for _ in range(400):
        tenant_state(st).label(tenant, 0.96, True)


def disputed(m: Any, v: Any) -> Any:
    """An entry of ``ASKED`` and the put whose fresh answer disputes it."""
    first = m.put(ASKED, "Yes, once.", tenant="t", embedding=v)
    assert m.lookup(ASKED, tenant="t", embedding=v) is None  # unconfirmed: verified
    slip = m.put(ASKED, "No, never.", tenant="t", embedding=v)
    assert not slip.stored and slip.compared_id == first.entry_id
    return first, slip


@pytest.mark.parametrize("speculate", [True, False])
def test_a_disputed_entry_is_not_served_to_another_question(
    make_manager: Any, redis_client: redis.Redis, speculate: bool
) -> None:
    """Held out of near matches too, in the lookup's first round trip (the hit script
    on its leading candidate) and in a ranked one (as on Redis Cluster)."""
    teach_near(redis_client, "t")
    m = make_manager(CacheConfig(max_error_rate=0.05, verify_rate=0.0))
    m.lookup_steps.speculate = speculate
    v = unit(80)
    first, _ = disputed(m, v)
    close = near(v, 0.97, 81)
    assert m.decide(OTHER, tenant="t", embedding=close).hit is None
    assert m.lookup(OTHER, tenant="t", embedding=close) is None
    # Settled (the next answer agrees with the cached one): a near match again.
    assert m.decide(ASKED, tenant="t", embedding=v).reason == "disputed"
    assert m.put(ASKED, "Yes, once.", tenant="t", embedding=v).entry_id == first.entry_id
    hit = m.lookup(OTHER, tenant="t", embedding=close)
    assert hit is not None and hit.entry_id == first.entry_id and not hit.exact


def test_without_a_bound_a_disputed_entry_serves_its_own_question(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """The docs hold a disputed entry out as the question's own only under a bound
    (nothing else would verify it): a lookup without one serves it, exactly, and still
    no other question."""
    m = make_manager(CacheConfig(max_error_rate=0.05, verify_rate=0.0))
    v = unit(82)
    first, _ = disputed(m, v)
    assert redis_client.hexists(tenant_keys("t").entry(first.entry_id), "dsp")
    plain = make_manager(CacheConfig(similarity_threshold=0.9))  # a replica without one
    assert plain.lookup(OTHER, tenant="t", embedding=near(v, 0.97, 83)) is None
    hit = plain.lookup(ASKED, tenant="t", embedding=v)
    assert hit is not None and hit.entry_id == first.entry_id and hit.exact


@pytest.mark.parametrize("bound", [True, False])
@pytest.mark.parametrize("speculate", [True, False])
def test_another_question_with_the_same_embedding_is_not_served_a_disputed_entry(
    make_manager: Any, redis_client: redis.Redis, speculate: bool, bound: bool
) -> None:
    """The hit script took a match at similarity 1 without a digest (a ranked lookup, as
    on Redis Cluster) for the question's own entry, so another question whose embedding
    is the same was served the disputed entry. The lookup now tells the script whether
    the entry is the question's own."""
    teach_near(redis_client, "t")
    exact = CacheConfig(vector_storage="float32")  # matched at 1.0 itself, not 0.99999
    m = make_manager(replace(exact, max_error_rate=0.05, verify_rate=0.0))
    v = unit(84)
    first, _ = disputed(m, v)
    other = make_manager(replace(exact, max_error_rate=0.05) if bound else exact)
    other.lookup_steps.speculate = speculate
    assert other.lookup(OTHER, tenant="t", embedding=v) is None
    if not bound:  # its own question is served it (test above)
        hit = other.lookup(ASKED, tenant="t", embedding=v)
        assert hit is not None and hit.entry_id == first.entry_id and hit.exact


def test_turning_the_disputed_answer_down_settles_for_the_cached_one(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """The disputed put's feedback is accepted: a negative reaction says the fresh
    answer was the one that erred, as a next answer agreeing with the cached one would:
    the dispute goes and the wrong label it was counted as turns right."""
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    v = unit(84)
    first, slip = disputed(m, v)
    assert slip.disputed and slip.compared_id == first.entry_id
    m.feedback(slip.feedback(False))
    assert not redis_client.hexists(tenant_keys("t").entry(first.entry_id), "dsp")
    cal = tenant_state(m.storage).calibration("t")
    assert cal.exact_wrong == 0.0 and cal.exact_right == 1.0
    assert m.decide(ASKED, tenant="t", embedding=v).reason != "disputed"
    got = m.storage.get_entry("t", first.entry_id)
    assert got.response == "Yes, once." and got.bandit_arm.beta == 2.0  # only the verify's
    # Settled once: a second reaction changes nothing.
    m.feedback(slip.feedback(True))
    assert m.storage.get_entry("t", first.entry_id).response == "Yes, once."


def test_approving_the_disputed_answer_stores_it_in_place_of_the_cached_one(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """A positive reaction: the cached answer stands wrong, and the fresh one is stored
    as the question's entry, with its put's own settings and the reaction as its first
    positive signal; the replaced entry is gone."""
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    v = unit(85)
    first = m.put(ASKED, "Yes, once.", tenant="t", embedding=v)
    assert m.lookup(ASKED, tenant="t", embedding=v) is None
    usage = {"model": "m1", "prompt_tokens": 7, "completion_tokens": 3}
    slip = m.put(ASKED, "No, never.", tenant="t", embedding=v, metadata={"k": 1}, usage=usage)
    assert slip.disputed
    m.feedback(slip.feedback(True, magnitude=2.0))
    assert not redis_client.exists(tenant_keys("t").entry(first.entry_id))
    cal = tenant_state(m.storage).calibration("t")
    assert (cal.exact_right, cal.exact_wrong) == (0.0, 1.0)  # the cached answer was wrong
    own = redis_client.hget(tenant_keys("t").q, codec.query_digest(ASKED, ""))
    assert own is not None and own.decode() != first.entry_id
    entry = m.storage.get_entry("t", own.decode())
    assert entry.response == "No, never." and entry.metadata == {"k": 1}
    assert entry.usage is not None and entry.usage.prompt_tokens == 7
    assert entry.bandit_arm.alpha == 3.0  # the prior's 1 and the reaction's 2
    assert m.stats("t")["entries"] == 1


def test_feedback_by_the_completion_id_of_a_disputed_answer_settles_the_dispute(
    redis_client: redis.Redis, redis_url: str, upstream: tuple[str, UpstreamState]
) -> None:
    """The proxy's answer that disputes the cached one is not cached, but its completion
    id is mapped to the dispute: feedback by it is accepted and settles it."""
    config = CacheConfig(max_error_rate=0.02, verify_rate=0.0)
    url, state = upstream
    with running_service(redis_client, redis_url, upstream_url=url, config=config) as svc:
        c = openai_client(svc)
        _, h = ask(c, ASKED)
        first = h["x-zerda-entry-id"]
        state.reply = "No, never."  # the LLM answers otherwise when verified
        reply, h = ask(c, ASKED)
        assert reply.choices[0].message.content == "No, never."
        assert h["x-zerda-cache"] == "verify" and h["x-zerda-verified"] == "false"
        assert "x-zerda-entry-id" not in h  # not cached: it disputes the cached answer
        body = {"completion_id": h["x-zerda-completion-id"], "positive": True}
        resp = httpx.post(svc.url + "/v1/feedback", json=body, headers=svc.headers("acme"))
        assert resp.status_code == 200, resp.text
        assert not redis_client.exists(tenant_keys("acme").entry(first))
        state.reply = None
        again, h = ask(c, ASKED)  # approved: stored, confirmed by the reaction
        assert again.choices[0].message.content == "No, never."


def test_the_json_api_takes_a_reaction_to_a_disputed_answer(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """``/v1/put`` says an answer is ``disputed``, and the dispute's ``dispute_id``;
    feedback with it on the entry it disputes settles the dispute (a negative one here:
    the cached answer stays, its label turns right) and leaves the cached arm alone;
    without it, a 422 (which dispute?)."""
    config = CacheConfig(max_error_rate=0.02, verify_rate=0.0)
    with running_service(redis_client, redis_url, config=config) as svc:

        def post(path: str, body: dict[str, Any]) -> Any:
            resp = httpx.post(svc.url + path, json=body, headers=svc.headers("acme"))
            assert resp.status_code == 200, resp.text
            return resp.json()

        first = post("/v1/put", {"query": ASKED, "response": "Yes, once."})["entry_id"]
        held = post("/v1/lookup", {"query": ASKED})
        assert held["decision"] == "verify"
        body = {"query": ASKED, "response": "No, never.", "verify_token": held["verify_token"]}
        put = post("/v1/put", body)
        assert put["disputed"] and not put["stored"] and put["compared_id"] == first
        key = tenant_keys("acme").entry(first)
        arm = redis_client.hget(tenant_keys("acme").st, first)
        unnamed = {"entry_id": first, "disputed": True, "positive": False}
        resp = httpx.post(svc.url + "/v1/feedback", json=unnamed, headers=svc.headers("acme"))
        assert resp.status_code == 422 and "dispute_id" in resp.text  # which dispute?
        assert redis_client.hexists(key, "dsp")
        reaction = {**unnamed, "dispute_id": put["dispute_id"]}
        assert post("/v1/feedback", reaction)["entry_id"] == first
        assert not redis_client.hexists(key, "dsp")
        assert redis_client.hget(tenant_keys("acme").st, first) == arm


def test_an_approval_a_full_server_refuses_leaves_the_dispute_for_a_retry(
    make_manager: Any, redis_server_factory: Any
) -> None:
    """The approved answer is stored before the dispute goes (with the cached entry):
    a put a full server refuses (``put`` is not allow-oom) leaves the dispute, and the
    cached answer held out of near matches; the retried reaction then stores it."""
    server = redis_server_factory()
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0), url=server.url)
    v = unit(86)
    first, slip = disputed(m, v)
    key = tenant_keys("t").entry(first.entry_id)
    with server.client() as c:
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", max(1, int(c.info("memory")["used_memory"]) - 64 * 1024))
        try:
            with pytest.raises(StorageError):
                m.feedback(slip.feedback(True))
            assert c.hexists(key, "dsp")  # still disputed: held out of near matches
        finally:
            c.config_set("maxmemory", 0)
        m.feedback(slip.feedback(True))
        own = c.hget(tenant_keys("t").q, codec.query_digest(ASKED, ""))
        assert own is not None and own.decode() != first.entry_id
        assert m.storage.get_entry("t", own.decode()).response == "No, never."
        assert not c.exists(key)


@pytest.mark.parametrize(
    "extra", [{}, {"tags": ["doc"]}, {"usage": LLMUsage("m", 1, 2)}, {"tags": ["a", "b"]}]
)
def test_the_put_of_an_approved_answer_needs_the_dispute_still_there(
    redis_client: redis.Redis, extra: dict[str, Any]
) -> None:
    """``put.lua`` stores an approved answer only while the entry it replaces carries
    the dispute (a verification may have settled it meanwhile): nothing written else."""
    st = RedisStorage(redis_client)
    v = unit(87)
    cached = st.put("t", ASKED, "Yes, once.", v)
    with pytest.raises(DisputeSettled):
        st.put("t", ASKED, "No, never.", v, approves=(cached.entry_id, ""), **extra)
    assert st.stats("t")["entries"] == 1
    assert st.drive(st.run_flow(st.plan_dispute("t", cached.entry_id, 0, "Later.", {}, "n1")))
    with pytest.raises(DisputeSettled):  # another dispute than the one approved
        st.put("t", ASKED, "No, never.", v, approves=(cached.entry_id, "n0"), **extra)
    out = st.put("t", ASKED, "No, never.", v, approves=(cached.entry_id, "n1"), **extra)
    assert out.displaced_id == cached.entry_id
    got = st.get_entry("t", out.entry_id)
    assert got.tags == tuple(extra.get("tags", ())) and got.usage == extra.get("usage")


def test_a_late_reaction_settles_only_the_dispute_it_answers(
    make_manager: Any, redis_client: redis.Redis
) -> None:
    """A reaction names its dispute (``PutResult.dispute_id``): once that one is settled
    and another answer disputes the entry, the late reaction, approving or turning down
    an answer its user saw, leaves the other dispute (whose answer they never saw)."""
    m = make_manager(CacheConfig(max_error_rate=0.02, verify_rate=0.0))
    v = unit(88)
    first, slip = disputed(m, v)
    assert slip.dispute_id and slip.feedback(True).dispute == slip.dispute_id
    st, key = RedisStorage(redis_client), tenant_keys("t").entry(first.entry_id)
    assert st.drive(st.run_flow(st.plan_resolve("t", first.entry_id, 0, True, slip.dispute_id)))
    assert st.drive(st.run_flow(st.plan_dispute("t", first.entry_id, 0, "Maybe.", {}, "b" * 16)))
    other = redis_client.hget(key, "dsp")
    m.feedback(slip.feedback(True))
    assert redis_client.hget(key, "dsp") == other and m.stats("t")["entries"] == 1
    assert m.storage.get_entry("t", first.entry_id).response == "Yes, once."
    m.feedback(slip.feedback(False))
    assert redis_client.hget(key, "dsp") == other
    m.feedback(DisputeSignal(first.entry_id, "t", True, dispute="b" * 16))  # its own
    own = redis_client.hget(tenant_keys("t").q, codec.query_digest(ASKED, ""))
    assert own is not None and m.storage.get_entry("t", own.decode()).response == "Maybe."


def test_a_dispute_below_level_one_resolves_the_unconfirmed_label(
    redis_client: redis.Redis,
) -> None:
    """One rule turns a level into its label's bin (``exact_bin``), as the scripts read
    the levels: below level 1 the bin is ``e`` (a level a token carries is the client's
    to send), so resolving such a dispute turns that bin's wrong label right."""
    assert [exact_bin(n) for n in (-1, 0, 1, 3)] == ["e", "e", "e1", "e3"]
    st = RedisStorage(redis_client)
    cached = st.put("t", ASKED, "Yes, once.", unit(89))
    st.drive(st.run_flow(st.plan_label("t", [1.0], False, "e", logged=False)))
    assert st.drive(st.run_flow(st.plan_dispute("t", cached.entry_id, -1, "No.", {}, "n")))
    assert st.drive(st.run_flow(st.plan_resolve("t", cached.entry_id, -1, True, "n")))
    cal = redis_client.hgetall(tenant_keys("t").cal)
    assert (float(cal[b"r:e"]), float(cal[b"w:e"])) == (1.0, 0.0)


def test_an_approved_answer_is_stored_by_the_puts_own_step(
    make_manager: Any, redis_server_factory: Any
) -> None:
    """The approval stores its answer as every put ends (``PutSteps.store_flow``): a
    storage error counts in ``storage_errors{put}``, the near-duplicate check runs
    (``dedup_threshold``), and the put's usage goes through the dispute as a usage
    mapping, not a list packed by hand."""
    server = redis_server_factory()
    registry = CollectorRegistry()
    config = CacheConfig(max_error_rate=0.02, verify_rate=0.0, dedup_threshold=0.99)
    m = make_manager(config, url=server.url, metrics=ReplicaMetrics(registry))
    v = unit(90)
    first = m.put(ASKED, "Yes, once.", tenant="t", embedding=v)
    assert m.lookup(ASKED, tenant="t", embedding=v) is None
    usage = {"model": "m1", "prompt_tokens": 7, "completion_tokens": 3}
    slip = m.put(ASKED, "No, never.", tenant="t", embedding=v, usage=usage)
    errors = ("zerda_cache_storage_errors_total", {"operation": "put"})
    with server.client() as c:
        raw = c.hget(tenant_keys("t").entry(first.entry_id), "dsp")
        assert raw is not None and msgpack.unpackb(raw)[2]["usage"] == usage
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", max(1, int(c.info("memory")["used_memory"]) - 64 * 1024))
        try:
            with pytest.raises(StorageError):
                m.feedback(slip.feedback(True))
        finally:
            c.config_set("maxmemory", 0)
    assert registry.get_sample_value(*errors) == 1.0
    m.feedback(slip.feedback(True))
    assert m.stats("t")["entries"] == 1
    hit = m.lookup(ASKED, tenant="t", embedding=v)
    assert hit is not None and hit.response == "No, never." and hit.usage == LLMUsage("m1", 7, 3)
