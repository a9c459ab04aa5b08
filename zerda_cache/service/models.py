"""Request and response bodies of the cache endpoints (``/v1/lookup`` ... ``/v1/stats``).

Strict models: a JSON string is never taken for a number or a boolean, and unknown
fields are refused, so a typo (``"embeding"``) is a 422 rather than a silent miss. The
tenant is never a field: it comes from the API key.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Longest embedding accepted (text-embedding-3-large has 3072 dimensions).
MAX_EMBEDDING_DIM = 8192


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


Embedding = list[float] | None
EMBEDDING = Field(
    None,
    max_length=MAX_EMBEDDING_DIM,
    description="The question's embedding; omit it to have the service's embedder make one.",
)
SCOPE = Field(None, description="Only entries put with the same scope match (default: '').")


class LookupRequest(_Strict):
    query: str
    embedding: Embedding = EMBEDDING
    scope: str | None = SCOPE
    max_error_rate: float | None = Field(
        default=None, gt=0, lt=1, description="An error bound for this lookup, in (0, 1)."
    )


class Entry(BaseModel):
    entry_id: str
    response: str
    query: str
    similarity: float
    score: float
    expected_reward: float
    confidence: float
    exact: bool
    scope: str
    metadata: dict[str, Any]
    hit_id: str = Field(
        description="Names this served hit: send it to ``/v1/feedback`` (``hit_id``) in "
        "place of ``entry_id``, and a negative verdict counts the hit wrong in the "
        "savings (once, however often it is sent), with the similarity it was served at."
    )


class LookupResponse(BaseModel):
    hit: bool
    decision: Literal["hit", "miss", "verify"] = Field(
        description="``hit``: ``entry`` is the served answer. ``miss``: nothing cached is "
        "close enough. ``verify``: a miss too (call the LLM), but under the tenant's error "
        "bound a cached candidate was held back: send ``verify_token`` with the "
        "``/v1/put`` of the LLM's answer, to any service replica, and the put compares "
        "the two answers (``verified`` in its response), which teaches the bound."
    )
    entry: Entry | None = Field(None, description="The served answer (null unless a hit).")
    reason: str = Field(
        description="Why, as a short code: ``exact``, ``near`` (hits); ``exact_unproven``, "
        "``near_unproven``, ``disputed``, ``explore`` (verifies); ``no_candidate``, "
        "``unservable``, ``unavailable`` (Redis failed: the lookup failed open), "
        "``no_cache`` (``Cache-Control: no-cache``: the cache was not read) (misses)."
    )
    verify_token: str | None = Field(
        default=None, description="For a ``verify``: what the ``/v1/put`` of the answer takes."
    )
    max_error_rate: float | None = Field(
        default=None, description="The error bound the lookup was decided under (null: none)."
    )
    threshold: float | None = Field(
        default=None,
        description="The score from which the bound serves near matches (their similarity "
        "unless the tenant has a match model); null: none yet, or no bound.",
    )
    exact_level: int | None = Field(
        default=None,
        description="The lowest level of exact repeats the bound serves (0: any servable "
        "entry); null: none, or no bound.",
    )
    estimated_error: float | None = Field(
        default=None,
        description="Wrong serves per request of serving so (the labels' point estimate); "
        "null without a bound.",
    )


class PutRequest(_Strict):
    query: str
    response: str
    embedding: Embedding = EMBEDDING
    scope: str | None = SCOPE
    ttl_s: float | None = Field(None, gt=0)
    quality: float | None = Field(None, ge=0, le=1)
    metadata: dict[str, Any] | None = None
    tags: list[str] | None = Field(
        None,
        description="Labels to invalidate the answer by later (``/v1/invalidate/tag``): "
        "the document it was built on, its source. Default: the ``X-Zerda-Tags`` header's.",
    )
    usage: dict[str, Any] | None = Field(
        None,
        description="What the LLM call that made the answer cost: ``model``, "
        "``prompt_tokens``, ``completion_tokens`` (an OpenAI response's usage and model). "
        "Each hit of the answer then counts that call saved (``/v1/stats``' savings).",
    )
    verify_token: str | None = Field(
        default=None,
        max_length=4096,
        description="The ``verify_token`` of the ``/v1/lookup`` (a ``verify``) this answer "
        "follows: the answer is compared with the candidate it held back, on whichever "
        "service replica. A token made for another question, scope or key is a 422.",
    )


class PutResponse(BaseModel):
    stored: bool
    entry_id: str | None = None
    reason: str | None = Field(None, description="Why the answer was not stored.")
    warnings: list[str] = Field(default_factory=list)
    replaced_id: str | None = None
    verified: bool | None = Field(
        None,
        description="When the put verified a candidate (its ``verify_token``, or a "
        "verification the lookup before it on this service replica left): whether the "
        "cached answer equalled this one.",
    )
    compared_id: str | None = Field(
        default=None, description="The cached entry this answer was compared with (``verified``)."
    )
    disputed: bool = Field(
        default=False,
        description="Not stored: the answer disputes the cached entry ``compared_id`` (held "
        'out until settled). Feedback on it, ``{"entry_id": compared_id, "dispute_id": '
        "dispute_id, ...}``, settles the dispute.",
    )
    dispute_id: str | None = Field(
        default=None,
        description="The id of the dispute a ``disputed`` answer recorded: a reaction "
        "sends it, and settles that dispute only (not one another answer recorded since).",
    )


class FeedbackRequest(_Strict):
    entry_id: str | None = Field(
        None,
        description="The entry (send one of this, completion_id and hit_id). A verdict by "
        "entry id teaches the entry but names no served hit: it counts no wrong hit.",
    )
    completion_id: str | None = Field(
        None,
        description="The id of a chat completion the proxy answered (its ``id``, also in "
        "``x-zerda-completion-id``), in place of ``entry_id``: the entry it was answered "
        "with, and the similarity it was served at. A negative verdict on a hit counts "
        "it wrong in the savings, once.",
    )
    hit_id: str | None = Field(
        None,
        description="A ``/v1/lookup`` hit's ``entry.hit_id``, in place of ``entry_id``: "
        "the entry, the hit and the similarity it was served at. A negative verdict "
        "counts that hit wrong in the savings, once however often it is sent.",
    )
    positive: bool
    disputed: bool = Field(
        False,
        description="With ``entry_id`` and ``dispute_id``: the reaction is to the answer a "
        "``/v1/put`` found disputing that entry (its ``disputed``), not to the entry's own.",
    )
    dispute_id: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.:-]*$",
        description="With ``entry_id``: the ``dispute_id`` of the ``/v1/put`` whose answer "
        "disputes that entry; the reaction is to that answer and settles that dispute only "
        "(negative: the cached answer stays; positive: the disputed one replaces it). A "
        "dispute settled meanwhile, or replaced by another, is left alone.",
    )
    magnitude: float = 1.0
    source: str = "user"
    similarity: float | None = Field(
        None,
        description="The similarity the entry was served at (a hit's entry.similarity, or "
        "the proxy's x-zerda-similarity header): a wrong near match then raises that "
        "entry's own similarity bar instead of condemning the answer.",
    )


class FeedbackResponse(BaseModel):
    applied: bool
    entry_id: str | None = Field(None, description="The entry the feedback reached.")


class InvalidateRequest(_Strict):
    entry_id: str


class InvalidateResponse(BaseModel):
    removed: bool


class InvalidateTagRequest(_Strict):
    tag: str


class InvalidateTagResponse(BaseModel):
    removed: int = Field(description="How many entries the tag named (now removed).")


__all__ = [
    "Entry",
    "FeedbackRequest",
    "FeedbackResponse",
    "InvalidateRequest",
    "InvalidateResponse",
    "InvalidateTagRequest",
    "InvalidateTagResponse",
    "LookupRequest",
    "LookupResponse",
    "PutRequest",
    "PutResponse",
]
