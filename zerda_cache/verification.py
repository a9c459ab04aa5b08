"""Verification under an error bound: how a cached answer is compared with the fresh one
the app's LLM gave (``same_text``, ``same_meaning``, or the app's own ``same_answer``),
and the ticket a lookup leaves for the put that verifies it.

A lookup that holds back a candidate (not proven safe enough to serve) returns a miss
and leaves a ``Ticket`` under the question's ``ticket_key``; the app's next put of that
question compares the two answers, and the comparison labels the candidate
(``CacheEngine._verify``).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any, NamedTuple

from zerda_cache.match_model import Features
from zerda_cache.storage import codec

#: ``same_answer(cached, fresh)``: is the cached answer as right as the fresh one? It
#: labels a verification (see ``same_text``).
SameAnswer = Callable[[str, str], bool]


def same_text(cached: str, fresh: str) -> bool:
    """The default answer equivalence: equal after Unicode normalisation, case folding
    and collapsing whitespace and punctuation. Strict: an LLM that words the same answer
    differently counts as a different answer, which errs on the side of not serving.
    Pass your own ``same_answer`` (an embedding similarity of the two answers, an LLM
    judge) when answers vary in wording."""
    return _canonical(cached) == _canonical(fresh)


def same_meaning(embed: Callable[[str], Any], threshold: float = 0.9) -> SameAnswer:
    """An answer equivalence for LLMs that word an answer differently from call to call:
    the same text (``same_text``), or embeddings of the two answers (``embed``: any sync
    text -> vector function, e.g. ``MiniLMEmbedder().embed``) at cosine ``threshold`` or
    more. Looser than ``same_text``: answers that differ in one name or number can embed
    close, so check the threshold on your own answers (under an error bound, a
    verification it gets wrong is a wrong label)."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")

    def compare(cached: str, fresh: str) -> bool:
        if same_text(cached, fresh):
            return True
        a, b = codec.normalize_vector(embed(cached)), codec.normalize_vector(embed(fresh))
        return float(a @ b) >= threshold

    return compare


def _canonical(text: str) -> str:
    folded = unicodedata.normalize("NFKC", text).casefold()
    return " ".join("".join(c if c.isalnum() else " " for c in folded).split())


class Ticket(NamedTuple):
    """A verification a lookup asked for: the candidate it held back, the similarity it
    matched at (1: the question's own entry), its match features (near matches) and its
    entry's level (exact repeats)."""

    entry_id: str
    similarity: float
    features: Features | None = None
    level: int = 0
    exact: bool = False


def ticket_key(tenant: str, query: str, scope: str) -> str:
    """Where a lookup's ticket for ``query`` waits for the put that verifies it."""
    return tenant + "\n" + codec.query_digest(query, scope)


__all__ = ["SameAnswer", "Ticket", "same_meaning", "same_text", "ticket_key"]
