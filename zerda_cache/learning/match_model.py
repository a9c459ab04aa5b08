"""A tenant-level model of P(the cached answer is right | this match), over features of
the match that the index search gives for free, and the score the error bound's bins are
kept in (``calibration.py``).

Features of a candidate, from the lookup's candidate list (similarities, best first):

- ``similarity``: its cosine similarity to the question asked;
- ``gap``: how far it is from the nearest other candidate, above or below (for the best
  one: its lead over the second), or above the search threshold when it is the only
  one: a match alone in its neighbourhood is more often right;
- ``crowd``: how many other candidates are within ``CROWD_EPS`` of it: a crowded
  neighbourhood (many close but different cached questions) is more often wrong;
- ``numbers``, ``names``, ``negation``: whether the question asked and the candidate's
  question differ in the numbers they hold, the names they capitalise, or in negating
  (``text_match.py``). A search does not give the candidate's text: a lookup scores a
  candidate under every combination of these (``MatchModel.text_mask``) and, when only
  some pass, the hit script serves it only if its own question's differences are one of
  those (it has the text); until then they are unknown (NaN: each weighs its mean), which
  is how a lookup's traffic is counted. A verification's label knows them.

Without a model (version 0) a match's score is its similarity, and the bins are
similarity bins. Once a tenant has enough labels of both kinds, the worker fits a
logistic regression over the standardised features on the tenant's bounded label log
(``Maintenance.calibrate_tenant``), checks that it ranks the newest labels better than
similarity alone, and publishes it with the label and lookup counts rescored
(``calibrate.lua``): from then on a match's score is ``0.5 + 0.5 * P(right)``, which
keeps the bins' range, and replicas read the model with the rest of the policy.
On QQP, over similarity, gap and crowd, it makes 1.2-2.5x the correct serves of
similarity alone at the same bound (``benchmarks/match_features.py`` measures it); the
text features add little there (QQP's near misses are rarely a number apart) and are
kept for the ones users meet ("... in 2023" / "... in 2024"): the worker fits them in
only where they rank the newest labels clearly better (``fitting.TEXT_AUC_GAIN``). A model
of the search's three features (stored before the text ones existed, or fitted without
them) decodes and scores a full row: the features it lacks weigh nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from zerda_cache.learning.text_match import (
    ALL,
    COMBOS,
    NONE,
    TEXT_FEATURES,
    bits_of,
)

#: The features, in the order of every row.
FEATURES = ("similarity", "gap", "crowd", *TEXT_FEATURES)
#: The features a search gives (the rest are the text's).
SEARCH_FEATURES = 3
#: Candidates within this similarity of another crowd it.
CROWD_EPS = 0.02
#: Labels (and of each kind) the worker needs before it fits a model.
MIN_FIT_LABELS = 300
MIN_EACH_KIND = 20
#: Labels logged between two fits of a tenant's model.
REFIT_EVERY = 500
#: Share of the newest labels held out to check the model against similarity alone.
HOLDOUT = 0.2
#: L2 penalty of the fit (on standardised features; the intercept is free).
RIDGE = 1.0

Features = tuple[float, ...]


def candidate_features(found: Sequence[tuple[str, float]], floor: float) -> list[Features]:
    """The features of every candidate of a lookup, in the order of ``found`` (which is
    best first, as the index returns it); ``floor``: the search threshold."""
    sims = [sim for _, sim in found]
    out: list[Features] = []
    nan = math.nan
    for i, s in enumerate(sims):
        others = [abs(x - s) for j, x in enumerate(sims) if j != i]
        gap = min(others) if others else max(0.0, s - floor)
        crowd = sum(1 for d in others if d <= CROWD_EPS)
        # (the text features unknown: NaN, one flat tuple per candidate on the hot path)
        out.append((float(s), float(gap), float(crowd), nan, nan, nan))
    return out


def text_known(features: Sequence[float]) -> bool:
    """Whether a match's text features are all known (a row of the search's alone: no)."""
    return len(features) > SEARCH_FEATURES and all(
        math.isfinite(x) for x in features[SEARCH_FEATURES:]
    )


def with_text(features: Sequence[float], bits: Sequence[float]) -> Features:
    """A match's features with its text features ``bits`` (``text_match.differences``)."""
    return (*(float(x) for x in features[:SEARCH_FEATURES]), *(float(b) for b in bits))


