"""zerda-cache for LlamaIndex: ``ZerdaCachedLLM(llm, manager, tenant=...)`` is an LLM that
answers from the semantic cache and asks the wrapped LLM only on a miss.

LlamaIndex has no global LLM cache, so the cache is a wrapper: pass it wherever an LLM
goes (``Settings.llm = ZerdaCachedLLM(OpenAI(...), manager, tenant="app")``, a query
engine's ``llm=``). It reports the wrapped LLM's ``metadata`` and copies its prompt
settings (system prompt, query wrapper, prompt formatters, output parser), so
``predict``, query engines and chat engines route and format exactly as they would with
the wrapped LLM.

- Cached: ``chat``, ``complete``, ``achat``, ``acomplete``. The scope is a digest of the
  wrapped LLM's class and parameters (``to_dict()``, without the credential fields
  named in ``CREDENTIAL_FIELDS``), of the endpoint (chat or completion, and
  ``formatted``) and of the call's keyword arguments, so answers made by another model,
  other parameters or the other endpoint never meet. Only the digest is stored.
  Parameters are read at every call: keep call state (counters, clients) out of the
  LLM's dumped fields.
- The query is the prompt, or for chat the messages as ``role: text`` lines. Calls the
  cache cannot key faithfully go to the wrapped LLM uncached: messages with non-text
  blocks (images, tool calls) or ``additional_kwargs``, and keyword arguments that are
  not JSON (tool objects, callbacks).
- Streaming (``stream_chat``, ``stream_complete`` and their async twins) passes through
  uncached: a stream cannot be served before it has ended, and replaying a cached answer
  as a one-chunk stream would hide that it came from the cache.
- Fail-open: a lookup or put that fails is logged (once per run of failures) and the
  wrapped LLM answers.
- Not for tool calling: the wrapper is a plain ``LLM`` (no ``chat_with_tools``), and its
  metadata says so; give tool-calling agents the wrapped LLM itself.
- Feedback: an answer that came from the cache or was just cached carries
  ``{"entry_id", "tenant", "similarity", "hit"}`` under ``"zerda_cache"`` in its
  ``additional_kwargs``; ``ZerdaCachedLLM.feedback(response, positive)`` sends it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    TextBlock,
)
from llama_index.core.llms.llm import LLM
from pydantic import PrivateAttr

from zerda_cache.aio import AsyncCacheManager
from zerda_cache.core.results import CacheHit, PutResult
from zerda_cache.integrations._binding import (
    INFO_KEY,
    CacheBinding,
    CacheKey,
    digest_scope,
    hit_info,
    put_info,
)
from zerda_cache.manager import CacheManager

log = logging.getLogger(__name__)

#: Metadata keys of a cached answer (JSON strings).
MESSAGE_KEY = "llamaindex.message"
KWARGS_KEY = "llamaindex.additional_kwargs"
_ADAPTER = {"adapter": "llamaindex"}
#: Parameters left out of the model's identity, by exact (case-insensitive) name:
#: credentials must not end up hashed into every entry, and a rotated key must not empty
#: the cache. An explicit list, not a pattern: a pattern for "token" or "key" also drops
#: ``max_tokens``, ``max_new_tokens`` or ``top_k``, and then a model configured for long
#: answers is served another's truncated ones. Headers are left out whole because they
#: carry ``Authorization``; every other parameter counts.
CREDENTIAL_FIELDS = frozenset(
    {
        "api_key",
        "api_token",
        "api_secret",
        "access_token",
        "auth_token",
        "bearer_token",
        "session_token",
        "token",
        "hf_token",
        "huggingfacehub_api_token",
        "azure_ad_token",
        "azure_ad_token_provider",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "client_secret",
        "private_key",
        "password",
        "secret",
        "secret_key",
        "auth",
        "authorization",
        "credentials",
        "default_headers",
        "headers",
    }
)


class ZerdaCachedLLM(LLM):
    """A LlamaIndex ``LLM`` that serves answers from zerda-cache and calls ``llm`` on a miss.

    Args:
        llm: the LlamaIndex LLM to wrap.
        manager: a ``CacheManager`` (sync and async calls; async ones run it in a worker
            thread) or an ``AsyncCacheManager`` (async calls only; sync ones raise
            ``TypeError``).
        tenant: the tenant the entries go to.
        async_manager: an ``AsyncCacheManager`` for the async calls, next to a sync
            ``manager``.
        scope: an extra partition (e.g. ``prompt_scope(request)``), combined with the
            model's identity.
    """

    _llm: LLM = PrivateAttr()
    _binding: CacheBinding = PrivateAttr()
    _scope: str = PrivateAttr(default="")

    def __init__(
        self,
        llm: LLM,
        manager: CacheManager | AsyncCacheManager,
        *,
        tenant: str,
        async_manager: AsyncCacheManager | None = None,
        scope: str | None = None,
    ) -> None:
        if not isinstance(llm, LLM):
            raise TypeError(f"llm must be a LlamaIndex LLM, got {type(llm)!r}")
        super().__init__(
            callback_manager=llm.callback_manager,
            system_prompt=llm.system_prompt,
            messages_to_prompt=llm.messages_to_prompt,
            completion_to_prompt=llm.completion_to_prompt,
            output_parser=llm.output_parser,
            pydantic_program_mode=llm.pydantic_program_mode,
            query_wrapper_prompt=llm.query_wrapper_prompt,
        )
        self._llm = llm
        self._binding = CacheBinding(manager, tenant=tenant, async_manager=async_manager)
        self._scope = scope or ""

    @classmethod
    def class_name(cls) -> str:
        return "ZerdaCachedLLM"

    @property
    def llm(self) -> LLM:
        """The wrapped LLM."""
        return self._llm

    @property
    def binding(self) -> CacheBinding:
        return self._binding

    @property
    def metadata(self) -> LLMMetadata:
        """The wrapped LLM's metadata, except that the wrapper is never a function-calling
        model: it has no ``chat_with_tools``, so LlamaIndex's tool-calling agents refuse it
        with a clear error instead of failing on a missing method."""
        return self._llm.metadata.model_copy(update={"is_function_calling_model": False})

    # -- cached endpoints -----------------------------------------------------------------
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        key = self.chat_key(messages, kwargs)
        if key is None:
            return self._llm.chat(messages, **kwargs)
        hit = self._binding.lookup(key)
        if hit is not None:
            return chat_from_hit(hit)
        response = self._llm.chat(messages, **kwargs)
        stored = self._chat_to_store(response)
        if stored is not None:
            _annotate(response.additional_kwargs, self._binding.put(key, *stored))
        return response

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        key = self.chat_key(messages, kwargs)
        if key is None:
            return await self._llm.achat(messages, **kwargs)
        hit = await self._binding.alookup(key)
        if hit is not None:
            return chat_from_hit(hit)
        response = await self._llm.achat(messages, **kwargs)
        stored = self._chat_to_store(response)
        if stored is not None:
            _annotate(response.additional_kwargs, await self._binding.aput(key, *stored))
        return response

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        key = self.complete_key(prompt, formatted, kwargs)
        if key is None:
            return self._llm.complete(prompt, formatted=formatted, **kwargs)
        hit = self._binding.lookup(key)
        if hit is not None:
            return completion_from_hit(hit)
        response = self._llm.complete(prompt, formatted=formatted, **kwargs)
        stored = self._completion_to_store(response)
        if stored is not None:
            _annotate(response.additional_kwargs, self._binding.put(key, *stored))
        return response

    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        key = self.complete_key(prompt, formatted, kwargs)
        if key is None:
            return await self._llm.acomplete(prompt, formatted=formatted, **kwargs)
        hit = await self._binding.alookup(key)
        if hit is not None:
            return completion_from_hit(hit)
        response = await self._llm.acomplete(prompt, formatted=formatted, **kwargs)
        stored = self._completion_to_store(response)
        if stored is not None:
            _annotate(response.additional_kwargs, await self._binding.aput(key, *stored))
        return response

    # -- streaming: uncached ----------------------------------------------------------------
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._llm.stream_chat(messages, **kwargs)

    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return self._llm.stream_complete(prompt, formatted=formatted, **kwargs)

    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        return await self._llm.astream_chat(messages, **kwargs)

    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return await self._llm.astream_complete(prompt, formatted=formatted, **kwargs)

    # -- feedback -------------------------------------------------------------------------
    def feedback(
        self, response: object, positive: bool, *, magnitude: float = 1.0, source: str = "user"
    ) -> bool:
        """Send feedback about an answer this LLM served from the cache or just cached.

        Args:
            response: a ``ChatResponse`` or ``CompletionResponse`` it returned, or the
                ``"zerda_cache"`` mapping of one.
            positive: the answer was right.

        Returns:
            ``False`` if the answer did not come through the cache (nothing to judge).

        Raises:
            EntryNotFoundError: the entry was evicted or cleared since.
            StorageError: Redis failed.
        """
        return self._binding.feedback_about(
            find_info(response), positive, magnitude=magnitude, source=source
        )

    async def afeedback(
        self, response: object, positive: bool, *, magnitude: float = 1.0, source: str = "user"
    ) -> bool:
        return await self._binding.afeedback_about(
            find_info(response), positive, magnitude=magnitude, source=source
        )

    # -- the mapping, no I/O ----------------------------------------------------------------
    def identity(self) -> str:
        """The wrapped model's class and parameters as stable JSON (no credentials).
        Values that are not JSON count by their type only, never by a repr that could
        carry a memory address and differ in every replica."""
        try:
            params = self._llm.to_dict()
        except Exception:  # a model whose fields do not dump: its public payload
            params = self._llm.to_payload()
        params = {k: v for k, v in params.items() if k.lower() not in CREDENTIAL_FIELDS}
        params.setdefault("class_name", self._llm.class_name())
        return json.dumps(params, sort_keys=True, default=lambda o: type(o).__qualname__)

    def chat_key(
        self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]
    ) -> CacheKey | None:
        """Where a chat call is looked up and stored; ``None``: it goes uncached."""
        lines = []
        for message in messages:
            if message.additional_kwargs or not all(
                isinstance(b, TextBlock) for b in message.blocks
            ):
                return None
            text = "".join(b.text for b in message.blocks if isinstance(b, TextBlock))
            lines.append(f"{message.role.value}: {text}")
        return self._key("\n".join(lines), "chat", kwargs)

    def complete_key(
        self, prompt: str, formatted: bool, kwargs: Mapping[str, Any]
    ) -> CacheKey | None:
        """Where a completion is looked up and stored; ``None``: it goes uncached."""
        return self._key(prompt, f"complete formatted={formatted}", kwargs)

    def _key(self, query: str, endpoint: str, kwargs: Mapping[str, Any]) -> CacheKey | None:
        try:
            args = json.dumps(dict(kwargs), sort_keys=True)
        except (TypeError, ValueError):
            return None
        key = CacheKey(query, digest_scope("li", self._scope, self.identity(), endpoint, args))
        return key if self._binding.fits(key) else None

    def _chat_to_store(self, response: ChatResponse) -> tuple[str, dict[str, Any]] | None:
        text = response.message.content
        if not text:
            return None
        extra = {MESSAGE_KEY: _json(response.message.model_dump(mode="json"))}
        if response.additional_kwargs:
            extra[KWARGS_KEY] = _json(response.additional_kwargs)
        extra = {k: v for k, v in extra.items() if v is not None}
        return text, self._binding.metadata(_ADAPTER, extra)

    def _completion_to_store(
        self, response: CompletionResponse
    ) -> tuple[str, dict[str, Any]] | None:
        if not response.text:
            return None
        kwargs = _json(response.additional_kwargs) if response.additional_kwargs else None
        extra = {KWARGS_KEY: kwargs} if kwargs is not None else {}
        return response.text, self._binding.metadata(_ADAPTER, extra)


def chat_from_hit(hit: CacheHit) -> ChatResponse:
    """The ``ChatResponse`` a hit serves: the stored message when it is readable and says
    what the cache served, else an assistant message with the served text."""
    message: ChatMessage | None = None
    raw = hit.metadata.get(MESSAGE_KEY)
    if isinstance(raw, str):
        try:
            message = ChatMessage.model_validate(json.loads(raw))
        except ValueError as exc:  # written by another version
            log.debug("zerda-cache: entry %s: unreadable message: %r", hit.entry_id, exc)
    if message is None or message.content != hit.response:
        message = ChatMessage(role="assistant", content=hit.response)
    return ChatResponse(message=message, additional_kwargs=_served_kwargs(hit))


def completion_from_hit(hit: CacheHit) -> CompletionResponse:
    """The ``CompletionResponse`` a hit serves."""
    return CompletionResponse(text=hit.response, additional_kwargs=_served_kwargs(hit))


def find_info(response: object) -> object:
    """The ``"zerda_cache"`` mapping of a response (see ``ZerdaCachedLLM.feedback``)."""
    if isinstance(response, ChatResponse | CompletionResponse):
        return response.additional_kwargs.get(INFO_KEY)
    if isinstance(response, Mapping):
        return response.get(INFO_KEY, response)
    return None


def _served_kwargs(hit: CacheHit) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    raw = hit.metadata.get(KWARGS_KEY)
    if isinstance(raw, str):
        try:
            loaded = json.loads(raw)
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            kwargs = loaded
    kwargs[INFO_KEY] = hit_info(hit)
    return kwargs


def _annotate(additional_kwargs: dict[str, Any], result: PutResult | None) -> None:
    """Mark the wrapped LLM's fresh answer with the entry it was cached as."""
    if result is not None and result.stored:
        additional_kwargs[INFO_KEY] = put_info(result)


def _json(value: Any) -> str | None:
    """``value`` as JSON, or ``None`` when it is not JSON (then it is not stored)."""
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


__all__ = [
    "KWARGS_KEY",
    "MESSAGE_KEY",
    "ZerdaCachedLLM",
    "chat_from_hit",
    "completion_from_hit",
]
