"""Configuration validation, key building and the codecs (no server needed)."""

from __future__ import annotations

import math
import re

import msgpack
import numpy as np
import pytest

from zerda_cache import (
    CacheConfig,
    CorruptEntryError,
    EvictionConfig,
    InvalidEmbeddingError,
    InvalidEntryError,
    InvalidTenantError,
    RLConfig,
)
from zerda_cache.core.validation import new_entry_id, validate_tenant
from zerda_cache.storage import codec
from zerda_cache.storage.keys import tenant_keys


# --- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (RLConfig, "prior_alpha", 0.0),
        (RLConfig, "prior_beta", -1.0),
        (RLConfig, "usage_decay", 0.0),
        (RLConfig, "usage_decay", 1.5),
        (RLConfig, "min_reward_to_keep", 1.2),
        (RLConfig, "decay_interval_s", math.nan),
        (RLConfig, "similarity_bonus_scale", -0.1),
        (RLConfig, "positive_feedback_reward", math.inf),
        (RLConfig, "seed", "x"),
        (EvictionConfig, "reward_weight", -0.5),
        (EvictionConfig, "max_entries", 0),
        (EvictionConfig, "max_bytes", 0),
        (EvictionConfig, "low_watermark", 1.0),
        (EvictionConfig, "scan_batch", 2.5),
        (EvictionConfig, "snapshot_ef_construction", 0),
        (EvictionConfig, "snapshot_ef_construction", "256"),
        (CacheConfig, "similarity_threshold", 1.01),
        (CacheConfig, "top_k", 0),
        (CacheConfig, "default_ttl_s", -5),
        (CacheConfig, "key_prefix", "a:b"),
        (CacheConfig, "max_response_bytes", True),
    ],
)
def test_bad_config_value_names_the_field(cls: type, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**{field: value})


def test_default_config_is_valid_and_nested() -> None:
    cfg = CacheConfig()
    assert cfg.rl == RLConfig() and cfg.eviction == EvictionConfig()
    assert cfg.to_dict()["rl"]["usage_decay"] == 0.995
    with pytest.raises(ValueError, match="rl"):
        CacheConfig(rl=EvictionConfig())  # type: ignore[arg-type]


# --- keys ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tenant", ["", "a{b", "b}", "a:b", "a b", "a\nb", "x" * 65, "ü", None, 5, "a\tb"]
)
def test_invalid_tenants(tenant: object) -> None:
    with pytest.raises(InvalidTenantError):
        validate_tenant(tenant)


@pytest.mark.parametrize("tenant", ["a", "acme-prod_1.eu", "x" * 64, "A.B-C_d"])
def test_valid_tenants(tenant: str) -> None:
    assert validate_tenant(tenant) == tenant


def test_every_tenant_key_carries_the_hash_tag() -> None:
    k = tenant_keys("acme", "zc")
    eid = new_entry_id()
    for key in (k.ids, k.q, k.log, k.stats, k.fb, k.cfg, k.entry(eid)):
        assert key.startswith("zc:{acme}:")
    assert k.entry(eid) == f"zc:{{acme}}:e:{eid}"
    assert re.fullmatch(r"[0-9a-f]{32}", eid)
    assert len({new_entry_id() for _ in range(1000)}) == 1000


# --- vectors ----------------------------------------------------------------------------------
def test_huge_finite_vector_normalises() -> None:
    np.testing.assert_allclose(codec.normalize_vector([1e308, 1e308]), [0.70710677] * 2)


def test_vectors_are_normalised_float32() -> None:
    raw = codec.encode_vector([3.0, 4.0])
    assert len(raw) == 8
    vec = codec.decode_vector(raw)
    assert vec.dtype == np.float32
    np.testing.assert_allclose(vec, [0.6, 0.8], rtol=1e-6)


