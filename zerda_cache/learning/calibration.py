"""How likely a near match's cached answer is right, learned from labelled outcomes, and
the similarity a tenant must reach to serve within its error bound ``max_error_rate``.

A label says whether the cached answer of a match at cosine similarity ``s`` was right
for the question asked: a verification (the app called its LLM anyway and the fresh
answer was compared with the cached one), or feedback on a served answer, with the
similarity it was served at. Labels are counted per similarity bin of width
``BIN_WIDTH`` in the tenant's ``cal`` hash, by one Lua script (``label.lua``), so every
replica learns from every other; when a tenant's count passes its window, every bin is
halved, so old evidence fades and the threshold follows a drift.

The bound is on wrong serves per request: of all the tenant's lookups, at most δ may be
served a wrong answer, whether the match was wrong (another question's answer) or the
answer itself (wrong for its own question: an LLM's mistake, or stale). Replicas count
their lookups (in batches, plain ``HINCRBYFLOAT``s): per bin of the best near
candidate's similarity (``t:<bin>``), the lookups that asked a cached question itself
(``t:e``), and the others (``t:x``). Serving every near match at ``s >= t`` serves a
wrong answer to a share of requests of

    P(best near candidate at s >= t) x P(wrong | s >= t)

The first factor comes from the lookup counts, the second from the labels (a
verification compares the cached answer with the app's fresh one, so a wrong answer
counts as a wrong match too), weighted by the requests of each bin rather than by its
labels (strata of ``STRATUM_LABELS`` labels: see ``weighted_error``). The
serving threshold for δ is the lowest labelled bin edge ``t`` at which the product of
both factors' one-sided 95% Wilson upper bounds is at most δ, with at least
``MIN_LABELS`` labels at or above ``t``. Without lookup counts
(a tenant whose replicas predate them) the first factor is 1: the bound is then on the
error among serves, which is stricter. Without enough labels there is no threshold:
every near candidate is verified, which costs nothing the app would not pay for a miss
(it calls its LLM either way). The shape of the rule is vCache's (Schroeder et al.,
arXiv 2502.03771), learned per tenant rather than per entry.

An exact repeat (the question itself) is judged by its entry's own history: the arm's
expected reward puts it in a *level* (``exact_level``: 0 below ``CONFIRMED_REWARD``,
which one positive signal clears, then one level per edge of ``EXACT_LEVELS``). Its
answer may be wrong all the same (an LLM's mistake a user praised by error, an answer
gone stale since), so exact repeats spend the bound too: labels per level
(verifications of exact repeats: ``r:e``/``w:e`` for level 0, ``r:e<k>``/``w:e<k>``) and
lookups per level (``t:e`` counts them all, ``t:e<k>`` those of level k >= 1) give the
wrong serves per request of serving every level from ``k`` up, by the same
requests-weighted, Wilson-bounded estimate as near matches. Exact repeats and near
matches share the bound: of the levels that fit in it (and serving none), the split that
serves the most lookups wins (``exact_plan``); lower levels are verified, and the
near-match threshold works with what is left. A disagreeing verification counts the
cached answer wrong until a third answer settles it (the engine's disputes). Until the
confirmed levels have ``MIN_LABELS`` labels, confirmed entries are served and
unconfirmed ones verified (a new tenant's exploration at ``verify_rate`` labels the
confirmed levels meanwhile). Labels at similarity 1 are never counted in the similarity
bins.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from zerda_cache.core.errors import InvalidSettingError
from zerda_cache.core.validation import count_or_zero, parse_digits
from zerda_cache.learning.match_model import FEATURES, SEARCH_FEATURES, MatchModel

#: Width of a similarity bin.
BIN_WIDTH = 0.005
#: Bins cover similarities from this up to 1 (below it, everything shares the first).
BIN_FLOOR = 0.5
N_BINS = round((1.0 - BIN_FLOOR) / BIN_WIDTH)
#: z of the one-sided 95% Wilson bound.
Z_95 = 1.6448536269514722
#: Labels a threshold needs at or above it before anything is served by similarity.
MIN_LABELS = 30
#: Labels per stratum of the error estimates (``weighted_error``).
STRATUM_LABELS = 10
#: Under a bound, an entry counts as confirmed when its arm's expected reward is at least
#: this (the prior's mean is 0.5: one positive signal, a user's or an agreeing
#: verification, confirms an entry without negatives).
CONFIRMED_REWARD = 0.55
#: The expected-reward edges of an exact repeat's levels: level k >= 1 is an entry whose
#: arm's expected reward is at least ``EXACT_LEVELS[k - 1]``, level 0 an unconfirmed one.
#: With the default Beta(1, 1) prior one positive signal gives 0.67 (level 2), two 0.75
#: (level 3), three 0.8 (level 4), nine 0.91 (level 5); decay pulls an arm back down.
EXACT_LEVELS = (CONFIRMED_REWARD, 0.6, 0.7, 0.8, 0.9)
N_LEVELS = len(EXACT_LEVELS) + 1
#: A reward bar no arm reaches: every exact repeat is verified.
NEVER = 2.0
#: Labels behind a serving decision past which exploration (``verify_rate``) falls off:
#: with ``n`` labels at or above the threshold (or on the exact-repeat levels served), a
#: servable candidate is verified at ``verify_rate * min(1, EXPLORE_LABELS / n)``.
EXPLORE_LABELS = 200


def exact_level(reward: float) -> int:
    """The level (0 .. N_LEVELS - 1) of an entry whose expected reward is ``reward``."""
    return bisect.bisect_right(EXACT_LEVELS, reward + 1e-12)


def served_level(bar: float | None) -> int | None:
    """The lowest level of exact repeats an expected-reward ``bar`` serves (0: any
    servable entry), ``None`` when it serves none (``NEVER``) or there is no bar."""
    if bar is None or bar >= NEVER:
        return None
    return exact_level(bar) if bar > 0 else 0


def bin_of(similarity: float) -> int:
    """The bin of a similarity (0 .. N_BINS - 1)."""
    i = math.floor((similarity - BIN_FLOOR) / BIN_WIDTH + 1e-9)
    return min(max(i, 0), N_BINS - 1)


def bin_floor(index: int) -> float:
    """The lowest similarity of bin ``index``."""
    return BIN_FLOOR + index * BIN_WIDTH


def wilson_upper(errors: float, n: float, z: float = Z_95) -> float:
    """Upper Wilson bound of an error rate with ``errors`` in ``n`` (1.0 when n == 0)."""
    if n <= 0:
        return 1.0
    p = errors / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    margin = z * math.sqrt(max(p * (1 - p) / n + z2 / (4 * n * n), 0.0))
    return min(1.0, (centre + margin) / (1 + z2 / n))


@dataclass(frozen=True, slots=True)
class Serving:
    """What a tenant serves under a bound (``Calibration.serving``), for reports."""

    #: the bound
    max_error_rate: float
    #: the score a near match needs (its similarity without a match model); ``None``:
    #: no near match is served yet (every one is verified)
    threshold: float | None
    #: the lowest level of exact repeats served (``exact_level``; 0: any servable entry);
    #: ``None``: none is served, every exact repeat is verified
    exact_level: int | None
    #: wrong serves per request of serving so, the point estimate and its 95% upper
    #: bound (the one held under ``max_error_rate``)
    estimated_error: float
    error_bound: float
    #: the labels behind it: near matches' and exact repeats'
    labels: float
    exact_labels: float


@dataclass(frozen=True, slots=True)
class Calibration:
    """A tenant's labelled outcomes per similarity bin, and its stored error bound."""

    right: tuple[float, ...] = field(default=(0.0,) * N_BINS)
    wrong: tuple[float, ...] = field(default=(0.0,) * N_BINS)
    #: The tenant's ``max_error_rate`` setting (``None``: not set in Redis).
    max_error_rate: float | None = None
    #: Lookups per bin of their best near candidate's similarity (``t:<bin>``).
    traffic: tuple[float, ...] = field(default=(0.0,) * N_BINS)
    #: Lookups without a near candidate nor the question's own entry (``t:x``).
    traffic_other: float = 0.0
    #: The tenant's match model (``match_model.py``), whose scores the bins count;
    #: ``None``: the bins are similarity bins (model version 0).
    model: MatchModel | None = None
    #: Verifications of exact repeats of unconfirmed entries (``r:e``, ``w:e``), and the
    #: lookups that asked a cached question itself (``t:e``): never tagged with the
    #: model version, and kept by a new model's publication.
    exact_right: float = 0.0
    exact_wrong: float = 0.0
    traffic_exact: float = 0.0
    #: The same for the confirmed levels 1 .. N_LEVELS - 1 (index 0 is level 1):
    #: ``r:e<k>``, ``w:e<k>``, and ``t:e<k>`` (a part of ``traffic_exact``).
    level_right: tuple[float, ...] = field(default=(0.0,) * (N_LEVELS - 1))
    level_wrong: tuple[float, ...] = field(default=(0.0,) * (N_LEVELS - 1))
    level_traffic: tuple[float, ...] = field(default=(0.0,) * (N_LEVELS - 1))
    #: The label stamp (``lv``): bumped by every label and policy change.
    stamp: int = 0
    #: Thresholds computed so far, by bound (a lookup asks for one every time).
    _memo: dict[tuple[float, int], Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def model_version(self) -> int:
        return 0 if self.model is None else self.model.version

    @classmethod
    def parse(cls, fields: Mapping[bytes | str, bytes | str], bound: object) -> Calibration:
        """From the ``cal`` hash (``r:<bin>``, ``w:<bin>`` label counts, ``t:<bin>`` and
        ``t:x`` lookup counts; with a model of version v, ``r<v>:<bin>`` and so on, and
        the model itself, ``model``) and the tenant's stored ``max_error_rate``
        (anything unparsable counts as absent)."""
        text = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        model = MatchModel.decode(text.get("model"))
        try:
            version = int(text.get("mv", 0))
        except ValueError:
            version = 0
        if model is not None and model.version != version:
            model = None  # a model that is not the one the counts are in
        tag = str(version) if model is not None else ""
        counts = {"r": [0.0] * N_BINS, "w": [0.0] * N_BINS, "t": [0.0] * N_BINS}
        other = 0.0
        exact = {"r": 0.0, "w": 0.0, "t": 0.0}
        levels = {
            "r": [0.0] * (N_LEVELS - 1),
            "w": [0.0] * (N_LEVELS - 1),
            "t": [0.0] * (N_LEVELS - 1),
        }
        for name, raw_value in text.items():
            prefix, _, index = name.partition(":")
            kind = prefix[:1]
            try:
                value = float(raw_value)
            except ValueError:
                continue
            if not math.isfinite(value) or value < 0 or kind not in counts:
                continue
            if index[:1] == "e":
                if prefix[1:] != "":
                    continue
                if index == "e":
                    exact[kind] = value
                elif 1 <= (level := parse_digits(index[1:], 3) or 0) < N_LEVELS:
                    levels[kind][level - 1] = value
                continue
            if prefix[1:] != tag:
                continue
            if kind == "t" and index == "x":
                other = value
                continue
            try:
                i = int(index)
            except ValueError:
                continue
            if 0 <= i < N_BINS:
                counts[kind][i] = value
        return cls(
            tuple(counts["r"]),
            tuple(counts["w"]),
            _rate(bound),
            tuple(counts["t"]),
            other,
            model,
            exact["r"],
            exact["w"],
            exact["t"],
            tuple(levels["r"]),
            tuple(levels["w"]),
            tuple(levels["t"]),
            count_or_zero(text.get("lv")),
        )

    @property
    def labels(self) -> float:
        return sum(self.right) + sum(self.wrong)

    @property
    def exact_labels(self) -> float:
        """Outcomes labelled for exact repeats, at every level."""
        return self.exact_right + self.exact_wrong + sum(self.level_right) + sum(self.level_wrong)

    def level_rows(self) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """Right labels, wrong labels and lookups of exact repeats per level (0 ..
        ``N_LEVELS`` - 1). ``t:e`` counts every exact repeat; level 0 is what the
        confirmed levels leave of it."""
        level0 = max(self.traffic_exact - sum(self.level_traffic), 0.0)
        return (
            (self.exact_right, *self.level_right),
            (self.exact_wrong, *self.level_wrong),
            (level0, *self.level_traffic),
        )

    @property
    def lookups(self) -> float:
        """The lookups counted (halved past their window)."""
        return sum(self.traffic) + self.traffic_other + self.traffic_exact

    def exact_plan(self, max_error_rate: float) -> tuple[float, float]:
        """How exact repeats are served under ``max_error_rate``: ``(bar, spend)``, the
        expected reward an entry needs for its exact repeats to be served (0: any
        servable entry; ``NEVER``: none, all are verified) and the share of requests
        that serving them may serve wrong, an upper bound at 95% confidence, which the
        near matches' threshold leaves to them.

        Each level's edge whose exact repeats (every level from there up, with
        ``MIN_LABELS`` labels at or above it) cost at most the bound is a candidate, and
        so is serving none of them; the one that serves the most lookups wins, counting
        the near matches the rest of the bound serves (the lookup counts per level and
        per score bin tell both; without lookup counts, the lowest level within half the
        bound). Without ``MIN_LABELS`` labels on the confirmed levels yet, serving none
        means the bar ``CONFIRMED_REWARD`` with no spend (an entry a positive signal
        confirmed is trusted until its level's labels speak); with them, ``NEVER``."""
        bar, _, spend = self._exact_choice(max_error_rate)
        return bar, spend

    def serving(self, max_error_rate: float) -> Serving:
        """The threshold and exact-repeat level served under ``max_error_rate``, with
        their estimated wrong serves per request (what ``tenant show`` reports)."""
        bar, exact_estimate, exact_bound = self._exact_choice(max_error_rate)
        threshold = self.threshold(max_error_rate)
        near_estimate = near_bound = 0.0
        if threshold is not None:
            edge = bin_of(threshold)
            for i, estimate, bound in self._near_costs(MIN_LABELS):
                if i == edge:
                    near_estimate, near_bound = estimate, bound
        margin = math.hypot(exact_bound - exact_estimate, near_bound - near_estimate)
        return Serving(
            max_error_rate,
            threshold,
            served_level(bar),
            exact_estimate + near_estimate,
            exact_estimate + near_estimate + margin,
            self.labels,
            self.exact_labels,
        )

    def exploration(self, max_error_rate: float) -> tuple[float, float]:
        """The share of ``verify_rate`` a lookup under ``max_error_rate`` spends verifying
        a candidate it could serve, for exact repeats and for near matches: all of it
        while few labels stand behind what is served, then less and less
        (``EXPLORE_LABELS`` over the labels), since each label then moves the bound
        little. Where nothing is served (every candidate is verified anyway), 1."""
        key = (max_error_rate, -2)
        if key not in self._memo:
            level = served_level(self._exact_choice(max_error_rate)[0])
            exact = 1.0
            if level is not None:
                right, wrong, _ = self.level_rows()
                labels = sum(right[level:]) + sum(wrong[level:])
                exact = min(1.0, EXPLORE_LABELS / max(labels, 1.0))
            near = 1.0
            threshold = self.threshold(max_error_rate)
            if threshold is not None:
                i = bin_of(threshold)
                labels = sum(self.right[i:]) + sum(self.wrong[i:])
                near = min(1.0, EXPLORE_LABELS / max(labels, 1.0))
            self._remember(key, (exact, near))
        shares: tuple[float, float] = self._memo[key]
        return shares

    def ceiling_threshold(self, ceiling: float) -> float | None:
        """The lowest edge of a labelled bin (with ``MIN_LABELS`` labels at or above it)
        whose near matches are wrong at most ``ceiling`` of the times they are served,
        at 95% confidence: the per-serve ceiling (``max_serve_error``) beside the
        per-request bound. ``None`` when none qualifies."""
        key = (ceiling, -3)
        if key not in self._memo:
            best: float | None = None
            labels = 0.0
            for i in range(N_BINS - 1, -1, -1):
                here = self.right[i] + self.wrong[i]
                labels += here
                if here and labels >= MIN_LABELS and self._error_above(i)[1] <= ceiling:
                    best = bin_floor(i)
            self._remember(key, best)
        edge: float | None = self._memo[key]
        return edge

    def ceiling_bar(self, ceiling: float) -> float:
        """The expected reward an entry needs for its exact repeats to be wrong at most
        ``ceiling`` of the times they are served (95%): the lowest level whose labels,
        with the levels above, prove it; ``NEVER`` when none does, and while the
        confirmed levels have fewer than ``MIN_LABELS`` labels, ``CONFIRMED_REWARD``."""
        key = (ceiling, -4)
        if key not in self._memo:
            right, wrong, traffic = self.level_rows()
            young = sum(self.level_right) + sum(self.level_wrong) < MIN_LABELS
            bar = CONFIRMED_REWARD if young else NEVER
            labels = 0.0
            for level in range(N_LEVELS - 1, -1, -1):
                labels += right[level] + wrong[level]
                rows = [
                    (right[k], wrong[k], traffic[k]) for k in range(N_LEVELS - 1, level - 1, -1)
                ]
                if labels >= MIN_LABELS and weighted_error(rows)[1] <= ceiling:
                    bar = EXACT_LEVELS[level - 1] if level else 0.0
            self._remember(key, bar)
        found: float = self._memo[key]
        return found

    def _exact_choice(self, max_error_rate: float) -> tuple[float, float, float]:
        """``exact_plan`` with the estimate of the spend too: (bar, estimate, bound)."""
        key = (max_error_rate, -1)
        if key not in self._memo:
            self._remember(key, self._exact_plan(max_error_rate))
        plan: tuple[float, float, float] = self._memo[key]
        return plan

    def _exact_plan(self, max_error_rate: float) -> tuple[float, float, float]:
        right, wrong, traffic = self.level_rows()
        total = self.lookups
        # (bar, cost estimate, cost bound, exact repeats it serves) of every level whose
        # exact repeats fit in the bound
        options: list[tuple[float, float, float, float]] = []
        labels = requests = 0.0
        for level in range(N_LEVELS - 1, -1, -1):
            labels += right[level] + wrong[level]
            requests += traffic[level]
            if labels < MIN_LABELS:
                continue
            share = wilson_upper(requests, total) if total > 0 else 1.0
            rows = [(right[k], wrong[k], traffic[k]) for k in range(N_LEVELS - 1, level - 1, -1)]
            error, bound = weighted_error(rows)
            cost = share * bound
            if cost <= max_error_rate:
                estimate = (requests / total if total > 0 else 1.0) * error
                bar = EXACT_LEVELS[level - 1] if level else 0.0
                options.append((bar, estimate, cost, requests))
        if sum(self.level_right) + sum(self.level_wrong) < MIN_LABELS:
            # a new tenant: confirmed entries, unbudgeted
            fallback = (CONFIRMED_REWARD, 0.0, 0.0)
        else:
            fallback = (NEVER, 0.0, 0.0)
        if total <= 0:  # no lookup counts to weigh what each split serves: half each
            within = [o[:3] for o in options if o[2] <= max_error_rate / 2]
            return within[-1] if within else fallback
        # The split of the bound that serves the most requests: exact repeats from a
        # level (what they spend, the near matches do without), or none of them.
        best, served = fallback, self._near_served(max_error_rate, 0.0, 0.0)
        for bar, estimate, cost, exact in options:  # from the top level down
            more = exact + self._near_served(max_error_rate, estimate, cost)
            if more >= served:
                best, served = (bar, estimate, cost), more
        return best

    def _near_served(self, max_error_rate: float, estimate: float, bound: float) -> float:
        """The lookups whose best near candidate clears the threshold the bound allows
        beside exact repeats that spend ``estimate`` (at most ``bound``)."""
        edge = self._near_threshold(max_error_rate, estimate, bound, MIN_LABELS)
        return 0.0 if edge is None else sum(self.traffic[bin_of(edge) :])

    def _remember(self, key: tuple[float, int], value: object) -> None:
        if len(self._memo) >= 64:  # per-call bounds are the caller's: keep a few
            self._memo.clear()
        self._memo[key] = value

    def threshold(self, max_error_rate: float, min_labels: int = MIN_LABELS) -> float | None:
        """The lowest edge of a labelled bin such that serving every near match at or
        above it serves a wrong answer to at most ``max_error_rate`` of the requests, at
        95% confidence (see the module's docstring); ``None`` when none qualifies. Only
        bins with labels of their own are candidates: below the lowest labelled
        similarity nothing is known, and nothing is served by similarity there."""
        key = (max_error_rate, min_labels)
        if key not in self._memo:
            self._remember(key, self._threshold(max_error_rate, min_labels))
        threshold: float | None = self._memo[key]
        return threshold

    def _threshold(self, max_error_rate: float, min_labels: int) -> float | None:
        # What serving exact repeats spends of the bound, the near matches do without.
        _, estimate, bound = self._exact_choice(max_error_rate)
        return self._near_threshold(max_error_rate, estimate, bound, min_labels)

    def _near_threshold(
        self, max_error_rate: float, exact_estimate: float, exact_bound: float, min_labels: int
    ) -> float | None:
        """The lowest edge whose near matches fit in the bound beside exact repeats that
        spend ``exact_estimate`` (at most ``exact_bound``): the two estimates plus their
        margins combined as independent errors (root of the sum of squares), so that the
        sum is bounded at about 95% rather than each part."""
        best: float | None = None
        exact_margin = exact_bound - exact_estimate
        for i, estimate, bound in self._near_costs(min_labels):  # from the top
            margin = math.hypot(exact_margin, bound - estimate)
            if exact_estimate + estimate + margin <= max_error_rate:
                best = bin_floor(i)
        return best

    def _near_costs(self, min_labels: int) -> list[tuple[int, float, float]]:
        """Per labelled bin with ``min_labels`` labels at or above it, from the top: the
        estimate and the bound of wrong serves per request of serving every near match at
        or above it (the same whatever the budget: memoised)."""
        key = (-1.0, min_labels)
        if key in self._memo:
            memo: list[tuple[int, float, float]] = self._memo[key]
            return memo
        out: list[tuple[int, float, float]] = []
        labels = near = 0.0
        total = self.lookups
        for i in range(N_BINS - 1, -1, -1):  # from the top: counts at s >= edge
            near += self.traffic[i]
            labels += self.right[i] + self.wrong[i]
            if not self.right[i] and not self.wrong[i]:
                continue
            if labels < min_labels:
                continue
            # Requests whose best near candidate is at s >= edge (an upper bound; 1
            # without lookup counts: the bound is then on the error among serves).
            share = wilson_upper(near, total) if total > 0 else 1.0
            error, bound = self._error_above(i)
            out.append((i, (near / total if total > 0 else 1.0) * error, share * bound))
        self._remember(key, out)
        return out

    def _error_above(self, edge: int) -> tuple[float, float]:
        """An upper bound (95%) of P(wrong | a request's best near candidate is at or
        above bin ``edge``): ``weighted_error`` over the bins from the top. Returns
        (estimate, bound)."""
        rows = [
            (self.right[i], self.wrong[i], self.traffic[i]) for i in range(N_BINS - 1, edge - 1, -1)
        ]
        return weighted_error(rows)

    def wrong_per_request(self, edge: float) -> float | None:
        """The point estimate of wrong serves per request when serving near matches at
        ``s >= edge`` (``None`` without labels there): for reports and tests."""
        i0 = bin_of(edge)
        if sum(self.wrong[i0:]) + sum(self.right[i0:]) <= 0:
            return None
        total, near = self.lookups, sum(self.traffic[i0:])
        share = near / total if total > 0 else 1.0
        return share * self._error_above(i0)[0]


def weighted_error(rows: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    """The error rate of the requests of ``rows`` (right labels, wrong labels, requests;
    from the most to the least trusted, bins or levels), and its upper bound at 95%:
    labels are not spread like the traffic (a served match is labelled only by feedback
    and exploration, a held-back one by every verification), so pooling them would let
    well-labelled rows speak for busy ones. Rows are grouped from the top into strata
    of ``STRATUM_LABELS`` labels or more; the estimate is the requests-weighted mean of
    the strata's error rates, its bound a Wilson bound over Kish's effective number of
    labels. Without requests the labels weigh themselves (the pooled rate). Returns
    (estimate, bound)."""
    strata: list[list[float]] = []  # [right, wrong, requests]
    cur = [0.0, 0.0, 0.0]
    for right, wrong, requests in rows:
        cur[0] += right
        cur[1] += wrong
        cur[2] += requests
        if cur[0] + cur[1] >= STRATUM_LABELS:
            strata.append(cur)
            cur = [0.0, 0.0, 0.0]
    if cur[0] + cur[1] > 0 or cur[2] > 0:  # too few labels to stand alone: merged
        if strata:
            strata[-1] = [a + b for a, b in zip(strata[-1], cur, strict=True)]
        else:
            strata.append(cur)
    near = sum(st[2] for st in strata)
    if near <= 0:  # no lookup counts: the pooled rate
        right = sum(st[0] for st in strata)
        wrong = sum(st[1] for st in strata)
        pooled = wrong / (right + wrong) if right + wrong > 0 else 1.0
        return pooled, wilson_upper(wrong, right + wrong)
    mean = inverse = 0.0
    for right, wrong, requests in strata:
        n = right + wrong
        if n <= 0:
            continue
        weight = requests / near
        mean += weight * wrong / n
        inverse += weight * weight / n
    if inverse <= 0:
        return 1.0, 1.0
    n_eff = 1.0 / inverse
    return mean, wilson_upper(mean * n_eff, n_eff)


def _rate(value: object) -> float | None:
    if value is None:
        return None
    try:
        rate = float(value.decode() if isinstance(value, bytes) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError, AttributeError):
        return None
    return rate if 0 < rate < 1 else None


def check_error_rate(value: object, name: str = "max_error_rate") -> float | None:
    """``value`` if it is ``None`` or a number in (0, 1), else ``ValueError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise InvalidSettingError(f"{name} must be a number in (0, 1) or None, got {value!r}")
    return float(value)


@dataclass(slots=True)
class LabelLogs:
    """What the worker fits a match model from: the labels' features and outcomes, the
    sampled lookups' best near candidates' features (NaN rows: none), the model version
    the counts are in, and the labels ever logged (``ln``) and at the last fit."""

    x: npt.NDArray[np.float64]
    y: npt.NDArray[np.bool_]
    seen: npt.NDArray[np.float64]
    version: int
    logged: int
    fitted: int
    #: Sampled lookups that asked a cached question itself, and of those, the ones at
    #: each confirmed level (``seen_levels[k]``: level k; index 0 unused).
    seen_exact: int = 0
    seen_levels: tuple[int, ...] = ()

    @classmethod
    def parse(cls, labels: list[Any], seen: list[Any], counters: list[Any]) -> LabelLogs:
        """From the label log, the lookup sample and the counters as Redis holds them
        (``RedisStorage.read_label_logs``); rows that do not decode are skipped, rows
        of fewer features (logged before the text features) get them unknown (NaN)."""
        width = len(FEATURES)
        rows: list[list[float]] = []
        outcomes: list[bool] = []
        for raw in reversed(labels):  # oldest first
            try:
                row = json.loads(raw)
                feats = [math.nan if v is None else float(v) for v in row[:-1]]
                ok = bool(row[-1])
            except (ValueError, TypeError, IndexError):
                continue
            if SEARCH_FEATURES <= len(feats) <= width:  # logged before text features: 3
                rows.append(feats + [math.nan] * (width - len(feats)))
                outcomes.append(ok)
        looked: list[list[float]] = []
        exact = 0
        levels = [0] * N_LEVELS
        for raw in reversed(seen):
            try:
                batch = msgpack.unpackb(raw)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
                continue
            for r in batch if isinstance(batch, list) else []:
                if isinstance(r, str) and r[:1] == "e":
                    exact += 1
                    if 0 < (level := parse_digits(r[1:], 3) or 0) < N_LEVELS:
                        levels[level] += 1
                elif r is None:
                    looked.append([math.nan] * width)
                elif isinstance(r, list) and SEARCH_FEATURES <= len(r) <= width:
                    try:
                        looked.append([float(v) for v in r] + [math.nan] * (width - len(r)))
                    except (TypeError, ValueError):
                        continue
        mv, ln, fit_ln = (count_or_zero(v) for v in counters)
        return cls(
            np.array(rows, dtype=np.float64).reshape(-1, width),
            np.array(outcomes, dtype=bool),
            np.array(looked, dtype=np.float64).reshape(-1, width),
            mv,
            ln,
            fit_ln,
            exact,
            tuple(levels),
        )


__all__ = [
    "BIN_WIDTH",
    "CONFIRMED_REWARD",
    "EXACT_LEVELS",
    "EXPLORE_LABELS",
    "MIN_LABELS",
    "NEVER",
    "Calibration",
    "LabelLogs",
    "Serving",
    "bin_of",
    "check_error_rate",
    "exact_level",
    "served_level",
    "weighted_error",
    "wilson_upper",
]
