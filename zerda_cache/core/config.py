"""Configuration dataclasses and the defaults they use.

Every default is named once here (``DEFAULT_*``) so that the library, the worker and the
CLI cannot drift apart. Only the CLI reads the environment; the library takes these
objects explicitly. Each dataclass validates itself on construction and raises
``ValueError`` naming the offending field.

Defaults the seed documents (``min_reward_to_keep=0.05``, ``usage_decay=0.995``, the
eviction weights 0.50/0.30/0.20, the 10,000-signal feedback log) are kept as documented;
the others are ours and are documented next to their constant.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zerda_cache.core.validation import finite_number, validate_prefix

#: How a usearch graph holds its vectors: ``i8`` (int8, searched ~2x as fast as float16
#: at 100k 384-d vectors on AVX2, and built ~2x as fast: bench_hnsw; the candidates are
#: re-scored from float16 rows kept beside the graph) or ``f16`` (float16 in the graph only: less
#: memory, slower searches) or ``b1`` (one bit a dimension, searched by Hamming distance,
#: the candidates re-scored from float16 rows as for ``i8``). See ``UsearchIndex``.
USEARCH_DTYPES = ("i8", "f16", "b1")
#: What ``ann_dtype`` (and ``index.IndexPolicy.dtype``) accepts: a dtype, or ``auto``
#: (``index.resolve_dtype``).
ANN_DTYPES = (*USEARCH_DTYPES, "auto")

# --- RLConfig (the bandit) -------------------------------------------------------------
#: Beta prior of every new arm: Beta(1, 1) is uniform, "we know nothing yet".
DEFAULT_PRIOR_ALPHA = 1.0
DEFAULT_PRIOR_BETA = 1.0
#: Added to alpha per unit of positive feedback magnitude.
DEFAULT_POSITIVE_FEEDBACK_REWARD = 1.0
#: Added to beta per unit of negative feedback magnitude (a positive number: the seed's
#: "penalty" is the weight of the evidence against the answer).
DEFAULT_NEGATIVE_FEEDBACK_PENALTY = 1.0
#: Weight of the Thompson draw against similarity in the composite ranking score.
DEFAULT_SIMILARITY_BONUS_SCALE = 0.5
#: Candidates rank by similarity first: only those within this much of the best
#: remaining one are "equally likely to be the same question", and among them the
#: composite score (the bandit) decides. 2.0 puts every candidate in one group: the
#: seed's order, where a fresh arm's Thompson draw outweighs a 0.1 similarity gap.
DEFAULT_SIMILARITY_TIE_MARGIN = 0.01
#: Seed default: an arm whose expected reward falls below this is never served and is
#: evicted first.
DEFAULT_MIN_REWARD_TO_KEEP = 0.05
#: Entries whose expected reward is below this are not served (they stay cached until
#: evicted). None: the same as min_reward_to_keep, the seed's single bar.
DEFAULT_MIN_REWARD_TO_SERVE: float | None = None
#: A negative signal at similarity s (below every positive's) lifts the entry's own
#: similarity bar to s + this margin...
DEFAULT_SIMILARITY_BAR_MARGIN = 0.005
#: ...and keeps only this share of its penalty on the arm (the match was wrong, perhaps
#: not the answer).
DEFAULT_NEAR_MISS_PENALTY_SHARE = 0.5
#: A negative signal that follows another negative (no positive between them) first
#: shrinks the arm's positive evidence over the prior by this factor: an answer that was
#: confirmed once and now draws complaint after complaint (it went stale) falls under a
#: serving bar of 0.4 after a few of them, not after as many complaints as it had praise.
DEFAULT_NEGATIVE_STREAK_FORGET = 0.25
#: Seed default: the excess of alpha and beta over the prior shrinks by this factor...
DEFAULT_USAGE_DECAY = 0.995
#: ...per this many seconds (the seed's suggested decay period, 5 minutes). Decay is
#: continuous in time: factor = usage_decay ** (elapsed / decay_interval_s).
DEFAULT_DECAY_INTERVAL_S = 300.0

# --- EvictionConfig ----------------------------------------------------------------------
DEFAULT_REWARD_WEIGHT = 0.50
DEFAULT_USAGE_WEIGHT = 0.30
DEFAULT_RECENCY_WEIGHT = 0.20
DEFAULT_MAX_ENTRIES = 10_000
#: Eviction stops at capacity * (1 - low_watermark), so a full tenant is not evicted again
#: by every single put that follows.
DEFAULT_LOW_WATERMARK = 0.05
DEFAULT_SCAN_BATCH = 500
DEFAULT_EVICTION_INTERVAL_S = 60.0
DEFAULT_DECAY_JOB_INTERVAL_S = 300.0
DEFAULT_METRICS_INTERVAL_S = 15.0
#: The eviction job reads a tenant within its capacity incrementally (its expired ids and
#: its arms with evidence), and whole at least this often: corrupt learning state and the
#: reward and confidence distributions of the metrics come from whole scans.
DEFAULT_FULL_SCAN_INTERVAL_S = 3_600.0
#: The decay job persists the decay of every arm with evidence at least this often: each
#: run takes the next share of the tenant's list (``decay_job_interval_s`` / this), so
#: its cost follows the list over the sweep, not the list at every run. An arm's value is
#: the same whether or not its decay was persisted (every reader decays it to now from
#: its ``decayed_at``); persisting folds the decay in and lets a faded arm leave the list.
DEFAULT_DECAY_SWEEP_S = 3_600.0
#: The worker publishes an index snapshot of every tenant with at least this many entries
#: (a replica builds a smaller index from scratch in a few seconds); 0: no snapshots.
DEFAULT_SNAPSHOT_MIN_ENTRIES = 50_000
#: How often the worker looks whether a tenant's snapshot is due: it is made again once
#: the tenant's log has moved by a tenth of its entries, or by half the log's cap (a
#: snapshot older than the log is useless: a replica would scan anyway).
DEFAULT_SNAPSHOT_INTERVAL_S = 120.0
#: HNSW's construction width for the graphs the worker builds for snapshots (a replica
#: builds its own at ``ann_ef_construction``, 128): a better graph for twice the build
#: time, paid once by the worker instead of by every replica's search. At 1M MiniLM
#: embeddings (docs/BENCHMARKS.md, "hnsw-minilm-1000k-quant") the replica's calibration
#: asks width 32 of such a graph, 64 of one built at 128; searches take 0.63x as long
#: (p99 0.50x), the build 2.2x (bench_hnsw measures both).
DEFAULT_SNAPSHOT_EF_CONSTRUCTION = 256

# --- the worker process ---------------------------------------------------------------------
#: The leader lease's time to live: a standby takes over within it when the leader dies.
DEFAULT_LEASE_TTL_S = 15.0
#: Where the worker serves /metrics (the dashboards and compose file use this port).
DEFAULT_METRICS_PORT = 9108
DEFAULT_METRICS_HOST = "0.0.0.0"
#: Touched by every successful lease tick; ``zerda-cache worker --check`` reads its age.
DEFAULT_HEALTH_FILE = "/tmp/zerda-cache-worker.health"

# --- CacheConfig ---------------------------------------------------------------------------
DEFAULT_KEY_PREFIX = "zc"
#: Cosine similarity, 0..1, higher is stricter: the one threshold scale everywhere.
DEFAULT_SIMILARITY_THRESHOLD = 0.85
DEFAULT_TOP_K = 8
DEFAULT_MAX_QUERY_CHARS = 8_192
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024
DEFAULT_MAX_METADATA_BYTES = 16 * 1024
#: Seed: the learner's rolling feedback log holds the most recent 10,000 signals.
DEFAULT_FEEDBACK_LOG_MAXLEN = 10_000
#: Approximate length of each tenant's add/remove log; replicas that fall further behind
#: than this rebuild their index from Redis.
DEFAULT_INDEX_LOG_MAXLEN = 100_000
#: Socket timeout of the clients ``CacheManager.from_url`` builds: past it a lookup fails
#: open (a miss) and a put or feedback raises ``StorageError``.
DEFAULT_REDIS_TIMEOUT_S = 0.5
#: Process-local memo of query -> embedding (the corrected ContextCache).
DEFAULT_EMBEDDING_CACHE_SIZE = 4_096
DEFAULT_EMBEDDING_CACHE_TTL_S = 3_600.0
#: Metrics label this many tenants by name; the rest are "other".
DEFAULT_MAX_TENANT_LABELS = 50
#: A scope's local index switches from exact search to HNSW at this many entries. Exact
#: search costs N x d multiply-adds per lookup, on one thread (replica/exact.py says why): at a
#: few thousand entries a whole lookup takes about as long exact as with HNSW, and past
#: that exact search falls behind, while HNSW's recall@1 stays near 1. Lower trades an
#: exact answer and a cheap insert for HNSW's search time sooner; bench_lookup times
#: exact search beside the HNSW graphs (``--sizes`` picks the entries).
DEFAULT_ANN_THRESHOLD = 5_000
#: usearch (~1.0x the raw vector bytes at M=32 with int8 graphs) or hnswlib (float32, ~1.4x).
DEFAULT_ANN_BACKEND = "usearch"
#: How a usearch graph holds its vectors: ``auto`` (the default) is one bit a dimension
#: (``b1``) for vectors of 256 dimensions and more, int8 (``i8``) for shorter ones
#: (``index.resolve_dtype``); both re-score the candidates from float16 rows beside the
#: graph. At 1M 384-d MiniLM embeddings, graphs as the worker builds them, a binary graph
#: searches in 0.66x the time of an int8 one (p99 0.37x) at the same width, builds in
#: 0.53x, in 0.79x the bytes, at the same near-copy recall (bench_hnsw;
#: docs/BENCHMARKS.md, "hnsw-minilm-1000k-b1"); whole lookups can take the same time
#: when the worker calibrates the int8 graph narrower (docs/design.md, "What a lookup
#: costs at 1M entries"). ``f16`` keeps float16 vectors in the graph only.
#: ``index.UsearchIndex`` says more.
DEFAULT_ANN_DTYPE = "auto"
#: How a put stores its vector in Redis: ``float16`` (the default: 2 bytes a dimension
#: and a marker byte, ~0.7x the memory of an entry at 384-d; a cosine moved by at most
#: 4e-5 on MiniLM embeddings, measured, ~1e-3 at worst) or ``float32`` (4 bytes, exact).
#: Readers tell them apart by the length, so a tenant may hold both. A release without
#: float16 storage reads a float16 vector as corrupt: a deployment that still runs one
#: sets ``float32`` until every replica and worker is upgraded.
VECTOR_STORAGES = ("float32", "float16")
ANN_BACKENDS = ("usearch", "hnswlib")
#: HNSW's M and construction width: at 1M clustered 384-d vectors, M=16/64 found a
#: near-copy's source 79% of the time and M=32/128 99% (search width 64; 99.8% at 128,
#: which the index takes past 500k entries: ``index.WIDE_FROM``), for 1.2x the index's
#: bytes, 2.2x its build time and 1.5x its search (docs/BENCHMARKS.md, "HNSW
#: parameters"). The search width: 16, where a search found near-copies of 20k and 100k
#: real MiniLM embeddings and of 20k clustered vectors as often as at 32 (0.998-1.000),
#: and of 100k clustered vectors 0.999 against 1.000 (calibration chose 32 there), in
#: 0.71-0.94x the time. It is where calibration starts (``index.CALIBRATE_FROM``: an
#: index of 20k entries or more measures the width it needs) and a floor; uncalibrated,
#: it doubles with the size past ``index.WIDE_FROM``.
DEFAULT_ANN_M = 32
DEFAULT_ANN_EF_CONSTRUCTION = 128
DEFAULT_ANN_EF_SEARCH = 16
#: With an error bound set, this share of lookups that could be served by similarity is
#: verified instead (the app calls its LLM and the cache compares answers), so that the
#: labels keep up with the traffic near and above the serving threshold.
#: The largest prior and the largest step one unit of feedback adds to an arm
#: (``RLConfig``). With ``entry.MAX_FEEDBACK_MAGNITUDE`` (1,000) a signal adds at most 1e9, so
#: no sequence of signals a tenant can send overflows an arm's float64 alpha or beta (at
#: 1e308, one signal of magnitude 1,000 turns an arm infinite: corrupt, never served).
MAX_ARM_STEP = 1e6

DEFAULT_VERIFY_RATE = 0.02
#: Labels a tenant keeps the full weight of; past it, every count is halved (drift).
DEFAULT_LABEL_WINDOW = 20_000
#: How often a replica re-reads a tenant's error bound and labels (in a lookup's pipeline,
#: no round trip of its own).
DEFAULT_POLICY_REFRESH_S = 2.0
#: A replica re-reads a tenant's policy (in its next lookup's pipeline) once a lookup saw
#: the tenant's label stamp this many labels ahead of the policy it holds: decisions
#: follow labels, not the clock, so a stream replayed faster, or over more replicas,
#: is decided the same way.
DEFAULT_POLICY_REFRESH_LABELS = 4


def _check_rate(name: str, value: object) -> None:
    """An error rate: a number in (0, 1), or None."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1
    ):
        raise ValueError(f"{name} must be in (0, 1) or None, got {value!r}")


