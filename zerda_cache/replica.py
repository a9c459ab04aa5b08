"""Keeping a replica's vector index in step with Redis through the tenant's log stream.

Every put and every removal appends an ``add`` or ``del`` event to ``zc:{t}:log`` inside
the same Lua script that changes the entry, so the log is a complete, ordered history.
A replica builds its index once (remember the log's last id, scan every live id, fetch
their vectors, then replay the log from the remembered id: events that raced the scan are
applied twice at worst, and both operations are idempotent) and afterwards applies only
the new events, read in the same pipeline round trip as the lookup's other reads.

If the log was trimmed past the replica's position (it fell more than
``index_log_maxlen`` events behind), events are lost and the replica rebuilds. The replica
counts the events it has consumed; ``XINFO STREAM`` says how many were ever added
(``entries-added``) and how many remain (``length``), so events were lost exactly when
``entries-added - length > consumed``. (``max-deleted-entry-id`` would not do: trimming
does not update it.) XINFO is asked only when the oldest event left is newer than the
position, which is rare.

This module does no I/O of its own: it queues commands on the caller's pipeline and
interprets the replies, so the sync and asyncio managers share it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from zerda_cache.index import IndexPolicy, ScopedIndex, Vector
from zerda_cache.keys import TenantKeys

log = logging.getLogger(__name__)

#: Events read per XREAD call while catching up.
CATCHUP_BATCH = 1_000


def _sid(raw: bytes | str) -> tuple[int, int]:
    """A stream id as a comparable (ms, seq) tuple."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _s(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _xinfo(reply: Any) -> dict[str, Any]:
    """``last`` generated id, events ever ``added`` and current ``length`` of a stream."""
    if not reply:
        return {"last": "0-0", "added": 0, "length": 0}
    info = {_s(k): v for k, v in reply.items()}
    return {
        "last": _s(info.get("last-generated-id") or b"0-0"),
        "added": int(info.get("entries-added") or 0),
        "length": int(info.get("length") or 0),
    }


@dataclass(slots=True)
class LogDelta:
    """What a catch-up read found: events to apply, and whether the index must be rebuilt."""

    adds: dict[str, str] = field(default_factory=dict)  # id -> scope, in log order
    dels: set[str] = field(default_factory=set)
    last_id: str | None = None
    count: int = 0  # events read, applied or not
    more: bool = False  # the batch was full: read again
    maybe_trimmed: bool = False  # the oldest event is newer than our position: check XINFO


class TenantIndex:
    """One tenant's index on one replica, and its position in the tenant's log."""

    def __init__(self, keys: TenantKeys, policy: IndexPolicy | None = None) -> None:
        self.keys = keys
        self.policy = policy if policy is not None else IndexPolicy()
        self.index: ScopedIndex | None = None
        self.last_id = "0-0"
        self.consumed = 0  # log events consumed since the log began
        self.built = False
        self.lock = threading.RLock()  # one catch-up at a time per tenant (sync manager)

    # -- catch-up ------------------------------------------------------------------------
    def queue_catchup(self, pipe: Any) -> None:
        """Queue the reads of one catch-up step: the oldest event and the new events."""
        pipe.xrange(self.keys.log, min="-", max="+", count=1)
        pipe.xread({self.keys.log: self.last_id}, count=CATCHUP_BATCH)

    def parse_catchup(self, first: Any, new: Any) -> LogDelta:
        delta = LogDelta()
        if first:
            delta.maybe_trimmed = _sid(_s(first[0][0])) > _sid(self.last_id)
        events: list[Any] = []
        if new:
            # RESP2 shape: [[stream, [(id, {field: value}), ...]]]
            events = new[0][1] if isinstance(new, list) else next(iter(new.values()))[0]
        for event_id, fields in events:
            op, eid = fields.get(b"op"), _s(fields.get(b"id", b""))
            if op == b"add":
                delta.adds[eid] = _s(fields.get(b"sc", b""))
                delta.dels.discard(eid)
            elif op == b"del":
                delta.adds.pop(eid, None)
                delta.dels.add(eid)
            delta.last_id = _s(event_id)
        delta.count = len(events)
        delta.more = len(events) >= CATCHUP_BATCH
        return delta

    def trimmed_past(self, xinfo: Any) -> bool:
        """From an ``XINFO STREAM`` reply: were events this replica has not consumed
        trimmed away?"""
        info = _xinfo(xinfo)
        return bool(info["added"] - info["length"] > self.consumed)

    def apply(self, delta: LogDelta, vectors: dict[str, tuple[Vector, str]]) -> bool:
        """Apply a delta (``vectors`` holds the added entries that still exist).

        Returns False if a vector does not fit the index (the tenant was cleared and
        re-created with another dimension): the caller must rebuild.
        """
        with self.lock:
            for eid in delta.dels:
                if self.index is not None:
                    self.index.remove(eid)
            for eid in delta.adds:
                found = vectors.get(eid)
                if found is None:
                    continue  # removed again since: its 'del' may be in a later batch
                vec, scope = found
                if self.index is None:
                    self.index = ScopedIndex(len(vec), self.policy)
                elif len(vec) != self.index.dim:
                    return False
                self.index.add(eid, vec, scope)
            if delta.last_id is not None:
                self.last_id = delta.last_id
            self.consumed += delta.count
            return True

    # -- build ---------------------------------------------------------------------------
    def start_build(self, xinfo: Any) -> None:
        """Reset to an empty index positioned at the log's newest event, from an
        ``XINFO STREAM`` reply (``None`` when the log does not exist yet)."""
        info = _xinfo(xinfo)
        with self.lock:
            self.index = None
            self.last_id = info["last"]
            self.consumed = info["added"]
            self.built = False

    def add_scanned(self, vectors: dict[str, tuple[Vector, str]]) -> None:
        with self.lock:
            for eid, (vec, scope) in vectors.items():
                if self.index is None:
                    self.index = ScopedIndex(len(vec), self.policy)
                elif len(vec) != self.index.dim:
                    log.warning(
                        "tenant %s: entry %s has dimension %d, index has %d; skipped",
                        self.keys.tenant,
                        eid,
                        len(vec),
                        self.index.dim,
                    )
                    continue
                self.index.add(eid, vec, scope)

    def finish_build(self) -> None:
        with self.lock:
            self.built = True

    # -- queries -------------------------------------------------------------------------
    def search(self, vec: Vector, scope: str, k: int, threshold: float) -> list[tuple[str, float]]:
        index = self.index
        if index is None or index.dim != len(vec):
            return []
        return index.search(vec, scope, k, threshold)

    def ids(self) -> set[str]:
        index = self.index
        return set() if index is None else index.ids()

    def __len__(self) -> int:
        index = self.index
        return 0 if index is None else len(index)
