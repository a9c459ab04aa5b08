"""A token-checked lease in Redis: one worker leads, the others stand by.

``SET key token NX PX ttl`` takes the lease; renewal and release are Lua scripts that
compare the token first, so a worker that stalled past its lease can neither extend nor
delete the lease another worker has taken meanwhile (redis-py's ``Lock`` pattern). A dead
leader's lease simply expires, and a standby takes it on its next attempt.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from typing import Any

from zerda_cache.storage.driver import wrap_errors
from zerda_cache.storage.scripts import Scripts

log = logging.getLogger(__name__)


class Lease:
    """One holder's view of a lease.

    Args:
        client: a sync redis-py client.
        key: the lease key (``keys.leader_key(prefix)``).
        ttl_s: how long the lease lasts without renewal.
        scripts: registered scripts (to share registrations); default: register here.
        holder_id: who holds it (shown in the key's value); default: the host name.
    """

    def __init__(
        self,
        client: Any,
        key: str,
        ttl_s: float,
        *,
        scripts: Scripts | None = None,
        holder_id: str | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.client = client
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.token = f"{holder_id or socket.gethostname()}:{secrets.token_hex(8)}"
        self.scripts = scripts if scripts is not None else Scripts.register(client)
        self._held = False
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        """Whether this holder believed it held the lease at its last acquire/renew."""
        return self._held

    def acquire_or_renew(self) -> bool:
        """Renew the lease if we hold it, else try to take it. True if we hold it now."""
        with self._lock, wrap_errors("lease"):
            if self._held:
                self._held = bool(
                    self.scripts.lease_renew(keys=[self.key], args=[self.token, self.ttl_ms])
                )
                if not self._held:
                    log.warning("lost the worker lease %s", self.key)
            if not self._held:
                self._held = bool(self.client.set(self.key, self.token, nx=True, px=self.ttl_ms))
                if self._held:
                    log.info("took the worker lease %s as %s", self.key, self.token)
            return self._held

    def release(self) -> bool:
        """Give the lease up if it is ours (on a clean exit)."""
        with self._lock, wrap_errors("lease"):
            released = bool(self.scripts.lease_release(keys=[self.key], args=[self.token]))
            self._held = False
            return released
