"""What storage's plans return, and how a reply becomes a value.

``ScriptCall`` (one Lua script invocation) and ``ReadPlan`` (plain commands queued on one
pipeline, one round trip) are the plans; the outcome types are what executing them gives
(``PutOutcome``, ``HitOutcome``, ``StateBatch``, ...), with the helpers that decode a
stored hash or state into them. Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, TypedDict, TypeVar, get_args

import numpy as np

from zerda_cache.core.config import RLConfig
from zerda_cache.core.entry import (
    BanditArm,
    FeedbackSignal,
    IntelligentCacheEntry,
    LLMUsage,
)
from zerda_cache.core.errors import (
    CorruptEntryError,
    InvalidEntryError,
)
from zerda_cache.storage import codec
from zerda_cache.storage.codec import text
from zerda_cache.storage.driver import storage_error

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
PEEK_COUNT = str(PEEK_EVENTS + 1)  # the XREVRANGE's COUNT: the position's event too


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """An entry's stored fields as they are in Redis (an export's unit)."""

    entry_id: str
    doc: bytes | None
    vec: bytes | None
    meta: bytes | None
    state: bytes | None
    #: Why the entry's key holds no fields although it exists (a key of another type),
    #: else ``None``: its fields are then all ``None`` without the entry being gone.
    corrupt: str | None = None


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
    #: the question's own entry under an error bound carries a dispute (two answers
    #: disagreed): held out until a verification settles it
    DISPUTED = "disputed"
    #: a near match whose question differs from the one asked in a way its text guard
    #: does not let through (``plan_hit``'s ``text``)
    TEXT = "text"


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
    #: with ``asked``: the tenant's label stamp (``TenantPlans.read_stamp``)
    stamp: int | None = None
    #: ``TEXT``: the combination of text differences found (``text_match.combo``)
    text: int | None = None

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
    (feedback is a hot path and most callers never look); ``wrong``: the usage the signal
    counted as a wrong hit in the savings (``None``: it counted none)."""

    __slots__ = ("_arm", "_raw_arm", "_raw_use", "_use", "entry_id", "wrong")

    def __init__(self, entry_id: str, raw_arm: bytes, raw_use: bytes, wrong: Any = None) -> None:
        self.entry_id, self.wrong = entry_id, wrong
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
            it saves that much (``zerda_cache.core.savings``).
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


def peek_delta(newest_first: list[Any], after: str) -> LogDelta:
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
    return log_delta(delta, events)  # fewer than CATCHUP_BATCH: never ``more``


def pairs(flat: list[Any]) -> dict[Any, Any]:
    """A stream entry's fields as a Lua script returns them (field, value, ...), as
    redis-py's stream replies give them (a dict)."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def log_delta(delta: LogDelta, events: list[Any]) -> LogDelta:
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
    (``tenant_policy.TenantPolicy.parse`` applies them)."""

    settings: dict[Any, Any]
    labels: dict[Any, Any]


def level_bin(bin_: int | str) -> bool:
    """A lookup count field of exact repeats at a confirmed level (``e<k>``)."""
    return isinstance(bin_, str) and bin_.startswith("e") and bin_ != "e"


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
            plans.append(evalsha(part, sha(part.script)))
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


def evalsha(call: ScriptCall[T], sha: str) -> ReadPlan[T]:
    def queue(pipe: Any) -> None:
        pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)

    return ReadPlan(call.script, queue, lambda replies: call.parse(replies[0]), 1)


#: The fields of an entry's hash that its state is read with: ``meta``, and the ``arm``,
#: ``use`` and ``sz`` of an entry written before the state hash (zerda-cache 0.1) whose
#: state no script has moved there yet (``codec``).
STATE_HASH_FIELDS = ("meta", "arm", "use", "sz")


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


def hash_row(reply: Any, key: str) -> Any:
    """A reply to an HMGET of an entry's hash: an error for a key of another type
    (hand-made damage) is that entry's corruption; any other error is the server's."""
    if isinstance(reply, Exception):
        if str(reply).startswith("WRONGTYPE"):
            raise CorruptEntryError(key, "the key is not a hash")
        raise storage_error(f"reading {key}", reply) from reply
    return reply


def sound_vector(
    vec: object, meta: object, dg: object, key: str, dim: int | None
) -> tuple[codec.Vector, str]:
    """An entry's vector and scope, if its vector, meta and digest field are sound."""
    unpacked = codec.unpack_meta(meta, key=key)
    vector = codec.decode_vector(vec, key=key, dim=unpacked["dim"])  # type: ignore[arg-type]
    if dim is not None and unpacked["dim"] != dim:
        raise CorruptEntryError(key, f"meta.dim is {unpacked['dim']}, the tenant's {dim}")
    codec.check_digest(dg, key=key)
    return vector, unpacked["sc"]


def unit_score(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise InvalidEntryError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def state_entry(
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
    expires_at = float(score) if score is not None else -math.inf
    return entry_of(
        tenant,
        entry_id,
        meta,
        arm,
        use,
        query="",
        response="",
        expires_at=expires_at,
        size_bytes=size,
    )


def entry_of(
    tenant: str,
    entry_id: str,
    meta: Mapping[str, Any],
    arm: BanditArm,
    use: codec.Use,
    **fields: Any,
) -> IntelligentCacheEntry:
    """An entry from its decoded meta and learning state (``codec.unpack_meta``,
    ``codec.unpack_state``), with ``fields`` it has beside them (query, response, ...)."""
    return IntelligentCacheEntry(
        entry_id=entry_id,
        tenant=tenant,
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
        **fields,
    )