def _check_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if finite_number(value) is None:
        shown = "an int too large for a float" if isinstance(value, int) else repr(value)
        raise ValueError(f"{name} must be finite, got {shown}")


def _prices(value: object) -> tuple[tuple[str, float, float], ...]:
    """``token_prices`` as a sorted tuple of ``(model, prompt, completion)``, checked."""
    items = value.items() if isinstance(value, Mapping) else value
    if not isinstance(items, Iterable) or isinstance(items, str):
        raise ValueError(f"token_prices must map a model to (prompt, completion), got {value!r}")
    out = []
    for item in items:
        if isinstance(value, Mapping):
            model, pair = item
            item = (model, *pair)
        if not (isinstance(item, tuple | list) and len(item) == 3 and isinstance(item[0], str)):
            raise ValueError(f"token_prices: {item!r} is not a model with two prices")
        model, prompt, completion = item
        _check_finite(f"token_prices[{model!r}]", prompt)
        _check_finite(f"token_prices[{model!r}]", completion)
        if prompt < 0 or completion < 0:
            raise ValueError(f"token_prices[{model!r}] must be >= 0")
        out.append((model, float(prompt), float(completion)))
    return tuple(sorted(out))


def _check_arm_step(name: str, value: float) -> None:
    """A prior or a per-signal step of an arm: > 0 and at most ``MAX_ARM_STEP``."""
    _check_positive(name, value)
    if value > MAX_ARM_STEP:
        raise ValueError(f"{name} must be at most {MAX_ARM_STEP:g}, got {value!r}")


