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
labels (strata of ``STRATUM_LABELS`` labels: see ``Calibration._error_above``). The
serving threshold for δ is the lowest labelled bin edge ``t`` at which the product of
both factors' one-sided 95% Wilson upper bounds is at most δ, with at least
``MIN_LABELS`` labels at or above ``t``. Without lookup counts
(a tenant whose replicas predate them) the first factor is 1: the bound is then on the
error among serves, which is stricter. Without enough labels there is no threshold:
every near candidate is verified, which costs nothing the app would not pay for a miss
(it calls its LLM either way). The shape of the rule is vCache's (Schroeder et al.,
arXiv 2502.03771), learned per tenant rather than per entry.

An exact repeat (the question itself) is served its entry if the entry is *confirmed*
(expected reward at least ``CONFIRMED_REWARD``: a user's positive signal, or a
verification whose fresh answer agreed). An unconfirmed entry's answer is as likely
wrong as a fresh LLM answer, so its exact repeats are verified too (``r:e``, ``w:e``),
until those labels prove that serving them costs at most half the bound
(``exact_error``); then they are served and the near-match threshold works with what is
left. Labels at similarity 1 are never counted in the similarity bins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from zerda_cache.errors import InvalidSettingError
from zerda_cache.match_model import MatchModel

#: Width of a similarity bin.
BIN_WIDTH = 0.005
#: Bins cover similarities from this up to 1 (below it, everything shares the first).
BIN_FLOOR = 0.5
N_BINS = round((1.0 - BIN_FLOOR) / BIN_WIDTH)
#: z of the one-sided 95% Wilson bound.
Z_95 = 1.6448536269514722
#: Labels a threshold needs at or above it before anything is served by similarity.
MIN_LABELS = 30
#: Labels per stratum of the near-match error estimate (``Calibration._error_above``).
STRATUM_LABELS = 10
#: Under a bound, an entry counts as confirmed when its arm's expected reward is at least
#: this (the prior's mean is 0.5: one positive signal, a user's or an agreeing
#: verification, confirms an entry without negatives).
CONFIRMED_REWARD = 0.55


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
    #: Thresholds computed so far, by bound (a lookup asks for one every time).
    _memo: dict[tuple[float, int], float | None] = field(
        default_factory=dict, compare=False, repr=False
    )

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
        for name, raw_value in text.items():
            prefix, _, index = name.partition(":")
            kind = prefix[:1]
            try:
                value = float(raw_value)
            except ValueError:
                continue
            if not math.isfinite(value) or value < 0 or kind not in counts:
                continue
            if index == "e":
                if prefix[1:] == "":
                    exact[kind] = value
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
        )

    @property
    def labels(self) -> float:
        return sum(self.right) + sum(self.wrong)

    @property
    def lookups(self) -> float:
        """The lookups counted (halved past their window)."""
        return sum(self.traffic) + self.traffic_other + self.traffic_exact

    def exact_error(self, max_error_rate: float) -> float | None:
        """The share of requests that serving unconfirmed entries to exact repeats would
        serve wrong (their answer is wrong for the question itself), an upper bound at
        95% confidence; ``None`` unless it is proven within half of ``max_error_rate``
        (over ``MIN_LABELS`` verifications at least). Until then, under a bound, an exact
        repeat is served only an entry confirmed by a positive signal, and the others
        are verified."""
        n = self.exact_right + self.exact_wrong
        if n < MIN_LABELS:
            return None
        total = self.lookups
        share = wilson_upper(self.traffic_exact, total) if total > 0 else 1.0
        term = share * wilson_upper(self.exact_wrong, n)
        return term if term <= max_error_rate / 2 else None

    def threshold(self, max_error_rate: float, min_labels: int = MIN_LABELS) -> float | None:
        """The lowest edge of a labelled bin such that serving every near match at or
        above it serves a wrong answer to at most ``max_error_rate`` of the requests, at
        95% confidence (see the module's docstring); ``None`` when none qualifies. Only
        bins with labels of their own are candidates: below the lowest labelled
        similarity nothing is known, and nothing is served by similarity there."""
        key = (max_error_rate, min_labels)
        if key not in self._memo:
            if len(self._memo) >= 64:  # per-call bounds are the caller's: keep a few
                self._memo.clear()
            self._memo[key] = self._threshold(max_error_rate, min_labels)
        return self._memo[key]

    def _threshold(self, max_error_rate: float, min_labels: int) -> float | None:
        # What serving unconfirmed exact repeats spends of the bound, when it is allowed.
        max_error_rate -= self.exact_error(max_error_rate) or 0.0
        best: float | None = None
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
            if share * self._error_above(i, near)[1] <= max_error_rate:
                best = bin_floor(i)
        return best

    def _error_above(self, edge: int, near: float) -> tuple[float, float]:
        """An upper bound (95%) of P(wrong | a request's best near candidate is at or
        above bin ``edge``), weighting the bins by their requests, not their labels:
        labels are not spread like the traffic (a served match is labelled only by
        feedback and exploration, a held-back one by every verification), so pooling
        the labels of all bins would let well-labelled bins speak for busy ones. Bins
        are grouped from the top into strata of ``STRATUM_LABELS`` labels or more; the
        estimate is the requests-weighted mean of the strata's error rates, and its
        bound a Wilson bound over Kish's effective number of labels. Without lookup
        counts the labels weigh themselves (the pooled rate). Returns (estimate, bound)."""
        strata: list[list[float]] = []  # [right, wrong, requests]
        cur = [0.0, 0.0, 0.0]
        for i in range(N_BINS - 1, edge - 1, -1):
            cur[0] += self.right[i]
            cur[1] += self.wrong[i]
            cur[2] += self.traffic[i]
            if cur[0] + cur[1] >= STRATUM_LABELS:
                strata.append(cur)
                cur = [0.0, 0.0, 0.0]
        if cur[0] + cur[1] > 0 or cur[2] > 0:  # too few labels to stand alone: merged
            if strata:
                strata[-1] = [a + b for a, b in zip(strata[-1], cur, strict=True)]
            else:
                strata.append(cur)
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

    def wrong_per_request(self, edge: float) -> float | None:
        """The point estimate of wrong serves per request when serving near matches at
        ``s >= edge`` (``None`` without labels there): for reports and tests."""
        i0 = bin_of(edge)
        if sum(self.wrong[i0:]) + sum(self.right[i0:]) <= 0:
            return None
        total, near = self.lookups, sum(self.traffic[i0:])
        share = near / total if total > 0 else 1.0
        return share * self._error_above(i0, near)[0]


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


__all__ = [
    "BIN_WIDTH",
    "CONFIRMED_REWARD",
    "MIN_LABELS",
    "Calibration",
    "bin_of",
    "check_error_rate",
    "wilson_upper",
]
