"""Storage plans: everything about Redis that does no I/O.

Keys, argument validation, the arguments of every script, the commands of every read,
and the parsing of every reply live here, as plans: a ``ScriptCall`` (one Lua script
invocation) or a ``ReadPlan`` (plain commands queued on one pipeline, one round trip).
``batch`` joins several plans into one pipeline. The flows of ``store.py`` execute plans
through a driver (``driver.py``), so the sync and asyncio flavours share every line here.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, TypedDict, TypeVar, Unpack, get_args

import msgpack
import numpy as np

from zerda_cache.config import CacheConfig, RLConfig
from zerda_cache.entry import (
    CONFIDENCE_WEIGHT,
    DEFAULT_QUALITY,
    DEFAULT_SIMILARITY,
    BanditArm,
    FeedbackSignal,
    IntelligentCacheEntry,
    LLMUsage,
)
from zerda_cache.errors import (
    CorruptEntryError,
    DimensionMismatchError,
    EntryNotFoundError,
    InvalidEntryError,
    SchemaVersionError,
    StorageError,
    ZerdaError,
)
from zerda_cache.storage import codec
from zerda_cache.storage.codec import text
from zerda_cache.storage.keys import TenantKeys, tenant_keys, tenants_key
from zerda_cache.validation import (
    check_query,
    check_response,
    check_scope,
    check_tags,
    finite_number,
    new_entry_id,
    validate_entry_id,
)

log = logging.getLogger(__name__)

#: Signals per feedback script call in ``feedback_many`` (bounds the time one call blocks
#: the server: a few milliseconds).
FEEDBACK_BATCH = 200
#: Why an entry was removed, as counted in the stats hash (``evicted:<reason>``).
EvictReason = Literal["expired", "low_reward", "capacity", "invalidated", "replaced", "corrupt"]
REASONS: tuple[EvictReason, ...] = get_args(EvictReason)
#: Events read per log read (XRANGE) while catching up.
CATCHUP_BATCH = 1_000
#: Events a lookup's peek at the log returns at most (``peek_log``, an XREVRANGE): a
#: replica further behind reads the log forward, in batches, instead.
PEEK_EVENTS = 64
_PEEK_COUNT = str(PEEK_EVENTS + 1)  # the XREVRANGE's COUNT: the position's event too


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """An entry's stored fields as they are in Redis (an export's unit)."""

    entry_id: str
    doc: bytes | None
    vec: bytes | None
    meta: bytes | None
    state: bytes | None


class DimensionLost(Exception):
    """The put script's answer when the tenant's dimension is gone from its cfg hash
    while entries remain, and the caller named none: ``Storage.put`` restores it from
    the entries (``plan_restore_dim``) and puts again. Never reaches a caller."""

    def __init__(self, tenant: str, dim: int) -> None:
        super().__init__(f"tenant {tenant!r}: its embedding dimension is lost")
        self.dim = dim  # the put's own


@dataclass(frozen=True, slots=True)
class PutOutcome:
    entry_id: str
    created_at: float
    #: The entry that the same (query, scope) pointed to before, if any: it is no longer
    #: reachable by exact match and is usually removed with reason "replaced".
    displaced_id: str | None


class HitStatus(enum.StrEnum):
    """What the hit script did with an entry."""

    SERVED = "served"
    GONE = "gone"  #: evicted or invalidated since the index saw it
    EXPIRED = "expired"
    CORRUPT = "corrupt"  #: its stored state does not decode: never served
    UNSERVABLE = "unservable"  #: expected reward (at now) under the serving bar
    BELOW_BAR = "below_bar"  #: the match is under the entry's own similarity bar
    #: the question asked has an entry of its own, another one (a speculative near match)
    NOT_OWN = "not_own"
    #: a rival within the tie margin may rank above it: the lookup ranks them itself
    TIED = "tied"


@dataclass(frozen=True, slots=True)
class HitOutcome:
    """Result of the hit script: ``entry`` (full content, arm at now) when served;
    ``reward``, the arm's expected reward at now, when it was under the bar."""

    status: HitStatus
    entry: IntelligentCacheEntry | None = None
    reward: float | None = None
    #: the candidates' states, read by a refused hit with rivals (``plan_hit``)
    states: StateBatch | None = None
    #: the served entry's confidence before this use counted (``entry`` has it after),
    #: the one a ranking of it used
    ranked_confidence: float | None = None
    #: the id the question's exact-match digest names, if any (with ``asked``: the
    #: script reads it for every reply, and the lookup nowhere else)
    own: str | None = None
    #: with ``peek``: what the script's peek at the log found (``peek_log``'s delta)
    log: LogDelta | None = None

    @property
    def served(self) -> IntelligentCacheEntry | None:
        """The entry, if it was served."""
        return self.entry if self.status is HitStatus.SERVED else None


