"""The plans that read a tenant: entries, states and vectors, the log, the labels and
traffic of the error bound, the settings hash and the registry, and the counters a
lookup writes on the way. Planned without I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgpack

from zerda_cache.core.config import RLConfig
from zerda_cache.core.entry import (
    IntelligentCacheEntry,
)
from zerda_cache.core.errors import (
    CorruptEntryError,
    EntryNotFoundError,
    SchemaVersionError,
)
from zerda_cache.core.validation import count_or_zero
from zerda_cache.storage import codec
from zerda_cache.storage.codec import text
from zerda_cache.storage.plan_base import PlanBase
from zerda_cache.storage.replies import (
    CATCHUP_BATCH,
    MAX_LABEL_LOG,
    PEEK_EVENTS,
    SEEN_BATCHES,
    STATE_HASH_FIELDS,
    LabelLogRows,
    LogDelta,
    PutOutcome,
    ReadPlan,
    ScriptCall,
    StateBatch,
    TenantHashes,
    hash_row,
    level_bin,
    log_delta,
    peek_delta,
    sound_vector,
    state_entry,
)

log = logging.getLogger(__name__)


class Dispute(NamedTuple):
    """A dispute an entry carries (``TenantPlans.plan_dispute``, ``dispute.lua``)."""

    #: the entry's exact-repeat level when the verification that disagreed labelled it
    level: int
    #: the fresh answer that disagreed with the entry's
    answer: str
    #: the disputed put's own settings, for storing its answer should a reaction settle
    #: the dispute for it: any of ``ttl_s``, ``quality``, ``metadata``, ``tags`` and
    #: ``usage`` (a mapping, as ``LLMUsage.of`` takes it) the put gave (``put_fields``)
    put: dict[str, Any]
    #: which dispute this is (random, written with it): a reaction names the dispute it
    #: answers (``DisputeSignal.dispute``), and settles only that one; ``""`` for a
    #: dispute written without one
    nonce: str = ""


class DisputeSettled(Exception):
    """The put script's answer when the dispute a reaction approved was settled
    meanwhile (``plan_approve``): nothing stored. Never reaches a caller."""

    def __init__(self, entry_id: str) -> None:
        super().__init__(f"the dispute on {entry_id} was settled meanwhile")


#: The arguments of a put with neither tags nor usage (``put.lua``: ARGV[1 .. 15]).
PUT_ARGS = 15


def exact_bin(level: int) -> str:
    """The calibration bin of exact repeats at ``level``: ``e`` below level 1 (an
    unconfirmed entry), ``e<k>`` at level k. The one rule of the label suffix."""
    return f"e{level}" if level >= 1 else "e"


def dispute_of(raw: bytes | None, key: str) -> Dispute | None:
    """A dispute as ``dispute.lua`` stored it (``None``: none, or undecodable)."""
    if raw is None:
        return None
    try:
        level, answer, *rest = msgpack.unpackb(raw)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        log.warning("undecodable dispute on %s ignored", key)
        return None
    put = rest[0] if rest and isinstance(rest[0], dict) else {}
    nonce = rest[1] if len(rest) > 1 and isinstance(rest[1], str) else ""
    if isinstance(level, bool) or not isinstance(level, int) or not isinstance(answer, str):
        return None
    return Dispute(level, answer, put, nonce)


class TenantPlans(PlanBase):
    """Reads of a tenant and its small writes (``StoragePlans`` gathers every plan)."""

    def read_entry(
        self, tenant: str, entry_id: str, *, with_vector: bool = True
    ) -> ReadPlan[IntelligentCacheEntry]:
        k = self.keys(tenant)
        key = k.entry(entry_id)
        fields = ("doc", "vec", "dg", *STATE_HASH_FIELDS)

        def queue(pipe: Any) -> None:
            pipe.hmget(key, fields)
            pipe.hget(k.st, entry_id)
            pipe.zscore(k.ids, entry_id)
            pipe.hget(k.cfg, "dim")

        def parse(res: list[Any]) -> IntelligentCacheEntry:
            raw, state, score, dim = res
            values = dict(zip(fields, hash_row(raw, key), strict=True))
            if values["doc"] is None:
                raise EntryNotFoundError(tenant, entry_id)
            entry = state_entry(tenant, entry_id, key, values, state, score)
            entry.query, entry.response, entry.metadata = codec.unpack_doc(values["doc"], key=key)
            # Read whole, the entry is checked whole: the vector against its meta and the
            # tenant, the digest field (the worker confirms reported entries this way).
            vec, _ = sound_vector(
                values["vec"], values["meta"], values["dg"], key, int(dim) if dim else None
            )
            if with_vector:
                entry.embedding = vec
            return entry

        return ReadPlan("get_entry", queue, parse, 4, tolerant=(0,))

    def read_audit(self, tenant: str, entry_ids: Sequence[str]) -> ReadPlan[list[str]]:
        """The ids among ``entry_ids`` whose stored content is corrupt: a key of another
        type, a doc, meta or digest that does not decode, a vector that is not of its
        meta's (and the tenant's) dimension or not of unit length. What the scan of
        learning states cannot see; a lost or corrupt state is that scan's to judge
        (a lost one is given the prior, not evicted), a gone entry the scan's too, and
        an entry of another version's schema is not corrupt (a rolling upgrade)."""
        k = self.keys(tenant)
        ids = list(entry_ids)

        def queue(pipe: Any) -> None:
            pipe.hget(k.cfg, "dim")
            for eid in ids:
                pipe.hmget(k.entry(eid), ("doc", "vec", "meta", "dg"))

        def parse(res: list[Any]) -> list[str]:
            dim, *rows = res
            bad = []
            for eid, row in zip(ids, rows, strict=True):
                key = k.entry(eid)
                try:
                    doc, vec, meta, dg = hash_row(row, key)
                    if doc is None and vec is None and meta is None:
                        continue  # gone
                    codec.unpack_doc(doc, key=key)
                    sound_vector(vec, meta, dg, key, int(dim) if dim else None)
                except SchemaVersionError:
                    continue
                except CorruptEntryError as exc:
                    log.warning("corrupt entry: %s", exc)
                    bad.append(eid)
            return bad

        rows = tuple(range(1, len(ids) + 1))
        return ReadPlan("audit", queue, parse, len(ids) + 1, tolerant=rows)

    def read_states(self, tenant: str, entry_ids: Sequence[str]) -> ReadPlan[StateBatch]:
        k = self.keys(tenant)
        ids = list(entry_ids)

        def queue(pipe: Any) -> None:
            for eid in ids:
                pipe.hmget(k.entry(eid), STATE_HASH_FIELDS)
            pipe.hmget(k.st, ids)
            pipe.zmscore(k.ids, ids)

        def parse(res: list[Any]) -> StateBatch:
            *rows, states, scores = res
            return self.state_batch(tenant, ids, rows, states, scores)

        # an entry's hash of another type is that entry's corruption (``hash_row``)
        rows = tuple(range(len(ids)))
        return ReadPlan("load_states", queue, parse, len(ids) + 2, tolerant=rows)

    def plan_raw_states(
        self,
        tenant: str,
        entry_ids: Sequence[str],
        *,
        rl: RLConfig | None = None,
        check_hashes: bool = False,
    ) -> ScriptCall[list[bytes | None]]:
        """Plan reading the states of many entries as stored (``None`` where none; the
        ``state`` script: one HMGET of the state hash, and the move or the return of a
        state for an entry without one there; ``state_arrays_of`` decodes). ``rl``: the
        prior an entry whose state was lost gets (by default the configuration's);
        ``check_hashes``: an entry whose hash is gone reads as gone even if its state
        remains (an EXISTS per entry)."""
        k = self.keys(tenant)
        ids = list(entry_ids)
        args = [self.now_arg(), *self.rl_args(rl)[:2], "1" if check_hashes else "", *ids]
        return ScriptCall(
            "state", [k.st, *(k.entry(eid) for eid in ids)], args, lambda res: list(res or [])
        )

    def read_vectors(
        self, tenant: str, entry_ids: Sequence[str], dim: int | None = None
    ) -> ReadPlan[dict[str, tuple[codec.Vector, str]]]:
        """``{id: (vector, scope)}`` of the entries that exist and are sound (with
        ``dim``: of that dimension). A corrupt one (a key of another type, a vector
        that is not its meta's dimension or not of unit length, a garbage field) is
        left out and reported for the worker to evict."""
        k = self.keys(tenant)
        ids = list(entry_ids)

        def queue(pipe: Any) -> None:
            for eid in ids:
                pipe.hmget(k.entry(eid), ("vec", "meta", "dg"))

        def parse(rows: list[Any]) -> dict[str, tuple[codec.Vector, str]]:
            out: dict[str, tuple[codec.Vector, str]] = {}
            for eid, row in zip(ids, rows, strict=True):
                key = k.entry(eid)
                try:
                    vec, meta, dg = hash_row(row, key)
                    if vec is None and meta is None:
                        continue  # gone
                    out[eid] = sound_vector(vec, meta, dg, key, dim)
                except CorruptEntryError as exc:
                    log.warning("skipping corrupt entry: %s", exc)
                    self.suspect(tenant, eid, exc)
            return out

        return ReadPlan("vectors", queue, parse, len(ids), tolerant=tuple(range(len(ids))))

    def read_stats(self, tenant: str) -> ReadPlan[dict[str, int]]:
        k = self.keys(tenant)

        def queue(pipe: Any) -> None:
            pipe.hgetall(k.stats)
            pipe.zcard(k.ids)

        def parse(res: list[Any]) -> dict[str, int]:
            raw, n = res
            out = {text(f): int(v) for f, v in raw.items()}
            out["entries"] = int(n)
            return out

        return ReadPlan("stats", queue, parse, 2)

    def read_log(self, tenant: str, after: str) -> ReadPlan[LogDelta]:
        """The tenant's log events after stream id ``after`` (``CATCHUP_BATCH`` at most,
        or one more when ``after`` is gone), and whether events may have been trimmed
        away before this reader saw them (then the caller asks ``XINFO``).

        One command: the range from ``after`` itself. A reader's position is the last
        event it read, and the log is trimmed oldest first, so while that event is
        still there nothing after it was trimmed; when the range does not start with it,
        it is gone (trimmed, or the log re-created) or was never an event (the position
        of an index built over an empty log, ``0-0``), and events may be missing. A log
        is trimmed only by the ``XADD`` of a newer event, so an empty range means none
        was. (One command, not an ``XRANGE`` of the oldest event and an ``XREAD``.)"""
        log_key = self.keys(tenant).log

        def queue(pipe: Any) -> None:
            pipe.xrange(log_key, min=after, max="+", count=CATCHUP_BATCH + 1)

        def parse(res: list[Any]) -> LogDelta:
            (events,) = res
            delta = LogDelta()
            if events:
                if text(events[0][0]) == after:
                    events = events[1:]
                else:
                    delta.maybe_trimmed = True
            return log_delta(delta, events)

        return ReadPlan("catch-up", queue, parse, 1)

    def peek_log(self, tenant: str, after: str) -> ReadPlan[LogDelta]:
        """``read_log`` for a lookup: the same delta, read from the log's newest end.

        The forward range first walks the position's stream node (up to 100 events) to
        find it, on the server's thread, at every lookup. Backwards from the newest
        event, a replica that is current (the common case) reads one event. Up to
        ``PEEK_EVENTS`` events after the position come back whole, as from
        ``read_log`` (every one of them: never ``more``); with more (the newest
        ``PEEK_EVENTS`` + 1 only, not the position's event), the delta is ``partial``:
        nothing to apply from it, read the log forward instead."""
        log_key = self.keys(tenant).log

        def queue(pipe: Any) -> None:
            pipe.xrevrange(log_key, max="+", min=after, count=PEEK_EVENTS + 1)

        def parse(res: list[Any]) -> LogDelta:
            return peek_delta(res[0], after)

        return ReadPlan("catch-up", queue, parse, 1)

    def read_dim(self, tenant: str) -> ReadPlan[int | None]:
        """The embedding dimension fixed by the tenant's first put, if any."""
        cfg_key = self.keys(tenant).cfg

        def queue(pipe: Any) -> None:
            pipe.hget(cfg_key, "dim")

        def parse(res: list[Any]) -> int | None:
            return int(res[0]) if res[0] is not None else None

        return ReadPlan("tenant_dim", queue, parse, 1)

    def read_exact(self, tenant: str, query: str, scope: str = "") -> ReadPlan[str | None]:
        """The id the (normalised query, scope) digest points to, if any."""
        return self.read_digest(tenant, codec.query_digest(query, scope))

    def read_digest(self, tenant: str, digest: str) -> ReadPlan[str | None]:
        """The id an exact-match digest (``codec.query_digest``) points to, if any."""
        q_key = self.keys(tenant).q

        def queue(pipe: Any) -> None:
            pipe.hget(q_key, digest)

        def parse(res: list[Any]) -> str | None:
            return text(res[0]) if res[0] is not None else None

        return ReadPlan("exact_match", queue, parse, 1)

    def claim_ticket(self, tenant: str, nonce: str, ttl_s: float) -> ReadPlan[bool]:
        """Mark a verification ticket settled, once: True for the first claim of
        ``nonce`` within ``ttl_s``, False after (a second put with the same token, or
        the replica that left the ticket after another replica's put took its token).
        One ``SET NX``: atomic on its own."""
        key = self.keys(tenant).verification(nonce)

        def queue(pipe: Any) -> None:
            pipe.set(key, 1, nx=True, px=max(1, int(ttl_s * 1000)))

        def parse(res: list[Any]) -> bool:
            return bool(res[0])

        return ReadPlan("claim ticket", queue, parse, 1)

    def read_stamp(self, tenant: str) -> ReadPlan[int]:
        """The tenant's label stamp: the calibration hash's ``lv``, which every label,
        dispute resolution, model publication and settings change bumps, so that a
        replica learns from any lookup's round trip how many labels its policy is behind
        (the hit script returns it too)."""
        cal = self.keys(tenant).cal

        def queue(pipe: Any) -> None:
            pipe.hget(cal, "lv")

        def parse(res: list[Any]) -> int:
            try:
                return int(res[0] or 0)
            except ValueError:
                return 0

        return ReadPlan("label stamp", queue, parse, 1)

    def plan_label(
        self,
        tenant: str,
        row: Sequence[float],
        right: bool,
        bin_: int | str,
        *,
        model_version: int = 0,
        window: int | None = None,
        logged: bool = True,
    ) -> ScriptCall[float]:
        """Plan counting one labelled outcome in the calibration bin ``bin_`` (a score bin,
        or ``e`` / ``e<level>`` for an exact repeat; ``tenant_state.plan_label`` bins it)
        and, if ``logged``, logging the match's features ``row`` for the worker's fit.
        The script counts it only if ``model_version`` is still the tenant's model.
        ``window``: the tenant's ``label_window`` (default: the configuration's), which
        is also the log's length (at most ``MAX_LABEL_LOG``). Returns the label count."""
        window = self.config.label_window if window is None else window
        log_size = min(window, MAX_LABEL_LOG) if logged else 0
        shown = ",".join("null" if not math.isfinite(x) else repr(float(x)) for x in row)
        args = [bin_, "1" if right else "0", window, model_version, shown, log_size]
        keys = [self.keys(tenant).cal, self.keys(tenant).lab]
        return ScriptCall("label", keys, args, lambda res: float(res))

    def plan_dispute(
        self,
        tenant: str,
        entry_id: str,
        level: int,
        fresh: str,
        put: Mapping[str, Any] | None = None,
        nonce: str = "",
    ) -> ScriptCall[bool]:
        """Plan recording on ``entry_id`` (a question's own entry at exact-repeat
        ``level``) the fresh answer ``fresh`` that disagreed with it, with the disputed
        put's own settings ``put`` (``Dispute.put``) and the dispute's ``nonce``; its
        wrong label the entry's next verification may take back (``dispute.lua``)."""
        payload = msgpack.packb([int(level), fresh, dict(put or {}), nonce])
        keys = [self.keys(tenant).entry(entry_id)]
        return ScriptCall("dispute", keys, [payload], lambda res: bool(int(res)))

    def read_dispute(self, tenant: str, entry_id: str) -> ReadPlan[Dispute | None]:
        """The dispute an entry carries (``plan_dispute``)."""
        key = self.keys(tenant).entry(entry_id)

        def queue(pipe: Any) -> None:
            pipe.hget(key, "dsp")

        return ReadPlan("read dispute", queue, lambda res: dispute_of(res[0], key), 1)

    def plan_resolve(
        self, tenant: str, entry_id: str, level: int, was_right: bool, nonce: str
    ) -> ScriptCall[bool]:
        """Plan taking ``entry_id``'s dispute away if it is still the one ``nonce``
        names (``Dispute.nonce``: False otherwise, nothing written); ``was_right``: the
        cached answer was right after all, so its wrong label becomes a right one."""
        k = self.keys(tenant)
        args = ["1" if was_right else "0", exact_bin(level), nonce]
        return ScriptCall("resolve", [k.entry(entry_id), k.cal], args, lambda r: bool(int(r)))

    def plan_approve(
        self, put: ScriptCall[PutOutcome], tenant: str, entry_id: str, nonce: str
    ) -> ScriptCall[PutOutcome]:
        """``put`` (``plan_put``) storing the answer a reaction approved in place of
        ``entry_id``, the entry it disputes: refused (``DisputeSettled``) unless that
        entry still carries the dispute ``nonce`` names (``put.lua``, KEYS[9+N])."""
        args, keys = list(put.args), list(put.keys)
        if len(args) == PUT_ARGS:  # a put with neither tags nor usage sends neither
            args.append(0)
            keys.append(self.keys(tenant).tags)
        if len(args) == PUT_ARGS + 1 + int(args[PUT_ARGS]):  # no usage
            args += ["", "", ""]
        args.append(nonce)
        keys.append(self.keys(tenant).entry(entry_id))

        def parse(res: Any) -> PutOutcome:
            if int(res[0]) == -4:
                raise DisputeSettled(entry_id)
            return put.parse(res)

        return ScriptCall("put", keys, args, parse)

    def plan_calibrate(
        self,
        tenant: str,
        fitted_against: int,
        model: tuple[int, str] | None,
        label_count: int,
        counts: Mapping[str, float],
    ) -> ScriptCall[bool]:
        """Plan publishing a fitted model, ``(version, encoded)``, with its rescored counts
        (``calibrate.lua``): refused (False) if another model was published since
        ``fitted_against``. ``model`` None: record the fit (``label_count``) without
        publishing anything."""
        if model is None:
            args: list[Any] = [fitted_against, "", "", label_count]
        else:
            args = [fitted_against, model[0], model[1], label_count]
        for name, value in counts.items():
            args += [name, repr(float(value))]
        keys = [self.keys(tenant).cal]
        return ScriptCall("calibrate", keys, args, lambda res: bool(int(res)))

    def read_fit_due(self, tenant: str) -> ReadPlan[int]:
        """Labels logged since the tenant's last fit (the worker's cheap check)."""
        cal = self.keys(tenant).cal

        def queue(pipe: Any) -> None:
            pipe.hmget(cal, "ln", "fit_ln")

        def parse(res: list[Any]) -> int:
            logged, fitted = (count_or_zero(v) for v in res[0])
            return logged - fitted

        return ReadPlan("fit due", queue, parse, 1)

    def read_label_logs(self, tenant: str) -> ReadPlan[LabelLogRows]:
        """The tenant's label log, its sample of lookups and the fit counters."""
        k = self.keys(tenant)

        def queue(pipe: Any) -> None:
            pipe.lrange(k.lab, 0, -1)
            pipe.lrange(k.seen, 0, -1)
            pipe.hmget(k.cal, "mv", "ln", "fit_ln")

        def parse(res: list[Any]) -> LabelLogRows:
            return LabelLogRows(res[0], res[1], res[2])

        return ReadPlan("label logs", queue, parse, 3)

    def count_traffic(
        self,
        tenant: str,
        counts: Mapping[tuple[int, int | str], float],
        sample: Sequence[Sequence[float] | str | None] = (),
    ) -> ReadPlan[float]:
        """Count a batch of lookups (``calibration.py``): ``counts`` maps (model version,
        score bin of the best near candidate, or ``"x"`` without one) to lookups; under a
        bound, ``sample`` holds the features of the lookups' best near candidates
        (``None``: none), logged for rescoring under the next model. Plain commands,
        each atomic, like the miss counter; a full server's refusal only loses these
        counts. Parses to the tenant's lookup count (0 when refused)."""
        k = self.keys(tenant)
        cal = k.cal
        items = list(counts.items())
        rows = [list(r) if isinstance(r, tuple | list) else r for r in sample]
        blob = msgpack.packb(rows) if sample else None

        def queue(pipe: Any) -> None:
            for (version, bin_), n in items:
                exact = isinstance(bin_, str) and bin_.startswith("e")
                tag = version if version and not exact else ""  # exact: never tagged
                pipe.hincrbyfloat(cal, f"t{tag}:{bin_}", n)
            if blob is not None:
                pipe.lpush(k.seen, blob)
                pipe.ltrim(k.seen, 0, SEEN_BATCHES - 1)
            # t:e<k> (exact repeats at level k) are a part of t:e: not counted twice
            pipe.hincrbyfloat(cal, "tn", sum(n for (_, b), n in items if not level_bin(b)))

        def parse(res: list[Any]) -> float:
            if isinstance(res[-1], Exception):
                log.warning("tenant %s: lookups not counted: %s", tenant, res[-1])
                return 0.0
            return float(res[-1])

        size = len(items) + 1 + (2 if blob is not None else 0)
        return ReadPlan("count traffic", queue, parse, size, tolerant=tuple(range(size)))

    def plan_halve_traffic(self, tenant: str, window: int) -> ScriptCall[float]:
        """Plan halving the tenant's lookup counts if they passed ``window``."""
        return ScriptCall("traffic", [self.keys(tenant).cal], [window], lambda res: float(res))

    def read_tenant(self, tenant: str) -> ReadPlan[TenantHashes]:
        """The tenant's settings and labelled outcomes, raw (``tenant_state.read_policy``
        resolves them into the policy a process applies)."""
        k = self.keys(tenant)

        def queue(pipe: Any) -> None:
            pipe.hgetall(k.cfg)
            pipe.hgetall(k.cal)

        def parse(res: list[Any]) -> TenantHashes:
            return TenantHashes(res[0], res[1])

        return ReadPlan("policy", queue, parse, 2)

    def plan_adopt(self, tenant: str, entry_ids: Sequence[str]) -> ScriptCall[int]:
        """Plan taking back entries whose hash outlived the tenant's ids zset
        (``adopt.lua``): returns how many were orphans."""
        k = self.keys(tenant)
        ids = list(entry_ids)
        keys = [k.ids, k.q, k.log, *(k.entry(eid) for eid in ids)]
        args = [self.config.index_log_maxlen, *ids]
        return ScriptCall("adopt", keys, args, lambda res: int(res))

    def plan_settings(self, tenant: str, changes: Mapping[str, str]) -> ScriptCall[int]:
        """Plan one change of the tenant's settings (validated and encoded by
        ``policy.check_changes``; '' clears): returns the new policy version."""
        args: list[Any] = []
        for name, value in changes.items():
            args += [name, value]
        keys = [self.keys(tenant).cfg, self.keys(tenant).cal]
        return ScriptCall("settings", keys, args, lambda res: int(res))

    def register(self, tenant: str) -> ReadPlan[Exception | None]:
        """Add ``tenant`` to the global registry (idempotent; best effort: a refusal,
        such as OOM on a full server, is returned, not raised). Lookups send
        it with every policy refresh: a FLUSHALL or an allkeys-* eviction of the set
        would otherwise hide the tenant from the worker for good."""
        key = self.tenants_key

        def queue(pipe: Any) -> None:
            pipe.sadd(key, tenant)

        def parse(res: list[Any]) -> Exception | None:
            return res[0] if isinstance(res[0], Exception) else None

        return ReadPlan("register tenant", queue, parse, 1, tolerant=(0,))

    def count_misses(self, tenant: str, n: int) -> ReadPlan[None]:
        """Add ``n`` to the tenant's miss counter (an atomic HINCRBY: no script needed)."""
        stats_key = self.keys(tenant).stats

        def queue(pipe: Any) -> None:
            pipe.hincrby(stats_key, "misses", n)

        def parse(res: list[Any]) -> None:
            if isinstance(res[0], Exception):  # e.g. OOM on a full server: a count lost
                log.warning("tenant %s: %d misses not counted: %s", tenant, n, res[0])

        return ReadPlan("count misses", queue, parse, 1, tolerant=(0,))
