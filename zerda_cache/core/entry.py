"""A cache entry and its bandit arm: the state, and every formula applied to it.

The formulas here are the reference. The Lua scripts in ``zerda_cache/storage/lua/``
implement the same ones (``_lib.lua`` is shared by the scripts), and
``tests/test_parity.py`` holds the two equal on random sequences of feedback, hits and
decay.

Time: an arm stores its values *as of* ``decayed_at``. Its value at a later time ``now`` is
the excess over the prior shrunk by ``usage_decay ** ((now - decayed_at) / interval)``.
Every operation that changes an arm first brings it to ``now`` (see ``BanditArm.decay_to``),
so an arm is a pure function of its feedback history and the times it arrived: a late,
missed or doubled decay cycle leaves the same arm.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zerda_cache.core.config import DEFAULT_DECAY_INTERVAL_S, DEFAULT_USAGE_DECAY, RLConfig
from zerda_cache.core.errors import InvalidEntryError, InvalidFeedbackError
from zerda_cache.core.validation import check_text, finite_number, validate_tenant

#: Usage credibility saturates at this many uses (seed: log1p(n) / log1p(50)).
USAGE_SATURATION = 50
#: Quality of an answer put without an explicit score: "unknown", halfway.
DEFAULT_QUALITY = 0.5
#: Insertion-time similarity of an answer put for exactly its own question.
DEFAULT_SIMILARITY = 1.0
#: Weight of an entry's confidence in the composite ranking score (seed constant).
CONFIDENCE_WEIGHT = 0.1
#: The weight one signal may carry. Far above any sensible judgement, far below what
#: would overflow an arm (1e308 twice made alpha infinite and the entry corrupt for good).
MAX_FEEDBACK_MAGNITUDE = 1_000.0
#: An entry id longer than this is refused before it reaches Redis (ours have 32 chars).
MAX_ENTRY_ID_CHARS = 128


def usage_credibility(usage_count: int) -> float:
    """``min(1, ln(1 + n) / ln(1 + 50))``: how much usage backs the estimate."""
    return min(1.0, math.log(1.0 + usage_count) / math.log(1.0 + USAGE_SATURATION))


def compute_confidence(
    expected_reward: float, similarity: float, quality: float, usage_count: int
) -> float:
    """The seed's composite confidence, clipped to [0, 1]."""
    raw = (
        0.40 * expected_reward
        + 0.25 * similarity
        + 0.25 * quality
        + 0.10 * usage_credibility(usage_count)
    )
    return min(1.0, max(0.0, raw))


def decay_factor(elapsed_s: float, usage_decay: float, interval_s: float) -> float:
    """``usage_decay ** (elapsed / interval)``; 1.0 when no time has passed."""
    if elapsed_s <= 0:
        return 1.0
    return float(usage_decay ** (elapsed_s / interval_s))


@dataclass(slots=True)
class BanditArm:
    """A Beta(alpha, beta) posterior over "this cached answer is right".

    Attributes:
        alpha: prior alpha plus (decayed) positive evidence.
        beta: prior beta plus (decayed) negative evidence.
        pulls: feedback signals received (never decayed).
        reward_sum: signed sum of rewards received (never decayed).
        decayed_at: the time (unix seconds) the values above are as of.
    """

    alpha: float = 1.0
    beta: float = 1.0
    pulls: int = 0
    reward_sum: float = 0.0
    decayed_at: float = 0.0

    @property
    def expected_reward(self) -> float:
        """The posterior mean ``alpha / (alpha + beta)``."""
        return self.alpha / (self.alpha + self.beta)

    def sample_reward(self, rng: np.random.Generator) -> float:
        """One Thompson draw from Beta(alpha, beta), using the caller's generator."""
        return float(rng.beta(self.alpha, self.beta))

    def update(self, positive: bool, reward: float) -> None:
        """Add one feedback signal of weight ``reward`` (>= 0)."""
        if positive:
            self.alpha += reward
            self.reward_sum += reward
        else:
            self.beta += reward
            self.reward_sum -= reward
        self.pulls += 1

    def decay_to(
        self,
        now: float,
        *,
        prior_alpha: float,
        prior_beta: float,
        usage_decay: float = DEFAULT_USAGE_DECAY,
        interval_s: float = DEFAULT_DECAY_INTERVAL_S,
    ) -> None:
        """Shrink the excess over the prior for the time since ``decayed_at``.

        A ``now`` at or before ``decayed_at`` changes nothing (time never runs backwards
        for an arm), so applying this twice at one instant equals applying it once. An arm
        at its prior has no evidence to shrink and is left as it is (``decayed_at``
        included): the decay script then skips writing it, which is most arms of a cache.
        """
        if now <= self.decayed_at:
            return
        if abs(self.alpha - prior_alpha) + abs(self.beta - prior_beta) <= 1e-12:
            return
        factor = decay_factor(now - self.decayed_at, usage_decay, interval_s)
        self.alpha = prior_alpha + (self.alpha - prior_alpha) * factor
        self.beta = prior_beta + (self.beta - prior_beta) * factor
        self.decayed_at = now

    def at(self, now: float, config: RLConfig) -> BanditArm:
        """A copy of this arm brought to ``now`` (the arm itself is not changed)."""
        arm = BanditArm(self.alpha, self.beta, self.pulls, self.reward_sum, self.decayed_at)
        arm.decay_to(
            now,
            prior_alpha=config.prior_alpha,
            prior_beta=config.prior_beta,
            usage_decay=config.usage_decay,
            interval_s=config.decay_interval_s,
        )
        return arm

    @classmethod
    def fresh(cls, config: RLConfig, now: float) -> BanditArm:
        return cls(alpha=config.prior_alpha, beta=config.prior_beta, decayed_at=now)


