"""What the cache's calls return: a served answer (``CacheHit``), what a lookup decided
(``Decision``) and what a put did (``PutResult``). A hit and a put result can make the
``FeedbackSignal`` about their entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from zerda_cache.core.entry import FeedbackSignal, LLMUsage
from zerda_cache.core.errors import InvalidFeedbackError


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A served answer.

    Attributes:
        entry_id: the entry to send feedback about.
        response: the cached answer.
        query: the cached question that matched.
        similarity: cosine similarity of the two questions (1.0 for an exact match).
        score: the composite ranking score (similarity, Thompson draw, confidence).
        expected_reward: the arm's posterior mean when it was served.
        confidence: the entry's composite confidence.
        exact: matched by the normalised-question digest rather than by vector search.
        usage: what the LLM call that made the answer cost (when its put said): what
            this hit saved.
        hit_number: which serve of the entry this is (1 for its first; the hit script
            counts them): ``feedback`` names the hit by it, so that a hit judged wrong
            is counted wrong in the savings once, however often the verdict repeats.
    """

    entry_id: str
    tenant: str
    response: str
    query: str
    similarity: float
    score: float
    expected_reward: float
    confidence: float
    metadata: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    exact: bool = False
    usage: LLMUsage | None = None
    hit_number: int = 0

    def feedback(
        self, positive: bool, *, magnitude: float = 1.0, source: str = "user"
    ) -> FeedbackSignal:
        """A ``FeedbackSignal`` about this hit, ready for ``CacheManager.feedback``."""
        similarity = min(1.0, max(-1.0, self.similarity))
        return feedback_signal(
            self.entry_id,
            self.tenant,
            positive,
            magnitude,
            source,
            similarity,
            self.hit_number or None,
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """What a lookup decided (``CacheManager.decide``). ``bool(decision)`` is a hit.

    Attributes:
        kind: ``"hit"`` (``hit`` is the answer to serve), ``"miss"`` (call the LLM and
            ``put`` its answer) or ``"verify"``: a miss too, but under an error bound a
            cached candidate was held back; pass ``verify_token`` to the ``put`` of the
            LLM's answer, on any replica, and that put compares the two answers.
        reason: why, as a short code: ``exact``, ``near`` (hits); ``exact_unproven``,
            ``near_unproven``, ``disputed``, ``explore`` (verifies); ``no_candidate``,
            ``unservable``, ``unavailable`` (misses; ``unavailable``: Redis failed and
            the lookup failed open). ``REASONS`` in ``flows/lookup.py`` says each in words.
        hit: the served answer (a hit), else ``None``.
        candidate_id: the entry held back (a verify), else ``None``.
        similarity: the similarity it matched at (1.0: the question's own entry).
        verify_token: for a verify, what ``put(..., verify_token=...)`` takes.
        max_error_rate: the error bound it was decided under (``None``: none).
        threshold: the score from which the bound (and ``max_serve_error``, if set)
            serves near matches (their similarity unless the tenant has a match model);
            ``None``: none yet, or no bound.
        exact_level: the lowest level of exact repeats served under them (0: any
            servable entry; ``calibration.exact_level``); ``None``: none, or no bound.
        estimated_error: wrong serves per request of serving by the bound's rule, the
            labels' point estimate (``Calibration.serving``; with ``max_serve_error``
            raising the bars, an estimate from above). ``None``: no bound.
    """

    kind: Literal["hit", "miss", "verify"]
    reason: str
    hit: CacheHit | None = None
    candidate_id: str | None = None
    similarity: float | None = None
    verify_token: str | None = None
    max_error_rate: float | None = None
    threshold: float | None = None
    exact_level: int | None = None
    estimated_error: float | None = None

    def __bool__(self) -> bool:
        return self.kind == "hit"


@dataclass(frozen=True, slots=True)
class PutResult:
    """What ``put`` did. ``bool(result)`` is ``stored``.

    Attributes:
        stored: the answer is now cached.
        entry_id: its id when stored. Under an error bound, when the lookup before held
            back the question's own cached entry and this answer is the same
            (``same_answer``), that entry is kept (with the verification's positive
            signal) and this is its id.
        reason: why it was not stored (the admission check's verdict).
        warnings: the admission check's warnings, stored or not.
        replaced_id: an entry this one replaced (same question, or a near-duplicate when
            ``dedup_threshold`` is set).
        tenant: the tenant it was put for.
        verified: when the lookup before this put asked for a verification (its
            ``verify_token``, or a ticket this replica's lookup left), whether the cached
            answer it held back was the same as this fresh one (``None``: no
            verification).
        compared_id: the cached entry this answer was compared with (``verified``).
            Under an error bound, a fresh answer that disagrees with the question's own
            entry is not stored the first time (``disputed``; ``reason`` says so): that
            entry stays, held out until the next answer settles which of the two is
            right, or the user's reaction to this one (``feedback``).
        disputed: this answer was not stored but recorded as a dispute on the entry
            ``compared_id`` names.
        dispute_id: that dispute's id (random): a reaction to this answer
            (``feedback``) carries it, and settles this dispute only, never one another
            answer recorded on the entry since.
    """

    stored: bool
    entry_id: str | None = None
    reason: str | None = None
    warnings: tuple[str, ...] = ()
    replaced_id: str | None = None
    tenant: str = ""
    verified: bool | None = None
    compared_id: str | None = None
    disputed: bool = False
    dispute_id: str | None = None

    def __bool__(self) -> bool:
        return self.stored

    def feedback(
        self, positive: bool, *, magnitude: float = 1.0, source: str = "user"
    ) -> FeedbackSignal:
        """A ``FeedbackSignal`` about the answer just cached, ready for
        ``CacheManager.feedback``: the user's reaction to the fresh answer judges it
        before it is ever served from the cache. It is about the entry's own question,
        so it carries similarity 1.0 (it never moves the entry's similarity bar).

        A disputed answer (``disputed``) was not stored: its reaction is a
        ``DisputeSignal`` about the entry it disputes, and settles that dispute (turned
        down, the cached answer stays; approved, this answer replaces it).

        Raises:
            ValueError: nothing was stored, nor disputed.
        """
        if self.disputed and self.compared_id is not None:
            return DisputeSignal(
                self.compared_id,
                self.tenant,
                positive,
                magnitude,
                source,
                similarity=1.0,
                dispute=self.dispute_id or "",
            )
        if not self.stored or self.entry_id is None:
            raise ValueError(f"nothing was stored ({self.reason}): no entry to give feedback on")
        return feedback_signal(self.entry_id, self.tenant, positive, magnitude, source, 1.0)


@dataclass(frozen=True, slots=True, init=False)
class DisputeSignal(FeedbackSignal):
    """A reaction to the fresh answer a dispute on ``entry_id`` recorded, not to the
    entry's own answer (``PutResult.feedback`` of a disputed put; the proxy's completion
    id of one): ``CacheManager.feedback`` settles the dispute with it instead of putting
    it on the entry's arm (``PutSteps.react_flow``). ``dispute`` names the dispute
    (``PutResult.dispute_id``): a reaction that comes after it was settled, and another
    answer disputed the entry since, settles nothing (that user never saw the other).

    Raises:
        InvalidFeedbackError: as ``FeedbackSignal``, or ``dispute`` is not a short str.
    """

    dispute: str

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
        dispute: str,
        tenant: str | None = None,
        served: bool = False,
        hit: int | None = None,
    ) -> None:
        object.__setattr__(self, "dispute", dispute)  # frozen
        FeedbackSignal.__init__(
            self,
            entry_id,
            tenant_id,
            positive,
            magnitude,
            source,
            timestamp,
            similarity,
            tenant=tenant,
            served=served,
            hit=hit,
        )

    def __post_init__(self) -> None:
        FeedbackSignal.__post_init__(self)
        if not isinstance(self.dispute, str) or len(self.dispute) > MAX_DISPUTE_ID_CHARS:
            raise InvalidFeedbackError(
                f"dispute must be a str of at most {MAX_DISPUTE_ID_CHARS} chars, "
                f"got {self.dispute!r:.80}"
            )


#: The longest dispute id (``PutResult.dispute_id``; the cache's are 16 characters).
MAX_DISPUTE_ID_CHARS = 64


def feedback_signal(
    entry_id: str,
    tenant: str,
    positive: bool,
    magnitude: float,
    source: str,
    similarity: float | None,
    hit: int | None = None,
) -> FeedbackSignal:
    """The ``FeedbackSignal`` about a result: ``entry_id`` of ``tenant``, matched at
    ``similarity`` (``None``: not known); ``hit``: the number of the hit it judges
    (``CacheHit.hit_number``; ``None``: an answer put, not served)."""
    return FeedbackSignal(
        entry_id=entry_id,
        tenant_id=tenant,
        positive=positive,
        magnitude=magnitude,
        source=source,
        similarity=similarity,
        hit=hit,
    )


__all__ = ["CacheHit", "Decision", "DisputeSignal", "PutResult", "feedback_signal"]