@dataclass(slots=True)
class StateArrays:
    """The learning state of a batch of entries as columns (the worker's fast path).

    ``ids[i]`` has ``alpha[i]``, ``beta[i]``, ... Entries gone meanwhile are left out;
    undecodable ones are listed in ``corrupt``.
    """

    ids: list[str]
    alpha: np.ndarray
    beta: np.ndarray
    decayed_at: np.ndarray
    usage_count: np.ndarray
    last_access: np.ndarray
    confidence: np.ndarray
    version: np.ndarray
    size: np.ndarray
    corrupt: list[str] = field(default_factory=list)

    @staticmethod
    def concat(parts: Sequence[StateArrays]) -> StateArrays:
        """The rows of ``parts``, in order, as one batch."""
        if len(parts) == 1:
            return parts[0]
        columns = {
            f.name: np.concatenate([getattr(p, f.name) for p in parts])
            for f in dataclasses.fields(StateArrays)
            if f.name not in ("ids", "corrupt")
        }
        return StateArrays(
            ids=[eid for p in parts for eid in p.ids],
            corrupt=[eid for p in parts for eid in p.corrupt],
            **columns,
        )

    def only(self, wanted: set[str]) -> StateArrays:
        """The rows (and corrupt ids) whose ids are in ``wanted``."""
        rows = np.fromiter((eid in wanted for eid in self.ids), dtype=bool, count=len(self.ids))
        columns = {
            f.name: getattr(self, f.name)[rows]
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }
        return StateArrays(
            ids=[eid for eid in self.ids if eid in wanted],
            corrupt=[eid for eid in self.corrupt if eid in wanted],
            **columns,
        )


class FeedbackOutcome:
    """An entry's learning state right after a feedback signal, decoded on first use
    (feedback is a hot path and most callers never look)."""

    __slots__ = ("_arm", "_raw_arm", "_raw_use", "_use", "entry_id")

    def __init__(self, entry_id: str, raw_arm: bytes, raw_use: bytes) -> None:
        self.entry_id = entry_id
        self._raw_arm, self._raw_use = raw_arm, raw_use
        self._arm: BanditArm | None = None
        self._use: codec.Use | None = None

    @property
    def bandit_arm(self) -> BanditArm:
        if self._arm is None:
            self._arm = codec.trusted_arm(self._raw_arm)
        return self._arm

    @property
    def use(self) -> codec.Use:
        if self._use is None:
            self._use = codec.trusted_use(self._raw_use)
        return self._use

    @property
    def expected_reward(self) -> float:
        return self.bandit_arm.expected_reward

    @property
    def confidence_score(self) -> float:
        return self.use.confidence

    @property
    def version(self) -> int:
        return self.use.version

    def __repr__(self) -> str:
        return f"FeedbackOutcome({self.entry_id!r}, {self.bandit_arm!r}, {self.use!r})"


@dataclass(slots=True)
class StateBatch:
    """Learning state of many entries, read in one round trip (no query/response)."""

    entries: dict[str, IntelligentCacheEntry] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DecayOutcome:
    decayed: int
    missing: int
    corrupt: list[str]


@dataclass(frozen=True, slots=True)
class EvictOutcome:
    removed: list[str]
    gone: list[str]
    changed: list[str]


T = TypeVar("T")


class PutFields(TypedDict, total=False):
    """The optional fields of a put.

    Attributes:
        scope: what the answer was produced under (``prompt_scope``); ``""`` by default.
        ttl_s: seconds to live; default: the tenant's ``ttl`` setting, else
            ``CacheConfig.default_ttl_s``, else none.
        quality / similarity: the seed's scores of the entry, in [0, 1].
        metadata: a msgpack-able mapping with str keys, returned with every hit.
        entry_id: the id to use (32 hex characters); default: a new random one.
        index_dim: the dimension the caller's index holds for the tenant, if any: a
            second witness of the tenant's dimension should its cfg hash be lost.
        rl: the tenant's bandit parameters (the new arm's prior); default: the
            configuration's.
        tags: labels to invalidate the entry by (``invalidate_tag``): the document an
            answer was built on, its source, a version.
        usage: what the LLM call that made the answer cost (``LLMUsage``): every hit of
            it saves that much (``zerda_cache.savings``).
    """

    scope: str
    ttl_s: float | None
    quality: float | None
    similarity: float | None
    metadata: Mapping[str, Any] | None
    entry_id: str | None
    index_dim: int | None
    rl: RLConfig | None
    tags: Sequence[str] | None
    usage: LLMUsage | None


@dataclass(frozen=True, slots=True)
class ScriptCall(Generic[T]):
    """One script invocation, planned without I/O: run it with any client flavour."""

    script: str
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], T]


