"""What the service's replicas share in Redis besides the cache: completion ids and leases.

**Completion ids.** Every chat completion the proxy answers under a cache key carries an
id of the proxy's making (``chatcmpl-zc`` and 24 hex digits). Once the response's entry
is known (a hit: the served entry; a miss: the entry its put created), the id is mapped
to it: ``TenantKeys.completion(id)`` holds ``{"t": tenant, "e": entry id, "s":
similarity, "h": 1 for a hit, "n": the hit's number}`` for ``completion_ttl_s`` (one
``SET ... EX``). ``POST /v1/feedback`` with ``completion_id`` reads it under the key's
own tenant, so another tenant's id is not found (a 404), like another tenant's entry id;
a negative verdict on a hit names the hit by its number (``CacheHit.hit_number``), so
that it is counted wrong in the savings once, however often it is sent.

**Leases on upstream calls (coalesced misses).** Concurrent identical misses of a tenant
(the same normalised question under the same scope, ``query_digest``) make one upstream
call, across replicas. The first takes the lease ``TenantKeys.in_flight(digest)`` with
``SET NX PX`` and a random token, renews it while its call runs, and when done replaces
it, token-checked, with a short-lived marker (``=stored`` or ``=none``); the others poll
the key and, once the marker shows, look the question up (the leader's answer is cached
by then) or go upstream on their own. A lease that lapses without a marker (its holder
died) is taken over by the next waiter; a waiter past ``coalesce_wait_s`` goes upstream
itself. Renewal and the finish are Lua scripts comparing the token first, so a holder
that stalled past its lease never touches the lease of the one that took over.

Every Redis failure here makes the proxy carry on without the shared state: a miss goes
upstream alone, a mapping that could not be written only logs (feedback by that id is
then a 404).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from zerda_cache.core.errors import StorageError
from zerda_cache.storage.store import AsyncRedisStorage

log = logging.getLogger(__name__)

#: What a completion id the proxy made looks like.
COMPLETION_PREFIX = "chatcmpl-zc"
#: What ``/v1/feedback`` accepts as a completion id (others: a 422, unknown ones a 404).
COMPLETION_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
#: Marker values a finished leader leaves (tokens are hex: never start with "=").
STORED, NO_ANSWER = "=stored", "=none"


#: A hit id (``/v1/lookup``'s ``entry.hit_id``): the entry, the hit's number and the
#: similarity it was served at, which ``/v1/feedback`` takes as a completion id's mapping.
HIT_ID_RE = re.compile(r"([0-9a-f]{32}):([1-9][0-9]{0,15}):(-?[01]\.[0-9]{6})")


def hit_id(entry_id: str, number: int, similarity: float) -> str:
    """The id naming one served hit (``CacheHit.hit_number`` of ``entry_id``): no state
    is written for it; the feedback script checks that the entry was served that often."""
    return f"{entry_id}:{number}:{min(1.0, max(-1.0, similarity)):.6f}"


def parse_hit_id(value: str) -> Served | None:
    """What a hit id names; ``None`` for a string that is not one."""
    match = HIT_ID_RE.fullmatch(value)
    if match is None:
        return None
    entry_id, number, similarity = match.groups()
    return Served(entry_id, float(similarity), True, int(number))


def new_completion_id() -> str:
    """A fresh completion id: unique per response (96 random bits)."""
    return COMPLETION_PREFIX + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Served:
    """What a completion id was answered with."""

    entry_id: str
    similarity: float
    #: the answer came from the cache (a hit), not from the upstream (a miss)
    hit: bool = False
    #: the hit's number (``CacheHit.hit_number``; None: a miss, or not known)
    hit_number: int | None = None
    #: the upstream's answer was not cached but disputes the entry (``PutResult.disputed``):
    #: the dispute's id (``PutResult.dispute_id``; feedback on it is a ``DisputeSignal``
    #: that settles that dispute only), else None
    dispute: str | None = None


@dataclass(frozen=True, slots=True)
class CoalesceSettings:
    """How misses are coalesced.

    Attributes:
        enabled: coalesce at all (off: every miss goes upstream).
        lease_s: the lease's time to live; its holder renews it every third of it, so a
            holder that died blocks the others for at most this long.
        wait_s: the longest a request waits for another's upstream call before making
            its own.
        poll_s: how often a waiting request reads the lease.
        finished_s: how long a finished leader's marker stays (waiters read it within
            ``poll_s``).
        max_hold_s: the longest a lease is renewed (a bound on a leaked holder).
    """

    enabled: bool = True
    lease_s: float = 10.0
    wait_s: float = 30.0
    poll_s: float = 0.05
    finished_s: float = 5.0
    max_hold_s: float = 600.0


@dataclass
class Lease:
    """A held lease on one upstream call; ``finish`` once (idempotent)."""

    coordination: Coordination
    tenant: str
    digest: str
    token: str
    _renewer: asyncio.Task[None] | None = field(default=None, repr=False)
    _finished: bool = False

    async def finish(self, stored: bool) -> None:
        """Stop renewing and leave the marker for the waiters (if the lease is still
        this holder's). Never raises: a failure leaves the lease to expire."""
        if self._finished:
            return
        self._finished = True
        if self._renewer is not None:
            self._renewer.cancel()  # not awaited: finish may run in a cancelled task
        co = self.coordination
        ms = max(1, int(co.settings.finished_s * 1000))
        marker = STORED if stored else NO_ANSWER
        try:
            await co.storage.finish_flight(self.tenant, self.digest, self.token, marker, ms)
        except StorageError as exc:
            log.warning("lease %s not finished (it expires): %s", self.digest, exc)


@dataclass(frozen=True, slots=True)
class Waited:
    """How a wait for another request's upstream call ended.

    ``outcome``: ``finished`` (the leader is done: look the question up), ``found`` (the
    lease was gone and the lookup found the answer: ``found``), ``lead`` (the lease
    lapsed and this request took it over: ``lease``), ``timeout`` (waited ``wait_s``) or
    ``error`` (Redis failed).
    """

    outcome: str
    lease: Lease | None = None
    found: Any = None


class Coordination:
    """Completion ids and leases in the cache's Redis (see the module docstring)."""

    def __init__(
        self,
        storage: AsyncRedisStorage,
        *,
        completion_ttl_s: float = 86_400.0,
        settings: CoalesceSettings | None = None,
    ) -> None:
        self.storage = storage
        self.completion_ttl_s = completion_ttl_s
        self.settings = settings if settings is not None else CoalesceSettings()

    # -- completion ids -------------------------------------------------------------------
    async def remember(
        self,
        tenant: str,
        completion_id: str,
        entry_id: str,
        similarity: float,
        *,
        hit: bool = False,
        number: int = 0,
        dispute: str | None = None,
    ) -> bool:
        """Map ``completion_id`` to the entry it was answered with (expires); ``hit``: it
        was served from the cache, the entry's serve ``number`` (``CacheHit.hit_number``);
        for an answer that disputes the entry, the ``dispute``'s id
        (``PutResult.dispute_id``). A Redis failure only logs: the response is served
        all the same."""
        mapped = {"t": tenant, "e": entry_id, "s": round(similarity, 6), "h": 1 if hit else 0}
        if hit and number > 0:
            mapped["n"] = number
        if dispute is not None:
            mapped["d"] = dispute
        value = json.dumps(mapped)
        try:
            await self.storage.remember_completion(
                tenant, completion_id, value, self.completion_ttl_s
            )
        except StorageError as exc:
            log.warning("tenant %s: completion id %s not mapped: %s", tenant, completion_id, exc)
            return False
        return True

    async def recall(self, tenant: str, completion_id: str) -> Served | None:
        """The entry ``completion_id`` of ``tenant`` was answered with; ``None`` when
        unknown, expired or not this tenant's.

        Raises:
            StorageError: Redis failed.
        """
        raw = await self.storage.recall_completion(tenant, completion_id)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
            if value["t"] != tenant:
                return None
            number = value.get("n")
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                number = None
            e, s, h = str(value["e"]), float(value["s"]), bool(value.get("h"))
            dispute = value.get("d")
            if dispute is not None and not isinstance(dispute, str):
                dispute = ""  # a mapping written before disputes had ids
            return Served(e, s, h, number, dispute)
        except (ValueError, KeyError, TypeError):
            log.warning("tenant %s: completion id %s maps to %r", tenant, completion_id, raw)
            return None

    # -- leases ---------------------------------------------------------------------------
    async def try_lead(self, tenant: str, digest: str) -> Lease | None:
        """Take the lease on the upstream call of request ``digest`` if it is free
        (``SET NX PX``), renewing it until ``finish``; ``None`` when another holds it.

        Raises:
            StorageError: Redis failed.
        """
        token = secrets.token_hex(16)
        ms = max(1, int(self.settings.lease_s * 1000))
        if not await self.storage.take_flight(tenant, digest, token, ms):
            return None
        lease = Lease(self, tenant, digest, token)
        lease._renewer = asyncio.create_task(self._keep(lease, ms))
        return lease

    async def _keep(self, lease: Lease, ms: int) -> None:
        """Renew the lease every third of its time to live, while it is this holder's."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.settings.max_hold_s
        while loop.time() < until:
            await asyncio.sleep(self.settings.lease_s / 3)
            try:
                if not await self.storage.renew_flight(lease.tenant, lease.digest, lease.token, ms):
                    return  # lapsed, and maybe another's now
            except StorageError as exc:
                log.warning("lease %s not renewed: %s", lease.digest, exc)

    async def wait(self, tenant: str, digest: str, look_up: Callable[[], Awaitable[Any]]) -> Waited:
        """Wait for the holder of request ``digest``'s lease to finish. ``look_up`` is
        called when the lease is gone without a marker (its holder died, or finished long
        ago): what it finds (not ``None``) ends the wait, else the lease is taken over."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.wait_s
        try:
            while True:
                raw = await self.storage.read_flight(tenant, digest)
                if raw is not None and raw.startswith(b"="):
                    return Waited("finished")
                if raw is None:
                    found = await look_up()
                    if found is not None:
                        return Waited("found", found=found)
                    lease = await self.try_lead(tenant, digest)
                    if lease is not None:
                        return Waited("lead", lease)
                if loop.time() >= deadline:
                    return Waited("timeout")
                await asyncio.sleep(self.settings.poll_s)
        except StorageError as exc:
            log.warning("lease %s: %s; going upstream", digest, exc)
            return Waited("error")


__all__ = [
    "COMPLETION_ID_RE",
    "COMPLETION_PREFIX",
    "CoalesceSettings",
    "Coordination",
    "Lease",
    "Served",
    "Waited",
    "new_completion_id",
]
