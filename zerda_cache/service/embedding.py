"""The service's embedder, named by ``zerda-cache serve --embedder``.

``none`` (callers send vectors; the proxy then passes requests through uncached),
``hashing`` or ``hashing:DIM`` (the built-in lexical embedder: tests and demos),
``minilm`` (all-MiniLM-L6-v2 offline, the ``minilm`` extra),
``sentence-transformers:MODEL`` (a sentence-transformers model name or local directory,
the ``sentence-transformers`` extra; both run in a thread so the event loop keeps serving),
or the base URL of an OpenAI-compatible embeddings API (``http(s)://.../v1``), called
with httpx. A tenant's dimension is fixed by its first put: changing the embedder of a
running cache needs ``clear`` of its tenants.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from zerda_cache.embedders import HashingEmbedder
from zerda_cache.embedders.openai_compatible import EmbedderError, OpenAIEmbedder

#: An embedder the service awaits: text -> vector.
AsyncEmbedFn = Callable[[str], Awaitable[Any]]


def in_thread(fn: Callable[[str], Any]) -> AsyncEmbedFn:
    """A CPU-bound embedder (an ONNX model) run in a worker thread."""

    async def embed(text: str) -> Any:
        return await asyncio.to_thread(fn, text)

    return embed


def make_embedder(
    spec: str, *, model: str = "text-embedding-3-small", api_key: str | None = None
) -> Callable[[str], Any] | None:
    """The embedder named by ``spec`` (see the module docstring); ``None`` for ``none``.

    Raises:
        ValueError: an unknown spec.
        RuntimeError: ``minilm`` or ``sentence-transformers:`` without its extra installed
            (the message names it).
    """
    name, _, arg = spec.partition(":")
    if spec == "none":
        return None
    if name == "hashing":
        dim = int(arg) if arg else 256
        if not 8 <= dim <= 8192:
            raise ValueError(f"hashing dimension must be in [8, 8192], got {dim}")
        return HashingEmbedder(dim)
    if spec == "minilm":
        from zerda_cache.embedders import MiniLMEmbedder

        return in_thread(MiniLMEmbedder())
    if name == "sentence-transformers":
        if not arg:
            raise ValueError("sentence-transformers:MODEL needs a model name or directory")
        from zerda_cache.embedders.sentence_transformer import SentenceTransformerEmbedder

        return in_thread(SentenceTransformerEmbedder(arg))
    if spec.startswith(("http://", "https://")):
        return OpenAIEmbedder(spec, model, api_key=api_key)
    raise ValueError(
        f"unknown embedder {spec!r}: use none, hashing[:DIM], minilm, "
        "sentence-transformers:MODEL or an http(s):// URL"
    )


__all__ = ["AsyncEmbedFn", "EmbedderError", "OpenAIEmbedder", "in_thread", "make_embedder"]
