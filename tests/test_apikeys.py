"""Per-tenant API keys: made, listed and revoked with the CLI; only digests in Redis."""

from __future__ import annotations

import re
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from redis.cluster import RedisCluster

from zerda_cache.apikeys import ApiKey, key_id, looks_like_token, new_record, token_digest
from zerda_cache.cli import cli
from zerda_cache.core.errors import InvalidTenantError
from zerda_cache.storage import RedisStorage

TOKEN = re.compile(r"^zk_[A-Za-z0-9_-]{43}$", re.M)


def run(url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--redis-url", url, *args])
    return result.exit_code, result.output


def create(url: str, tenant: str, name: str = "") -> str:
    code, out = run(url, "keys", "create", "--tenant", tenant, "--name", name)
    assert code == 0, out
    tokens = TOKEN.findall(out)
    assert len(tokens) == 1, out
    return tokens[0]


def test_create_list_revoke(redis_client: redis.Redis, redis_url: str) -> None:
    a1 = create(redis_url, "acme", "web")
    a2 = create(redis_url, "acme", "batch")
    b1 = create(redis_url, "globex")
    assert len({a1, a2, b1}) == 3 and all(looks_like_token(t) for t in (a1, a2, b1))

    stored = redis_client.hgetall("zc:apikeys")
    assert set(stored) == {token_digest(t).encode() for t in (a1, a2, b1)}
    dump = b"".join(k + v for k, v in stored.items())
    for token in (a1, a2, b1):  # the token itself is nowhere in Redis
        assert token.encode() not in dump and token[3:].encode() not in dump
    st = RedisStorage(redis_client)
    rec = st.api_key(token_digest(a1))
    assert rec is not None and rec.tenant == "acme" and rec.name == "web" and rec.active

    code, out = run(redis_url, "keys", "list")
    assert code == 0 and not TOKEN.search(out)
    for token in (a1, a2, b1):
        assert key_id(token_digest(token)) in out
    code, out = run(redis_url, "keys", "list", "--tenant", "globex")
    assert key_id(token_digest(b1)) in out and key_id(token_digest(a1)) not in out

    # by id, then the same again (nothing left to revoke: exit 1)
    code, out = run(redis_url, "keys", "revoke", key_id(token_digest(a1)))
    assert code == 0 and f"revoked {key_id(token_digest(a1))}" in out
    code, _ = run(redis_url, "keys", "revoke", key_id(token_digest(a1)))
    assert code == 1
    rec = st.api_key(token_digest(a1))
    assert rec is not None and not rec.active and rec.tenant == "acme" and rec.name == "web"
    other = st.api_key(token_digest(a2))
    assert other is not None and other.active  # the tenant's other key is untouched
    # by the token itself
    code, out = run(redis_url, "keys", "revoke", b1)
    assert code == 0 and key_id(token_digest(b1)) in out
    # every key of a tenant
    a3 = create(redis_url, "acme")
    code, out = run(redis_url, "keys", "revoke", "--tenant", "acme")
    assert code == 0 and set(re.findall(r"revoked (\w+)", out)) == {
        key_id(token_digest(a2)),
        key_id(token_digest(a3)),
    }
    assert all(not k.active for k in st.api_keys())
    code, out = run(redis_url, "keys", "list")
    assert out.count("revoked") == 4


def test_bad_usage_writes_nothing(redis_client: redis.Redis, redis_url: str) -> None:
    for args in (
        ("keys", "create", "--tenant", "bad tenant"),
        ("keys", "create", "--tenant", "{acme}"),
        ("keys", "create", "--tenant", "acme", "--name", "x" * 65),
        ("keys", "revoke"),
        ("keys", "revoke", "nothex"),
        ("keys", "revoke", "abcdefabcdef", "--tenant", "acme"),
    ):
        code, out = run(redis_url, *args)
        assert code == 2, (args, out)
    assert redis_client.exists("zc:apikeys") == 0
    # no URL: a key in a throwaway server would be lost, so the command refuses
    result = CliRunner().invoke(
        cli, ["keys", "create", "--tenant", "acme"], env={"ZERDA_REDIS_URL": None}
    )
    assert result.exit_code == 2 and "redis-url" in result.output


def test_records_round_trip_and_validate() -> None:
    token, digest, rec = new_record("acme", "web", 1_700_000_000.5)
    assert looks_like_token(token) and digest == token_digest(token) and rec.id == digest[:12]
    assert ApiKey.decode(rec.encode()) == rec
    assert not looks_like_token(token + "x") and not looks_like_token("sk-" + token[3:])
    with pytest.raises(InvalidTenantError):
        new_record("a:b", "", 0.0)


def test_keys_on_redis_cluster(cluster_client: RedisCluster) -> None:
    """One global hash, one slot: the scripts run on a cluster as on one server."""
    st = RedisStorage(cluster_client)
    _token, digest, rec = new_record("acme", "", st.now())
    assert st.add_api_key(digest, rec)
    assert not st.add_api_key(digest, rec)  # a digest is never overwritten
    assert st.api_key(digest) == rec
    assert st.revoke_api_keys(tenant="acme") == [rec.id]
    got = st.api_key(digest)
    assert got is not None and got.revoked is not None and got.revoked >= rec.created


def round_trips(flow: Any) -> tuple[int, Any]:
    """Drive a storage flow, counting its steps: each is one client call, one round
    trip (a pipeline is one step). Returns ``(steps, result)``."""
    steps, value, resume = 0, None, flow.send
    while True:
        try:
            step = resume(value)
        except StopIteration as stop:
            return steps, stop.value
        steps += 1
        try:
            value, resume = step(), flow.send
        except Exception as exc:
            value, resume = exc, flow.throw


def test_a_key_is_checked_in_one_round_trip(redis_client: redis.Redis) -> None:
    """The service's check of a request's key (``find_api_key``) reads the record and,
    for an unknown key, whether the store holds any (the ``no_api_keys`` refusal), in
    one round trip: an unknown key costs no second one."""
    st = RedisStorage(redis_client)
    _token, digest, rec = new_record("acme", "", st.now())
    assert round_trips(st.find_api_key_flow(digest)) == (1, (None, False))
    assert st.add_api_key(digest, rec)
    assert round_trips(st.find_api_key_flow("0" * 64)) == (1, (None, True))
    steps, (found, held) = round_trips(st.find_api_key_flow(digest))
    assert steps == 1 and held and found is not None and found.tenant == "acme"
