"""The service's embedder, named by ``zerda-cache serve --embedder``.

``none`` (callers send vectors; the proxy then passes requests through uncached),
``hashing`` or ``hashing:DIM`` (the built-in lexical embedder: tests and demos),
``minilm`` (all-MiniLM-L6-v2 offline, run in a thread so the event loop keeps serving),
or the base URL of an OpenAI-compatible embeddings API (``http(s)://.../v1``), called
with httpx. A tenant's dimension is fixed by its first put: changing the embedder of a
running cache needs ``clear`` of its tenants.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np

from zerda_cache.embedders import HashingEmbedder

#: An embedder the service awaits: text -> vector.
AsyncEmbedFn = Callable[[str], Awaitable[Any]]


class EmbedderError(RuntimeError):
    """The embedder failed (its endpoint is down, or answered something unusable)."""


class OpenAIEmbedder:
    """``POST {base_url}/embeddings`` of an OpenAI-compatible API, one text per call.

    Args:
        base_url: e.g. ``https://api.openai.com/v1``.
        model: the embedding model's name.
        api_key: sent as ``Authorization: Bearer``; ``None`` sends none.
        timeout: seconds per call.
        client: an ``httpx.AsyncClient`` to use (tests); default: one of its own.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/embeddings"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client if client is not None else httpx.AsyncClient(timeout=timeout)

    async def __call__(self, text: str) -> np.ndarray:
        try:
            resp = await self.client.post(
                self.url, json={"model": self.model, "input": text}, headers=self.headers
            )
        except httpx.HTTPError as exc:
            raise EmbedderError(f"embeddings endpoint unreachable: {exc}") from exc
        if resp.status_code != 200:
            raise EmbedderError(f"embeddings endpoint answered {resp.status_code}")
        try:
            vec = np.asarray(resp.json()["data"][0]["embedding"], dtype=np.float64)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EmbedderError(f"embeddings endpoint answered no embedding: {exc}") from exc
        if vec.ndim != 1 or not vec.size or not np.all(np.isfinite(vec)):
            raise EmbedderError("embeddings endpoint answered a malformed vector")
        return vec

    async def aclose(self) -> None:
        await self.client.aclose()


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
        RuntimeError: ``minilm`` without its model installed (``make minilm``).
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
    if spec.startswith(("http://", "https://")):
        return OpenAIEmbedder(spec, model, api_key=api_key)
    raise ValueError(
        f"unknown embedder {spec!r}: use none, hashing[:DIM], minilm or an http(s):// URL"
    )


__all__ = ["AsyncEmbedFn", "EmbedderError", "OpenAIEmbedder", "in_thread", "make_embedder"]
