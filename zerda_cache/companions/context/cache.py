"""``ContextCache``: a small process-local LRU+TTL cache (the seed's, corrected).

The seed's version tracks recency in a deque that goes stale (a re-put does not move its
key; an expired key stays in the deque), so it behaves as FIFO with stale keys. This one
is a real LRU: an ``OrderedDict`` in recency order, where every hit and every put moves
the key to the most-recent end, and expired or evicted keys leave every structure at once.
In zerda-cache each replica uses it to memoise query -> embedding.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any


class ContextCache:
    """LRU cache with a per-entry time to live; thread-safe.

    Args:
        max_size: most entries kept; the least recently used goes first (>= 1).
        ttl_seconds: an entry older than this (since its last put) is a miss (> 0).
        timer: the clock, in seconds (injectable for tests).
    """

    def __init__(
        self,
        max_size: int = 256,
        ttl_seconds: float = 300,
        *,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size must be an integer >= 1, got {max_size!r}")
        if not isinstance(ttl_seconds, int | float) or not ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds!r}")
        self.max_size = max_size
        self.ttl_seconds = ttl_seconds
        self._timer = timer
        self._store: OrderedDict[str, tuple[Any, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def get(self, key: str) -> Any | None:
        """The value for ``key``, or ``None`` if absent or expired (then removed)."""
        with self._lock:
            item = self._store.get(key)
            if item is None:
                self._misses += 1
                return None
            value, stored_at = item
            if self._timer() - stored_at > self.ttl_seconds:
                del self._store[key]
                self._misses += 1
                return None
            self._store.move_to_end(key)
            self._hits += 1
            return value

    def put(self, key: str, context: Any) -> None:
        """Store ``context`` under ``key`` as the most recently used entry."""
        with self._lock:
            if key in self._store:
                self._store.move_to_end(key)
            elif len(self._store) >= self.max_size:
                self._store.popitem(last=False)
            self._store[key] = (context, self._timer())

    def pop(self, key: str) -> Any | None:
        """Remove ``key`` and return its value (``None`` if absent or expired)."""
        with self._lock:
            item = self._store.pop(key, None)
        if item is None or self._timer() - item[1] > self.ttl_seconds:
            return None
        return item[0]

    @staticmethod
    def make_key(query: str, filters: Mapping[str, Any] | None = None) -> str:
        """MD5 (a cache key digest, not security) of the lower-cased, stripped query,
        with ``str(sorted(filters.items()))`` appended when filters are given."""
        text = query.lower().strip()
        if filters:
            text += str(sorted(filters.items()))
        return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()

    @property
    def stats(self) -> dict[str, Any]:
        """size, max_size, hits, misses, hit_rate (a percentage string) and ttl_sec."""
        with self._lock:
            total = self._hits + self._misses
            return {
                "size": len(self._store),
                "max_size": self.max_size,
                "hits": self._hits,
                "misses": self._misses,
                "hit_rate": f"{100.0 * self._hits / total:.1f}%" if total else "0%",
                "ttl_sec": self.ttl_seconds,
            }

    def clear(self) -> None:
        """Drop every entry. As in the seed, the hit and miss counters are kept."""
        with self._lock:
            self._store.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._store)

    def keys(self) -> list[str]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._store)
