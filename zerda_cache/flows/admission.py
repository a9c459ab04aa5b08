"""The admission check of ``put``: whether an answer may enter the cache at all. The
default is the seed's ``ContextGuard`` (``zerda_cache.companions.context``), loosened for a
cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from zerda_cache.companions.context import ContextEngineConfig, ContextGuard, GuardConfig
from zerda_cache.core.config import CacheConfig


class AdmissionCheck(Protocol):
    """Decides whether an answer may enter the cache: ``(passed, warnings)``.

    A failed check means the answer is not cached; the first warning is the reason.
    """

    def __call__(
        self, query: str, response: str, metadata: Mapping[str, Any]
    ) -> tuple[bool, list[str]]: ...


def basic_admission(
    query: str, response: str, metadata: Mapping[str, Any]
) -> tuple[bool, list[str]]:
    """The simplest check: refuse an empty (or whitespace-only) answer."""
    if not response.strip():
        return False, ["empty response"]
    return True, []


def default_admission(config: CacheConfig) -> AdmissionCheck:
    """The seed's ``ContextGuard`` as the admission check of ``put``: the answer about to
    be cached is the context it validates (empty, too short, too long). A failed guard
    means the answer is not cached.

    For a cache, the guard's RAG-oriented defaults are loosened: any non-empty answer
    is long enough, source markers are not required, and relevance checking is off
    (turn it on with your own ``ContextGuard(..., embed_fn=...)``: question-answer
    similarity depends on the embedding model).
    """
    guard_config = GuardConfig(
        min_context_length=1,
        max_context_length=config.max_response_bytes,
        check_source_coverage=False,
        check_relevance=False,
    )
    return ContextGuard(ContextEngineConfig(guard=guard_config)).as_admission()


__all__ = ["AdmissionCheck", "basic_admission", "default_admission"]
