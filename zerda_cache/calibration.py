"""How likely a near match's cached answer is right, learned from labelled outcomes, and
the similarity a tenant must reach to serve within its error bound ``max_error_rate``.

A label says whether the cached answer of a match at cosine similarity ``s`` was right
for the question asked: a verification (the app called its LLM anyway and the fresh
answer was compared with the cached one), or feedback on a served answer, with the
similarity it was served at. Labels are counted per similarity bin of width
``BIN_WIDTH`` in the tenant's ``cal`` hash, by one Lua script (``label.lua``), so every
replica learns from every other; when a tenant's count passes its window, every bin is
halved, so old evidence fades and the threshold follows a drift.

The serving threshold for an error bound δ is the lowest bin edge ``t`` such that the
matches at ``s >= t`` were wrong at most δ of the time, at 95% confidence: the Wilson
upper bound of their error rate is at most δ, over at least ``MIN_LABELS`` labels.
Serving only at ``s >= t`` then keeps the share of wrong answers among served ones under
δ, as far as the labels are representative of the traffic. Without enough labels there
is no threshold: only exact repeats are served, and every other candidate is verified,
which costs nothing the app would not pay for a miss (it calls its LLM either way). The
shape of the rule is vCache's (Schroeder et al., arXiv 2502.03771), learned per tenant
rather than per entry; an entry's own history still counts through its arm, its serving
bar and its similarity bar.

Labels at similarity 1 (the question itself, or the fresh answer's own entry) say
nothing about near matches and are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from zerda_cache.errors import InvalidSettingError

#: Width of a similarity bin.
BIN_WIDTH = 0.005
#: Bins cover similarities from this up to 1 (below it, everything shares the first).
BIN_FLOOR = 0.5
N_BINS = round((1.0 - BIN_FLOOR) / BIN_WIDTH)
#: z of the one-sided 95% Wilson bound.
Z_95 = 1.6448536269514722
#: Labels a threshold needs at or above it before anything is served by similarity.
MIN_LABELS = 30


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

    @classmethod
    def parse(cls, fields: Mapping[bytes | str, bytes | str], bound: object) -> Calibration:
        """From the ``cal`` hash (``r:<bin>``, ``w:<bin>`` counts) and the tenant's stored
        ``max_error_rate`` (anything unparsable counts as absent)."""
        right, wrong = [0.0] * N_BINS, [0.0] * N_BINS
        for raw_name, raw_value in fields.items():
            name = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
            kind, _, index = name.partition(":")
            try:
                i, value = int(index), float(raw_value)
            except ValueError:
                continue
            if 0 <= i < N_BINS and math.isfinite(value) and value >= 0:
                if kind == "r":
                    right[i] = value
                elif kind == "w":
                    wrong[i] = value
        return cls(tuple(right), tuple(wrong), _rate(bound))

    @property
    def labels(self) -> float:
        return sum(self.right) + sum(self.wrong)

    def threshold(self, max_error_rate: float, min_labels: int = MIN_LABELS) -> float | None:
        """The lowest edge of a labelled bin at and above which the matches' error rate
        is at most ``max_error_rate`` at 95% confidence; ``None`` when none qualifies.
        Only bins with labels of their own are candidates: below the lowest labelled
        similarity nothing is known, and nothing is served by similarity there."""
        best: float | None = None
        right = wrong = 0.0
        for i in range(N_BINS - 1, -1, -1):  # from the top: cumulative counts at s >= edge
            if not self.right[i] and not self.wrong[i]:
                continue
            right += self.right[i]
            wrong += self.wrong[i]
            n = right + wrong
            if n >= min_labels and wilson_upper(wrong, n) <= max_error_rate:
                best = bin_floor(i)
        return best


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
    "MIN_LABELS",
    "Calibration",
    "bin_of",
    "check_error_rate",
    "wilson_upper",
]