@dataclass(frozen=True, slots=True)
class LLMUsage:
    """What the upstream LLM call that produced an answer cost: its model and tokens (the
    OpenAI ``usage`` shape). Stored with the entry; every hit of it saved that much."""

    model: str
    prompt_tokens: int
    completion_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not 0 < len(self.model) <= 128:
            raise InvalidEntryError(f"usage model must be a str of 1-128 chars, got {self.model!r}")
        if not self.model.isprintable() or not self.model.isascii():
            raise InvalidEntryError(f"usage model must be printable ASCII, got {self.model!r}")
        for name in ("prompt_tokens", "completion_tokens"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**31:
                raise InvalidEntryError(f"usage {name} must be an int in [0, 2**31), got {n!r}")

    @classmethod
    def of(cls, value: object) -> LLMUsage | None:
        """A usage from an ``LLMUsage``, a mapping with ``model``, ``prompt_tokens`` and
        ``completion_tokens`` (an OpenAI response's ``usage`` plus its ``model``), or
        ``None``."""
        if value is None or isinstance(value, LLMUsage):
            return value
        if not isinstance(value, Mapping):
            raise InvalidEntryError(f"usage must be a mapping, got {type(value).__name__}")
        unknown = set(value) - {"model", "prompt_tokens", "completion_tokens", "total_tokens"}
        if unknown:
            raise InvalidEntryError(f"usage has unknown fields {sorted(unknown)}")
        try:
            return cls(value["model"], value["prompt_tokens"], value["completion_tokens"])
        except KeyError as exc:
            raise InvalidEntryError(f"usage needs {exc.args[0]!r}") from None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class IntelligentCacheEntry:
    """One cached answer: immutable content plus mutable learning state.

    ``embedding`` is ``None`` when an entry is loaded without its vector.
    ``expires_at`` is ``math.inf`` for an entry without a TTL.
    """

    entry_id: str
    tenant: str
    query: str
    response: str
    embedding: np.ndarray[Any, np.dtype[np.float32]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    #: Labels the entry can be invalidated by (``invalidate_tag``).
    tags: tuple[str, ...] = ()
    #: What the LLM call that produced the answer cost, if the put said.
    usage: LLMUsage | None = None
    created_at: float = 0.0
    ttl_s: float | None = None
    expires_at: float = math.inf
    quality_score: float = DEFAULT_QUALITY
    similarity_score: float = DEFAULT_SIMILARITY
    usage_count: int = 0
    last_access: float = 0.0
    confidence_score: float = 0.0
    bandit_arm: BanditArm = field(default_factory=BanditArm)
    version: int = 0
    size_bytes: int = 0
    #: The entry's own similarity bar, learned from negative signals at low similarity.
    similarity_bar: float = 0.0
    #: The lowest similarity at which the entry got positive feedback (2.0: none yet).
    min_positive_similarity: float = 2.0
    #: Negative signals in a row since the last positive (those blamed on the match
    #: excluded); see ``RLConfig.negative_streak_forget``.
    negative_streak: int = 0

    def record_hit(self, positive: bool, reward: float) -> None:
        """Apply one feedback signal to the arm (the seed's name for it)."""
        self.bandit_arm.update(positive, reward)

    def record_use(self, now: float) -> None:
        """The entry was served: count it and note the time."""
        self.usage_count += 1
        self.last_access = max(self.last_access, now)

    @property
    def expected_reward(self) -> float:
        return self.bandit_arm.expected_reward

    def sample_reward(self, rng: np.random.Generator) -> float:
        return self.bandit_arm.sample_reward(rng)

    def is_expired(self, now: float) -> bool:
        return now >= self.expires_at

    def eviction_score(
        self,
        decay: float = DEFAULT_USAGE_DECAY,
        reward_w: float = 0.50,
        usage_w: float = 0.30,
        recency_w: float = 0.20,
        *,
        now: float,
        interval_s: float = DEFAULT_DECAY_INTERVAL_S,
    ) -> float:
        """How much this entry is worth keeping; lower is evicted first.

        ``reward_w * expected_reward + usage_w * usage_credibility
        + recency_w * decay ** (idle / interval_s)``, where idle is the time since the
        entry was last served (or created). The weights are the caller's: the learner
        passes ``EvictionConfig``'s (the seed ignored them).
        """
        idle = max(0.0, now - max(self.last_access, self.created_at))
        recency = decay_factor(idle, decay, interval_s)
        return (
            reward_w * self.expected_reward
            + usage_w * usage_credibility(self.usage_count)
            + recency_w * recency
        )


@dataclass(frozen=True, slots=True, init=False)
class FeedbackSignal:
    """One external judgement of a cached answer: right (``positive``) or wrong.

    ``FeedbackSignal(entry_id, tenant, positive)``: the tenant is the second argument,
    or ``tenant=`` as in every other call (``tenant_id=``, the seed's name, works too).
    ``source`` is free-form ("user", "llm_eval", "auto" by convention). ``timestamp`` is
    the caller's clock and is only recorded; arm arithmetic uses the Redis server's clock.
    Construction validates: a NaN, infinite, negative or over ``MAX_FEEDBACK_MAGNITUDE``
    ``magnitude``, a bad tenant id, an empty entry id or a ``source`` that is not text
    raises ``InvalidFeedbackError`` at once.
    """

    entry_id: str
    tenant_id: str
    positive: bool
    magnitude: float
    source: str
    timestamp: float
    #: The cosine similarity at which the entry was served (``CacheHit.feedback`` fills
    #: it): lets a negative signal on a near miss teach the entry its own similarity bar.
    similarity: float | None
    #: Which serve of the entry it judges: the hit's number (``CacheHit.hit_number``;
    #: given, ``served`` is true). A negative one counts that hit as wrong in the savings
    #: (``zerda_cache.core.savings``), once however often it is repeated.
    hit: int | None

    def __init__(
        self,
        entry_id: str,
        tenant_id: str | None = None,
        positive: bool | None = None,
        magnitude: float = 1.0,
        source: str = "user",
        timestamp: float | None = None,
        similarity: float | None = None,
        *,
        tenant: str | None = None,
        served: bool = False,
        hit: int | None = None,
    ) -> None:
        # ``served`` is accepted and ignored: it is derived from ``hit`` (``served``).
        del served
        if tenant is not None and tenant_id is not None and tenant != tenant_id:
            raise InvalidFeedbackError(f"tenant {tenant!r} and tenant_id {tenant_id!r} differ")
        tid = tenant_id if tenant_id is not None else tenant
        put = object.__setattr__  # frozen; a missing tenant or polarity fails validation
        put(self, "entry_id", entry_id)
        put(self, "tenant_id", tid)
        put(self, "positive", positive)
        put(self, "magnitude", magnitude)
        put(self, "source", source)
        put(self, "timestamp", time.time() if timestamp is None else timestamp)
        put(self, "similarity", similarity)
        put(self, "hit", hit)
        self.__post_init__()

    @property
    def tenant(self) -> str:
        """The tenant (the same as ``tenant_id``)."""
        return self.tenant_id

    @property
    def served(self) -> bool:
        """The signal is about a hit the cache served: it names the hit's number
        (``hit``). Derived, never stored: the ``served=`` keyword is accepted for the
        callers that pass it, and ignored."""
        return self.hit is not None

    def __post_init__(self) -> None:
        if not isinstance(self.entry_id, str) or not 0 < len(self.entry_id) <= MAX_ENTRY_ID_CHARS:
            raise InvalidFeedbackError(
                f"entry_id must be a str of 1-{MAX_ENTRY_ID_CHARS} chars, got {self.entry_id!r}"
            )
        check_text(self.entry_id, "entry_id", InvalidFeedbackError)
        validate_tenant(self.tenant_id)
        if not isinstance(self.positive, bool | np.bool_):
            raise InvalidFeedbackError(f"positive must be a bool, got {self.positive!r}")
        m = finite_number(self.magnitude)
        if m is None or not 0 <= m <= MAX_FEEDBACK_MAGNITUDE:
            raise InvalidFeedbackError(
                f"magnitude must be a number in [0, {MAX_FEEDBACK_MAGNITUDE:g}], "
                f"got {_shown(self.magnitude)}"
            )
        if not isinstance(self.source, str) or not 0 < len(self.source) <= 64:
            raise InvalidFeedbackError(f"source must be a str of 1-64 chars, got {self.source!r}")
        check_text(self.source, "source", InvalidFeedbackError)
        if self.similarity is not None:
            sim = finite_number(self.similarity)
            if sim is None or not -1.0 <= sim <= 1.0 + 1e-6:
                raise InvalidFeedbackError(
                    f"similarity must be in [-1, 1] or None, got {_shown(self.similarity)}"
                )
        hit = self.hit
        if hit is not None and (
            isinstance(hit, bool) or not isinstance(hit, int) or not 0 < hit < 2**53
        ):
            raise InvalidFeedbackError(
                f"hit must be a hit's number (CacheHit.hit_number, 1 or more), got {_shown(hit)}"
            )
        if finite_number(self.timestamp) is None:
            raise InvalidFeedbackError(
                f"timestamp must be a finite number, got {_shown(self.timestamp)}"
            )


def _shown(value: object) -> str:
    """A bad value for an error message, cut short (``10**400`` has 401 digits)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**20 else "an int too large"
    return text if len(text) <= 80 else text[:77] + "..."
