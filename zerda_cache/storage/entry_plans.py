"""The plans that write entries: put, hit, feedback, decay, evict, restore and a tag's
upkeep. Each is one Lua script call (``storage/lua``), planned without I/O.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Unpack

from zerda_cache.core.config import RLConfig
from zerda_cache.core.entry import (
    CONFIDENCE_WEIGHT,
    DEFAULT_QUALITY,
    DEFAULT_SIMILARITY,
    FeedbackSignal,
    IntelligentCacheEntry,
    LLMUsage,
)
from zerda_cache.core.errors import (
    CorruptEntryError,
    DimensionMismatchError,
    EntryNotFoundError,
    InvalidEntryError,
    ZerdaError,
)
from zerda_cache.core.validation import (
    finite_number,
    new_entry_id,
    validate_entry_id,
)
from zerda_cache.storage import codec
from zerda_cache.storage.codec import text
from zerda_cache.storage.plan_base import PlanBase
from zerda_cache.storage.replies import (
    PEEK_COUNT,
    REASONS,
    DecayOutcome,
    DimensionLost,
    EvictOutcome,
    EvictReason,
    FeedbackOutcome,
    HitOutcome,
    HitStatus,
    LogDelta,
    PutFields,
    PutOutcome,
    ReadPlan,
    ScriptCall,
    StoredEntry,
    entry_of,
    hash_row,
    pairs,
    peek_delta,
    unit_score,
)

log = logging.getLogger(__name__)


class EntryPlans(PlanBase):
    """Script calls that change entries (``StoragePlans`` gathers every plan)."""

    def plan_put(
        self, tenant: str, query: str, response: str, embedding: object, **fields: Unpack[PutFields]
    ) -> ScriptCall[PutOutcome]:
        """Plan storing a new entry (see ``PutFields`` for the optional fields)."""
        k = self.keys(tenant)
        cfg = self.config
        rl = fields.get("rl") or cfg.rl
        metadata, entry_id = fields.get("metadata"), fields.get("entry_id")
        _, doc, scope, tags, usage = codec.checked_doc(
            cfg,
            query,
            response,
            metadata,
            scope=fields.get("scope"),
            tags=fields.get("tags"),
            usage=fields.get("usage"),
        )
        quality, similarity = fields.get("quality"), fields.get("similarity")
        ttl = fields.get("ttl_s")
        if ttl is not None and (
            not isinstance(ttl, int | float) or (finite_number(ttl) or 0.0) <= 0
        ):
            shown = "an int too large for a float" if isinstance(ttl, int) else repr(ttl)
            raise InvalidEntryError(f"ttl_s must be a finite number > 0, got {shown}")
        q = unit_score("quality", DEFAULT_QUALITY if quality is None else quality)
        s = unit_score("similarity", DEFAULT_SIMILARITY if similarity is None else similarity)
        vec = codec.encode_vector(embedding, cfg.vector_storage)
        dim = codec.vector_dim(vec)
        eid = new_entry_id() if entry_id is None else validate_entry_id(entry_id)
        args: list[Any] = [
            self.now_arg(),
            eid,
            doc,
            vec,
            dim,
            codec.query_digest(query, scope),
            scope,
            "" if ttl is None else repr(float(ttl)),
            repr(s),
            repr(q),
            repr(rl.prior_alpha),
            repr(rl.prior_beta),
            cfg.index_log_maxlen,
            repr(float(cfg.default_ttl_s or 0)),
            "" if fields.get("index_dim") is None else str(int(fields["index_dim"] or 0)),
        ]
        keys = [k.entry(eid), k.ids, k.q, k.log, k.stats, k.cfg, k.st]
        if tags or usage is not None:  # a put with neither sends neither (put.lua)
            args += [len(tags), *tags]
            keys += [k.tags, *(k.tag(tag) for tag in tags)]
        if usage is not None:
            args += [usage.model, usage.prompt_tokens, usage.completion_tokens]

        def parse(res: Any) -> PutOutcome:
            code = int(res[0])
            if code == -1:
                raise DimensionMismatchError(tenant, int(res[1]), dim)
            if code == -3:
                raise DimensionLost(tenant, dim)
            if code == -2:
                raise InvalidEntryError(f"entry id {eid} already exists in tenant {tenant!r}")
            displaced = text(res[1]) or None
            return PutOutcome(entry_id=eid, created_at=float(res[2]), displaced_id=displaced)

        return ScriptCall("put", keys, args, parse)

    def plan_restore_dim(self, tenant: str, sample: Sequence[str]) -> ScriptCall[int | None]:
        """Plan reading the tenant's embedding dimension, restored (and stored again) from
        the vectors of the ``sample`` of its ids when its cfg hash lost it: the dimension
        more than half of them hold, else ``None`` (see ``lua/dim.lua``)."""
        k = self.keys(tenant)
        keys = [k.cfg, k.ids, *(k.entry(eid) for eid in sample)]
        return ScriptCall("dim", keys, [], lambda res: int(res) if res else None)

    def read_export(self, tenant: str, entry_ids: Sequence[str]) -> ReadPlan[list[StoredEntry]]:
        """The stored fields of ``entry_ids`` as they are, for an export: doc, vec, meta
        and the learning state (``None`` fields where an entry is gone or partial)."""
        k = self.keys(tenant)
        ids = list(entry_ids)

        def queue(pipe: Any) -> None:
            for eid in ids:
                pipe.hmget(k.entry(eid), ("doc", "vec", "meta"))
            pipe.hmget(k.st, ids)

        def parse(res: list[Any]) -> list[StoredEntry]:
            *rows, states = res
            out = []
            for eid, row, state in zip(ids, rows, states, strict=True):
                key = k.entry(eid)
                try:
                    doc, vec, meta = hash_row(row, key)
                except CorruptEntryError as exc:
                    out.append(StoredEntry(eid, None, None, None, state, corrupt=exc.detail))
                    continue
                out.append(StoredEntry(eid, doc, vec, meta, state))
            return out

        return ReadPlan("export", queue, parse, len(ids) + 1, tolerant=tuple(range(len(ids))))

    def plan_restore_entry(
        self,
        tenant: str,
        entry: StoredEntry,
        *,
        digest: str,
        scope: str,
        dim: int,
        expires_at: float,
        size: int,
        evidence: bool,
        tags: Sequence[str],
    ) -> ScriptCall[bool]:
        """Plan writing back an exported entry whole (``lua/restore_entry.lua``): True
        stored, False skipped (an entry with its id exists). Every value is the
        caller's to check first."""
        k = self.keys(tenant)
        keys = [k.entry(entry.entry_id), k.ids, k.q, k.log, k.stats, k.cfg, k.st, k.ev, k.tags]
        keys += [k.tag(tag) for tag in tags]
        expiry = "+inf" if math.isinf(expires_at) else repr(float(expires_at))
        args = [
            entry.entry_id,
            entry.doc,
            entry.vec,
            entry.meta,
            digest,
            scope,
            dim,
            expiry,
            entry.state,
            size,
            self.config.index_log_maxlen,
            "1" if evidence else "",
            len(tags),
            *tags,
        ]

        def parse(res: Any) -> bool:
            if isinstance(res, list):
                raise DimensionMismatchError(tenant, int(res[1]), dim)
            return bool(int(res))

        return ScriptCall("restore_entry", keys, args, parse)

    def plan_tag_sweep(self, tenant: str, tag: str, ids: Sequence[str]) -> ScriptCall[int]:
        """Plan dropping the ids among ``ids`` that are no longer live from ``tag``'s set,
        and the tag from the tenant's tags once its set is empty (``lua/tag_sweep.lua``)."""
        k = self.keys(tenant)
        keys = [k.tag(tag), k.ids, k.tags]
        return ScriptCall("tag_sweep", keys, [tag, *ids], lambda res: int(res))

    def needs_registration(self, tenant: str) -> bool:
        """True until this process has added ``tenant`` to the global tenant set.

        The set lives in another slot, so it cannot be part of the put script; SADD is
        idempotent and the worker tolerates a tenant without entries.
        """
        return tenant not in self.registered_tenants

    def read_question(self, tenant: str, entry_id: str) -> ReadPlan[str | None]:
        """The question an entry was stored for (its doc's), or ``None`` (gone, or a doc
        that does not decode: that is for the hit script and the worker to report)."""
        key = self.keys(tenant).entry(entry_id)

        def queue(pipe: Any) -> None:
            pipe.hget(key, "doc")

        def parse(res: list[Any]) -> str | None:
            if res[0] is None:
                return None
            try:
                return codec.unpack_doc(res[0], key=key)[0]
            except ZerdaError:
                return None

        return ReadPlan("read question", queue, parse, 1)

    def plan_hit(
        self,
        tenant: str,
        entry_id: str,
        *,
        refresh_ttl: bool = False,
        min_reward: float | None = None,
        similarity: float | None = None,
        rl: RLConfig | None = None,
        asked: str | None = None,
        own_bar: float | None = None,
        rivals: Sequence[tuple[str, float]] = (),
        candidates: Sequence[str] = (),
        peek: str | None = None,
        text: str | None = None,
        own: bool = False,
    ) -> ScriptCall[HitOutcome]:
        """Plan serving ``entry_id``; with ``min_reward`` an arm whose expected reward (at
        now) is below it is not served (status ``unservable``); with ``similarity`` a
        match below the entry's own learned bar is not served (``below_bar``).

        ``asked``: the exact-match digest (``codec.query_digest``) of the question of a
        lookup serving its best near match before it knows whether the question is
        cached itself. If the digest names another entry, this one is not served
        (``not_own``: the lookup ranks that one first); if it names this one, it is
        served as the question's own entry, at similarity 1 and under ``own_bar`` too.
        Whatever the status, the outcome's ``own`` is the entry the digest names.
        ``own_bar`` without ``asked``: this entry is the question's own, under an error
        bound. A disputed entry (``DISPUTED``) is served as a near match to no other question,
        and under a bound not as its question's own (the next answer or a reaction settles it).

        ``rivals`` (with ``asked``): ``(id, similarity)`` of the lookup's candidates
        within ``similarity_tie_margin`` of this one. It is served only if the ranking
        would put it first whatever the Thompson draws (``TIED`` otherwise: nothing
        written). ``candidates``: every candidate's id, this one first and the rivals
        next, whose states come back with any reply but a hit (``HitOutcome.states``),
        so that ranking them then needs no read of its own (hit.lua).

        ``peek`` (with ``asked``): the lookup's position in the tenant's log. The script
        also peeks at the log from there, as ``peek_log`` would, and the outcome's
        ``log`` is that delta: the lookup's one command.

        ``text``: a near match's guard (``Lookup.guard``): the text differences that may
        be served (``MatchModel.text_mask``) and the question's sketch. The entry is
        served only if its own question differs by one of those (``TEXT`` otherwise, with
        ``HitOutcome.text``); the question's own entry is never guarded.

        ``own``: the lookup knows this is the question's own entry (``question_args``)."""
        k = self.keys(tenant)
        key = k.entry(entry_id)
        ids = list(candidates)
        tied = bool(rivals)
        if tied and (
            asked is None or ids[: len(rivals) + 1] != [entry_id, *(r for r, _ in rivals)]
        ):
            raise ValueError("a tie needs the question's digest and its candidates in order")
        args = [
            self.now_arg(),
            entry_id,
            *self.rl_args(rl),
            "1" if refresh_ttl else "0",
            "" if min_reward is None else repr(float(min_reward)),
            "" if similarity is None else repr(float(similarity)),
        ]
        keys = [key, k.ids, k.stats, k.st, k.bad]
        if asked is not None:
            keys += [k.q, k.log]
        if asked is not None or own or own_bar is not None or text or peek is not None:
            args += self.question_args(asked, own_bar, own, peek)
        if tied or text:
            args.append(text or "")
        if tied:
            keys += [k.entry(eid) for eid in ids]
            args += self.tie_args(rl, rivals, ids)
        if asked is not None:
            keys.append(k.cal)  # the label stamp, read last (KEYS[#KEYS])

        parse = self.hit_reply(tenant, entry_id, key, asked, peek, ids if tied else None)
        return ScriptCall("hit", keys, args, parse)

    @staticmethod
    def question_args(
        asked: str | None, own_bar: float | None, own: bool, peek: str | None
    ) -> list[str]:
        """The hit script's ARGV[10..14] (``plan_hit``): the question's digest, its own
        entry's bar, whether this entry is that one as the lookup knows without a digest
        (``own``, or ``own_bar`` given without ``asked``; with a digest the script finds
        it), the peek's position and count. The script is told, never guesses it from
        the similarity: another question may match at 1 (an identical embedding)."""
        if peek is not None and not asked:
            raise ValueError("a peek at the log needs the question's digest")
        if own and asked is not None:
            raise ValueError("with the question's digest, the script finds its own entry")
        bar = "" if own_bar is None else repr(float(own_bar))
        if asked is not None:
            return [asked, bar, "", peek or "", PEEK_COUNT]
        return ["", bar, "1" if own or own_bar is not None else "", "", PEEK_COUNT]

    def hit_reply(
        self,
        tenant: str,
        entry_id: str,
        key: str,
        asked: str | None,
        peek: str | None,
        tie_ids: list[str] | None,
    ) -> Callable[[Any], HitOutcome]:
        """The parser of a hit script's reply (``plan_hit``): wrapped with the digest's
        entry, the peek and the label stamp when the script was given a digest, and
        carrying the candidates' states when a tie (``tie_ids``) was not served."""

        def parse(res: Any) -> HitOutcome:
            own, news, stamp = None, None, None
            if asked:  # the script wraps its reply when it is given a digest
                res, own_raw, peeked, stamp_raw = res
                own = text(own_raw) if own_raw else None
                stamp = int(stamp_raw or 0)
                if peek is not None:
                    events = [] if peeked == 1 else [(eid, pairs(raw)) for eid, raw in peeked]
                    news = peek_delta(events, peek)
            outcome = self.hit_outcome(tenant, entry_id, key, res, own, news, stamp)
            # (served by the script but corrupt here: no states in the reply)
            if tie_ids is not None and int(res[0]) != 1:
                rows, states, scores = res[2]
                batch = self.state_batch(tenant, tie_ids, rows, states, scores)
                return dataclasses.replace(outcome, states=batch)
            return outcome

        return parse

    def tie_args(
        self, rl: RLConfig | None, rivals: Sequence[tuple[str, float]], ids: Sequence[str]
    ) -> list[str]:
        """The hit script's arguments for a tie: the ranking's weights (the same rule as
        ``bandit.score_candidates``; tests/test_tie.py holds the two equal), the
        candidates' ids and the rivals' similarities."""
        cfg = self.config.rl if rl is None else rl
        return [
            repr(cfg.similarity_bonus_scale),
            repr(CONFIDENCE_WEIGHT),
            "1" if cfg.similarity_tie_margin >= 2 else "",  # the seed's order draws all
            str(len(rivals)),
            str(len(ids)),
            *ids,
            *(repr(float(sim)) for _, sim in rivals),
        ]

    def hit_outcome(
        self,
        tenant: str,
        entry_id: str,
        key: str,
        res: Any,
        own: str | None,
        news: LogDelta | None,
        stamp: int | None = None,
    ) -> HitOutcome:
        """The hit script's reply (its status code first) as a ``HitOutcome``."""
        code = int(res[0])
        if code != 1:
            status = _HIT_STATUS[code]
            if status is HitStatus.CORRUPT:
                log.warning("corrupt entry %s not served", key)
            reward = float(res[1]) if code in (-4, -8) and len(res) > 1 else None
            differs = int(res[1]) if code == -9 else None
            return HitOutcome(status, reward=reward, own=own, log=news, stamp=stamp, text=differs)
        try:
            entry = served_entry(tenant, entry_id, key, res)
        except CorruptEntryError as exc:
            log.warning("corrupt entry not served: %s", exc)
            self.suspect(tenant, entry_id, exc)
            return HitOutcome(HitStatus.CORRUPT, own=own, log=news, stamp=stamp)
        before = float(res[4])  # the confidence a ranking would have used
        return HitOutcome(
            HitStatus.SERVED, entry, ranked_confidence=before, own=own, log=news, stamp=stamp
        )

    def plan_feedback(
        self, signals: Sequence[FeedbackSignal], *, rl: RLConfig | None = None
    ) -> ScriptCall[list[FeedbackOutcome | ZerdaError]]:
        """Plan one script call applying ``signals`` (all of one tenant), in order, with
        the bandit parameters ``rl`` (the tenant's policy; default: the configuration's).

        The reply holds, per signal, the entry's new learning state or the error for it
        (``EntryNotFoundError``, ``CorruptEntryError``).
        """
        sigs = list(signals)
        tenant = sigs[0].tenant_id
        k = self.keys(tenant)
        keys = [k.stats, k.fb, k.ev, k.st]
        args: list[Any] = [self.now_arg(), *self.rl_static(rl)[1]]
        for sig in sigs:
            if sig.tenant_id != tenant:
                raise ValueError("plan_feedback takes signals of one tenant")
            keys.append(k.entry(sig.entry_id))
            args += [
                sig.entry_id,
                "1" if sig.positive else "0",
                repr(float(sig.magnitude)),
                sig.source,
                repr(float(sig.timestamp)),
                "" if sig.similarity is None else repr(float(sig.similarity)),
                "" if sig.hit is None else str(sig.hit),
            ]

        def parse(res: Any) -> list[FeedbackOutcome | ZerdaError]:
            out: list[FeedbackOutcome | ZerdaError] = []
            for sig, reply in zip(sigs, res, strict=True):
                code = reply[0]
                if code == 1:
                    wrong = None
                    if len(reply) > 3:  # counted a wrong hit: its usage (zc_sound_usage)
                        wrong = LLMUsage(text(reply[3]), int(reply[4]), int(reply[5]))
                    out.append(FeedbackOutcome(sig.entry_id, reply[1], reply[2], wrong))
                elif code == 0:
                    out.append(EntryNotFoundError(tenant, sig.entry_id))
                else:
                    out.append(
                        CorruptEntryError(
                            k.entry(sig.entry_id), "arm, use or meta does not decode; not applied"
                        )
                    )
            return out

        return ScriptCall("feedback", keys, args, parse)

    def plan_decay(
        self,
        tenant: str,
        entry_ids: Sequence[str],
        *,
        fence: int | None = None,
        rl: RLConfig | None = None,
        complete: bool = False,
    ) -> ScriptCall[DecayOutcome]:
        """Plan persisting the decay of ``entry_ids``; ``fence``: the worker's lease epoch
        (a write of an older epoch than the tenant saw is refused: ``FencedError``);
        ``complete``: a full scan of the tenant ends with this call, so its evidence set
        (``ev``, the decay job's work list from now on) holds every arm with evidence."""
        k = self.keys(tenant)
        ids = list(entry_ids)

        def parse(res: Any) -> DecayOutcome:
            decayed, missing, corrupt = res
            bad = [ids[int(i) - 1] for i in corrupt]
            for eid in bad:
                log.warning("decay skipped corrupt entry %s", k.entry(eid))
            return DecayOutcome(int(decayed), int(missing), bad)

        keys = [k.cfg, k.ev, k.st, *(k.entry(eid) for eid in ids)]
        args = [
            self.now_arg(),
            *self.rl_args(rl),
            "" if fence is None else str(int(fence)),
            "1" if complete else "",
            *ids,
        ]
        return ScriptCall("decay", keys, args, parse)

    def plan_evict(
        self,
        tenant: str,
        candidates: Sequence[tuple[str, int | None]],
        reason: EvictReason,
        *,
        fence: int | None = None,
    ) -> ScriptCall[EvictOutcome]:
        if reason not in REASONS:
            raise ValueError(f"unknown eviction reason {reason!r}; use one of {REASONS}")
        k = self.keys(tenant)
        cands = list(candidates)
        keys = [k.ids, k.q, k.log, k.stats, k.cfg, k.ev, k.st]
        keys += [k.entry(eid) for eid, _ in cands]
        args: list[Any] = [
            reason,
            self.config.index_log_maxlen,
            "" if fence is None else str(int(fence)),
        ]
        for eid, ver in cands:
            args += [eid, "" if ver is None else str(int(ver))]

        def parse(res: Any) -> EvictOutcome:
            out = EvictOutcome([], [], [])
            for (eid, _), status in zip(cands, res, strict=True):
                {1: out.removed, 0: out.gone, -1: out.changed}[int(status)].append(eid)
            return out

        return ScriptCall("evict", keys, args, parse)

    # -- read plans ----------------------------------------------------------------------------


#: The hit script's status codes other than 1 (served).
_HIT_STATUS = {
    0: HitStatus.GONE,
    -1: HitStatus.EXPIRED,
    -3: HitStatus.CORRUPT,
    -4: HitStatus.UNSERVABLE,
    -5: HitStatus.BELOW_BAR,
    -6: HitStatus.NOT_OWN,
    -7: HitStatus.TIED,
    -8: HitStatus.DISPUTED,
    -9: HitStatus.TEXT,
}


def served_entry(tenant: str, entry_id: str, key: str, res: Any) -> IntelligentCacheEntry:
    """The entry a hit script served: its doc, state and meta as the reply carries them.

    Raises:
        CorruptEntryError: the doc or meta does not decode.
    """
    query, response, metadata = codec.unpack_doc(res[2], key=key)
    meta = codec.unpack_meta(res[3], key=key)
    arm, use = codec.trusted_state(res[1])
    return entry_of(
        tenant, entry_id, meta, arm, use, query=query, response=response, metadata=metadata
    )
