"""The path of a put (``CacheEngine.put``), as named steps (``PutSteps.put_flow``).

The answer is checked and admitted first (``PutSteps.admit``). A put stores the fresh
answer of the app's LLM, and that answer settles what the lookup before it asked for: a
verification of the question's own entry, held back under an error bound
(``settle_own_flow``: the same answer keeps the entry, with one more positive signal; a
first disagreement keeps it too, disputed, and stores nothing), or of a near match
(``verify_flow``, through ``Verifier.verify_flow``). The verification is the one a
lookup on this replica left, or the one a verify token carries from any replica
(``decide``). Then the put
script writes the entry (``Storage.put_flow``), and the entries it replaces (the same
question, a near duplicate under ``dedup_threshold``) are evicted.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from zerda_cache.companions.context import AdaptiveLearningSystem
from zerda_cache.core.entry import FeedbackSignal, LLMUsage
from zerda_cache.core.errors import InvalidEmbeddingError, StorageError
from zerda_cache.core.results import DisputeSignal, PutResult
from zerda_cache.core.validation import check_query, check_response, check_scope, check_tags
from zerda_cache.flows.admission import AdmissionCheck
from zerda_cache.flows.counting import record_window
from zerda_cache.flows.ranking import LocalClock
from zerda_cache.flows.verification import (
    Comparison,
    Ticket,
    Verifier,
    decode_ticket,
    ticket_key,
)
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.learning.tenant_state import PolicyCache
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.replica.indexes import ReplicaIndexes
from zerda_cache.storage.codec import Vector
from zerda_cache.storage.driver import Flow
from zerda_cache.storage.keys import TenantKeys
from zerda_cache.storage.plans import FeedbackOutcome, PutFields, PutOutcome, ReadPlan
from zerda_cache.storage.store import Storage
from zerda_cache.storage.tenant_plans import DisputeSettled

log = logging.getLogger(__name__)


class PutSteps:
    """The steps of a put over one replica's storage, indexes and verifications.

    Args:
        storage: the manager's storage.
        indexes: the replica's indexes (a near duplicate is found in them).
        policies: the replica's cache of tenant policies.
        verifier: the replica's verifications (the tickets its lookups left).
        clock: the storage clock, estimated locally.
        metrics: the replica's metrics.
        admission: the admission check of every answer.
        adaptive: the replica's rolling windows (``counting.record_window``).
        embed: the flow that embeds a question (``CacheEngine.embedding_flow``).
    """

    def __init__(
        self,
        storage: Storage,
        indexes: ReplicaIndexes,
        policies: PolicyCache,
        verifier: Verifier,
        clock: LocalClock,
        metrics: ReplicaMetrics,
        admission: AdmissionCheck,
        adaptive: AdaptiveLearningSystem,
        embed: Callable[[str, object | None], Flow[Vector | None]],
    ) -> None:
        self.storage = storage
        self.config = storage.config
        self.indexes = indexes
        self.policies = policies
        self.verifier = verifier
        self.clock = clock
        self.metrics = metrics
        self.admission = admission
        self.adaptive = adaptive
        self.embed = embed

    def put_flow(
        self,
        query: str,
        response: str,
        tenant: str,
        embedding: object | None,
        ttl_s: float | None,
        quality: float | None,
        metadata: Mapping[str, Any] | None,
        scope: str | None,
        tags: Sequence[str] | None,
        usage: LLMUsage | Mapping[str, Any] | None,
        verify_token: str | None = None,
    ) -> Flow[PutResult]:
        """``CacheEngine.put``: check, embed and admit the answer (``admit``), settle a
        verification of the question's own entry (``settle_own_flow``: it may keep that
        entry, or record a dispute on it instead of storing), find a near duplicate,
        store, settle a verification of a near match, evict what the entry replaced.
        ``verify_token``: the verification a lookup on any replica asked for
        (``verification.encode_ticket``); without it, the one this replica's left."""
        try:
            query = check_query(query, self.config.max_query_chars)
            scope = check_scope(scope)
            # checked before anything is written (a verification below writes labels)
            tag_names = check_tags(tags) if tags is not None else ()
            cost_of = LLMUsage.of(usage)
            token = None
            if verify_token is not None:  # checked before anything is written too
                token = decode_ticket(verify_token, tenant, query, scope)
            vec = yield from self.embed(query, embedding)
            if vec is None:
                raise InvalidEmbeddingError(NO_EMBEDDING)
            passed, warnings = self.admit(tenant, query, response, metadata)
            policy = yield from self.policies.policy_flow(tenant)
            if not passed:
                reason = warnings[0] if warnings else "admission check failed"
                return PutResult(False, reason=reason, warnings=tuple(warnings), tenant=tenant)
            held_key = ticket_key(tenant, query, scope)
            mine = self.verifier.tickets.pop(held_key)
            held = token if token is not None else mine
            own: Comparison | None = None
            settings = put_settings(ttl_s, quality, metadata, tag_names, cost_of)
            if held is not None and held.exact:
                own, settled = yield from self.settle_own_flow(
                    tenant, held, response, settings, warnings
                )
                if settled is not None:
                    return settled
        except StorageError:
            self.metrics.storage_errors.labels("put").inc()
            raise

        def verify(result: PutResult) -> Flow[PutResult]:
            assert held is not None
            return (yield from self.verify_flow(tenant, held, own, query, response, result, policy))

        stored = Stored(tenant, query, response, vec, scope, put_fields(settings))
        settle = verify if held is not None else None
        return (yield from self.store_flow(stored, policy, warnings, settle=settle))

    def store_flow(
        self,
        put: Stored,
        policy: TenantPolicy,
        warnings: list[str],
        *,
        approves: tuple[str, str] | None = None,
        settle: Callable[[PutResult], Flow[PutResult]] | None = None,
    ) -> Flow[PutResult]:
        """The end of every put (``put_flow``, and ``react_flow``'s of an approved
        answer): store the answer (``Storage.put_flow``; ``approves``: the dispute whose
        answer it is, ``plan_approve``) and evict the entries it replaced: the
        question's own, whose digest the put script moved, a near duplicate under
        ``dedup_threshold``, the entry whose dispute it approves. ``settle`` (a
        verification's) runs on the result before they go: it may compare one of them.
        A storage error counts in ``storage_errors{put}``."""
        tenant = put.tenant
        try:
            near: str | None = None
            dedup = policy.config.dedup_threshold
            if dedup is not None:
                keys = self.storage.keys(tenant)
                near = yield from self.near_duplicate_flow(keys, put.vec, put.scope, dedup)
            indexed = self.indexes.get(tenant)
            fields: PutFields = {
                **put.fields,
                "scope": put.scope,
                "index_dim": indexed.dim if indexed is not None and indexed.usable else None,
                "rl": policy.rl,
            }
            args = (tenant, put.query, put.response, put.vec)
            out = yield from self.storage.put_flow(*args, approves=approves, **fields)
            disputed = approves[0] if approves is not None else None
            replaced, result = self.stored(tenant, warnings, out, near, disputed)
            if settle is not None:
                result = yield from settle(result)
            if replaced:
                gone = [(e, None) for e in replaced]
                yield from self.storage.evict_flow(tenant, gone, "replaced")
            return result
        except StorageError:
            self.metrics.storage_errors.labels("put").inc()
            raise

    def admit(
        self, tenant: str, query: str, response: object, metadata: Mapping[str, Any] | None
    ) -> tuple[bool, list[str]]:
        """Check the answer (``check_response``) and run the admission check on it:
        ``(passed, warnings)``, counted in the replica's windows and metrics."""
        response = check_response(response, self.config.max_response_bytes)
        started = time.perf_counter()
        passed, warnings = self.admission(query, response, metadata or {})
        record_window(self.adaptive, query, len(response), 0, time.perf_counter() - started, passed)
        label = self.metrics.tenant(tenant)
        if not passed:
            reason = warnings[0] if warnings else "admission check failed"
            self.metrics.puts.labels(label, "rejected").inc()
            self.metrics.puts_rejected.labels(reason_label(reason)).inc()
        return passed, list(warnings)

    def settle_own_flow(
        self,
        tenant: str,
        held: Ticket,
        response: str,
        settings: dict[str, Any],
        warnings: list[str],
    ) -> Flow[tuple[Comparison, PutResult | None]]:
        """Verify the question's own entry, which the lookup before held back, against
        the fresh answer: ``(the comparison, the result when the put ends here)``.

        The same answer keeps the entry, with this verification's positive signal on top
        of its evidence (replaced by the fresh entry, its arm would start again from one
        signal, and its exact repeats' level with it), unless it has expired or the put
        sets a TTL, quality, metadata, tags or usage of its own (``settings``,
        ``put_settings``).

        A different answer is not a verdict on its own (an LLM errs too): the first
        disagreement keeps the cached entry and records the fresh answer on it as a
        dispute (``Verifier.dispute_flow``), with the put's ``settings``; the fresh
        answer is not stored (the result's ``disputed`` says so), and the entry is held
        out until its next verification. That one settles it: the same as the cached
        answer, the entry stays; a different one replaces it (confirmed when it agrees
        with the disputed answer). The user's reaction to the disputed answer settles it
        too (``react_flow``)."""
        own = yield from self.verifier.verify_flow(tenant, held, response)
        cached, label = own.cached, self.metrics.tenant(tenant)
        if cached is None or own.same is None:
            return own, None
        if own.same:
            if settings:
                return own, None
            now = yield from self.clock.now_flow()
            if cached.is_expired(now):
                return own, None
            self.metrics.puts.labels(label, "kept").inc()
            kept = PutResult(
                True,
                held.entry_id,
                warnings=tuple(warnings),
                tenant=tenant,
                verified=True,
                compared_id=held.entry_id,
            )
            return own, kept
        if own.settled:  # the second disagreement: the fresh answer replaces it
            return own, None
        dispute = self.verifier.dispute_flow(tenant, held.entry_id, held.level, response, settings)
        nonce = yield from dispute
        if nonce is None:
            return own, None
        self.metrics.puts.labels(label, "disputed").inc()
        disputed = PutResult(
            False,
            reason=DISPUTED,
            warnings=tuple(warnings),
            tenant=tenant,
            verified=False,
            compared_id=held.entry_id,
            disputed=True,
            dispute_id=nonce,
        )
        return own, disputed

    def verify_flow(
        self,
        tenant: str,
        ticket: Ticket,
        own: Comparison | None,
        query: str,
        response: str,
        result: PutResult,
        policy: TenantPolicy,
    ) -> Flow[PutResult]:
        """The verification of the stored answer: of the question's own entry, settled
        before the put (``own``), or of a near match the lookup before held back,
        settled now. The result says whether the two answers were the same. Two answers
        that agree confirm the fresh one too (under a bound, its exact repeats are then
        served without another verification)."""
        if own is None:
            own = yield from self.verifier.verify_flow(tenant, ticket, response, query)
            agree = own.same
        else:  # the question's own entry: a fresh answer agreeing with a disputed one too
            agree = own.same or own.agrees_with_dispute
        if agree and result.entry_id != ticket.entry_id and result.entry_id is not None:
            yield from self.verifier.confirm_flow(tenant, result.entry_id, policy)
        return dataclasses.replace(result, verified=own.same, compared_id=ticket.entry_id)

    def feedback_flow(self, signal: FeedbackSignal) -> Flow[FeedbackOutcome | None]:
        """``CacheEngine.feedback``: a signal about an entry's answer goes on its arm
        (``Verifier.learn_flow``, whose outcome says whether it counted a wrong hit); one
        about the answer a dispute on it recorded (``DisputeSignal``, from a disputed put's
        ``PutResult.feedback``) settles that dispute (``react_flow``: no hit to count)."""
        if isinstance(signal, DisputeSignal):
            yield from self.react_flow(signal)
            return None
        return (yield from self.verifier.learn_flow(signal))

    def react_flow(self, signal: DisputeSignal) -> Flow[None]:
        """The user's reaction to a disputed fresh answer settles the dispute, as the
        question's next verification would, once. The entry and its dispute are read in
        one round trip. Turned down, the fresh answer was the one that erred: the cached
        entry stays and the wrong label its verification was counted as turns right
        (``resolve.lua``, atomically). Approved, the cached answer stands wrong: the
        fresh one is stored in its place (with the disputed put's own settings), the
        reaction the positive signal on its arm, and the cached entry is evicted, its
        dispute with it. The dispute is not taken away first: until the put is done the
        cached entry stays held out, and a put that fails leaves the dispute for a
        retried reaction; the put script stores the answer only while the dispute is
        there. A dispute settled meanwhile leaves the reaction noted only.

        Raises:
            EntryNotFoundError: the disputed entry is gone.
        """
        tenant, entry_id, st = signal.tenant_id, signal.entry_id, self.storage
        parts: list[ReadPlan[Any]] = [
            st.read_entry(tenant, entry_id, with_vector=True),
            st.read_dispute(tenant, entry_id),
        ]
        cached, dispute = yield from st.read_flow(st.batch("react", parts))
        self.verifier.learner.note_feedback(signal)
        if dispute is None or dispute.nonce != signal.dispute:  # the writes check it too
            log.debug("tenant %s: the dispute on %s was settled already", tenant, entry_id)
            return
        if not signal.positive:
            plan = st.plan_resolve(tenant, entry_id, dispute.level, True, signal.dispute)
            yield from st.run_flow(plan)
            return
        if cached.embedding is None:
            log.warning("tenant %s: %s has no vector: its dispute stays", tenant, entry_id)
            return
        policy = yield from self.policies.policy_flow(tenant)
        put = Stored(
            tenant, cached.query, dispute.answer, cached.embedding, cached.scope,
            put_fields(dispute.put),
        )  # fmt: skip

        def approve(result: PutResult) -> Flow[PutResult]:  # the new entry's first signal
            assert result.entry_id is not None
            approved = FeedbackSignal(
                result.entry_id, tenant, True, signal.magnitude, signal.source, similarity=1.0
            )
            yield from self.verifier.learn_flow(approved)
            return result

        approves = (entry_id, signal.dispute)
        try:
            yield from self.store_flow(put, policy, [], approves=approves, settle=approve)
        except DisputeSettled:
            log.debug("tenant %s: the dispute on %s was settled meanwhile", tenant, entry_id)

    def near_duplicate_flow(
        self, keys: TenantKeys, vec: Vector, scope: str, dedup: float
    ) -> Flow[str | None]:
        """The entry a put replaces as a near duplicate (``dedup_threshold``), found in
        the replica's index: while it is being built (past the bounded wait) only the
        same question is replaced."""
        ti = self.indexes.of(keys)
        if not ti.built:
            yield from self.indexes.await_index(ti, self.indexes.build_wait(ti, True))
        if not ti.usable:
            return None
        yield from self.indexes.refresh(ti)
        self.indexes.check_dim(keys.tenant, ti, vec)
        best = ti.search(vec, scope, 1, dedup)
        return best[0][0] if best else None

    def stored(
        self, tenant: str, warnings: list[str], out: PutOutcome, *near: str | None
    ) -> tuple[list[str], PutResult]:
        """The entries the new one replaces (to evict), and the result."""
        replaced = list(
            dict.fromkeys(e for e in (out.displaced_id, *near) if e and e != out.entry_id)
        )
        self.metrics.puts.labels(self.metrics.tenant(tenant), "stored").inc()
        result = PutResult(
            True,
            out.entry_id,
            warnings=tuple(warnings),
            replaced_id=replaced[0] if replaced else None,
            tenant=tenant,
        )
        return replaced, result


