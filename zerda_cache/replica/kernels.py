"""The usearch backend's kernels: usearch's compiled search called directly
(``search_one``) and numkong's float16 dot products for re-scoring (``f16_dot``), each
with a check that falls back to the plain path where it is unfit.

``COMPILED_SEARCH`` and ``NUMKONG_FIT`` are those checks' outcomes (a usearch that refuses
the compiled call, a CPU whose numkong products are not exact enough): module switches
that the tests set to run both paths.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)


try:  # float16 dot products with SIMD, for re-scoring (``UsearchIndex._rescore``)
    import numkong as NUMKONG
except ImportError:  # an older usearch (it depended on simsimd): numpy's product
    NUMKONG = None  # type: ignore[assignment]
#: Whether numkong's float16 dot products are fit for re-scoring on this CPU: checked
#: once (``numkong_fit``); None until then.
NUMKONG_FIT: bool | None = None


def numkong_fit() -> bool:
    """numkong picks its kernel by CPU. Re-scoring with it needs sums in float32 or wider
    (within 1e-4 of the float64 product here) that are the same for a row alone and in
    a batch (calibration re-scores one source row at a time, ``SlottedAnn.calibrate``,
    and compares to 1e-9). Checked once on random unit vectors; if not, numpy's product."""
    global NUMKONG_FIT
    if NUMKONG_FIT is None:
        fit = False
        if NUMKONG is not None:
            rng = np.random.default_rng(0)
            rows = rng.normal(size=(24, 384))
            rows /= np.linalg.norm(rows, axis=1, keepdims=True)
            half, query = rows.astype(np.float16), rows[0].astype(np.float16)
            try:
                batch = np.asarray(NUMKONG.dot(half, query), dtype=np.float64)
                alone = [
                    float(np.asarray(NUMKONG.dot(half[i : i + 1], query))[0]) for i in range(24)
                ]
            except Exception as exc:  # any failure: numpy's product instead
                log.warning("numkong's float16 dot failed (%s): re-scoring with numpy", exc)
            else:
                exact = half.astype(np.float64) @ query.astype(np.float64)
                fit = bool(np.abs(batch - exact).max() < 1e-4) and batch.tolist() == alone
                if not fit:
                    log.warning("numkong's float16 dot is not exact enough here: numpy's instead")
        NUMKONG_FIT = fit
    return NUMKONG_FIT


def import_usearch() -> Any:
    """``usearch.index``, imported after onnxruntime when that is installed.

    Creating an onnxruntime session after usearch's extension was loaded crashes the
    process (segfault; seen with usearch 2.26 and onnxruntime 1.32), and the other order
    works. A replica may well run an ONNX embedding model (``MiniLMEmbedder``) beside its
    index, so load onnxruntime first whenever it is there.
    """
    with contextlib.suppress(ImportError):
        import onnxruntime  # noqa: F401

    import usearch.index

    return usearch.index


#: Whether searches call usearch's compiled ``search_many`` themselves (``search_one``);
#: cleared, for ``Index.search`` from then on, once a usearch refuses that call.
COMPILED_SEARCH = True


def search_one(graph: Any, query: Any, k: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """The keys and distances of ``graph``'s ``k`` nearest to one ``query``, nearest
    first: usearch's compiled search called as ``Index.search`` calls it (the same
    keywords), without the Python around it: its argument checks and its ``BatchMatches``
    and ``Matches`` objects, a sizeable share of a small graph's search
    (``bench_lookup``'s index-alone column measures whole searches)."""
    global COMPILED_SEARCH
    refused: Exception | None = None
    if COMPILED_SEARCH:
        try:
            keys, dists, counts = graph._compiled.search_many(
                query.reshape(1, -1),
                count=k,
                exact=False,
                threads=1,
                dtype=sys.modules["usearch.index"].ScalarKind.Unknown,
            )[:3]
        except (AttributeError, TypeError) as exc:  # another usearch, or a bad query
            refused = exc
        else:
            n = int(counts[0])
            return keys[0, :n], dists[0, :n]
    found = graph.search(query, k, threads=1)  # raises for a bad query: no fallback then
    if refused is not None:
        COMPILED_SEARCH = False
        log.warning(
            "usearch's compiled search refused its call (%s): Index.search from now on", refused
        )
    return np.asarray(found.keys), np.asarray(found.distances)


def f16_dot(rows: npt.NDArray[np.float16], query: npt.NDArray[np.float16]) -> npt.NDArray[Any]:
    """``rows @ query`` by numkong (callers check ``numkong_fit`` first)."""
    return np.asarray(NUMKONG.dot(rows, query))