@dataclass(frozen=True, slots=True)
class ReadPlan(Generic[T]):
    """Plain commands queued on one pipeline (one round trip), then parsed.

    Reads, and the counter increments that need no script (misses). ``size`` is the
    number of commands ``queue`` adds. ``scripts`` lists the positions of scripts sent
    by EVALSHA inside the pipeline (see ``batch``): on NOSCRIPT, the executor runs that
    script once through its ``Script`` object, which loads it.
    """

    name: str
    queue: Callable[[Any], None]
    parse: Callable[[list[Any]], T]
    size: int
    scripts: tuple[tuple[int, ScriptCall[Any]], ...] = ()
    #: Positions whose error reply goes to ``parse`` instead of failing the plan (the
    #: miss count, which a full server refuses: the lookup is served all the same).
    tolerant: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LogInfo:
    """From ``XINFO STREAM`` of a tenant's log: the newest id, the events ever added and
    the events left (all zero when the log does not exist yet)."""

    last_id: str = "0-0"
    added: int = 0
    length: int = 0

    @classmethod
    def parse(cls, reply: Any) -> LogInfo:
        if not reply:
            return cls()
        info = {text(k): v for k, v in reply.items()}
        return cls(
            last_id=text(info.get("last-generated-id") or b"0-0"),
            added=int(info.get("entries-added") or 0),
            length=int(info.get("length") or 0),
        )

    def holds_since(self, added: int) -> bool:
        """Does the stream still hold every entry added after its first ``added``, and
        is it the stream those were counted in? Not if more were trimmed than that, nor
        if fewer were ever added (deleted and re-created)."""
        return self.added >= added and self.added - self.length <= added


@dataclass(slots=True)
class LogDelta:
    """What a catch-up read of a tenant's log found: events to apply, and whether they
    may not follow on from the reader's position."""

    adds: dict[str, str] = field(default_factory=dict)  # id -> scope, in log order
    dels: set[str] = field(default_factory=set)
    last_id: str | None = None
    count: int = 0  # events read, applied or not
    more: bool = False  # the batch was full: read again
    maybe_trimmed: bool = False  # the position's event is gone: ask XINFO
    partial: bool = False  # a lookup's peek saw only the newest events: read them all

    @property
    def empty(self) -> bool:
        return not self.adds and not self.dels and self.last_id is None


