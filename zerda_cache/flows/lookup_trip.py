"""A lookup's first round trip, by name.

A lookup sends everything it needs, and everything other lookups left for it to send,
in one round trip: the hit script of the candidate it hopes to serve (or reads of the
question's exact-match digest and of its candidates' states), the log's news (or the
tenant's dimension), and when due, the pending miss and traffic counts, a
report of corrupt ids and a refresh of the tenant's policy. ``LookupTrip`` queues each
part under what it is and, once sent, keeps each part's reply under that name
(``trip.hit``, ``trip.own``, ``trip.news``, ``trip.policy`` ...), so that no caller
counts positions in the pipeline.
"""

from __future__ import annotations

from typing import Any

from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.storage.plans import HitOutcome, LogDelta, ReadPlan, ScriptCall, StateBatch


class LookupTrip:
    """The parts of a lookup's first round trip (``parts``), and once sent, their replies
    by name (``take``); a reply of a part that was not sent is ``None``."""

    #: The log's news since the lookup's position (a live index), from the hit script's
    #: peek or a read of its own.
    news: LogDelta | None = None
    #: The tenant's dimension (an index not built yet: the vector is checked against it).
    dim: int | None = None
    #: The tenant's policy, read again for the next lookups.
    policy: TenantPolicy | None = None
    #: The tenant's lookup count after the traffic counts were added.
    counted: float | None = None
    #: The entry the question's exact-match digest names: the question's own entry.
    own: str | None = None
    #: The candidates' learning states (read when no hit script runs).
    states: StateBatch | None = None
    #: The hit script's outcome on the candidate it tried.
    hit: HitOutcome | None = None
    #: The tenant's label stamp (``PolicyCache.stamps``), from the hit script or read.
    stamp: int | None = None
    #: The leading candidate's question, read when no hit script runs and the tenant's
    #: match model weighs text differences (``LookupSteps.texts_known``).
    question: str | None = None

    def __init__(self) -> None:
        self.parts: list[ReadPlan[Any] | ScriptCall[Any]] = []
        #: (name, position) of each part whose reply is kept
        self.named: list[tuple[str, int]] = []

    def send(self, plan: ReadPlan[Any] | ScriptCall[Any]) -> None:
        """A part whose reply nobody reads (a count, a report, a registration)."""
        self.parts.append(plan)

    def peek_log(self, plan: ReadPlan[LogDelta]) -> None:
        self.keep("news", plan)

    def read_dim(self, plan: ReadPlan[int | None]) -> None:
        self.keep("dim", plan)

    def read_policy(self, plan: ReadPlan[TenantPolicy]) -> None:
        self.keep("policy", plan)

    def count_traffic(self, plan: ReadPlan[float]) -> None:
        self.keep("counted", plan)

    def read_digest(self, plan: ReadPlan[str | None]) -> None:
        self.keep("own", plan)

    def read_stamp(self, plan: ReadPlan[int]) -> None:
        self.keep("stamp", plan)

    def read_states(self, plan: ReadPlan[StateBatch]) -> None:
        self.keep("states", plan)

    def read_question(self, plan: ReadPlan[str | None]) -> None:
        self.keep("question", plan)

    def try_hit(self, plan: ScriptCall[HitOutcome]) -> None:
        """The hit script of the lookup's leading candidate, which also reads the
        question's digest (``own``) and, given the lookup's position, peeks at the log
        (``news``)."""
        self.keep("hit", plan)

    def keep(self, name: str, plan: ReadPlan[Any] | ScriptCall[Any]) -> None:
        """A part whose reply ``take`` keeps as the attribute ``name``."""
        self.named.append((name, len(self.parts)))
        self.parts.append(plan)

    def take(self, replies: list[Any]) -> None:
        """Keep the replies of the parts, sent in one round trip in the order queued (a
        lone script as its EVALSHA alone: ``Storage.send_flow``), by name."""
        for name, at in self.named:
            setattr(self, name, replies[at])
        hit = self.hit
        if hit is not None:
            self.own = hit.own
            if hit.stamp is not None:
                self.stamp = hit.stamp
            if hit.log is not None:
                self.news = hit.log


__all__ = ["LookupTrip"]
