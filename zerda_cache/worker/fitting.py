"""The worker's fits of each tenant's match model (``match_model.py``) on its label log."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from zerda_cache.learning.calibration import LabelLogs, bin_of
from zerda_cache.learning.match_model import (
    FEATURES,
    HOLDOUT,
    MIN_EACH_KIND,
    MIN_FIT_LABELS,
    REFIT_EVERY,
    SEARCH_FEATURES,
    MatchModel,
    auc,
    fit,
)
from zerda_cache.learning.tenant_state import TenantState
from zerda_cache.storage import RedisStorage
from zerda_cache.worker.cycle_context import LOGGER

log = logging.getLogger(LOGGER)

#: The text features (``text_match.py``) enter a tenant's model only when a model with
#: them ranks the newest labels (held out) better than one without by at least this
#: much AUC: each costs a guard in the hit script and a read of the leading candidate's
#: question on lookups the hit script does not serve, and a feature that ranks no
#: better only adds noise to the scores the bound is kept in (``match_features.py``
#: measures their gain on QQP, whose near misses rarely differ in a number: docs/
#: BENCHMARKS.md, "match-features").
TEXT_AUC_GAIN = 0.005


@dataclass(slots=True)
class FitReport:
    """What one match-model fit of a tenant did (``ModelFits.calibrate_tenant``)."""

    tenant: str
    labels: int
    #: Area under the ROC curve on the newest labels (held out): the model's, and the
    #: similarity's alone. The model is published only if it ranks them better.
    auc_model: float
    auc_similarity: float
    published: bool
    version: int
    reason: str = ""
    #: Whether the model weighs the text features (``TEXT_AUC_GAIN``).
    text: bool = False


class ModelFits:
    """Owns the match model's fit: when one is due, whether the model it makes ranks the
    newest labels better than similarity alone, and publishing it with the tenant's
    label and lookup counts rescored in its bins."""

    def __init__(self, storage: RedisStorage) -> None:
        self.storage = storage

    def calibrate_tenant(self, tenant: str, *, force: bool = False) -> FitReport | None:
        """Fit the tenant's match model on its label log when ``REFIT_EVERY`` labels
        were logged since the last fit (or ``force``), and publish it with the label and
        lookup counts rescored, if it ranks the newest labels better than similarity
        alone. ``None``: not due, or too few labels."""
        st = self.storage
        if not force and st.read(st.read_fit_due(tenant)) < REFIT_EVERY:
            return None
        logs = TenantState(st).label_logs(tenant)
        n = len(logs.y)
        right = int(logs.y.sum())
        if n < MIN_FIT_LABELS or min(right, n - right) < MIN_EACH_KIND:
            return None
        started = time.perf_counter()
        split = int(n * (1 - HOLDOUT))
        held_y = logs.y[split:]
        aucs = []
        for width in (SEARCH_FEATURES, len(FEATURES)):  # without the text features, with
            trial = fit(logs.x[:split, :width], logs.y[:split], logs.version + 1)
            scores = np.array([trial.p_right(row) for row in logs.x[split:]])
            aucs.append(auc(scores, held_y))
        text = aucs[1] >= aucs[0] + TEXT_AUC_GAIN
        auc_model = aucs[1] if text else aucs[0]
        auc_sim = auc(logs.x[split:, 0], held_y)
        report = FitReport(tenant, n, auc_model, auc_sim, False, logs.version, text=text)
        if auc_model <= auc_sim:
            report.reason = "no better than similarity alone on the newest labels"
            log.info(
                "tenant %s: match model not published (AUC %.3f vs similarity %.3f, %d labels)",
                tenant,
                auc_model,
                auc_sim,
                n,
            )
            TenantState(st).calibrate(tenant, logs.version, None, logs.logged, {})
            return report
        width = len(FEATURES) if text else SEARCH_FEATURES
        model = fit(logs.x[:, :width], logs.y, logs.version + 1)  # on every label
        counts = rescored(model, logs)
        report.published = TenantState(st).calibrate(
            tenant, logs.version, model, logs.logged, counts
        )
        report.version = model.version if report.published else logs.version
        log.info(
            "tenant %s: match model v%d%s %s (AUC %.3f vs similarity %.3f on the newest %d "
            "of %d labels; %.2f s)",
            tenant,
            model.version,
            " with text features" if text else "",
            "published" if report.published else "not published (another fit won)",
            auc_model,
            auc_sim,
            n - split,
            n,
            time.perf_counter() - started,
        )
        return report


def rescored(model: MatchModel, logs: LabelLogs) -> dict[str, float]:
    """The label and lookup counts of ``logs`` in ``model``'s score bins."""
    tag = str(model.version)
    counts: Counter[str] = Counter()
    for row, ok in zip(logs.x, logs.y, strict=True):
        counts[f"{'r' if ok else 'w'}{tag}:{bin_of(model.score(row))}"] += 1
    for row in logs.seen:
        near = math.isfinite(row[0])
        counts[f"t{tag}:{bin_of(model.score(row)) if near else 'x'}"] += 1
    if len(logs.seen) or logs.seen_exact:
        # From the same sample, so that the shares are of one window (untagged: exact
        # repeats have no score). Without a sample the old counts stay.
        counts["t:e"] = logs.seen_exact
        for level, n in enumerate(logs.seen_levels):
            if level and n:
                counts[f"t:e{level}"] = n
    return dict(counts)
