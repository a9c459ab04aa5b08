"""Disputes (design.md, "Disputes"): a verification whose fresh answer disagrees with the
question's own entry keeps that entry and records the fresh answer on it. The entry is
held out until the dispute is settled, and the user's reaction to the disputed answer
is kept: it settles the dispute."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from conftest import near, unit
from state_support import tenant_state

from zerda_cache import CacheConfig, FeedbackSignal
from zerda_cache.storage import RedisStorage
from zerda_cache.storage.keys import tenant_keys

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
