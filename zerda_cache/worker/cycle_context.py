"""What the parts of a worker cycle share (``maintenance.py`` composes them): the storage,
the tenant's policy, and whether the cycle may go on writing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from zerda_cache.core.config import EvictionConfig
from zerda_cache.core.errors import FencedError
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.learning.tenant_state import TenantState
from zerda_cache.storage import RedisStorage

#: The logger of every part of a cycle: one name for the worker's maintenance, whichever
#: module a record comes from, so that a logging setup that names it sees them all.
LOGGER = "zerda_cache.worker.maintenance"

log = logging.getLogger(LOGGER)


class CycleContext:
    """The storage a cycle works on, and the cycle's brakes: a stop request, the lease,
    the fencing token, and whether a write was refused (then the cycle is over).

    Args:
        storage: the sync storage (its config carries the worker's defaults).
        stop: set it to finish the current batch and stop (a warm stop).
        active: checked between batches too; a worker passes "I still hold the lease",
            so a leader that lost its lease mid-cycle sends no further batch (the
            fencing token refuses what is already under way, if a newer leader wrote).
        fence: the fencing token (lease epoch) every decay and evict write carries; a
            write refused because a newer leader wrote to the tenant (``FencedError``)
            stops the cycle. ``None``: writes are not fenced (the CLI's single passes).
    """

    def __init__(
        self,
        storage: RedisStorage,
        *,
        stop: threading.Event | None = None,
        active: Callable[[], bool] | None = None,
        fence: Callable[[], int | None] | None = None,
    ) -> None:
        self.storage = storage
        self.eviction: EvictionConfig = storage.config.eviction
        self.stop = stop if stop is not None else threading.Event()
        self.active = active if active is not None else (lambda: True)
        self.fence = fence if fence is not None else (lambda: None)
        self.fenced = False  # a write was refused: this cycle is over

    def halted(self) -> bool:
        """Stop before the next batch: asked to, fenced off, or the lease is gone."""
        return self.stop.is_set() or self.fenced or not self.active()

    def refused(self, tenant: str, exc: FencedError) -> None:
        """A write to ``tenant`` was refused by its fence: this cycle stops."""
        if not self.fenced:  # once (two evict calls in flight are both refused)
            log.warning("tenant %s: %s; this worker lost the lease, its cycle stops", tenant, exc)
        self.fenced = True

    def policy(self, tenant: str) -> TenantPolicy:
        """The tenant's policy: this worker's configuration with the tenant's stored
        settings on top (``zerda_cache.learning.tenant_policy``), read at the start of each
        pass, so a change made with ``zerda-cache tenant set`` applies from the next cycle.
        With it, in the same round trip, when due, the worker's report of its own settings
        (``storage/reports.py``): best effort, a report that fails is not retried before
        ``REPORT_EVERY_S`` passed (it counts as said when it is sent), then with the next
        pass that reads the tenant's policy."""
        return TenantState(self.storage).policy(tenant, report=True)