@dataclass(frozen=True, slots=True)
class MatchModel:
    """A fitted logistic regression: ``P(right) = sigmoid(w0 + w . (x - mu) / sd)``."""

    version: int
    mu: tuple[float, ...]
    sd: tuple[float, ...]
    w: tuple[float, ...]  # intercept first

    def p_right(self, features: Features | Sequence[float]) -> float:
        """``P(right)`` of a match; a feature missing from ``features`` or from the
        model (a row or a model from before a feature existed) weighs nothing."""
        z = self.w[0]
        for x, m, s, w in zip(features, self.mu, self.sd, self.w[1:], strict=False):
            if not math.isfinite(x):  # unknown (feedback carries the similarity only)
                continue
            z += w * (x - m) / s
        return 1.0 / (1.0 + math.exp(-min(30.0, max(-30.0, z))))

    def score(self, features: Features | Sequence[float]) -> float:
        return 0.5 + 0.5 * self.p_right(features)

    @property
    def weighs_text(self) -> bool:
        """Whether the model weighs any text feature (a lookup then scores text)."""
        return any(w != 0 for w in self.w[1 + SEARCH_FEATURES :])

    def text_mask(self, features: Sequence[float], threshold: float) -> str:
        """Which combinations of text differences (``text_match.combo``: character ``i``
        for combination ``i``) let a match with ``features`` score ``threshold`` or
        more: ``"1"`` passes, ``"0"`` does not. Known differences decide alone (every
        combination passes, or none)."""
        if text_known(features):
            return ALL if self.score(features) >= threshold else NONE
        head = features[:SEARCH_FEATURES]
        return "".join(
            "1" if self.score((*head, *bits_of(i))) >= threshold else "0" for i in range(COMBOS)
        )

    def encode(self) -> str:
        return json.dumps({"v": self.version, "mu": self.mu, "sd": self.sd, "w": self.w})

    @classmethod
    def decode(cls, raw: bytes | str | None) -> MatchModel | None:
        """The stored model, or ``None`` if absent or not a model of these features."""
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            model = cls(
                int(data["v"]),
                tuple(float(x) for x in data["mu"]),
                tuple(float(x) for x in data["sd"]),
                tuple(float(x) for x in data["w"]),
            )
        except (ValueError, KeyError, TypeError):
            return None
        n = len(model.mu)  # the features it was fitted on: the first n
        values = (*model.mu, *model.sd, *model.w)
        if (
            model.version < 1
            or not SEARCH_FEATURES <= n <= len(FEATURES)
            or (len(model.sd), len(model.w)) != (n, n + 1)
            or not all(math.isfinite(x) for x in values)
            or min(model.sd) <= 0
        ):
            return None
        return model


def score_of(model: MatchModel | None, features: Features | Sequence[float]) -> float:
    """The score a match is binned and served by: its similarity without a model."""
    return float(features[0]) if model is None else model.score(features)


def fit(
    x: npt.NDArray[np.float64], y: npt.NDArray[np.bool_], version: int, ridge: float = RIDGE
) -> MatchModel:
    """Fit by Newton's method (IRLS) on standardised features; unknown values (NaN) are
    replaced by their column's mean, so they weigh nothing."""
    x = np.array(x, dtype=np.float64)
    finite = np.isfinite(x)
    known_rows = finite.sum(axis=0)
    # a column never known (text features of labels logged before them) weighs nothing
    mu = np.where(finite, x, 0.0).sum(axis=0) / np.maximum(known_rows, 1)
    x = np.where(finite, x, mu)
    sd = x.std(axis=0)
    sd = np.where(sd > 1e-9, sd, 1.0)
    z = np.column_stack([np.ones(len(x)), (x - mu) / sd])
    w = np.zeros(z.shape[1])
    reg = np.full(z.shape[1], ridge)
    reg[0] = 0.0
    target = y.astype(np.float64)
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -30, 30)))
        grad = z.T @ (p - target) + reg * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(reg + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return MatchModel(version, tuple(mu.tolist()), tuple(sd.tolist()), tuple(w.tolist()))


def auc(score: npt.NDArray[np.float64], y: npt.NDArray[np.bool_]) -> float:
    """Area under the ROC curve of ``score`` for ``y`` (ties count half); 0.5 if one
    kind is missing."""
    pos = int(y.sum())
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return 0.5
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ranks = (np.bincount(inverse, weights=ranks) / counts)[inverse]
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


__all__ = [
    "CROWD_EPS",
    "FEATURES",
    "SEARCH_FEATURES",
    "MatchModel",
    "auc",
    "candidate_features",
    "fit",
    "score_of",
    "text_known",
    "with_text",
]
