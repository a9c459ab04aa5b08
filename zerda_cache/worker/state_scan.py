"""Reading a tenant's learning state for the worker: in bounded calls, and for a whole
scan, in threads ahead of the batch being scored."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from zerda_cache.core.config import RLConfig
from zerda_cache.storage import RedisStorage, StateArrays
from zerda_cache.storage.store import IdBatch

T = TypeVar("T")


class StateScan:
    """Owns how the worker reads learning state: ``arrays`` reads a list of ids in calls
    of at most ``batch`` (each call holds the server's one thread), ``ahead`` walks the
    whole ids zset with ``read_ahead`` batches read in threads while the caller scores
    the current one (0: one at a time)."""

    def __init__(self, storage: RedisStorage, *, batch: int, read_ahead: int) -> None:
        self.storage = storage
        self.batch = batch
        self.read_ahead = read_ahead

    def arrays(self, tenant: str, ids: list[str], rl: RLConfig, check: bool = False) -> StateArrays:
        """The learning state of ``ids``, read in calls of at most ``batch`` (``rl``: the
        tenant's prior, for an entry whose state was lost; ``check``: read an entry whose
        hash is gone as gone)."""
        step, st = self.batch, self.storage
        parts = [
            st.state_arrays(tenant, ids[i : i + step], rl=rl, check_hashes=check)
            for i in range(0, len(ids), step)
        ]
        return StateArrays.concat(parts) if parts else st.state_arrays(tenant, [])

    def ahead(
        self, tenant: str, now: float, skip: set[str], rl: RLConfig, check: bool
    ) -> Iterator[tuple[IdBatch, StateArrays]]:
        """The ids zset in ZSCAN batches, each with the learning state of its ids that
        are live at ``now`` and not in ``skip``. The next batches' ZSCAN steps and state
        reads run in threads while the caller scores this one, so a whole scan costs
        about its reads rather than its reads plus the scoring (Redis and Python run side
        by side)."""

        def read(batch: IdBatch) -> tuple[IdBatch, StateArrays]:
            live = [eid for eid, expires_at in batch if expires_at > now and eid not in skip]
            return batch, self.arrays(tenant, live, rl, check)

        depth = self.read_ahead
        batches = self.storage.iter_ids(tenant, self.storage.config.eviction.scan_batch)
        if depth:  # the ZSCAN steps too, so that no read waits for the caller's turn
            batches = _read_ahead(batches, depth)
        with ThreadPoolExecutor(max(1, depth), thread_name_prefix="zerda-scan") as pool:
            pending: deque[Future[tuple[IdBatch, StateArrays]]] = deque()
            try:
                for batch in batches:
                    pending.append(pool.submit(read, batch))
                    if len(pending) > depth:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()  # a scan stopped early: its ZSCAN thread stops too


def _read_ahead(items: Iterator[T], depth: int) -> Iterator[T]:
    """``items``, taken in a thread of their own ahead of the caller (``depth`` waiting
    in a queue and one more in hand: the whole scan's ZSCAN steps, each waiting on a
    round trip). An error in ``items`` is raised here, after the items before it;
    closing this generator stops the thread."""
    out: queue.Queue[tuple[bool, object]] = queue.Queue(depth)
    stop = threading.Event()

    def put(entry: tuple[bool, object]) -> bool:
        while not stop.is_set():
            try:
                out.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((False, None))
        except BaseException as exc:  # handed to the caller, raised there
            put((False, exc))

    thread = threading.Thread(target=produce, name="zerda-scan-ids", daemon=True)
    thread.start()
    try:
        while True:
            more, item = out.get()
            if not more:
                if isinstance(item, BaseException):
                    # Not ``raise item``: its traceback would hold this frame, and the
                    # frame the error, a cycle that keeps the caller's whole scan alive
                    # until the cyclic collector runs.
                    exc, item = item, None
                    raise exc
                return
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        thread.join()