def put_settings(
    ttl_s: float | None,
    quality: float | None,
    metadata: Mapping[str, Any] | None,
    tags: Sequence[str],
    usage: LLMUsage | None,
) -> dict[str, Any]:
    """The settings a put gives of its own (empty: none), as a dispute keeps them
    (``Dispute.put``) for storing its answer should a reaction approve it."""
    given: dict[str, Any] = {"ttl_s": ttl_s, "quality": quality}
    if metadata is not None:
        given["metadata"] = dict(metadata)
    if tags:
        given["tags"] = list(tags)
    if usage is not None:
        given["usage"] = dataclasses.asdict(usage)
    return {k: v for k, v in given.items() if v is not None}


def put_fields(settings: Mapping[str, Any]) -> PutFields:
    """The fields of a put from its settings (``put_settings``; a dispute's ``put``)."""
    fields: PutFields = {}
    for name in ("ttl_s", "quality", "metadata"):
        if settings.get(name) is not None:
            fields[name] = settings[name]
    if settings.get("tags"):
        fields["tags"] = tuple(settings["tags"])
    if settings.get("usage") is not None:
        fields["usage"] = LLMUsage.of(settings["usage"])
    return fields


class Stored(NamedTuple):
    """An answer to store (``PutSteps.store_flow``): its question, vector, scope and the
    put's own fields."""

    tenant: str
    query: str
    response: str
    vec: Vector
    scope: str
    fields: PutFields


#: Why a put whose answer disagreed with the question's own cached entry did not store it.
DISPUTED = (
    "disputed: the cached answer disagrees with this one; it stays, held out until the "
    "next answer settles which is right"
)

#: Why a put without an embedding fails when the manager has no ``embed_fn``.
NO_EMBEDDING = "no embedding: pass embedding=... or create the manager with an embed_fn"


def reason_label(reason: str) -> str:
    """A bounded metric label from a free-form reason: its first few words."""
    words = "".join(c if c.isalnum() else " " for c in reason.lower()).split()
    return "_".join(words[:4]) or "unknown"


__all__ = [
    "DISPUTED",
    "NO_EMBEDDING",
    "PutSteps",
    "Stored",
    "put_fields",
    "put_settings",
    "reason_label",
]