def _peek_delta(newest_first: list[Any], after: str) -> LogDelta:
    """The delta of a peek at the log (``peek_log``): ``newest_first``, at most
    ``PEEK_EVENTS`` + 1 events back from the newest, down to the reader's position
    ``after``. With the position's own event among them, the events after it; with
    more than ``PEEK_EVENTS`` and not it, a ``partial`` delta (nothing to apply: read
    the log forward instead); with fewer and not it, the events, ``maybe_trimmed``."""
    events = newest_first[::-1]
    delta = LogDelta()
    if events and text(events[0][0]) == after:
        events = events[1:]
    elif len(events) > PEEK_EVENTS:  # more than a peek returns: some not seen
        delta.partial = True
        return delta
    elif events:  # every event from the position on, and not the position's
        delta.maybe_trimmed = True
    return _log_delta(delta, events)  # fewer than CATCHUP_BATCH: never ``more``


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    """A stream entry's fields as a Lua script returns them (field, value, ...), as
    redis-py's stream replies give them (a dict)."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _log_delta(delta: LogDelta, events: list[Any]) -> LogDelta:
    """``delta`` with ``events`` (log entries after the reader's position, oldest first)
    folded in: the last add or delete of each id wins."""
    for event_id, fields in events:
        op, eid = fields.get(b"op"), text(fields.get(b"id", b""))
        if op == b"add":
            delta.adds[eid] = text(fields.get(b"sc", b""))
            delta.dels.discard(eid)
        elif op == b"del":
            delta.adds.pop(eid, None)
            delta.dels.add(eid)
        delta.last_id = text(event_id)
    delta.count = len(events)
    delta.more = len(events) >= CATCHUP_BATCH
    return delta


#: Batches of lookups' features a tenant's lookup sample keeps (``seen``; ~32 each).
SEEN_BATCHES = 500
#: The longest label log (``lab``; label_window if shorter): ~60 bytes a label.
MAX_LABEL_LOG = 50_000


class LabelLogRows(NamedTuple):
    """A tenant's label log, its sample of lookups and its fit counters, as Redis holds
    them (``calibration.LabelLogs.parse`` reads them)."""

    labels: list[Any]
    seen: list[Any]
    counters: list[Any]


class TenantHashes(NamedTuple):
    """A tenant's settings hash and its calibration hash, as ``HGETALL`` returns them
    (``policy.TenantPolicy.parse`` applies them)."""

    settings: dict[Any, Any]
    labels: dict[Any, Any]


def _level_bin(bin_: int | str) -> bool:
    """A lookup count field of exact repeats at a confirmed level (``e<k>``)."""
    return isinstance(bin_, str) and bin_.startswith("e") and bin_ != "e"


def _int(raw: Any) -> int:
    try:
        return int(float(raw))
    except (TypeError, ValueError):
        return 0


def batch(
    name: str, parts: Sequence[ReadPlan[Any] | ScriptCall[Any]], sha: Callable[[str], str]
) -> ReadPlan[list[Any]]:
    """Several plans in one pipeline (one round trip); parses to their results, in order.

    A ``ScriptCall`` part is sent as a raw EVALSHA (``sha`` gives a script's SHA1): a
    pipeline of redis-py ``Script`` objects would first send SCRIPT EXISTS, a round trip
    of its own. Scripts cannot run inside Redis Cluster pipelines: on Cluster, run them
    on their own.
    """
    plans: list[ReadPlan[Any]] = []
    scripts: list[tuple[int, ScriptCall[Any]]] = []
    tolerant: list[int] = []
    at = 0
    for part in parts:
        if isinstance(part, ScriptCall):
            scripts.append((at, part))
            plans.append(_evalsha(part, sha(part.script)))
        else:
            plans.append(part)
            tolerant += [at + i for i in part.tolerant]
        at += plans[-1].size

    def queue(pipe: Any) -> None:
        for plan in plans:
            plan.queue(pipe)

    def parse(replies: list[Any]) -> list[Any]:
        out, at = [], 0
        for plan in plans:
            out.append(plan.parse(replies[at : at + plan.size]))
            at += plan.size
        return out

    return ReadPlan(name, queue, parse, at, tuple(scripts), tuple(tolerant))


def _evalsha(call: ScriptCall[T], sha: str) -> ReadPlan[T]:
    def queue(pipe: Any) -> None:
        pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)

    return ReadPlan(call.script, queue, lambda replies: call.parse(replies[0]), 1)


#: The fields of an entry's hash that its state is read with: ``meta``, and the ``arm``,
#: ``use`` and ``sz`` of an entry written before the state hash (zerda-cache 0.1) whose
#: state no script has moved there yet (``codec``).
_STATE_FIELDS = ("meta", "arm", "use", "sz")


class StoragePlans:
    """The plans of one keyspace: keys, validation, script arguments and the parsing of
    replies. ``Storage`` (store.py) executes them.

    Args:
        config: key prefix, size limits and the bandit parameters the scripts apply.
        clock: returns "now" in unix seconds; default: the Redis server's clock, read
            inside each script (one clock for every replica).
    """

    def __init__(
        self, config: CacheConfig | None = None, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.config = config if config is not None else CacheConfig()
        self.clock = clock
        self._keys: dict[str, TenantKeys] = {}
        self.registered_tenants: set[str] = set()
        #: Ids this process found undecodable (a doc, meta or vec the put script does not
        #: check), by tenant, until a lookup reports them for the worker to evict.
        self._suspected: dict[str, set[str]] = {}
        self._static: dict[RLConfig, tuple[list[str], list[str]]] = {}

    def _rl_static(self, rl: RLConfig | None) -> tuple[list[str], list[str]]:
        """The script arguments of a policy's bandit parameters, formatted once per
        policy (repr round-trips floats): the decay ones, and the feedback ones."""
        rl = self.config.rl if rl is None else rl
        out = self._static.get(rl)
        if out is None:
            decay = [
                repr(rl.prior_alpha),
                repr(rl.prior_beta),
                repr(rl.usage_decay),
                repr(rl.decay_interval_s),
            ]
            feedback = [
                repr(rl.positive_feedback_reward),
                repr(rl.negative_feedback_penalty),
                *decay,
                str(self.config.feedback_log_maxlen),
                repr(rl.similarity_bar_margin),
                repr(rl.near_miss_penalty_share),
                repr(rl.negative_streak_forget),
            ]
            if len(self._static) > 1_000:
                self._static.clear()
            out = self._static[rl] = (decay, feedback)
        return out

    def keys(self, tenant: str) -> TenantKeys:
        """The (validated) keys of ``tenant``."""
        k = self._keys.get(tenant)
        if k is None:
            k = tenant_keys(tenant, self.config.key_prefix)
            if len(self._keys) < 10_000:
                self._keys[tenant] = k
        return k

    @property
    def tenants_key(self) -> str:
        return tenants_key(self.config.key_prefix)

    def _now_arg(self) -> str:
        return "" if self.clock is None else repr(float(self.clock()))

    def _rl_args(self, rl: RLConfig | None = None) -> list[str]:
        return self._rl_static(rl)[0]

    # -- script plans ----------------------------------------------------------------------
    def plan_put(
        self, tenant: str, query: str, response: str, embedding: object, **fields: Unpack[PutFields]
    ) -> ScriptCall[PutOutcome]:
        """Plan storing a new entry (see ``PutFields`` for the optional fields)."""
        k = self.keys(tenant)
        cfg = self.config
        rl = fields.get("rl") or cfg.rl
        check_query(query, cfg.max_query_chars)
        check_response(response, cfg.max_response_bytes)
        scope = check_scope(fields.get("scope", ""))
        tags = check_tags(fields["tags"]) if fields.get("tags") is not None else ()
        usage = LLMUsage.of(fields["usage"]) if fields.get("usage") is not None else None
        quality, similarity = fields.get("quality"), fields.get("similarity")
        metadata, entry_id = fields.get("metadata"), fields.get("entry_id")
        ttl = fields.get("ttl_s")
        if ttl is not None and (
            not isinstance(ttl, int | float) or (finite_number(ttl) or 0.0) <= 0
        ):
            shown = "an int too large for a float" if isinstance(ttl, int) else repr(ttl)
            raise InvalidEntryError(f"ttl_s must be a finite number > 0, got {shown}")
        q = _unit_score("quality", DEFAULT_QUALITY if quality is None else quality)
        s = _unit_score("similarity", DEFAULT_SIMILARITY if similarity is None else similarity)
        vec = codec.encode_vector(embedding, cfg.vector_storage)
        dim = codec.vector_dim(vec)
        doc = codec.pack_doc(query, response, metadata, max_metadata_bytes=cfg.max_metadata_bytes)
        eid = new_entry_id() if entry_id is None else validate_entry_id(entry_id)
        args: list[Any] = [
            self._now_arg(),
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
            len(tags),
            *tags,
            *(
                ("",)
                if usage is None
                else (usage.model, usage.prompt_tokens, usage.completion_tokens)
            ),
        ]

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

        keys = [k.entry(eid), k.ids, k.q, k.log, k.stats, k.cfg, k.st, k.tags]
        keys += [k.tag(tag) for tag in tags]
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
                    doc, vec, meta = _hash_row(row, key)
                except CorruptEntryError:
                    doc = vec = meta = None
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

        ``rivals`` (with ``asked``): ``(id, similarity)`` of the lookup's candidates
        within ``similarity_tie_margin`` of this one. It is served only if the ranking
        would put it first whatever the Thompson draws (``TIED`` otherwise: nothing
        written). ``candidates``: every candidate's id, this one first and the rivals
        next, whose states come back with any reply but a hit (``HitOutcome.states``),
        so that ranking them then needs no read of its own (hit.lua).

        ``peek`` (with ``asked``): the lookup's position in the tenant's log. The script
        also peeks at the log from there, as ``peek_log`` would, and the outcome's
        ``log`` is that delta: the lookup's one command."""
        k = self.keys(tenant)
        key = k.entry(entry_id)
        tied = bool(rivals)
        if tied:
            ids = list(candidates)
            if asked is None or ids[: len(rivals) + 1] != [entry_id, *(r for r, _ in rivals)]:
                raise ValueError("a tie needs the question's digest and its candidates in order")
        if peek is not None and not asked:
            raise ValueError("a peek at the log needs the question's digest")
        args = [
            self._now_arg(),
            entry_id,
            *self._rl_args(rl),
            "1" if refresh_ttl else "0",
            "" if min_reward is None else repr(float(min_reward)),
            "" if similarity is None else repr(float(similarity)),
        ]
        keys = [key, k.ids, k.stats, k.st, k.bad]
        if asked is not None:
            keys += [k.q, k.log]
            args += [
                asked,
                "" if own_bar is None else repr(float(own_bar)),
                "" if peek is None else peek,
                _PEEK_COUNT,
            ]
        if tied:
            cfg = self.config.rl if rl is None else rl
            keys += [k.entry(eid) for eid in ids]
            args += [
                repr(cfg.similarity_bonus_scale),
                repr(CONFIDENCE_WEIGHT),
                "1" if cfg.similarity_tie_margin >= 2 else "",  # the seed's order draws all
                str(len(rivals)),
                str(len(ids)),
                *ids,
                *(repr(float(sim)) for _, sim in rivals),
            ]

        def parse(res: Any) -> HitOutcome:
            own, news = None, None
            if asked:  # the script wraps its reply when it is given a digest
                res, own_raw, peeked = res
                own = text(own_raw) if own_raw else None
                if peek is not None:
                    events = [] if peeked == 1 else [(eid, _pairs(raw)) for eid, raw in peeked]
                    news = _peek_delta(events, peek)
            outcome = parse_code(res, own, news)
            # (served by the script but corrupt here: no states in the reply)
            if tied and int(res[0]) != 1:
                rows, states, scores = res[2]
                batch = self._state_batch(tenant, ids, rows, states, scores)
                return dataclasses.replace(outcome, states=batch)
            return outcome

        def parse_code(res: Any, own: str | None, news: LogDelta | None) -> HitOutcome:
            code = int(res[0])
            if code == 0:
                return HitOutcome(HitStatus.GONE, own=own, log=news)
            if code == -1:
                return HitOutcome(HitStatus.EXPIRED, own=own, log=news)
            if code == -3:
                log.warning("corrupt entry %s not served", key)
                return HitOutcome(HitStatus.CORRUPT, own=own, log=news)
            if code == -4:
                reward = float(res[1]) if len(res) > 1 else None
                return HitOutcome(HitStatus.UNSERVABLE, reward=reward, own=own, log=news)
            if code == -5:
                return HitOutcome(HitStatus.BELOW_BAR, own=own, log=news)
            if code == -6:
                return HitOutcome(HitStatus.NOT_OWN, own=own, log=news)
            if code == -7:
                return HitOutcome(HitStatus.TIED, own=own, log=news)
            try:
                query, response, metadata = codec.unpack_doc(res[2], key=key)
                meta = codec.unpack_meta(res[3], key=key)
            except CorruptEntryError as exc:
                log.warning("corrupt entry not served: %s", exc)
                self._suspect(tenant, entry_id, exc)
                return HitOutcome(HitStatus.CORRUPT, own=own, log=news)
            arm, use = codec.trusted_state(res[1])
            entry = IntelligentCacheEntry(
                entry_id=entry_id,
                tenant=tenant,
                query=query,
                response=response,
                metadata=metadata,
                scope=meta["sc"],
                tags=meta["tg"],
                usage=meta["us"],
                created_at=meta["ct"],
                ttl_s=meta["ttl"] or None,
                quality_score=use.quality,
                similarity_score=use.similarity,
                usage_count=use.count,
                last_access=use.last_access,
                confidence_score=use.confidence,
                bandit_arm=arm,
                version=use.version,
                similarity_bar=use.similarity_bar,
                min_positive_similarity=use.min_positive_similarity,
                negative_streak=use.negative_streak,
            )
            before = float(res[4])  # the confidence a ranking would have used
            return HitOutcome(HitStatus.SERVED, entry, ranked_confidence=before, own=own, log=news)

        return ScriptCall("hit", keys, args, parse)

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
        args: list[Any] = [self._now_arg(), *self._rl_static(rl)[1]]
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
            ]

        def parse(res: Any) -> list[FeedbackOutcome | ZerdaError]:
            out: list[FeedbackOutcome | ZerdaError] = []
            for sig, reply in zip(sigs, res, strict=True):
                code = reply[0]
                if code == 1:
                    out.append(FeedbackOutcome(sig.entry_id, reply[1], reply[2]))
                elif code == 0:
                    out.append(EntryNotFoundError(tenant, sig.entry_id))
                else:
                    out.append(
                        CorruptEntryError(
                            k.entry(sig.entry_id), "arm or use does not decode; not applied"
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
            self._now_arg(),
            *self._rl_args(rl),
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
    def read_entry(
        self, tenant: str, entry_id: str, *, with_vector: bool = True
    ) -> ReadPlan[IntelligentCacheEntry]:
        k = self.keys(tenant)
        key = k.entry(entry_id)
        fields = ("doc", "vec", "dg", *_STATE_FIELDS)

        def queue(pipe: Any) -> None:
            pipe.hmget(key, fields)
            pipe.hget(k.st, entry_id)
            pipe.zscore(k.ids, entry_id)
            pipe.hget(k.cfg, "dim")

        def parse(res: list[Any]) -> IntelligentCacheEntry:
            raw, state, score, dim = res
            values = dict(zip(fields, _hash_row(raw, key), strict=True))
            if values["doc"] is None:
                raise EntryNotFoundError(tenant, entry_id)
            entry = _state_entry(tenant, entry_id, key, values, state, score)
            entry.query, entry.response, entry.metadata = codec.unpack_doc(values["doc"], key=key)
            # Read whole, the entry is checked whole: the vector against its meta and the
            # tenant, the digest field (the worker confirms reported entries this way).
            vec, _ = _sound_vector(
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
                    doc, vec, meta, dg = _hash_row(row, key)
                    if doc is None and vec is None and meta is None:
                        continue  # gone
                    codec.unpack_doc(doc, key=key)
                    _sound_vector(vec, meta, dg, key, int(dim) if dim else None)
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
                pipe.hmget(k.entry(eid), _STATE_FIELDS)
            pipe.hmget(k.st, ids)
            pipe.zmscore(k.ids, ids)

        def parse(res: list[Any]) -> StateBatch:
            *rows, states, scores = res
            return self._state_batch(tenant, ids, rows, states, scores)

        # an entry's hash of another type is that entry's corruption (``_hash_row``)
        rows = tuple(range(len(ids)))
        return ReadPlan("load_states", queue, parse, len(ids) + 2, tolerant=rows)

    def _state_batch(
        self,
        tenant: str,
        ids: Sequence[str],
        rows: Sequence[Sequence[Any]],
        states: Sequence[bytes | None],
        scores: Sequence[Any],
    ) -> StateBatch:
        """The states of ``ids`` from their hashes' ``_STATE_FIELDS`` (``rows``), the
        state hash and the ids' expiry scores, as ``read_states`` and a tied hit read
        them."""
        k = self.keys(tenant)
        out = StateBatch()
        for eid, raw, state, score in zip(ids, rows, states, scores, strict=True):
            key = k.entry(eid)
            try:
                row = _hash_row(raw, key)
                if state is None and all(value is None for value in row):
                    out.missing.append(eid)
                    continue
                values = dict(zip(_STATE_FIELDS, row, strict=True))
                out.entries[eid] = _state_entry(tenant, eid, key, values, state, score)
            except CorruptEntryError as exc:
                log.warning("skipping corrupt entry: %s", exc)
                out.corrupt.append(eid)
                self._suspect(tenant, eid, exc)
        return out

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
        args = [self._now_arg(), *self._rl_args(rl)[:2], "1" if check_hashes else "", *ids]
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
                    vec, meta, dg = _hash_row(row, key)
                    if vec is None and meta is None:
                        continue  # gone
                    out[eid] = _sound_vector(vec, meta, dg, key, dim)
                except CorruptEntryError as exc:
                    log.warning("skipping corrupt entry: %s", exc)
                    self._suspect(tenant, eid, exc)
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
            return _log_delta(delta, events)

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
            return _peek_delta(res[0], after)

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
        self, tenant: str, entry_id: str, level: int, replaced: str
    ) -> ScriptCall[bool]:
        """Plan recording on ``entry_id`` (a fresh answer) that it disagreed with the
        cached answer ``replaced`` of an entry at exact-repeat ``level``, whose wrong
        label its own next verification may take back (``dispute.lua``)."""
        payload = msgpack.packb([int(level), replaced])
        keys = [self.keys(tenant).entry(entry_id)]
        return ScriptCall("dispute", keys, [payload], lambda res: bool(int(res)))

    def read_dispute(self, tenant: str, entry_id: str) -> ReadPlan[tuple[int, str] | None]:
        """The dispute an entry carries (``plan_dispute``): (level, replaced answer)."""
        key = self.keys(tenant).entry(entry_id)

        def queue(pipe: Any) -> None:
            pipe.hget(key, "dsp")

        def parse(res: list[Any]) -> tuple[int, str] | None:
            if res[0] is None:
                return None
            try:
                level, replaced = msgpack.unpackb(res[0])
            except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError):
                log.warning("undecodable dispute on %s ignored", key)
                return None
            if not isinstance(level, int) or not isinstance(replaced, str):
                return None
            return level, replaced

        return ReadPlan("read dispute", queue, parse, 1)

    def plan_resolve(
        self, tenant: str, entry_id: str, level: int, replaced_was_right: bool
    ) -> ScriptCall[bool]:
        """Plan taking ``entry_id``'s dispute away; ``replaced_was_right``: a third
        answer agreed with the replaced one, so its wrong label becomes a right one."""
        k = self.keys(tenant)
        suffix = f"e{level}" if level else "e"
        args = ["1" if replaced_was_right else "0", suffix]
        return ScriptCall("resolve", [k.entry(entry_id), k.cal], args, lambda r: bool(int(r)))

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
            logged, fitted = (_int(v) for v in res[0])
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
            pipe.hincrbyfloat(cal, "tn", sum(n for (_, b), n in items if not _level_bin(b)))

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
        return ScriptCall("settings", [self.keys(tenant).cfg], args, lambda res: int(res))

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

    def _suspect(self, tenant: str, entry_id: str, exc: CorruptEntryError) -> None:
        if isinstance(exc, SchemaVersionError):
            return  # another version's entry: readable by it, not to be evicted
        found = self._suspected.setdefault(tenant, set())
        if len(found) < 10_000:
            found.add(entry_id)

    def report_suspects(self, tenant: str) -> ReadPlan[None] | None:
        """The ids this process found corrupt in ``tenant`` (taken: reported once), added
        to the tenant's ``bad`` set, where the worker finds and evicts them; ``None``
        when there are none. A full server may refuse it: then they wait for the scan."""
        ids = sorted(self._suspected.pop(tenant, ()))
        if not ids:
            return None
        bad = self.keys(tenant).bad

        def queue(pipe: Any) -> None:
            pipe.sadd(bad, *ids)

        def parse(res: list[Any]) -> None:
            if isinstance(res[0], Exception):
                log.warning("tenant %s: %d corrupt ids not reported: %s", tenant, len(ids), res[0])

        return ReadPlan("report corrupt", queue, parse, 1, tolerant=(0,))

    def read_usage(self, tenant: str, entry_id: str) -> ReadPlan[LLMUsage | None]:
        """What the LLM call that made ``entry_id``'s answer cost, if its put said
        (``None`` too when the entry is gone or its meta does not read)."""
        key = self.keys(tenant).entry(entry_id)

        def queue(pipe: Any) -> None:
            pipe.hget(key, "meta")

        def parse(res: list[Any]) -> LLMUsage | None:
            if res[0] is None or isinstance(res[0], Exception):
                return None
            try:
                usage: LLMUsage | None = codec.unpack_meta(res[0], key=key)["us"]
            except CorruptEntryError:
                return None
            return usage

        return ReadPlan("usage", queue, parse, 1, tolerant=(0,))

    def count_stats(self, tenant: str, increments: Mapping[str, int]) -> ReadPlan[None]:
        """Add ``increments`` to fields of the tenant's stats hash (HINCRBY each: no script
        needed); a refusal (a full server) loses the counts, never the lookup."""
        stats_key = self.keys(tenant).stats
        items = [(name, int(n)) for name, n in increments.items() if n]

        def queue(pipe: Any) -> None:
            for name, n in items:
                pipe.hincrby(stats_key, name, n)

        def parse(res: list[Any]) -> None:
            errors = [r for r in res if isinstance(r, Exception)]
            if errors:
                log.warning("tenant %s: %d counts not written: %s", tenant, len(errors), errors[0])

        return ReadPlan("count stats", queue, parse, len(items), tolerant=tuple(range(len(items))))

    def count_misses(self, tenant: str, n: int) -> ReadPlan[None]:
        """Add ``n`` to the tenant's miss counter (an atomic HINCRBY: no script needed)."""
        stats_key = self.keys(tenant).stats

        def queue(pipe: Any) -> None:
            pipe.hincrby(stats_key, "misses", n)

        def parse(res: list[Any]) -> None:
            if isinstance(res[0], Exception):  # e.g. OOM on a full server: a count lost
                log.warning("tenant %s: %d misses not counted: %s", tenant, n, res[0])

        return ReadPlan("count misses", queue, parse, 1, tolerant=(0,))


def state_arrays_of(ids: Sequence[str], states: Sequence[bytes | None]) -> StateArrays:
    """The states of ``ids`` as stored (``None``: gone), decoded into columns."""
    status, arr = codec.state_columns(states)
    ok = status == 1
    bad = np.flatnonzero(status == -1).tolist()
    rows = arr[ok]
    return StateArrays(
        ids=[ids[i] for i in np.flatnonzero(ok).tolist()],
        alpha=rows[:, 0],
        beta=rows[:, 1],
        decayed_at=rows[:, 2],
        usage_count=rows[:, 3],
        last_access=rows[:, 4],
        confidence=rows[:, 5],
        version=rows[:, 6].astype(np.int64),
        size=rows[:, 7].astype(np.int64),
        corrupt=[ids[i] for i in bad],
    )


def group_by_tenant(signals: Sequence[FeedbackSignal]) -> dict[str, list[int]]:
    """Positions of ``signals`` grouped by tenant, in order."""
    groups: dict[str, list[int]] = {}
    for i, sig in enumerate(signals):
        groups.setdefault(sig.tenant_id, []).append(i)
    return groups


def _hash_row(reply: Any, key: str) -> Any:
    """A reply to an HMGET of an entry's hash: an error for a key of another type
    (hand-made damage) is that entry's corruption; any other error is the server's."""
    if isinstance(reply, Exception):
        if str(reply).startswith("WRONGTYPE"):
            raise CorruptEntryError(key, "the key is not a hash")
        raise StorageError(f"reading {key} failed: {reply}") from reply
    return reply


def _sound_vector(
    vec: object, meta: object, dg: object, key: str, dim: int | None
) -> tuple[codec.Vector, str]:
    """An entry's vector and scope, if its vector, meta and digest field are sound."""
    unpacked = codec.unpack_meta(meta, key=key)
    vector = codec.decode_vector(vec, key=key, dim=unpacked["dim"])  # type: ignore[arg-type]
    if dim is not None and unpacked["dim"] != dim:
        raise CorruptEntryError(key, f"meta.dim is {unpacked['dim']}, the tenant's {dim}")
    codec.check_digest(dg, key=key)
    return vector, unpacked["sc"]


def _unit_score(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise InvalidEntryError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _state_entry(
    tenant: str,
    entry_id: str,
    key: str,
    values: Mapping[str, Any],
    state: bytes | None,
    score: float | None,
) -> IntelligentCacheEntry:
    meta = codec.unpack_meta(values["meta"], key=key)
    if state is not None:
        arm, use, size = codec.unpack_state(state, key=key)
    else:  # written before the state hash, and not yet moved there
        arm = codec.unpack_arm(values["arm"], key=key)
        use = codec.unpack_use(values["use"], key=key)
        try:
            size = int(values["sz"])
        except (TypeError, ValueError) as exc:
            raise CorruptEntryError(key, "sz is not an integer") from exc
    return IntelligentCacheEntry(
        entry_id=entry_id,
        tenant=tenant,
        query="",
        response="",
        scope=meta["sc"],
        tags=meta["tg"],
        usage=meta["us"],
        created_at=meta["ct"],
        ttl_s=meta["ttl"] or None,
        expires_at=float(score) if score is not None else -math.inf,
        quality_score=use.quality,
        similarity_score=use.similarity,
        usage_count=use.count,
        last_access=use.last_access,
        confidence_score=use.confidence,
        bandit_arm=arm,
        version=use.version,
        size_bytes=size,
        similarity_bar=use.similarity_bar,
        min_positive_similarity=use.min_positive_similarity,
        negative_streak=use.negative_streak,
    )
