"""zerda-cache as LangChain's LLM cache: ``set_llm_cache(ZerdaLLMCache(manager, tenant=...))``.

Every LLM and chat model call that LangChain routes through its cache (``invoke``,
``generate``, ``ainvoke``, ...; ``stream`` bypasses LangChain's cache) is looked up
in the semantic cache first, and the model's answer is put there after a miss.

- The scope is a digest of LangChain's ``llm_string`` (the model class and every
  parameter, stop words and bound tools included), so answers made by another model or
  with other parameters never meet.
- The query is the prompt for LLMs; for chat models it is the conversation rendered as
  ``role: content`` lines (LangChain passes its JSON serialisation, which would make a
  poor text to embed). A conversation with anything beyond plain text (tool calls, names,
  multimodal content) keeps LangChain's JSON as its query, so it only meets itself.
- The response the cache compares and serves is the first generation's text; all the
  generations, chat messages included, are kept in the entry's metadata so a chat model
  gets its ``ChatGeneration`` back. Answers whose generations do not fit in
  ``max_metadata_bytes`` are cached as text only (served as ``Generation(text=...)``,
  which LangChain turns into an ``AIMessage`` for chat models).
- Fail-open: lookups and updates that fail (Redis down, an embedding API down) log a
  warning (once per run of failures) and the LLM is called as if there were no cache.
- Feedback: every answer that came from the cache or was just cached carries
  ``{"entry_id", "tenant", "similarity", "hit"}`` under ``"zerda_cache"`` in its
  ``generation_info`` and, for chat models, in the message's ``response_metadata``;
  ``ZerdaLLMCache.feedback(answer, positive)`` sends it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.caches import RETURN_VAL_TYPE, BaseCache
from langchain_core.messages import BaseMessage, message_to_dict, messages_from_dict
from langchain_core.outputs import ChatGeneration, Generation, LLMResult

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

#: Metadata key of the serialised generations (a JSON string: msgpack stores it as is).
GENERATIONS_KEY = "langchain.generations"
_ADAPTER = {"adapter": "langchain"}
#: The message fields a plain-text message may carry and still be rendered as text.
_PLAIN_FIELDS = frozenset({"content", "type", "tool_calls", "invalid_tool_calls"})


class ZerdaLLMCache(BaseCache):
    """A LangChain ``BaseCache`` over a zerda-cache manager.

    Args:
        manager: a ``CacheManager`` (sync and async calls; async ones run it in a worker
            thread) or an ``AsyncCacheManager`` (async calls only: ``ainvoke`` etc.).
        tenant: the tenant the entries go to. ``clear()`` removes all of the tenant's
            entries, so give LangChain a tenant of its own.
        async_manager: an ``AsyncCacheManager`` for the async calls, next to a sync
            ``manager``, for apps that use both.
        scope: an extra partition (e.g. ``prompt_scope(request)``), combined with the
            model's ``llm_string``.
    """

    def __init__(
        self,
        manager: CacheManager | AsyncCacheManager,
        *,
        tenant: str,
        async_manager: AsyncCacheManager | None = None,
        scope: str | None = None,
    ) -> None:
        self.binding = CacheBinding(manager, tenant=tenant, async_manager=async_manager)
        self.scope = scope or ""

    @property
    def tenant(self) -> str:
        return self.binding.tenant

    # -- BaseCache ------------------------------------------------------------------------
    def lookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        """The cached generations for ``prompt`` under ``llm_string``, or ``None``."""
        key = self.key(prompt, llm_string)
        if not self.binding.fits(key):
            return None
        hit = self.binding.lookup(key)
        return None if hit is None else generations_from_hit(hit)

    async def alookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        key = self.key(prompt, llm_string)
        if not self.binding.fits(key):
            return None
        hit = await self.binding.alookup(key)
        return None if hit is None else generations_from_hit(hit)

    def update(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        """Cache the model's answer. Never raises for the cache's sake: a failed put is
        logged and the answer still goes back to the app."""
        key, stored = self._to_store(prompt, llm_string, return_val)
        if stored is not None:
            _annotate(return_val, self.binding.put(key, *stored))

    async def aupdate(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        key, stored = self._to_store(prompt, llm_string, return_val)
        if stored is not None:
            _annotate(return_val, await self.binding.aput(key, *stored))

    def clear(self, **kwargs: Any) -> None:
        """Remove every entry of the tenant (every model's, and any other user's of the
        tenant), from every replica."""
        self.binding.clear()

    async def aclear(self, **kwargs: Any) -> None:
        await self.binding.aclear()

    # -- feedback -------------------------------------------------------------------------
    def feedback(
        self, answer: object, positive: bool, *, magnitude: float = 1.0, source: str = "user"
    ) -> bool:
        """Send feedback about an answer the cache served or stored.

        Args:
            answer: what the model returned: an ``AIMessage`` (chat ``invoke``), a
                ``Generation`` / ``ChatGeneration`` or an ``LLMResult`` (``generate``:
                its first generation), or the ``"zerda_cache"`` mapping itself.
            positive: the answer was right.

        Returns:
            ``False`` if the answer did not come through the cache (nothing to judge).

        Raises:
            EntryNotFoundError: the entry was evicted or cleared since.
            StorageError: Redis failed.
        """
        return self.binding.feedback_about(
            find_info(answer), positive, magnitude=magnitude, source=source
        )

    async def afeedback(
        self, answer: object, positive: bool, *, magnitude: float = 1.0, source: str = "user"
    ) -> bool:
        return await self.binding.afeedback_about(
            find_info(answer), positive, magnitude=magnitude, source=source
        )

    # -- the mapping, no I/O ----------------------------------------------------------------
    def key(self, prompt: str, llm_string: str) -> CacheKey:
        """Where ``prompt`` under ``llm_string`` is looked up and stored."""
        return CacheKey(prompt_text(prompt), digest_scope("lc", self.scope, llm_string))

    def _to_store(
        self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE
    ) -> tuple[CacheKey, tuple[str, dict[str, Any]] | None]:
        key = self.key(prompt, llm_string)
        if not return_val or not self.binding.fits(key):
            return key, None
        extra = {GENERATIONS_KEY: dump_generations(return_val)}
        return key, (return_val[0].text, self.binding.metadata(_ADAPTER, extra))


def prompt_text(prompt: str) -> str:
    """The text the cache embeds and compares for LangChain's ``prompt``.

    A chat model's prompt is the JSON of its messages (``langchain_core.load.dumps``);
    when every message is plain text, this is ``role: content`` per line. Anything else
    is returned unchanged, so it only matches itself.
    """
    if not prompt.startswith("[{"):
        return prompt
    try:
        messages = json.loads(prompt)
    except ValueError:
        return prompt
    lines = []
    for message in messages:
        kwargs = message.get("kwargs") if isinstance(message, dict) else None
        if not isinstance(kwargs, dict):
            return prompt
        content, role = kwargs.get("content"), kwargs.get("type")
        extras = {k: v for k, v in kwargs.items() if k not in _PLAIN_FIELDS and v}
        plain = not kwargs.get("tool_calls") and not kwargs.get("invalid_tool_calls")
        if not isinstance(content, str) or not isinstance(role, str) or extras or not plain:
            return prompt
        lines.append(f"{role}: {content}")
    return "\n".join(lines) if lines else prompt


def dump_generations(generations: Sequence[Generation]) -> str:
    """The generations as JSON (messages through ``message_to_dict``, which round-trips
    without LangChain's beta ``loads``). A message's id is dropped: it names the run that
    made it, and a served copy is another answer. Generation info that is not JSON is
    dropped too."""
    out = []
    for gen in generations:
        item: dict[str, Any] = {"text": gen.text, "info": _jsonable(gen.generation_info)}
        if isinstance(gen, ChatGeneration):
            data = message_to_dict(gen.message.model_copy(update={"id": None}))
            item["message"] = data if _jsonable(data) is not None else None
        out.append(item)
    return json.dumps(out, separators=(",", ":"))


def load_generations(raw: str) -> list[Generation]:
    """``dump_generations``'s output back as generations."""
    out: list[Generation] = []
    for item in json.loads(raw):
        info = item.get("info")
        if item.get("message") is not None:
            (message,) = messages_from_dict([item["message"]])
            out.append(ChatGeneration(message=message, generation_info=info))
        else:
            out.append(Generation(text=item["text"], generation_info=info))
    return out


def generations_from_hit(hit: CacheHit) -> list[Generation]:
    """The generations a hit serves, each marked with the entry it came from."""
    raw = hit.metadata.get(GENERATIONS_KEY)
    generations: list[Generation] = []
    if isinstance(raw, str):
        try:
            generations = load_generations(raw)
        except (ValueError, KeyError, TypeError) as exc:  # written by another version
            log.debug("zerda-cache: entry %s: unreadable generations: %r", hit.entry_id, exc)
    if not generations:
        generations = [Generation(text=hit.response)]
    elif generations[0].text != hit.response:
        # The entry's response is what the cache compared and served: it wins.
        generations = [Generation(text=hit.response)]
    _mark(generations, hit_info(hit))
    return generations


def _annotate(generations: Sequence[Generation], result: PutResult | None) -> None:
    """Mark the model's fresh answer with the entry it was cached as: the app receives
    these very objects (LangChain updates the cache before returning them)."""
    if result is not None and result.stored:
        _mark(generations, put_info(result))


def _mark(generations: Sequence[Generation], info: dict[str, Any]) -> None:
    for gen in generations:
        gen.generation_info = {**(gen.generation_info or {}), INFO_KEY: info}
        if isinstance(gen, ChatGeneration):
            gen.message.response_metadata = {**gen.message.response_metadata, INFO_KEY: info}


def find_info(answer: object) -> object:
    """The ``"zerda_cache"`` mapping of an answer (see ``ZerdaLLMCache.feedback``)."""
    if isinstance(answer, LLMResult):
        answer = answer.generations[0][0] if answer.generations and answer.generations[0] else None
    if isinstance(answer, ChatGeneration):
        answer = answer.message
    if isinstance(answer, BaseMessage):
        return answer.response_metadata.get(INFO_KEY)
    if isinstance(answer, Generation):
        return (answer.generation_info or {}).get(INFO_KEY)
    if isinstance(answer, Mapping):
        return answer.get(INFO_KEY, answer)
    return None


def _jsonable(value: Any) -> Any:
    """``value`` if it survives JSON unchanged in kind, else ``None``."""
    if value is None:
        return None
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value


__all__ = [
    "GENERATIONS_KEY",
    "ZerdaLLMCache",
    "dump_generations",
    "generations_from_hit",
    "load_generations",
    "prompt_text",
]
