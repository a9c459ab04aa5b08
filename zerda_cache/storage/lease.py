"""A token-checked lease in Redis: one worker leads, the others stand by.

``SET key token NX PX ttl`` takes the lease; renewal and release are Lua scripts that
compare the token first, so a worker that stalled past its lease can neither extend nor
delete the lease another worker has taken meanwhile (redis-py's ``Lock`` pattern). A dead
leader's lease simply expires, and a standby takes it on its next attempt.

Two guards keep a stalled leader (SIGSTOP, a long GC pause, a frozen VM) from finishing
its cycle after it lost the lease:

* ``held`` is also false once the lease's time to live has passed on this process's own
  monotonic clock since the last successful renewal (measured from before the renewal
  was sent), so a leader that wakes up after its lease lapsed stops at its next batch;
* every lease taken gets a fencing token, ``epoch``: the server's time in microseconds
  when it was taken, in the same script as the ``SET NX`` (so it is taken on a full
  server too, and grows with every new leader); the decay and evict scripts refuse a
  write whose epoch is older than one that already wrote to the tenant
  (``FencedError``), which closes the gap between the check and the write.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
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
        #: The fencing token of the lease this holder took last (``None``: never took one).
        self.epoch: int | None = None
        self._held = False
        self._valid_until = 0.0  # time.monotonic() after which the lease may be another's
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        """Whether this holder holds the lease: it did at its last acquire or renewal,
        and the lease's time to live has not run out since, by this process's clock."""
        return self._held and time.monotonic() < self._valid_until

    def acquire_or_renew(self) -> bool:
        """Renew the lease if we hold it, else try to take it. True if we hold it now."""
        with self._lock, wrap_errors("lease"):
            sent = time.monotonic()
            if self._held:
                self._held = bool(
                    self.scripts.lease_renew(keys=[self.key], args=[self.token, self.ttl_ms])
                )
                if not self._held:
                    log.warning("lost the worker lease %s", self.key)
            if not self._held:
                epoch = int(
                    self.scripts.lease_acquire(keys=[self.key], args=[self.token, self.ttl_ms])
                )
                self._held = epoch > 0
                if self._held:
                    self.epoch = epoch
                    log.info(
                        "took the worker lease %s as %s (epoch %d)",
                        self.key,
                        self.token,
                        self.epoch,
                    )
            if self._held:
                self._valid_until = sent + self.ttl_ms / 1000.0
            return self._held

    def release(self) -> bool:
        """Give the lease up if it is ours (on a clean exit)."""
        with self._lock, wrap_errors("lease"):
            released = bool(self.scripts.lease_release(keys=[self.key], args=[self.token]))
            self._held = False
            return released