def _check_positive(name: str, value: float) -> None:
    _check_finite(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _check_unit(name: str, value: float, *, closed_low: bool = True) -> None:
    _check_finite(name, value)
    low_ok = value >= 0 if closed_low else value > 0
    if not (low_ok and value <= 1):
        interval = "[0, 1]" if closed_low else "(0, 1]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def _check_count(name: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class RLConfig:
    """Parameters of the Beta-Bernoulli bandit behind every cache entry.

    Attributes:
        prior_alpha: Beta prior alpha of a new arm (> 0, at most ``MAX_ARM_STEP``).
        prior_beta: Beta prior beta of a new arm (> 0, at most ``MAX_ARM_STEP``).
        positive_feedback_reward: alpha added per unit of positive feedback (> 0, at most
            ``MAX_ARM_STEP``).
        negative_feedback_penalty: beta added per unit of negative feedback (> 0, at most
            ``MAX_ARM_STEP``).
        similarity_bonus_scale: weight of the Thompson draw in the composite score (>= 0).
        similarity_tie_margin: candidates within this much cosine similarity of the best
            remaining candidate are ranked among themselves by the composite score; the
            others wait for their turn (0..2; 2 is the seed's order: composite only).
            Below 2, an arm without any signal is not drawn: its prior mean stands in, so
            among fresh answers the closer question wins.
        min_reward_to_keep: arms whose expected reward is below this are never served
            and are evicted first (0..1).
        similarity_bar_margin: how far above a rejected match's similarity an entry's
            own similarity bar rises (0..1).
        near_miss_penalty_share: share of a negative signal's penalty the arm keeps when
            the signal is blamed on the match (0..1; 1 is the seed's behaviour).
        negative_streak_forget: on the second and later negative signal in a row (no
            positive between them), the arm's positive evidence over the prior is first
            multiplied by this (0..1; 1 is the seed's behaviour: never forget). Negatives
            blamed on the match do not count towards the streak.
        min_reward_to_serve: a stricter bar for serving only (0..1, at least
            ``min_reward_to_keep``); ``None`` uses ``min_reward_to_keep``. With sparse
            feedback, the seed's 0.05 takes ~19 net negative signals to stop serving an
            answer; a serving bar of 0.4 stops after the first negative on an answer
            nobody has confirmed, while confirmed answers survive a few false negatives.
        usage_decay: decay factor per ``decay_interval_s`` (0 < x <= 1; 1 disables decay).
        decay_interval_s: the time unit of ``usage_decay`` in seconds (> 0).
        seed: seed of the learner's own random generator; ``None`` draws fresh entropy.
    """

    prior_alpha: float = DEFAULT_PRIOR_ALPHA
    prior_beta: float = DEFAULT_PRIOR_BETA
    positive_feedback_reward: float = DEFAULT_POSITIVE_FEEDBACK_REWARD
    negative_feedback_penalty: float = DEFAULT_NEGATIVE_FEEDBACK_PENALTY
    similarity_bonus_scale: float = DEFAULT_SIMILARITY_BONUS_SCALE
    similarity_tie_margin: float = DEFAULT_SIMILARITY_TIE_MARGIN
    min_reward_to_keep: float = DEFAULT_MIN_REWARD_TO_KEEP
    min_reward_to_serve: float | None = DEFAULT_MIN_REWARD_TO_SERVE
    similarity_bar_margin: float = DEFAULT_SIMILARITY_BAR_MARGIN
    near_miss_penalty_share: float = DEFAULT_NEAR_MISS_PENALTY_SHARE
    negative_streak_forget: float = DEFAULT_NEGATIVE_STREAK_FORGET
    usage_decay: float = DEFAULT_USAGE_DECAY
    decay_interval_s: float = DEFAULT_DECAY_INTERVAL_S
    seed: int | None = None

    @property
    def serve_bar(self) -> float:
        """The expected reward an entry needs to be served."""
        if self.min_reward_to_serve is None:
            return self.min_reward_to_keep
        return self.min_reward_to_serve

    def __post_init__(self) -> None:
        _check_arm_step("prior_alpha", self.prior_alpha)
        _check_arm_step("prior_beta", self.prior_beta)
        _check_arm_step("positive_feedback_reward", self.positive_feedback_reward)
        _check_arm_step("negative_feedback_penalty", self.negative_feedback_penalty)
        _check_finite("similarity_bonus_scale", self.similarity_bonus_scale)
        if self.similarity_bonus_scale < 0:
            raise ValueError(
                f"similarity_bonus_scale must be >= 0, got {self.similarity_bonus_scale!r}"
            )
        _check_finite("similarity_tie_margin", self.similarity_tie_margin)
        if not 0 <= self.similarity_tie_margin <= 2:
            raise ValueError(
                f"similarity_tie_margin must be in [0, 2], got {self.similarity_tie_margin!r}"
            )
        _check_unit("min_reward_to_keep", self.min_reward_to_keep)
        _check_unit("similarity_bar_margin", self.similarity_bar_margin)
        _check_unit("near_miss_penalty_share", self.near_miss_penalty_share)
        _check_unit("negative_streak_forget", self.negative_streak_forget)
        if self.min_reward_to_serve is not None:
            _check_unit("min_reward_to_serve", self.min_reward_to_serve)
            if self.min_reward_to_serve < self.min_reward_to_keep:
                raise ValueError(
                    f"min_reward_to_serve ({self.min_reward_to_serve}) must be >= "
                    f"min_reward_to_keep ({self.min_reward_to_keep})"
                )
        _check_unit("usage_decay", self.usage_decay, closed_low=False)
        _check_positive("decay_interval_s", self.decay_interval_s)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    """What the eviction worker keeps, and how it scores the rest.

    Attributes:
        reward_weight: weight of the arm's expected reward in ``eviction_score``.
        usage_weight: weight of log-scaled usage (saturating at 50 uses).
        recency_weight: weight of recency, ``usage_decay ** (idle / decay_interval_s)``.
        max_entries: per-tenant entry capacity (default; tenants may override in Redis).
        max_bytes: per-tenant byte capacity of stored content, ``None`` for no limit.
        low_watermark: eviction brings a tenant down to capacity * (1 - low_watermark).
        scan_batch: ids per ZSCAN or SSCAN step of the worker's scans, and the least a
            decay job's run takes; their state is read, and they are evicted and
            decayed, in calls of at most ``maintenance.STATE_BATCH`` (500),
            ``EVICT_BATCH`` (50, two at a time) and ``DECAY_BATCH`` (100), so that one
            call holds Redis briefly.
        eviction_interval_s / decay_job_interval_s / metrics_interval_s: how often the
            worker runs each job.
        snapshot_min_entries / snapshot_interval_s: index snapshots for new replicas
            (``DEFAULT_SNAPSHOT_MIN_ENTRIES``; 0 turns them off).
        snapshot_ef_construction: HNSW's construction width for the worker's snapshot
            graphs (``DEFAULT_SNAPSHOT_EF_CONSTRUCTION``); None: ``ann_ef_construction``.
        full_scan_interval_s: the eviction job scans a tenant that is within its
            capacity whole at least this often (in between it reads only the expired
            ids and the arms that got a signal since its last run).
        decay_sweep_s: the decay job persists the decay of every arm with evidence at
            least this often, a share of the list at each run (``DEFAULT_DECAY_SWEEP_S``).
            (``RLConfig.decay_interval_s`` is another thing: the time unit of
            ``usage_decay``. How often decay is persisted never changes how fast arms
            decay.)
    """

    reward_weight: float = DEFAULT_REWARD_WEIGHT
    usage_weight: float = DEFAULT_USAGE_WEIGHT
    recency_weight: float = DEFAULT_RECENCY_WEIGHT
    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int | None = None
    low_watermark: float = DEFAULT_LOW_WATERMARK
    scan_batch: int = DEFAULT_SCAN_BATCH
    eviction_interval_s: float = DEFAULT_EVICTION_INTERVAL_S
    decay_job_interval_s: float = DEFAULT_DECAY_JOB_INTERVAL_S
    metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S
    full_scan_interval_s: float = DEFAULT_FULL_SCAN_INTERVAL_S
    decay_sweep_s: float = DEFAULT_DECAY_SWEEP_S
    snapshot_min_entries: int = DEFAULT_SNAPSHOT_MIN_ENTRIES
    snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S
    snapshot_ef_construction: int | None = DEFAULT_SNAPSHOT_EF_CONSTRUCTION

    def __post_init__(self) -> None:
        for name in ("reward_weight", "usage_weight", "recency_weight"):
            value = getattr(self, name)
            _check_finite(name, value)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if self.reward_weight + self.usage_weight + self.recency_weight <= 0:
            raise ValueError("reward_weight + usage_weight + recency_weight must be > 0")
        _check_count("max_entries", self.max_entries)
        _check_count("max_bytes", self.max_bytes, allow_none=True)
        _check_finite("low_watermark", self.low_watermark)
        if not 0 <= self.low_watermark < 1:
            raise ValueError(f"low_watermark must be in [0, 1), got {self.low_watermark!r}")
        _check_count("scan_batch", self.scan_batch)
        _check_positive("eviction_interval_s", self.eviction_interval_s)
        _check_positive("decay_job_interval_s", self.decay_job_interval_s)
        _check_positive("metrics_interval_s", self.metrics_interval_s)
        if (
            isinstance(self.snapshot_min_entries, bool)
            or not isinstance(self.snapshot_min_entries, int)
            or self.snapshot_min_entries < 0
        ):
            raise ValueError(
                f"snapshot_min_entries must be an integer >= 0, got {self.snapshot_min_entries!r}"
            )
        _check_positive("snapshot_interval_s", self.snapshot_interval_s)
        _check_count("snapshot_ef_construction", self.snapshot_ef_construction, allow_none=True)
        _check_positive("decay_sweep_s", self.decay_sweep_s)
        _check_finite("full_scan_interval_s", self.full_scan_interval_s)
        if self.full_scan_interval_s < 0:
            raise ValueError(
                f"full_scan_interval_s must be >= 0, got {self.full_scan_interval_s!r}"
            )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Everything a replica and the worker need, with the two nested configs.

    Attributes:
        key_prefix: first component of every Redis key (``zc`` gives ``zc:{tenant}:...``).
        similarity_threshold: minimum cosine similarity (0..1, higher is stricter) for a
            cached question to be a candidate.
        top_k: candidates taken from the vector index per lookup.
        default_ttl_s: TTL of entries put without one; ``None`` keeps them until evicted.
        max_query_chars / max_response_bytes / max_metadata_bytes: input size limits.
        feedback_log_maxlen: length of each tenant's feedback stream (an approximate cap:
            Redis trims whole stream nodes, so up to 100 more may remain). The worker's
            eviction job reads the arms that changed from it: more signals than this
            between two runs make it read every arm with evidence instead.
        index_log_maxlen: approximate length of each tenant's add/remove log.
        refresh_ttl_on_hit: a served entry's TTL starts again (off by default).
        dedup_threshold: when set, a put whose embedding has cosine >= this with an entry
            of the same scope replaces that entry instead of adding a near-copy.
        redis_timeout_s: socket timeout of clients built by ``from_url``.
        embedding_cache_size / embedding_cache_ttl_s: the per-replica embedding memo.
        max_tenant_labels: tenants the worker names in its metrics; the rest are "other"
            (replicas: ``ReplicaMetrics(max_tenant_labels=...)``).
        ann_threshold: entries at which a scope's local index becomes HNSW (usearch, a
            dependency); ``None`` keeps every index exact.
        ann_backend: ``usearch`` (default) or ``hnswlib``; see docs/BENCHMARKS.md.
        ann_dtype: ``auto`` (default: ``b1`` for vectors of 256 dimensions and more,
            ``i8`` below), ``i8`` (int8 graphs, re-scored from float16 rows beside
            them), ``f16`` (float16 graphs; less replica memory, slower) or ``b1`` (one
            bit a dimension, Hamming distance, re-scored from float16 rows as ``i8``:
            the fastest; docs/operations.md, "Index dtype").
        ann_m / ann_ef_construction / ann_ef_search: HNSW parameters (recall vs speed).
            ``ann_ef_search`` is the narrowest search width: a replica that builds or
            loads an index of ``index.CALIBRATE_FROM`` entries or more measures on its
            vectors the width they need (this, twice this, ... up to 32x) and uses it,
            or takes the worker's measure from the snapshot it loads.
        vector_storage: ``float16`` (default) or ``float32``: see ``VECTOR_STORAGES``.
        max_error_rate: the error bound δ of every tenant without its own
            ``max_error_rate`` setting: serve a near match only where labelled outcomes
            say matches that close were wrong at most this often (95% confidence);
            ``None`` (default): no bound, the serving rules of the bandit alone.
        max_serve_error: under a bound, an optional ceiling on the error among the
            answers served (where ``max_error_rate`` bounds it per request): a near
            match or an exact repeat is served only where its labels say that matches
            like it are wrong at most this often when served (95% confidence).
        verify_rate: with a bound, the most of the servable candidates verified instead
            (exploration, which keeps the bound's labels current): all of it while few
            labels stand behind what is served, less and less as they grow
            (``calibration.EXPLORE_LABELS``).
        index_snapshots: a replica's index build loads the tenant's index snapshot when
            the worker has published one (tenants of ``snapshot_min_entries`` and more),
            and replays the log from its position, instead of scanning every vector.
        label_window / policy_refresh_s / policy_refresh_labels: see
            ``DEFAULT_LABEL_WINDOW``, ``DEFAULT_POLICY_REFRESH_S`` and
            ``DEFAULT_POLICY_REFRESH_LABELS``.
        token_prices: US dollars per million tokens, ``{model: (prompt, completion)}``,
            over ``savings.DEFAULT_PRICES``: what the savings metrics and ``stats`` count
            a hit's avoided call at (kept as a sorted tuple of ``(model, prompt,
            completion)``, so that the configuration stays hashable).
        rl / eviction: the nested configurations.
    """

    key_prefix: str = DEFAULT_KEY_PREFIX
    similarity_threshold: float = DEFAULT_SIMILARITY_THRESHOLD
    top_k: int = DEFAULT_TOP_K
    default_ttl_s: float | None = None
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES
    feedback_log_maxlen: int = DEFAULT_FEEDBACK_LOG_MAXLEN
    index_log_maxlen: int = DEFAULT_INDEX_LOG_MAXLEN
    refresh_ttl_on_hit: bool = False
    vector_storage: str = "float16"
    dedup_threshold: float | None = None
    redis_timeout_s: float = DEFAULT_REDIS_TIMEOUT_S
    embedding_cache_size: int = DEFAULT_EMBEDDING_CACHE_SIZE
    embedding_cache_ttl_s: float = DEFAULT_EMBEDDING_CACHE_TTL_S
    max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS
    ann_threshold: int | None = DEFAULT_ANN_THRESHOLD
    ann_backend: str = DEFAULT_ANN_BACKEND
    ann_dtype: str = DEFAULT_ANN_DTYPE
    ann_m: int = DEFAULT_ANN_M
    ann_ef_construction: int = DEFAULT_ANN_EF_CONSTRUCTION
    ann_ef_search: int = DEFAULT_ANN_EF_SEARCH
    max_error_rate: float | None = None
    max_serve_error: float | None = None
    verify_rate: float = DEFAULT_VERIFY_RATE
    label_window: int = DEFAULT_LABEL_WINDOW
    policy_refresh_s: float = DEFAULT_POLICY_REFRESH_S
    policy_refresh_labels: int = DEFAULT_POLICY_REFRESH_LABELS
    index_snapshots: bool = True
    token_prices: Any = ()
    rl: RLConfig = field(default_factory=RLConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

    def __post_init__(self) -> None:
        validate_prefix(self.key_prefix)
        object.__setattr__(self, "token_prices", _prices(self.token_prices))
        _check_rate("max_error_rate", self.max_error_rate)
        _check_rate("max_serve_error", self.max_serve_error)
        _check_unit("verify_rate", self.verify_rate)
        _check_count("label_window", self.label_window)
        _check_positive("policy_refresh_s", self.policy_refresh_s)
        _check_count("policy_refresh_labels", self.policy_refresh_labels)
        _check_unit("similarity_threshold", self.similarity_threshold)
        _check_count("top_k", self.top_k)
        if self.default_ttl_s is not None:
            _check_positive("default_ttl_s", self.default_ttl_s)
        _check_count("max_query_chars", self.max_query_chars)
        _check_count("max_response_bytes", self.max_response_bytes)
        _check_count("max_metadata_bytes", self.max_metadata_bytes)
        _check_count("feedback_log_maxlen", self.feedback_log_maxlen)
        _check_count("index_log_maxlen", self.index_log_maxlen)
        if not isinstance(self.index_snapshots, bool):
            raise ValueError(f"index_snapshots must be a bool, got {self.index_snapshots!r}")
        if self.vector_storage not in VECTOR_STORAGES:
            raise ValueError(
                f"vector_storage must be one of {VECTOR_STORAGES}, got {self.vector_storage!r}"
            )
        if not isinstance(self.refresh_ttl_on_hit, bool):
            raise ValueError(f"refresh_ttl_on_hit must be a bool, got {self.refresh_ttl_on_hit!r}")
        if self.dedup_threshold is not None:
            _check_unit("dedup_threshold", self.dedup_threshold)
        _check_positive("redis_timeout_s", self.redis_timeout_s)
        _check_count("embedding_cache_size", self.embedding_cache_size)
        _check_positive("embedding_cache_ttl_s", self.embedding_cache_ttl_s)
        _check_count("max_tenant_labels", self.max_tenant_labels)
        _check_count("ann_threshold", self.ann_threshold, allow_none=True)
        if self.ann_backend not in ANN_BACKENDS:
            raise ValueError(f"ann_backend must be one of {ANN_BACKENDS}, got {self.ann_backend!r}")
        if self.ann_dtype not in ANN_DTYPES:
            raise ValueError(f"ann_dtype must be one of {ANN_DTYPES}, got {self.ann_dtype!r}")
        _check_count("ann_m", self.ann_m)
        _check_count("ann_ef_construction", self.ann_ef_construction)
        _check_count("ann_ef_search", self.ann_ef_search)
        if not isinstance(self.rl, RLConfig):
            raise ValueError(f"rl must be an RLConfig, got {type(self.rl).__name__}")
        if not isinstance(self.eviction, EvictionConfig):
            raise ValueError(
                f"eviction must be an EvictionConfig, got {type(self.eviction).__name__}"
            )

    def to_dict(self) -> dict[str, Any]:
        """A plain-dict view (for logs and the CLI)."""
        from dataclasses import asdict

        return asdict(self)


def load_rl_config(path: str) -> RLConfig:
    """An ``RLConfig`` from a TOML or JSON file of its fields (``zerda-cache
    --rl-config``; env ``ZERDA_RL_CONFIG``): give the worker the same policy as the app
    replicas, whose scripts apply the caller's priors and decay. Fields left out keep
    their defaults.

    Raises:
        ValueError: unreadable file, unknown field or invalid value.
    """
    import json
    import tomllib
    from dataclasses import fields

    try:
        with open(path, "rb") as f:
            raw = f.read()
        data = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the RLConfig file {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path!r}: expected a table of RLConfig fields")
    known = {f.name for f in fields(RLConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path!r}: unknown RLConfig fields {unknown}; known: {sorted(known)}")
    try:
        return RLConfig(**data)
    except TypeError as exc:
        raise ValueError(f"{path!r}: {exc}") from exc
