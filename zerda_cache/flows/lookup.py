"""The path of a lookup, as named steps (``LookupSteps.find_flow``).

A lookup whose best candidate leads the rest (or ties with rivals that no Thompson draw
could rank first) costs one round trip, usually one command: the hit script on that
candidate, which also reads the question's exact-match digest and peeks at the log's new
events (``LookupSteps.plan_first`` plans it, ``LookupTrip`` sends it). Otherwise it
ranks the candidates on the states that script returned and runs the hit script of the
best (two round trips; on Redis Cluster, whose pipelines cannot carry scripts, it reads
the states first: ``LookupSteps.rank_flow``). Only when the log had news (a put or a removal by
another replica) does it read the new vectors.

Under an error bound, a candidate that is not proven safe enough to serve is held back
for verification: the lookup returns a miss and leaves a ticket for the app's next put
of the question (``verification.py``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from zerda_cache.core.errors import DimensionMismatchError, StorageError
from zerda_cache.core.results import CacheHit
from zerda_cache.flows.counting import LookupCounts
from zerda_cache.flows.lookup_trip import LookupTrip
from zerda_cache.flows.ranking import (
    LocalClock,
    Near,
    Ranking,
    clear_leader,
    features,
    hit_of,
    search,
)
from zerda_cache.flows.verification import Ticket, Verifier, new_nonce
from zerda_cache.learning import text_match
from zerda_cache.learning.calibration import NEVER, exact_level
from zerda_cache.learning.match_model import (
    SEARCH_FEATURES,
    Features,
    score_of,
    text_known,
    with_text,
)
from zerda_cache.learning.tenant_policy import TenantPolicy
from zerda_cache.learning.tenant_state import PolicyCache, read_policy
from zerda_cache.replica.indexes import ReplicaIndexes, TenantIndex
from zerda_cache.storage import codec
from zerda_cache.storage.codec import Vector
from zerda_cache.storage.driver import Flow
from zerda_cache.storage.keys import TenantKeys
from zerda_cache.storage.plans import HitOutcome, HitStatus, ScriptCall, StateBatch
from zerda_cache.storage.store import Storage

log = logging.getLogger(__name__)

#: The most candidates a tie passes to the hit script (Lua's unpack has a limit); a
#: larger top_k ranks its ties after reading their states, as a cluster does.
TIE_MAX = 512
#: A miss whose ``top_k`` nearest candidates were all unservable searches this many
#: times wider, again and again, up to ``WIDEST_WINDOW`` candidates (``serve_wider_flow``).
WIDEN_FACTOR = 4
WIDEST_WINDOW = 256
#: What the hit script answers for a leading candidate that gave way (to the question's
#: own entry, or to a rival of a tie) without being refused, or that its text guard kept
#: from serving (its features now know its text, so it is not servable): it stays a
#: candidate, to rank or to verify.
_GAVE_WAY = (HitStatus.NOT_OWN, HitStatus.TIED, HitStatus.TEXT)


#: Why a lookup decided as it did (``Found.reason``).
REASONS = {
    "exact": "hit: the question's own entry",
    "near": "hit: a near match the bound (or the similarity threshold) lets serve",
    "exact_unproven": "verify: the question's own entry, at a level its labels do not prove",
    "near_unproven": "verify: the best near match, under the threshold the bound allows",
    "disputed": "verify: the question's own entry, whose last verification disagreed",
    "explore": "verify: a servable candidate, verified to keep the bound's labels current",
    "no_candidate": "miss: nothing cached near the question",
    "unservable": "miss: no candidate is servable",
}


@dataclass(slots=True)
class Found:
    """What a lookup decided (``LookupSteps.find_flow``)."""

    hit: CacheHit | None  #: the answer served, or None (a miss, or a verification)
    candidates: int  #: how many near candidates the index found
    verify: bool  #: a candidate was held back: the app's next put verifies it
    #: for an exact repeat, its entry's level at this lookup as far as it is known
    #: (``calibration.exact_level``; 0 when it is not); None: not an exact repeat
    level: int | None
    #: the candidate held back for verification (``verify``)
    ticket: Ticket | None = None
    #: why (``REASONS``)
    reason: str = ""
    #: the tenant's policy the lookup decided under
    policy: TenantPolicy | None = None

    @property
    def decision(self) -> str:
        """``"hit"``, ``"verify"`` (a candidate held back) or ``"miss"``."""
        return "hit" if self.hit is not None else ("verify" if self.verify else "miss")


class Lookup:
    """One lookup as its steps share it: what it asks, the policy it is decided under,
    the candidates the index found (best first) with their match features, and what its
    first round trip tries (``spec``, ``plan``); once it ranks, the states it read, the
    ids it found gone from Redis (``ghosts``) and the ids it tried."""

    __slots__ = (
        "bound",
        "digest",
        "disputed",
        "exact_bar",
        "explore",
        "explore_exact",
        "feats",
        "found",
        "ghosts",
        "guards",
        "live",
        "model",
        "mono",
        "n_found",
        "now",
        "plan",
        "policy",
        "position",
        "query",
        "scope",
        "sketch",
        "spec",
        "states",
        "tenant",
        "threshold",
        "ti",
        "tried",
        "vec",
    )

    #: Set once the lookup ranks (``LookupSteps.rank_flow``): the candidates' states, the
    #: ids found gone from Redis, the ids the hit script was run on, the storage clock.
    states: StateBatch
    ghosts: set[str]
    tried: set[str]
    now: float
    #: When the first round trip was planned (``time.monotonic``).
    mono: float

    def __init__(
        self,
        ti: TenantIndex,
        query: str,
        vec: Vector | None,
        scope: str,
        policy: TenantPolicy,
        override: float | None,
        stamp: int,
    ) -> None:
        self.ti = ti
        self.tenant = ti.keys.tenant
        self.query = query
        self.vec = vec
        self.scope = scope
        self.policy = policy
        # Until it is built, search the index this replica had before, if any (a
        # rebuild), without catching it up, and check the dimension against Redis instead.
        self.live = ti.usable
        self.found: list[Near] = search(ti, vec, scope, policy)
        self.n_found = len(self.found)
        self.position = ti.last_id
        # The question's exact-match digest: the entry it names is read by a speculative
        # hit's script (which checks it), else by a command of the round trip.
        self.digest = codec.query_digest(query, scope)
        self.bound = bound = policy.bound(override)
        #: this lookup verifies a servable candidate instead of serving it: an exact
        #: repeat, a near match (``explore_draw``)
        self.explore_exact = self.explore = False
        if bound is not None and policy.config.verify_rate > 0:
            draw = explore_draw(self.digest, stamp) / policy.config.verify_rate
            exact_share, near_share = policy.calibration.exploration(bound)
            self.explore_exact = draw < exact_share
            self.explore = draw < near_share
        self.threshold = policy.threshold(override)
        self.model = policy.calibration.model
        # Each candidate's features and score (its similarity without a match model).
        self.feats: dict[str, Features] = features(self.found, policy)
        #: near matches the bound serves only for some text differences: their masks
        #: (``MatchModel.text_mask``), checked by the hit script on the entry's question
        self.guards: dict[str, str] = {}
        self.sketch: str | None = None  #: the question's (``text_match.sketch``), once needed
        # Under a bound, an exact repeat is served only an entry whose level the labels
        # prove safe enough (``Calibration.exact_plan``): the bar its arm's expected
        # reward must reach (0: any servable entry), and an exact repeat refused (or
        # disputed) is verified, never served another question's answer instead. None:
        # no bound.
        if bound is None:
            self.exact_bar = None
        else:
            self.exact_bar = NEVER if self.explore_exact else policy.exact_bar(override)
        self.disputed = False  #: the question's own entry was held out for its dispute
        self.spec: Near | None = None  #: the candidate the first round trip tries to serve
        self.plan: ScriptCall[HitOutcome] | None = None  #: its hit script

    def servable(self, cands: list[Near]) -> list[Near]:
        """Near matches the bound lets this lookup serve (all of them without one)."""
        if self.bound is None:
            return cands
        if self.threshold is None or self.explore:
            return []
        return [c for c in cands if self.passes(c[0])]

    def leader_servable(self) -> bool:
        """Whether the bound lets this lookup serve its best candidate (always without
        one)."""
        return self.bound is None or (
            self.threshold is not None
            and not self.explore
            and bool(self.found)
            and self.passes(self.found[0][0])
        )

    def passes(self, entry_id: str) -> bool:
        """Whether near match ``entry_id`` scores the threshold (under a bound, with a
        threshold): for some of the text differences it may have, when the match model
        weighs them (then the hit script checks the entry's, ``guard``)."""
        feats, model, threshold = self.feats.get(entry_id), self.model, self.threshold
        assert threshold is not None
        if feats is None:
            return False
        if model is None or not model.weighs_text:
            return score_of(model, feats) >= threshold
        mask = model.text_mask(feats, threshold)
        if mask == text_match.ALL:
            self.guards.pop(entry_id, None)
            return True
        if mask == text_match.NONE:
            return False
        self.guards[entry_id] = mask
        return True

    def guard(self, entry_id: str) -> str | None:
        """The hit script's text guard for near match ``entry_id`` (``plan_hit``'s
        ``text``): its mask and the question's sketch; None: no guard."""
        mask = self.guards.get(entry_id)
        return None if mask is None else mask + self.asked_sketch()

    def asked_sketch(self) -> str:
        """The question's sketch (``text_match.sketch``), made once, when first needed."""
        if self.sketch is None:
            self.sketch = text_match.sketch(self.query)
        return self.sketch

    def counts_text(self) -> bool:
        """Whether this lookup's count needs its best candidate's text differences:
        under a bound whose match model weighs them, with a candidate."""
        model = self.model
        return (
            self.bound is not None and model is not None and model.weighs_text and bool(self.found)
        )

    def know_text(self, entry_id: str, question: str) -> None:
        """Near match ``entry_id``'s question is ``question``: its text differences from
        the one asked, into its features."""
        theirs = text_match.sketch(question)
        self.set_text(entry_id, text_match.differences(self.asked_sketch(), theirs))

    def refused_text(self, entry_id: str, outcome: HitOutcome) -> None:
        """The hit script found near match ``entry_id``'s question different beyond its
        guard: keep the differences it found in the match's features (a verification's
        label, the lookup's count)."""
        if outcome.text is not None:
            self.set_text(entry_id, text_match.bits_of(outcome.text))

    def set_text(self, entry_id: str, bits: Sequence[float]) -> None:
        """Near match ``entry_id``'s text differences are ``bits``: into its features."""
        feats = self.feats.get(entry_id)
        if feats is not None:
            self.feats[entry_id] = with_text(feats, bits)


def explore_draw(digest: str, stamp: int) -> float:
    """A lookup's exploration draw in [0, 1): a hash of its question and the tenant's
    label stamp, not a random number, so that the same stream is explored the same way
    on any number of replicas; a question is drawn anew once labels come in."""
    raw = hashlib.blake2b(f"{digest}:{stamp}".encode(), digest_size=8).digest()
    return int.from_bytes(raw, "big") / 2.0**64


def asked_level(exact_id: str | None, hit: CacheHit | None) -> int | None:
    """The level of an exact repeat's entry (``None``: the lookup was not one), known
    when it was served; 0 when not (a near match served instead)."""
    if exact_id is None:
        return None
    if hit is not None and hit.exact:
        return exact_level(hit.expected_reward)
    return 0


class LookupSteps:
    """The steps of a lookup over one replica's parts.

    Args:
        storage: the manager's storage.
        indexes: the replica's vector indexes.
        policies: the replica's cache of tenant policies.
        counts: the replica's pending lookup counts.
        verifier: the replica's verifications (a lookup may leave a ticket).
        ranking: orders candidates with the replica's learner.
        clock: the storage clock, estimated locally.
    """

    def __init__(
        self,
        storage: Storage,
        indexes: ReplicaIndexes,
        policies: PolicyCache,
        counts: LookupCounts,
        verifier: Verifier,
        ranking: Ranking,
        clock: LocalClock,
    ) -> None:
        self.storage = storage
        self.indexes = indexes
        self.policies = policies
        self.counts = counts
        self.verifier = verifier
        self.ranking = ranking
        self.clock = clock
        # Scripts cannot run inside Redis Cluster pipelines: there, two round trips.
        self.speculate = not storage.cluster

    def find_flow(
        self,
        keys: TenantKeys,
        query: str,
        vec: Vector | None,
        scope: str,
        override: float | None,
    ) -> Flow[Found]:
        """Decide one lookup: the answer to serve, or a miss, or a verification. The
        tenant's index is made ready (``await_build_flow``) and its policy known
        (``PolicyCache.for_lookup``); the lookup searches (``Lookup``) and plans what its
        first round trip tries (``plan_first``), plans that round trip (``trip``), sends
        it and takes the log's news (``round_trip_flow``). Then the hit that round trip
        served is the answer (``served_first``), or the candidates are ranked and served
        (``rank_flow``)."""
        ti = self.indexes.of(keys)
        if not ti.built:  # built in the background: wait a bounded time for it
            yield from self.await_build_flow(ti, vec)
        known = self.policies.for_lookup(keys.tenant)
        if known is None:  # none yet, or too old: read first
            policy = yield from self.policies.policy_flow(keys.tenant, fresh=True, register=True)
            refresh = False
        else:
            policy, refresh = known
        stamp = self.policies.stamps.get(keys.tenant, 0)
        lookup = Lookup(ti, query, vec, scope, policy, override, stamp)
        self.plan_first(lookup)
        trip = self.trip(lookup, refresh)
        changed = yield from self.round_trip_flow(lookup, trip)
        hit = trip.hit
        if hit is not None and hit.served is not None:
            return self.served_first(lookup, trip, hit)
        return (yield from self.rank_flow(lookup, trip, changed))

    def await_build_flow(self, ti: TenantIndex, vec: Vector | None) -> Flow[None]:
        """Wait a bounded time for the index's build (a lookup without an embedding
        matches exactly only: it starts the build and does not wait)."""
        wait = self.indexes.build_wait(ti, vec is not None)
        waits = wait > 0 and not self.indexes.outage()  # (no wait during an outage)
        yield from self.indexes.await_index(ti, wait)
        job = ti.job
        if waits and not ti.built and not ti.answered and job and not job.done():
            # The build is still waiting for its first reply from Redis: the lookup's
            # own commands would wait as long again. Fail open now, within one
            # redis_timeout_s in all. (A build that failed already is retried later;
            # meanwhile lookups go on as usual.)
            tenant = ti.keys.tenant
            raise StorageError(f"tenant {tenant}: Redis did not answer within {wait:g} s")

    def plan_first(self, lookup: Lookup) -> None:
        """What the lookup's first round trip tries: the hit script of its leading
        candidate (``lookup.spec``, ``lookup.plan``), or nothing.

        The common lookup serves the most similar candidate in that round trip. When it
        is the only one, or the only one within ``similarity_tie_margin`` of the top, the
        ranking would put it first whatever the arms say; the hit script refuses it for
        what ranking would skip it for (gone, expired, under the serving bar or its
        similarity bar) and for the one thing ranking puts before it: the question's own
        entry, when that is another (the digest, checked in the script). If it is this
        one, it is served as such, under its own bar. With rivals within the margin, the
        script also reads their arms and serves it only if the bandit would rank it
        first whatever it drew (arms without evidence score their mean, so entries
        without feedback rank by similarity and confidence); if not, or refused, it
        returns every candidate's state and they are ranked, one round trip later."""
        found, policy = lookup.found, lookup.policy
        if not (self.speculate and found and lookup.leader_servable()):
            return
        margin = policy.rl.similarity_tie_margin
        tie = not clear_leader(found, margin)
        if tie and len(found) > TIE_MAX:
            return
        spec = lookup.spec = found[0]
        rivals: list[Near] = []
        if tie:
            floor = spec[1] - margin
            rivals = lookup.servable([c for c in found[1:] if c[1] >= floor])
        # every candidate's id, the leader first and its rivals next (plan_hit)
        tied = [eid for eid, _ in rivals]
        ids = [spec[0], *tied, *(e for e, _ in found[1:] if e not in tied)] if tied else []
        # the script also peeks at the log: the lookup's one command, usually
        lookup.plan = self.plan_hit(
            lookup.tenant,
            *spec,
            policy,
            lookup.exact_bar,
            asked=lookup.digest,
            rivals=rivals,
            candidates=ids,
            peek=lookup.position if lookup.live else None,
            text=lookup.guard(spec[0]) if lookup.guards else None,
        )

    def trip(self, lookup: Lookup, refresh: bool) -> LookupTrip:
        """The lookup's first round trip: its hit script (which peeks at the log), or a
        read of the question's digest, of the candidates' states and of the log's news;
        and what is due: the pending counts, a report of corrupt ids, a policy refresh."""
        st, tenant = self.storage, lookup.tenant
        trip = LookupTrip()
        if lookup.plan is None or not lookup.live:  # else the hit script peeks at the log
            if lookup.live:
                trip.peek_log(st.peek_log(tenant, lookup.position))
            else:
                trip.read_dim(st.read_dim(tenant))
        misses = self.counts.send_misses(tenant)
        if misses is not None:
            trip.send(misses)
        report = st.report_suspects(tenant)  # corrupt ids found here: for the worker
        if report is not None:
            trip.send(report)
        lookup.mono = mono = time.monotonic()
        traffic = self.counts.due(tenant, mono)
        if traffic is not None:
            trip.count_traffic(st.count_traffic(tenant, *traffic))
        if refresh:  # read the policy again for the next lookups, in this round trip
            trip.read_policy(read_policy(st, tenant))
            trip.send(st.register(tenant))
            for said in st.report_settings(tenant):  # the settings this replica applies
                trip.send(said)
        if lookup.plan is not None:
            trip.try_hit(lookup.plan)
        else:
            trip.read_digest(st.read_digest(tenant, lookup.digest))
            if lookup.bound is not None:  # labels decide only under a bound
                trip.read_stamp(st.read_stamp(tenant))
            if lookup.found:
                trip.read_states(st.read_states(tenant, [eid for eid, _ in lookup.found]))
                if lookup.counts_text():  # (a hit script would have compared it)
                    trip.read_question(st.read_question(tenant, lookup.found[0][0]))
        return trip

    def round_trip_flow(self, lookup: Lookup, trip: LookupTrip) -> Flow[bool]:
        """Send the lookup's first round trip, and take what it brought besides the
        candidates: the policy for the next lookups, the traffic count (halved past its
        window), and the log's news, applied to the index (without it, the tenant's
        dimension, checked). True if the index changed."""
        trip.take((yield from self.storage.send_flow("lookup", trip.parts)))
        tenant, ti, policy = lookup.tenant, lookup.ti, lookup.policy
        if trip.policy is not None:
            self.policies.keep(tenant, lookup.mono, trip.policy)
        stamp, stamps = trip.stamp, self.policies.stamps
        if stamp is not None and stamp > stamps.get(tenant, 0):  # the newest one seen
            stamps[tenant] = stamp
        if trip.own is None:  # an exact repeat is counted once its level is known
            bounded = lookup.bound is not None
            if bounded:
                self.texts_known(lookup, trip)
            self.counts.near(tenant, lookup.found, lookup.feats, lookup.mono, policy, bounded)
        if trip.counted is not None and self.counts.over_window(trip.counted, policy):
            yield from self.counts.halve(tenant, policy)
        if lookup.live:
            news = trip.news
            assert news is not None
            changed = yield from self.indexes.catch_up(ti, news, lookup.position)
            if not ti.built:  # the catch-up found a rebuild necessary: a bounded wait
                yield from self.indexes.await_index(ti, self.indexes.build_wait(ti, True))
            return changed
        vec, dim = lookup.vec, trip.dim
        if vec is not None and dim is not None and dim != len(vec):
            raise DimensionMismatchError(tenant, dim, len(vec))
        return False

    @staticmethod
    def texts_known(lookup: Lookup, trip: LookupTrip) -> None:
        """What the first round trip showed of the leading near match's text differences,
        into its features, so that the lookup is counted in the bin its score falls in
        (the bound weighs each bin's traffic by its labels' errors): refused by its
        guard, served (its question came back), or read (no hit script ran). Unknown
        only when the hit script refused it for something else."""
        if not lookup.counts_text():
            return
        outcome, spec = trip.hit, lookup.spec
        if outcome is not None and spec is not None:
            if outcome.status is HitStatus.TEXT:
                lookup.refused_text(spec[0], outcome)
            elif outcome.served is not None:
                lookup.know_text(spec[0], outcome.served.query)
        elif trip.question is not None:
            lookup.know_text(lookup.found[0][0], trip.question)

    def served_first(self, lookup: Lookup, trip: LookupTrip, outcome: HitOutcome) -> Found:
        """The lookup's leading candidate, served by its first round trip."""
        spec, own = lookup.spec, trip.own
        assert spec is not None
        exact = spec[0] == own
        if exact:  # the question itself: an exact hit, similarity 1
            spec = (spec[0], 1.0)
        served = self.ranking.spec_hit(lookup.tenant, spec, outcome, exact, lookup.policy)
        reason = "exact" if exact else "near"
        level = asked_level(own, served)
        return Found(served, lookup.n_found, False, level, reason=reason, policy=lookup.policy)

    def rank_flow(self, lookup: Lookup, trip: LookupTrip, changed: bool) -> Flow[Found]:
        """The first round trip served nothing: rank the candidates on their states (from
        the hit script's refusal, or read) and serve the best one the hit script accepts;
        forget ids gone from Redis and search again, then ever wider; a miss under a bound
        asks for a verification."""
        tenant, spec, hit, policy = lookup.tenant, lookup.spec, trip.hit, lookup.policy
        exact_id = asked = trip.own  # the question's own entry, if cached
        lookup.states, lookup.ghosts = StateBatch(), set()
        if hit is not None and spec is not None:
            if hit.states is not None:  # a tie's (or a refused leader's) candidates
                lookup.states = hit.states
                lookup.ghosts.update(hit.states.missing)
            if hit.status is HitStatus.GONE:
                lookup.ghosts.add(spec[0])
            elif lookup.exact_bar is not None and spec[0] == exact_id:  # under its bar
                lookup.disputed = hit.status is HitStatus.DISPUTED
                level = exact_level(hit.reward) if hit.reward is not None else 0
                return self.verify_exact(lookup, spec[0], level)
        elif trip.states is not None:
            lookup.states = trip.states
            lookup.ghosts.update(trip.states.missing)
        self.indexes.check_dim(tenant, lookup.ti, lookup.vec)
        if changed:
            lookup.found = search(lookup.ti, lookup.vec, lookup.scope, policy)
            feats, lookup.feats = lookup.feats, features(lookup.found, policy)
            for eid, f in feats.items():  # the text differences a guard found stay known
                if text_known(f):
                    lookup.set_text(eid, f[SEARCH_FEATURES:])
        # A near match that gave way to the question's own entry, or to the bandit's
        # ranking of a tie, or that its text guard kept from serving, stays a candidate.
        tried: set[str] = set()
        lookup.tried = tried
        if hit is not None and spec is not None and hit.status not in _GAVE_WAY:
            tried.add(spec[0])
        found = [(eid, sim) for eid, sim in lookup.found if eid not in tried]
        if exact_id in tried:
            exact_id = None
        now = self.clock.estimate()
        lookup.now = now if now is not None else (yield from self.clock.now_flow())
        near = lookup.servable(found)
        served = None
        if exact_id is not None and not near and exact_id not in lookup.states.entries:
            # The question itself and no near match (an index still building, or an
            # embedding far from the cached question's): nothing to rank, so the hit
            # script alone decides, without reading the entry's state first.
            served, refused_at = yield from self.serve_own_flow(lookup, exact_id)
            if refused_at is not None:
                return self.verify_exact(lookup, exact_id, refused_at)
            exact_id = None
        if served is None and (near or exact_id is not None):  # else nothing to rank
            refused: dict[str, int] = {}
            served = yield from self.serve_best_flow(
                lookup, near, exact_id, lookup.exact_bar, refused
            )
            if asked is not None and asked in refused:
                return self.verify_exact(lookup, asked, refused[asked])
        if served is None and lookup.ghosts:
            found, served = yield from self.without_ghosts_flow(lookup)
        # A window of top_k candidates that was not full has no candidate further out.
        full = lookup.n_found >= policy.config.top_k
        if served is None and lookup.vec is not None and full:
            served = yield from self.serve_wider_flow(lookup, lookup.vec)
        if served is not None:
            reason = "exact" if served.exact else "near"
            at = asked_level(asked, served)
            return Found(served, lookup.n_found, False, at, None, reason, lookup.policy)
        self.counts.miss(tenant)
        ticket = None
        if lookup.bound is not None and found:
            ticket = yield from self.hold_flow(lookup, found)
        if ticket is not None:
            reason = "explore" if lookup.explore else "near_unproven"
        else:
            reason = "unservable" if lookup.n_found else "no_candidate"
        at = asked_level(asked, None)
        return Found(None, lookup.n_found, ticket is not None, at, ticket, reason, lookup.policy)

    def serve_own_flow(
        self, lookup: Lookup, exact_id: str
    ) -> Flow[tuple[CacheHit | None, int | None]]:
        """Run the hit script on the question's own entry alone: ``(the hit, None)``, or
        under a bound, ``(None, its level)`` when it is refused (to verify)."""
        lookup.tried.add(exact_id)
        plan = self.plan_hit(
            lookup.tenant, exact_id, 1.0, lookup.policy, lookup.exact_bar, own=True
        )
        outcome = yield from self.storage.run_flow(plan)
        if outcome.served is not None:
            hit = self.ranking.spec_hit(
                lookup.tenant, (exact_id, 1.0), outcome, True, lookup.policy
            )
            return hit, None
        if outcome.status is HitStatus.GONE:
            lookup.ghosts.add(exact_id)
        elif lookup.exact_bar is not None:
            lookup.disputed = outcome.status is HitStatus.DISPUTED
            return None, exact_level(outcome.reward) if outcome.reward is not None else 0
        return None, None

    def serve_best_flow(
        self,
        lookup: Lookup,
        found: list[Near],
        exact_id: str | None,
        exact_bar: float | None = None,
        refused: dict[str, int] | None = None,
    ) -> Flow[CacheHit | None]:
        """Rank the candidates and serve the best one the hit script accepts; ids found
        gone from Redis are added to the lookup's ``ghosts``, every id tried to its
        ``tried``. With ``exact_bar``, the question's own entry is served only if its
        expected reward reaches it; if it does not (or the entry is not servable),
        nothing else is tried and its id goes to ``refused`` with its level: an exact
        repeat is never served another question's answer instead."""
        tenant, policy, states, now = lookup.tenant, lookup.policy, lookup.states, lookup.now
        ghosts = lookup.ghosts
        missing = [eid for eid, _ in found if eid not in states.entries]
        if exact_id is not None and exact_id not in states.entries:
            missing.append(exact_id)
        if missing:
            more = yield from self.storage.load_states_flow(tenant, missing)
            states.entries.update(more.entries)
            ghosts.update(more.missing)
        ranked = self.ranking.candidates(found, exact_id, states, now, policy)
        own_first = bool(ranked) and ranked[0][2]

        def refuse(eid: str) -> None:
            entry = states.entries.get(eid)
            if refused is not None:
                arm = entry.bandit_arm.at(now, policy.rl) if entry is not None else None
                refused[eid] = exact_level(arm.expected_reward) if arm is not None else 0

        exact_asked = exact_bar is not None and exact_id is not None and exact_id not in ghosts
        if exact_asked and not own_first and exact_id is not None:
            # the question's own entry is not servable: nothing else is served instead
            refuse(exact_id)
            return None
        for cand, score, exact in ranked:
            lookup.tried.add(cand[0])
            plan = self.plan_hit(
                tenant,
                cand[0],
                cand[1],
                policy,
                exact_bar if exact else None,
                text=lookup.guard(cand[0]) if lookup.guards and not exact else None,
                own=exact,
            )
            outcome = yield from self.storage.run_flow(plan)
            if outcome.served is not None:
                return hit_of(tenant, cand, score, exact, outcome.served)
            if outcome.status is HitStatus.GONE:
                ghosts.add(cand[0])
            elif outcome.status is HitStatus.TEXT:
                lookup.refused_text(cand[0], outcome)
            elif exact_bar is not None and exact:
                lookup.disputed = outcome.status is HitStatus.DISPUTED
                refuse(cand[0])
                return None
        return None

    def without_ghosts_flow(self, lookup: Lookup) -> Flow[tuple[list[Near], CacheHit | None]]:
        """Ghosts (left by a FLUSHALL, an empty restart, a lost log event) take places in
        the top-k that live entries should have: forget them, search again and serve the
        best of what is new. Returns the candidates left, and the hit."""
        ti, ghosts, policy = lookup.ti, lookup.ghosts, lookup.policy
        log.debug("tenant %s: %d ids gone from Redis left the index", lookup.tenant, len(ghosts))
        ti.forget(ghosts)
        again = search(ti, lookup.vec, lookup.scope, policy)
        lookup.feats = features(again, policy)
        found = [f for f in again if f[0] not in lookup.tried]
        if not found:
            return found, None
        return found, (yield from self.serve_best_flow(lookup, lookup.servable(found), None))

    def serve_wider_flow(self, lookup: Lookup, vec: Vector) -> Flow[CacheHit | None]:
        """A miss whose window of ``top_k`` candidates was full: the nearest ones may all
        be unservable (expired until the worker's next cycle, marked wrong under
        ``min_reward_to_serve``, under their own similarity bar) and hide a servable
        match further out. Search ever wider (``WIDEN_FACTOR`` times, up to
        ``WIDEST_WINDOW`` candidates) and serve the best of the new ones."""
        policy, ti = lookup.policy, lookup.ti
        window = policy.config.top_k
        # every candidate read or tried
        seen = set(lookup.states.entries) | lookup.tried | lookup.ghosts
        full = lookup.n_found >= window
        while full and window < WIDEST_WINDOW:
            window = min(window * WIDEN_FACTOR, WIDEST_WINDOW)
            wider = ti.search(vec, lookup.scope, window, policy.config.similarity_threshold)
            new = [c for c in wider if c[0] not in seen]
            seen.update(eid for eid, _ in new)
            lookup.feats.update(features(new, policy))
            if new:
                hit = yield from self.serve_best_flow(lookup, lookup.servable(new), None)
                if hit is not None:
                    return hit
            full = len(wider) >= window
        return None

    def hold_flow(self, lookup: Lookup, found: list[Near]) -> Flow[Ticket | None]:
        """A miss under a bound: ask the app's next put of this question to verify the
        best candidate (a ticket, ``verification.py``). None when none is servable."""
        rest = [f for f in found if f[0] not in lookup.ghosts]
        states, tenant = lookup.states, lookup.tenant
        missing = [eid for eid, _ in rest if eid not in states.entries]
        if missing:
            states.entries.update(
                (yield from self.storage.load_states_flow(tenant, missing)).entries
            )
        ranked = self.ranking.candidates(rest, None, states, lookup.now, lookup.policy)
        if not ranked:
            return None
        (eid, sim, _), _, _ = ranked[0]
        ticket = Ticket(eid, sim, lookup.feats.get(eid), nonce=new_nonce())
        self.verifier.hold(tenant, lookup.query, lookup.scope, ticket)
        return ticket

    def verify_exact(self, lookup: Lookup, entry_id: str, level: int) -> Found:
        """Not served: the question's own entry is under its bar under a bound (its
        ``level`` is not proven safe enough, it carries a dispute, or this lookup
        explores). The app's next put of the question verifies it (an exact label at
        that level)."""
        self.counts.miss(lookup.tenant)
        ticket = Ticket(entry_id, 1.0, None, level, True, new_nonce())
        self.verifier.hold(lookup.tenant, lookup.query, lookup.scope, ticket)
        if lookup.disputed:
            reason = "disputed"
        else:
            reason = "explore" if lookup.explore_exact else "exact_unproven"
        return Found(None, lookup.n_found, True, level, ticket, reason, lookup.policy)

    def plan_hit(
        self,
        tenant: str,
        entry_id: str,
        similarity: float,
        policy: TenantPolicy,
        exact_bar: float | None = None,
        asked: str | None = None,
        rivals: Sequence[Near] = (),
        candidates: Sequence[str] = (),
        peek: str | None = None,
        text: str | None = None,
        own: bool = False,
    ) -> ScriptCall[HitOutcome]:
        """The hit script's call; ``exact_bar``: the expected reward the question's own
        entry needs under a bound (``Calibration.exact_plan``), over the serving bar.
        ``asked``: the question's exact-match digest, for a speculative near match, which
        the script serves as the question's own entry (under ``exact_bar``) only if it is
        that, and not at all if the question has another. ``rivals``, ``candidates``: a
        speculative near match's tie, and ``peek``, the lookup's position in the log;
        ``text``, a near match's text guard (``Lookup.guard``); ``own``: the entry is the
        question's own, as the lookup knows without a digest (``StoragePlans.plan_hit``)."""
        return self.storage.plan_hit(
            tenant,
            entry_id,
            refresh_ttl=policy.config.refresh_ttl_on_hit,
            min_reward=policy.rl.serve_bar,
            similarity=similarity,
            rl=policy.rl,
            asked=asked,
            own_bar=exact_bar,
            rivals=rivals,
            candidates=candidates,
            peek=peek,
            text=text,
            own=own,
        )


__all__ = [
    "REASONS",
    "TIE_MAX",
    "WIDEN_FACTOR",
    "WIDEST_WINDOW",
    "Found",
    "Lookup",
    "LookupSteps",
    "asked_level",
]
