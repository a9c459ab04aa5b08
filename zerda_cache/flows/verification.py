"""Verification under an error bound: how a cached answer is compared with the fresh one
the app's LLM gave (``same_text``, ``same_meaning``, or the app's own ``same_answer``),
the ticket a lookup leaves for the put that verifies it, and what the cache learns from
the comparison (``Verifier``).

A lookup that holds back a candidate (not proven safe enough to serve) returns a miss
and leaves a ``Ticket`` under the question's ``ticket_key`` (``Verifier.hold``), which
``decide`` also hands the app as a verify token (``encode_ticket``); the app's next put
of that question, with the token on any replica or without it on this one, compares the
two answers, and the comparison labels the candidate (``Verifier.verify_flow``), once:
the ticket's nonce is claimed by the first put that settles it.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import os
import unicodedata
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from zerda_cache.companions.context import ContextCache
from zerda_cache.core.entry import IntelligentCacheEntry
from zerda_cache.core.errors import (
    CorruptEntryError,
    EntryNotFoundError,
    InvalidEntryError,
    StorageError,
)
from zerda_cache.learning import text_match
from zerda_cache.learning.bandit import CachePolicyLearner, FeedbackSignal
from zerda_cache.learning.match_model import FEATURES, SEARCH_FEATURES, Features, with_text
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.learning.tenant_state import PolicyCache, plan_label
from zerda_cache.storage import codec
from zerda_cache.storage.driver import Flow, call
from zerda_cache.storage.plans import FeedbackOutcome, ReadPlan
from zerda_cache.storage.store import Storage
from zerda_cache.storage.tenant_plans import Dispute

log = logging.getLogger(__name__)

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


#: How long a verification a lookup asked for waits for its put.
TICKET_TTL_S = 900.0


class Ticket(NamedTuple):
    """A verification a lookup asked for: the candidate it held back, the similarity it
    matched at (1: the question's own entry), its match features (near matches), its
    entry's level (exact repeats), and a nonce that lets it be settled once only, by
    whichever put brings it first (``StoragePlans.claim_ticket``; '': no such check)."""

    entry_id: str
    similarity: float
    features: Features | None = None
    level: int = 0
    exact: bool = False
    nonce: str = ""


def new_nonce() -> str:
    """A ticket's nonce."""
    return os.urandom(8).hex()


class Comparison(NamedTuple):
    """What a verification found (``Verifier.verify_flow``)."""

    #: the cached answer is the same as the fresh one (``None``: not compared: the
    #: candidate is gone, or the judge failed)
    same: bool | None
    #: the candidate as read (``None``: gone)
    cached: IntelligentCacheEntry | None
    #: the question's own entry carried a dispute, which this verification settled
    settled: bool = False
    #: the fresh answer agrees with the one the dispute recorded (two fresh answers
    #: against the cached one)
    agrees_with_dispute: bool = False


def ticket_key(tenant: str, query: str, scope: str) -> str:
    """Where a lookup's ticket for ``query`` waits for the put that verifies it."""
    return tenant + "\n" + codec.query_digest(query, scope)


#: The version mark of a verify token (``encode_ticket``).
TOKEN_PREFIX = "zv1."


def encode_ticket(tenant: str, query: str, scope: str, ticket: Ticket) -> str:
    """A verify token: ``ticket`` for the put of ``query`` (in ``scope``) of ``tenant``,
    as text the app can carry to any replica (``put(verify_token=...)``), where this
    replica's memory (``Verifier.hold``) reaches only its own puts. It names the
    candidate and how it matched; nothing in it is secret, and a put checks that it is
    for that tenant and question."""
    entry_id, similarity, features, level, exact, nonce = ticket
    feats = None if features is None else [float(f) for f in features]
    digest = codec.query_digest(query, scope)
    fields = [tenant, digest, entry_id, float(similarity), feats, level, exact, nonce]
    packed = msgpack.packb(fields)
    return TOKEN_PREFIX + base64.urlsafe_b64encode(packed).decode().rstrip("=")


def decode_ticket(token: object, tenant: str, query: str, scope: str) -> Ticket:
    """The ticket of a verify token (``encode_ticket``) for ``query`` of ``tenant``.

    Raises:
        InvalidEntryError: not a verify token, or one for another tenant or question.
    """
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX) or len(token) > 4096:
        raise InvalidEntryError("verify_token is not a token a lookup returned")
    body = token[len(TOKEN_PREFIX) :]
    try:
        raw = msgpack.unpackb(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        t, digest, entry_id, similarity, feats, level, exact, nonce = raw
        similarity = float(similarity)
        features = None if feats is None else tuple(float(f) for f in feats)
        level, exact = int(level), bool(exact)
    except (ValueError, TypeError, binascii.Error, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError):  # fmt: skip
        raise InvalidEntryError("verify_token is not a token a lookup returned") from None
    if t != tenant or digest != codec.query_digest(query, scope):
        raise InvalidEntryError("verify_token was given for another tenant or question")
    if not isinstance(entry_id, str) or not isinstance(nonce, str) or not math.isfinite(similarity):
        raise InvalidEntryError("verify_token is not a token a lookup returned")
    if features is not None and not SEARCH_FEATURES <= len(features) <= len(FEATURES):
        raise InvalidEntryError("verify_token is not a token a lookup returned")
    return Ticket(entry_id, similarity, features, level, exact, nonce)


class Verifier:
    """The verifications of one replica: the tickets its lookups leave, and the flows
    that settle them when the app's put brings the fresh answer. Every signal the cache
    learns from, a verification's or the app's feedback, goes through ``learn_flow``.

    Args:
        storage: the manager's storage.
        learner: the replica's bandit learner (it notes every signal).
        policies: the replica's cache of tenant policies.
        same_answer: labels a verification: is the cached answer the same as the fresh
            one?
    """

    def __init__(
        self,
        storage: Storage,
        learner: CachePolicyLearner,
        policies: PolicyCache,
        same_answer: SameAnswer,
    ) -> None:
        self.storage = storage
        self.learner = learner
        self.policies = policies
        self.same_answer = same_answer
        #: Verifications asked for, by ``ticket_key``: what the lookup held back.
        self.tickets = ContextCache(max_size=10_000, ttl_seconds=TICKET_TTL_S)

    def hold(self, tenant: str, query: str, scope: str, ticket: Ticket) -> None:
        """Ask the app's next put of ``query`` (in ``scope``) to verify ``ticket``."""
        self.tickets.put(ticket_key(tenant, query, scope), ticket)

    def verify_flow(
        self, tenant: str, ticket: Ticket, fresh: str, query: str | None = None
    ) -> Flow[Comparison]:
        """Compare the fresh answer with the candidate a lookup held back, and learn from
        it: one label of the tenant's calibration (with the match's features, the text
        differences between ``query``, the question asked, and the candidate's own
        included), one signal on the entry's arm (at the similarity it was matched at).

        The question's own entry may carry a dispute (``dispute_flow``): an earlier
        fresh answer disagreed with it, and it was counted wrong meanwhile. This answer
        settles it: the same as the cached one, that label turns right; otherwise it
        stands (and ``Comparison.agrees_with_dispute`` says whether the two fresh answers
        agree)."""
        entry_id, similarity, features, level, exact, nonce = ticket
        st = self.storage
        try:
            parts: list[ReadPlan[Any]] = [st.read_entry(tenant, entry_id, with_vector=False)]
            if exact:  # in the same round trip
                parts.append(st.read_dispute(tenant, entry_id))
            if nonce:
                parts.append(st.claim_ticket(tenant, nonce, TICKET_TTL_S))
            replies = yield from st.read_flow(st.batch("verify", parts))
            cached: IntelligentCacheEntry = replies[0]
            dispute: Dispute | None = replies[1] if exact else None
            if nonce and not replies[-1]:  # settled already, by another put
                log.debug("tenant %s: verification of %s settled already", tenant, entry_id)
                return Comparison(None, None)
        except (EntryNotFoundError, CorruptEntryError) as exc:  # gone or unreadable: no label
            log.debug("tenant %s: verification of %s dropped: %s", tenant, entry_id, exc)
            return Comparison(None, None)
        try:  # a step: an async judge (an LLM call) is awaited by the async driver
            right = bool((yield call(self.same_answer, cached.response, fresh)))
            agrees = False
            if dispute is not None and not right:
                agrees = bool((yield call(self.same_answer, dispute.answer, fresh)))
        except Exception as exc:  # the answer is stored: a failing judge labels nothing
            log.warning("tenant %s: same_answer failed, no label: %r", tenant, exc)
            return Comparison(None, cached)
        # An HNSW index re-scores from float16 vectors: a match can come out a hair over 1.
        sim = min(1.0, max(-1.0, similarity))
        signal = FeedbackSignal(entry_id, tenant, right, source="verify", similarity=sim)
        if features is not None:
            features = (sim, *features[1:])
            if query is not None:
                asked, theirs = text_match.sketch(query), text_match.sketch(cached.query)
                features = with_text(features, text_match.differences(asked, theirs))
        yield from self.learn_flow(signal, label=True, features=features, level=level)
        if dispute is not None:
            plan = st.plan_resolve(tenant, entry_id, dispute.level, right, dispute.nonce)
            yield from st.run_flow(plan)
        return Comparison(right, cached, dispute is not None, agrees)

    def dispute_flow(
        self,
        tenant: str,
        entry_id: str,
        level: int,
        fresh: str,
        settings: dict[str, Any] | None = None,
    ) -> Flow[str | None]:
        """Record on the question's own entry ``entry_id`` (at ``level``) the fresh answer
        that disagreed with it, and the put's own ``settings`` (``put.put_settings``):
        one disagreement is not a verdict (an LLM errs too), so the entry stays, counted
        wrong meanwhile, and it is held out (under a bound its next exact repeat is
        verified) until the next verification settles it (``verify_flow``), or the
        user's reaction to the fresh answer (``PutSteps.react_flow``). Returns the
        dispute's nonce, which names it to a reaction (``PutResult.dispute_id``); None
        when it could not be recorded (the entry is gone, or a full server refused it):
        the fresh answer is then stored as usual."""
        nonce = new_nonce()
        plan = self.storage.plan_dispute(tenant, entry_id, level, fresh, settings, nonce)
        try:
            recorded = yield from self.storage.run_flow(plan)
        except StorageError as exc:
            log.debug("tenant %s: dispute not recorded: %s", tenant, exc)
            return None
        return nonce if recorded else None

    def confirm_flow(self, tenant: str, entry_id: str, policy: TenantPolicy) -> Flow[None]:
        """A fresh answer two verifications agree on: a positive signal on its entry."""
        agree = FeedbackSignal(entry_id, tenant, True, source="verify")
        yield from self.storage.feedback_flow(agree, rl=policy.rl)

    def learn_flow(
        self,
        signal: FeedbackSignal,
        *,
        label: bool = False,
        features: Features | None = None,
        level: int = 0,
    ) -> Flow[FeedbackOutcome]:
        """Apply a signal to the entry's arm and count it as a labelled outcome of a near
        match (at the similarity it carries, below 1) when ``label`` (a verification) or
        when an error bound is known for the tenant (this replica's cached policy or the
        config). The label is counted only once the signal was applied. ``level``: a
        verified exact repeat's entry's level at its lookup. Returns what the feedback
        script did (``FeedbackOutcome.wrong``: the wrong hit it counted, if any)."""
        tenant, sim = signal.tenant_id, signal.similarity
        policy = yield from self.policies.policy_flow(tenant)
        label = label or policy.bound() is not None
        outcome = yield from self.storage.feedback_flow(signal, rl=policy.rl)
        # A label of a near match (below similarity 1); at 1, only a verification of an
        # exact repeat is one, counted apart at its entry's level.
        exact = sim is not None and sim >= 1.0
        if label and sim is not None and (not exact or signal.source == "verify"):
            plan = plan_label(
                self.storage,
                tenant,
                sim,
                signal.positive,
                window=policy.config.label_window,
                features=features,
                model=policy.calibration.model,
                exact=exact,
                level=level,
            )
            yield from self.storage.run_flow(plan)
        self.learner.note_feedback(signal)
        return outcome


__all__ = [
    "TICKET_TTL_S",
    "TOKEN_PREFIX",
    "Comparison",
    "SameAnswer",
    "Ticket",
    "Verifier",
    "decode_ticket",
    "encode_ticket",
    "new_nonce",
    "same_meaning",
    "same_text",
    "ticket_key",
]
