"""An async ``embed_fn`` for any OpenAI-compatible ``/embeddings`` endpoint (OpenAI,
Azure OpenAI, vLLM, Ollama, LiteLLM, ...): ``pip install 'zerda-cache[openai-embeddings]'``.

    embed = OpenAIEmbedder("https://api.openai.com/v1", "text-embedding-3-small",
                           api_key=os.environ["OPENAI_API_KEY"])
    cache = AsyncCacheManager.from_url(url, embed_fn=embed)

A tenant's dimension is fixed by its first put: every replica must use the same model.
"""

from __future__ import annotations

import httpx
import numpy as np


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


__all__ = ["EmbedderError", "OpenAIEmbedder"]
