"""An ``embed_fn`` running any sentence-transformers model, named on the Hugging Face hub
or a local directory: ``pip install 'zerda-cache[sentence-transformers]'``.

    embed = SentenceTransformerEmbedder("sentence-transformers/all-MiniLM-L6-v2")
    cache = CacheManager.from_url(url, embed_fn=embed)

sentence-transformers needs PyTorch. pip installs the default build of the platform
unless one is installed already: install the one you want first (a CPU-only build is a
fraction of the size of a CUDA one). A model name is fetched from the hub once, into its
cache; a directory (a model saved with ``save`` or shipped in a package) loads offline.
For all-MiniLM-L6-v2 without PyTorch, ``MiniLMEmbedder`` (the ``minilm`` extra) gives the
same vectors within a cosine of about 0.998.

A tenant's dimension is fixed by its first put: every replica must use the same model.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

INSTALL = "pip install 'zerda-cache[sentence-transformers]'"


class SentenceTransformerEmbedder:
    """Texts -> L2-normalised float32 rows of a sentence-transformers model.

    sentence-transformers is imported here, at construction (it imports torch, which takes
    seconds), so that ``zerda_cache.embedders`` stays cheap to import.

    Args:
        model: a model name (``sentence-transformers/all-MiniLM-L6-v2``) or the path of a
            local model directory.
        device: ``"cpu"``, ``"cuda"``, ...; ``None`` lets sentence-transformers choose (a
            GPU when there is one).
        batch_size: texts per forward pass in ``embed_many``.
        **model_kwargs: passed to ``SentenceTransformer`` (``revision``,
            ``trust_remote_code``, ``cache_folder``, ...).

    Raises:
        RuntimeError: sentence-transformers is not installed (the message says how).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        device: str | None = None,
        batch_size: int = 64,
        **model_kwargs: Any,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise RuntimeError(
                f"SentenceTransformerEmbedder needs sentence-transformers and PyTorch "
                f"({exc.name or exc} is missing): {INSTALL}"
            ) from exc
        self.model_name = os.fspath(model)
        self.batch_size = batch_size
        self.model = SentenceTransformer(self.model_name, device=device, **model_kwargs)
        # Renamed in sentence-transformers 6 (the old name warns there); either may say
        # None (a model whose last module does not declare it): then ask the model.
        dimension = getattr(self.model, "get_embedding_dimension", None)
        if dimension is None:
            dimension = self.model.get_sentence_embedding_dimension
        dim = dimension()
        self.dim: int = int(dim) if dim else int(self._encode(["dimension"]).shape[1])

    def _encode(self, texts: list[str]) -> np.ndarray:
        rows = self.model.encode(
            texts,
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        out: np.ndarray = np.asarray(rows, dtype=np.float32)
        return out

    def embed_many(self, texts: list[str]) -> np.ndarray:
        """Embeddings of ``texts``, one L2-normalised float32 row each (``(0, dim)`` for
        no texts, without calling the model)."""
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        return self._encode(list(texts))

    def __call__(self, text: str) -> np.ndarray:
        row: np.ndarray = self.embed_many([text])[0]
        return row


__all__ = ["INSTALL", "SentenceTransformerEmbedder"]
