"""The replica's in-memory vector index (no server needed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zerda_cache.companions.context import ContextCache
from zerda_cache.replica.exact import ExactIndex
from zerda_cache.replica.scoped import ScopedIndex
from zerda_cache.storage.codec import normalize_vector


def unit(rng: np.random.Generator, dim: int = 32) -> np.ndarray:
    return normalize_vector(rng.normal(size=dim))


def brute(vectors: dict[str, np.ndarray], q: np.ndarray, k: int, thr: float) -> list[str]:
    sims = sorted(((float(v @ q), eid) for eid, v in vectors.items()), reverse=True)
    return [eid for s, eid in sims[:k] if s >= thr]


def test_exact_index_matches_brute_force_through_adds_and_removes() -> None:
    rng = np.random.default_rng(0)
    idx = ExactIndex(32)
    live: dict[str, np.ndarray] = {}
    for step in range(3000):
        if live and rng.random() < 0.35:
            eid = list(live)[int(rng.integers(len(live)))]
            assert idx.remove(eid)
            del live[eid]
        else:
            eid = f"e{step}"
            live[eid] = unit(rng)
            idx.add(eid, live[eid])
        if step % 250 == 0:
            q = unit(rng)
            got = [eid for eid, _ in idx.search(q, 5, -1.0)]
            assert got == brute(live, q, 5, -1.0)
    assert len(idx) == len(live) and set(idx.ids()) == set(live)
    for eid, v in live.items():
        np.testing.assert_array_equal(idx.vector(eid), v)


def test_search_threshold_k_and_similarity_values() -> None:
    idx = ExactIndex(2)
    idx.add("x", normalize_vector([1.0, 0.0]))
    idx.add("y", normalize_vector([1.0, 1.0]))
    idx.add("z", normalize_vector([0.0, 1.0]))
    res = idx.search(normalize_vector([1.0, 0.1]), 3, 0.5)
    assert [e for e, _ in res] == ["x", "y"]
    assert res[0][1] == pytest.approx(1 / np.sqrt(1.01), rel=1e-6)
    assert idx.search(normalize_vector([1.0, 0.1]), 1, 0.0)[0][0] == "x"
    assert idx.search(normalize_vector([1.0, 0.0]), 0, 0.0) == []
    assert ExactIndex(2).search(normalize_vector([1.0, 0.0]), 3, 0.0) == []


def test_replace_and_remove_unknown() -> None:
    idx = ExactIndex(2)
    idx.add("x", normalize_vector([1.0, 0.0]))
    idx.add("x", normalize_vector([0.0, 1.0]))
    assert len(idx) == 1 and idx.search(normalize_vector([0.0, 1.0]), 1, 0.99)[0][0] == "x"
    assert idx.remove("nope") is False
    with pytest.raises(ValueError):
        idx.add("bad", np.zeros(3, dtype=np.float32))


def test_memory_stays_near_raw_bytes_and_shrinks() -> None:
    rng = np.random.default_rng(1)
    idx = ExactIndex(384)
    for i in range(5000):
        idx.add(f"{i:032x}", unit(rng, 384))
    raw = 5000 * 384 * 4
    assert idx.nbytes() <= 1.2 * raw
    for i in range(4500):
        idx.remove(f"{i:032x}")
    assert idx.nbytes() <= 1.2 * 500 * 384 * 4 + 256 * 384 * 4


def test_scoped_index_keeps_scopes_apart() -> None:
    idx = ScopedIndex(2)
    v = normalize_vector([1.0, 0.0])
    idx.add("a", v, "en")
    idx.add("b", v, "tr")
    assert [e for e, _ in idx.search(v, "en", 5, 0.0)] == ["a"]
    assert [e for e, _ in idx.search(v, "tr", 5, 0.0)] == ["b"]
    assert idx.search(v, "de", 5, 0.0) == []
    idx.add("a", v, "tr")  # moved to another scope
    assert idx.search(v, "en", 5, 0.0) == [] and len(idx) == 2
    assert sorted(e for e, _ in idx.search(v, "tr", 5, 0.0)) == ["a", "b"]
    assert idx.remove("a") and not idx.remove("a") and "b" in idx and idx.ids() == {"b"}
    assert idx.remove("b") and idx.scopes() == []


# --- ContextCache (the corrected LRU+TTL) ------------------------------------------------------
class FakeTimer:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_context_cache_is_lru_not_fifo() -> None:
    timer = FakeTimer()
    c = ContextCache(max_size=2, ttl_seconds=10, timer=timer)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # a is now most recently used
    c.put("c", 3)  # evicts b, not a
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3
    c.put("a", 9)  # re-put moves a to the end
    c.put("d", 4)  # evicts c
    assert c.keys() == ["a", "d"]


def test_context_cache_ttl_and_stats() -> None:
    timer = FakeTimer()
    c = ContextCache(max_size=4, ttl_seconds=10, timer=timer)
    assert c.stats["hit_rate"] == "0%"
    c.put("a", "x")
    timer.t = 10.0
    assert c.get("a") == "x"
    timer.t = 10.5
    assert c.get("a") is None and c.keys() == []  # expired: gone from every structure
    s = c.stats
    assert (s["size"], s["hits"], s["misses"], s["hit_rate"], s["ttl_sec"]) == (
        0,
        1,
        1,
        "50.0%",
        10,
    )
    c.put("b", 1)
    c.clear()
    assert len(c) == 0 and c.stats["hits"] == 1  # clear keeps the counters (seed behaviour)


def test_context_cache_make_key_and_validation() -> None:
    assert ContextCache.make_key("  Hello ") == ContextCache.make_key("hello")
    assert ContextCache.make_key("q", {"b": 1, "a": 2}) == ContextCache.make_key(
        "q", {"a": 2, "b": 1}
    )
    assert ContextCache.make_key("q", {"a": 1}) != ContextCache.make_key("q")
    with pytest.raises(ValueError):
        ContextCache(max_size=0)
    with pytest.raises(ValueError):
        ContextCache(ttl_seconds=0)


# --- HNSW (the ann extra) ------------------------------------------------------------------------
def hex_id(i: int) -> str:
    return f"{i:032x}"


def clustered(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    centers = rng.normal(size=(max(1, n // 20), dim))
    x = centers[rng.integers(0, len(centers), n)] + 0.6 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


BACKENDS = ["usearch", "hnswlib"]


def make_ann(backend: str, dim: int, capacity: int) -> Any:
    from zerda_cache.replica.ann import HnswIndex
    from zerda_cache.replica.usearch_index import UsearchIndex

    cls = UsearchIndex if backend == "usearch" else HnswIndex
    return cls(dim, capacity=capacity)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ann_recall_against_exact_above_threshold(backend: str) -> None:
    rng = np.random.default_rng(3)
    x = clustered(rng, 5000, 64)
    exact, ann = ExactIndex(64), make_ann(backend, 64, 256)
    for i, v in enumerate(x):
        exact.add(hex_id(i), v)
        ann.add(hex_id(i), v)
    found = wanted = 0
    for j in rng.integers(0, len(x), 300):
        q = normalize_vector(x[j] + 0.25 * rng.normal(size=64) / 8)
        want = {e for e, _ in exact.search(q, 8, 0.8)}
        got = ann.search(q, 8, 0.8)
        assert all(s >= 0.8 for _, s in got)
        found += len(want & {e for e, _ in got})
        wanted += len(want)
    assert wanted > 300 and found / wanted >= 0.95


@pytest.mark.parametrize("backend", BACKENDS)
def test_ann_add_remove_readd_replace_and_grow(backend: str) -> None:
    rng = np.random.default_rng(4)
    ann = make_ann(backend, 16, 8)
    vecs = {hex_id(i): unit(rng, 16) for i in range(300)}  # grows past capacity
    for eid, v in vecs.items():
        ann.add(eid, v)
    assert len(ann) == 300 and set(ann.ids()) == set(vecs)
    for i in range(0, 300, 2):
        assert ann.remove(hex_id(i))
        assert hex_id(i) not in ann
    assert not ann.remove(hex_id(0)) and len(ann) == 150
    for i in range(1, 300, 2):  # every live vector is found as its own nearest neighbour
        assert ann.search(vecs[hex_id(i)], 1, 0.99)[0][0] == hex_id(i)
    new = unit(rng, 16)
    ann.add(hex_id(10_000), new)  # reuses a freed slot
    (eid, sim), *_ = ann.search(new, 1, 0.99)
    assert eid == hex_id(10_000) and sim == pytest.approx(1.0, abs=2e-3)
    np.testing.assert_allclose(ann.vector(hex_id(10_000)), new, atol=2e-3)
    ann.add(hex_id(1), new)  # replace a live entry's vector
    assert {e for e, _ in ann.search(new, 2, 0.99)} == {hex_id(1), hex_id(10_000)}
    assert len(ann) == 151
    assert ann.search(new, 500, -1.0)[0][0] in {hex_id(1), hex_id(10_000)}  # k > size
    ids, arr = ann.to_arrays()
    assert len(ids) == 151 and arr.shape == (151, 16)
    with pytest.raises(ValueError, match="hex"):
        ann.add("not-hex", new)


def test_scoped_index_switches_to_hnsw_and_back() -> None:
    from zerda_cache.replica.ann import IndexPolicy
    from zerda_cache.replica.usearch_index import UsearchIndex

    rng = np.random.default_rng(5)
    idx = ScopedIndex(16, IndexPolicy(ann_threshold=100))
    vecs = {hex_id(i): unit(rng, 16) for i in range(150)}
    for eid, v in vecs.items():
        idx.add(eid, v, "s")
    idx.add(hex_id(999), unit(rng, 16), "other")
    assert idx.kind("s") == "hnsw" and idx.kind("other") == "exact" and idx.kind("x") == "none"
    assert isinstance(idx.sub("s"), UsearchIndex)  # the default backend
    assert idx.ids() == set(vecs) | {hex_id(999)}
    some = hex_id(7)
    assert idx.search(vecs[some], "s", 1, 0.99)[0][0] == some
    for i in range(130):
        idx.remove(hex_id(i))
    assert idx.kind("s") == "exact" and len(idx) == 21
    assert idx.search(vecs[hex_id(140)], "s", 1, 0.99)[0][0] == hex_id(140)


def test_ann_threshold_none_keeps_exact() -> None:
    from zerda_cache.replica.ann import IndexPolicy

    rng = np.random.default_rng(6)
    idx = ScopedIndex(8, IndexPolicy(ann_threshold=None))
    for i in range(50):
        idx.add(hex_id(i), unit(rng, 8), "")
    assert idx.kind("") == "exact"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bulk_add_matches_one_at_a_time_and_switches_once(backend: str) -> None:
    """``ScopedIndex.add_many`` (a replica's index build): the same contents as adding one
    at a time; a scope that reaches the threshold becomes HNSW before the rest goes in;
    ids already there are replaced, even from another scope; other dimensions skipped."""
    from zerda_cache.replica.ann import IndexPolicy

    rng = np.random.default_rng(8)
    policy = IndexPolicy(ann_threshold=100, backend=backend)
    bulk, single = ScopedIndex(16, policy), ScopedIndex(16, policy)
    vecs = {hex_id(i): (unit(rng, 16), "s" if i % 5 else "t") for i in range(400)}
    items = list(vecs.items())
    for start in range(0, 400, 150):  # three batches: exact, then the switch, then HNSW
        assert bulk.add_many(dict(items[start : start + 150])) == 0
    for eid, (v, scope) in items:
        single.add(eid, v, scope)
    assert bulk.kind("s") == single.kind("s") == "hnsw" and bulk.kind("t") == "exact"
    assert bulk.ids() == single.ids() == set(vecs) and len(bulk) == 400
    for eid, (v, scope) in items:  # each finds itself (small graphs insert on one thread)
        assert bulk.search(v, scope, 1, 0.99)[0][0] == eid
    moved, fresh = hex_id(3), unit(rng, 16)  # was in "s"; now in "t", with a new vector
    skipped = bulk.add_many({moved: (fresh, "t"), hex_id(9999): (unit(rng, 8), "s")})
    assert skipped == 1 and hex_id(9999) not in bulk and len(bulk) == 400
    assert bulk.search(fresh, "t", 1, 0.99)[0][0] == moved
    assert all(e != moved for e, _ in bulk.search(vecs[moved][0], "s", 5, 0.5))


def test_exact_bulk_add_replaces_and_grows() -> None:
    rng = np.random.default_rng(9)
    idx = ExactIndex(8)
    first = {hex_id(i): unit(rng, 8) for i in range(300)}
    idx.add_many(list(first), np.stack(list(first.values())))
    again = {hex_id(i): unit(rng, 8) for i in range(250, 700)}  # 50 replaced, 400 new
    idx.add_many(list(again), np.stack(list(again.values())))
    assert len(idx) == 700
    both = first | again
    for eid in (hex_id(0), hex_id(260), hex_id(699)):
        np.testing.assert_allclose(idx.vector(eid), both[eid], rtol=1e-6)
        assert idx.search(both[eid], 1, 0.999)[0][0] == eid


@pytest.mark.parametrize("backend", BACKENDS)
def test_hnsw_searches_wider_as_it_grows(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``WIDE_FROM`` entries the search width doubles each time the size does (a
    graph of a million entries needs a wider search for the same recall)."""
    import zerda_cache.replica.ann as index_module

    monkeypatch.setattr(index_module, "WIDE_FROM", 100)
    rng = np.random.default_rng(9)
    ann = make_ann(backend, 16, 512)
    widths = []
    for size in (100, 150, 300, 500):
        while len(ann) < size:
            ann.add(hex_id(len(ann)), unit(rng, 16))
        widths.append(ann.search_width())
        q = unit(rng, 16)
        assert ann.search(q, 3, -1.0)  # still finds
    assert widths == [16, 32, 64, 128]  # from the default ef_search, 16
    if backend == "usearch":  # the library's own width follows
        assert ann._graph.expansion_search == 128


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_built_hnsw_index_calibrates_its_search_width(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``calibrate`` keeps the narrowest width (from ``ef_search`` up) at which probes
    find their sources, uses it until the index doubles, then doubles it with the size."""
    import zerda_cache.replica.ann as index_module

    monkeypatch.setattr(index_module, "CALIBRATE_FROM", 500)
    monkeypatch.setattr(index_module, "CALIBRATION_PROBES", 200)
    rng = np.random.default_rng(4)
    x = clustered(rng, 2000, 32)
    ann = make_ann(backend, 32, 4096)
    ann.ef_search = 16
    ann.add_many([hex_id(i) for i in range(400)], x[:400])
    assert ann.calibrate(5) is None and ann.calibrated is None  # too small: the schedule's
    ann.add_many([hex_id(i) for i in range(400, 1000)], x[400:1000])
    width = ann.calibrate(5)
    assert width == 16  # 1,000 clustered vectors: the narrowest width tried finds them
    assert ann.calibrated == (1000, 16) and ann.search_width() == 16
    q = normalize_vector(x[7] + 0.05 * rng.normal(size=32))
    assert ann.search(q, 3, -1.0)[0][0] == hex_id(7)
    ann.add_many([hex_id(i) for i in range(1000, 2000)], x[1000:2000])
    assert ann.search_width() == 16  # 2,000: not yet twice 1,000
    ann.add(hex_id(2000), unit(rng, 32))
    assert ann.search_width() == 32  # past twice as large: doubled with the size
    ann.ef_search = 64  # the configured width is a floor
    assert ann.calibrate(5) == 64 and ann.search_width() == 64


def test_calibration_widens_past_a_width_that_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A width whose searches miss more than ``CALIBRATION_MISSES`` of the probes is not
    kept: the next (twice as wide) is tried, up to 32x ``ef_search``; below the first that
    passes, the width between it and the last that failed (over sqrt(2)) is tried, and
    kept if it passes too."""
    import zerda_cache.replica.ann as index_module
    from zerda_cache.replica.usearch_index import UsearchIndex

    monkeypatch.setattr(index_module, "CALIBRATE_FROM", 500)
    monkeypatch.setattr(index_module, "CALIBRATION_PROBES", 100)
    rng = np.random.default_rng(5)
    x = clustered(rng, 1000, 32)
    ann = UsearchIndex(32, capacity=1024, ef_search=16)
    ann.add_many([hex_id(i) for i in range(1000)], x)
    real = ann._graph_search
    tried = []

    def blind_below(width: int) -> Any:
        def search(query: np.ndarray, k: int) -> np.ndarray:
            tried.append(ann.search_width())
            if ann.search_width() < width:  # a graph too sparse for this width: noise
                return np.asarray(rng.choice(1000, size=k, replace=False), dtype=np.int64)
            return real(query, k)

        return search

    monkeypatch.setattr(ann, "_graph_search", blind_below(64))
    assert ann.calibrate(5) == 64
    assert list(dict.fromkeys(tried)) == [16, 32, 64, 45]  # 45 = 64 / sqrt(2): it misses
    assert tried.count(16) == index_module.CALIBRATION_MISSES + 1  # a failing width stops early
    assert tried.count(64) == 100  # a passing width searches every probe
    tried.clear()
    monkeypatch.setattr(ann, "_graph_search", blind_below(40))
    assert ann.calibrate(5) == 45  # between 32 (misses) and 64: enough
    assert list(dict.fromkeys(tried)) == [16, 32, 64, 45] and ann.search_width() == 45
    tried.clear()
    monkeypatch.setattr(ann, "_graph_search", blind_below(0))
    assert ann.calibrate(5) == 16 and tried == [16] * 100  # the first passes: nothing below
    monkeypatch.setattr(ann, "_graph_search", blind_below(10**6))
    assert ann.calibrate(5) == 512  # none finds them: the widest tried, 32x
    assert ann.calibrated == (1000, 512)

    def broken(query: np.ndarray, k: int) -> np.ndarray:
        raise RuntimeError("the graph failed")

    monkeypatch.setattr(ann, "_graph_search", broken)
    with pytest.raises(RuntimeError):
        ann.calibrate(5)
    assert ann.calibrated == (1000, 512)  # a failed calibration leaves the last one


@pytest.mark.parametrize(("dim", "dtype"), [(16, "i8"), (255, "i8"), (256, "b1"), (384, "b1")])
def test_auto_gives_long_vectors_a_binary_graph_and_short_ones_an_int8_graph(
    dim: int, dtype: str
) -> None:
    """The default ``ann_dtype`` (``auto``): one bit a dimension is measured to search
    faster at the same recall on 384-d vectors; short vectors keep int8."""
    from zerda_cache import CacheConfig
    from zerda_cache.replica.ann import AUTO_B1_FROM_DIM, IndexPolicy
    from zerda_cache.replica.scoped import ScopedIndex
    from zerda_cache.replica.usearch_index import UsearchIndex

    assert CacheConfig().ann_dtype == "auto" and AUTO_B1_FROM_DIM == 256
    ix = ScopedIndex(dim, IndexPolicy(ann_threshold=300, dtype="auto"))
    x = np.random.default_rng(dim).normal(size=(400, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ids = [f"{i:032x}" for i in range(len(x))]
    ix.add_many({ids[i]: (x[i], "") for i in range(len(x))})
    sub = ix.sub("")
    assert isinstance(sub, UsearchIndex) and sub.dtype == dtype
    assert ix.search(x[5], "", 1, 0.99)[0][0] == ids[5]
    blob = ix.dump()
    assert blob is not None
    back = ScopedIndex.restore(blob, IndexPolicy(ann_threshold=300, dtype="auto"))
    again = back.sub("")
    assert isinstance(again, UsearchIndex) and again.dtype == dtype
    with pytest.raises(ValueError):
        IndexPolicy(dtype="b2")


@pytest.mark.parametrize("dtype", ["i8", "b1", "f16"])
def test_usearch_fast_search_paths_agree_with_the_public_ones(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search calls usearch's compiled search directly and re-scores float16 rows with
    numkong; without either (another usearch), the public ``Index.search`` and numpy's
    float64 product give the same candidates in the same order, and similarities within
    the float16 query's rounding. Both ways also from a snapshot's graph served in place,
    with removals and additions since (two graphs searched and merged)."""
    import zerda_cache.replica.kernels as index_module
    from zerda_cache.replica.ann import IndexPolicy
    from zerda_cache.replica.usearch_index import UsearchIndex

    pytest.importorskip("numkong")
    rng = np.random.default_rng(11)
    x = clustered(rng, 1200, 64)
    ids = [hex_id(i) for i in range(len(x))]
    policy = IndexPolicy(ann_threshold=300, dtype=dtype)
    built = ScopedIndex(64, policy)
    built.add_many({ids[i]: (x[i], "") for i in range(1000)})
    blob = built.dump()
    assert blob is not None
    served = ScopedIndex.restore(memoryview(blob), policy)
    for i in range(0, 1000, 3):
        served.remove(ids[i])
    served.add_many({ids[i]: (x[i], "") for i in range(1000, 1200)})
    assert isinstance(served.sub(""), UsearchIndex) and served.sub("").viewed
    probes = [normalize_vector(x[i] + 0.08 * rng.normal(size=64)) for i in range(0, 1200, 7)]

    def run() -> list[list[tuple[str, float]]]:
        return [ix.search(q, "", 5, 0.3) for ix in (built, served) for q in probes]

    fast = run()
    # both fast ways were taken (a usearch or numkong that refused would fall back)
    assert index_module.COMPILED_SEARCH is True
    if dtype != "f16":
        assert index_module.NUMKONG_FIT is True
    monkeypatch.setattr(index_module, "COMPILED_SEARCH", False)
    monkeypatch.setattr(index_module, "NUMKONG_FIT", False)
    slow = run()
    assert [[e for e, _ in r] for r in fast] == [[e for e, _ in r] for r in slow]
    assert sum(len(r) for r in fast) > 3 * len(fast)
    pairs = zip(fast, slow, strict=True)
    diffs = [abs(a - b) for rf, rs in pairs for (_, a), (_, b) in zip(rf, rs, strict=True)]
    if dtype == "f16":  # no rows: numpy re-scores from the graph's vectors either way
        assert max(diffs) == 0.0
    else:
        assert 0.0 < max(diffs) < 2e-4


def test_a_compiled_search_that_refuses_its_call_falls_back_once_a_bad_query_does_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A usearch whose compiled search takes other arguments: the public ``Index.search``
    answers (the same), with a warning, from then on. A bad query raises as before and
    keeps the compiled call for the next searches."""
    import zerda_cache.replica.kernels as index_module
    from zerda_cache.replica.usearch_index import UsearchIndex

    monkeypatch.setattr(index_module, "COMPILED_SEARCH", True)
    ann = UsearchIndex(32, capacity=1024, dtype="f16")
    x = clustered(np.random.default_rng(3), 600, 32)
    ann.add_many([hex_id(i) for i in range(600)], x)
    graph, q = ann._graph, x[5]
    with pytest.raises((AttributeError, AssertionError)):
        index_module.search_one(graph, list(q), 4)  # not an array: usearch refuses too
    assert index_module.COMPILED_SEARCH is True
    keys, dists = index_module.search_one(graph, q, 4)

    class OtherUsearch:
        """A graph whose compiled search has another signature."""

        _compiled = object()

        def search(self, query: np.ndarray, k: int, threads: int) -> Any:
            return graph.search(query, k, threads=threads)

    with caplog.at_level("WARNING", logger="zerda_cache.replica.kernels"):
        keys2, dists2 = index_module.search_one(OtherUsearch(), q, 4)
    assert index_module.COMPILED_SEARCH is False
    assert "Index.search from now on" in caplog.text
    np.testing.assert_array_equal(keys, keys2)
    np.testing.assert_array_equal(dists, dists2)
    assert int(keys[0]) == 5


def test_numkong_is_used_for_rescoring_only_where_its_sums_are_exact_enough(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """numkong picks its kernel by CPU: one that sums in float16 (or differs between a
    row alone and in a batch) is not used, and numpy's product re-scores instead."""
    import zerda_cache.replica.kernels as index_module

    pytest.importorskip("numkong")

    class HalfSums:
        """A float16 dot product summed in float16."""

        @staticmethod
        def dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            out = np.zeros(len(a), dtype=np.float16)
            for j in range(a.shape[1]):
                out += a[:, j] * b[j]
            return out

    monkeypatch.setattr(index_module, "NUMKONG_FIT", None)
    assert index_module.numkong_fit() is True  # this machine's numkong
    monkeypatch.setattr(index_module, "NUMKONG_FIT", None)
    monkeypatch.setattr(index_module, "NUMKONG", HalfSums)
    assert index_module.numkong_fit() is False
    x = clustered(np.random.default_rng(5), 800, 32)
    from zerda_cache.replica.usearch_index import UsearchIndex

    ann = UsearchIndex(32, capacity=1024, dtype="i8")
    ann.add_many([hex_id(i) for i in range(800)], x)
    best = ann.search(x[9], 1, 0.5)[0]
    assert best[0] == hex_id(9)
    rows = ann._rows_at(np.array([9])).astype(np.float64)
    assert best[1] == float(rows[0] @ x[9].astype(np.float64))  # numpy's float64 product