def test_float16_storage_is_marked_half_the_size_and_close() -> None:
    v = np.random.default_rng(1).normal(size=384)
    raw32, raw16 = codec.encode_vector(v), codec.encode_vector(v, "float16")
    assert (len(raw32), len(raw16)) == (1536, 769) and raw16[:1] == b"h"
    assert codec.vector_dim(raw32) == codec.vector_dim(raw16) == 384
    a, b = codec.decode_vector(raw32), codec.decode_vector(raw16)
    assert b.dtype == np.float32 and abs(float(np.linalg.norm(b)) - 1) < 1e-6
    assert float(a @ b) > 1 - 1e-6  # the same direction
    u = codec.decode_vector(codec.encode_vector(np.random.default_rng(2).normal(size=384)))
    assert abs(float(a @ u) - float(b @ u)) < 1e-3  # cosines move by less than 1e-3
    with pytest.raises(ValueError, match="vector_storage"):
        CacheConfig(vector_storage="int8")


@pytest.mark.parametrize(
    "bad",
    [[], [[1.0, 2.0]], [1.0, math.nan], [math.inf, 1.0], [0.0, 0.0], "abc", None],
)
def test_bad_embeddings(bad: object) -> None:
    with pytest.raises(InvalidEmbeddingError):
        codec.normalize_vector(bad)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"abc",
        b"h",
        b"x" + np.ones(2, np.float16).tobytes(),
        b"h" + np.array([np.inf, 1.0], np.float16).tobytes(),
        np.array([np.nan], np.float32).tobytes(),
        None,
    ],
)
def test_corrupt_vectors(raw: object) -> None:
    with pytest.raises(CorruptEntryError):
        codec.decode_vector(raw)  # type: ignore[arg-type]


# --- docs and states --------------------------------------------------------------------------
def test_doc_round_trip() -> None:
    meta = {"model": "gpt", "n": [1, 2.5, None, True], "nested": {"k": b"\x00"}}
    q, r, m = codec.unpack_doc(codec.pack_doc("Q?", "A.", meta))
    assert (q, r, m) == ("Q?", "A.", meta)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({1: "x"}, "not a str"),
        ({"a": {2: "x"}}, "not a str"),
        ({"a": object()}, "unserialisable"),
        ({"a": {1, 2}}, "unserialisable"),
        ({"a": 2**70}, "64 bits"),
        (["not", "a", "map"], "mapping"),
    ],
)
def test_bad_metadata(meta: object, match: str) -> None:
    with pytest.raises(InvalidEntryError, match=match):
        codec.pack_doc("q", "r", meta)  # type: ignore[arg-type]


def test_metadata_size_limit() -> None:
    with pytest.raises(InvalidEntryError, match="max_metadata_bytes"):
        codec.pack_doc("q", "r", {"blob": "x" * 100}, max_metadata_bytes=50)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 99, "q": "q", "r": "r", "m": {}}),
        msgpack.packb({"v": 1, "q": 5, "r": "r", "m": {}}),
        None,
    ],
)
def test_corrupt_docs(raw: bytes | None) -> None:
    with pytest.raises(CorruptEntryError, match="doc"):
        codec.unpack_doc(raw, key="k")


def test_corrupt_arm() -> None:
    with pytest.raises(CorruptEntryError, match=r"arm\.b"):
        codec.unpack_arm(msgpack.packb({"a": 1.0, "b": "x", "n": 0, "r": 0, "t": 0}), key="k")
    arm = codec.unpack_arm(msgpack.packb({"a": 2, "b": 1.5, "n": 3, "r": 1, "t": 10}))
    assert (arm.alpha, arm.beta, arm.pulls, arm.decayed_at) == (2.0, 1.5, 3, 10.0)


def test_query_digest_normalises_and_scopes() -> None:
    assert codec.query_digest("  What IS  Redis?") == codec.query_digest("what is redis?")
    assert codec.query_digest("q", "scope-a") != codec.query_digest("q", "scope-b")
    assert codec.query_digest("ﬁle") == codec.query_digest("file")  # NFKC
