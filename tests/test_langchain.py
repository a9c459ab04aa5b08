"""The LangChain adapter under LangChain's own cache path (``set_llm_cache``) and fake
models, on the real servers of conftest: a repeated prompt never reaches the model,
other parameters never meet, near-duplicates hit, async works, Redis down costs nothing
but the cache."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from langchain_core.globals import get_llm_cache, set_llm_cache
from langchain_core.language_models.fake import FakeListLLM
from langchain_core.language_models.fake_chat_models import (
    FakeListChatModel,
    FakeMessagesListChatModel,
)
from langchain_core.load import dumps
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, Generation
from prometheus_client import CollectorRegistry

from zerda_cache import AsyncCacheManager, CacheConfig, CacheManager, RLConfig
from zerda_cache.embedders import HashingEmbedder
from zerda_cache.integrations.langchain import (
    GENERATIONS_KEY,
    ZerdaLLMCache,
    dump_generations,
    load_generations,
    prompt_text,
)
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.testing import RedisServer

CONFIG = CacheConfig(similarity_threshold=0.8)
QUESTION = "How do I reset my password?"
#: HashingEmbedder cosine to QUESTION: ~0.82 as a prompt, ~0.86 as a chat message.
REPHRASED = "How can I reset my password, please?"
UNRELATED = "What is the capital of France?"


@pytest.fixture
def make_cache(redis_url: str, redis_client: redis.Redis) -> Iterator[Callable[..., Any]]:
    """``make(config=CONFIG, *, url=redis_url, **cache_kwargs)``: a ``ZerdaLLMCache`` over a
    fresh sync manager (HashingEmbedder: deterministic across processes), installed as
    LangChain's global cache; the global cache is reset and the managers closed after."""
    made: list[CacheManager] = []

    def make(config: CacheConfig = CONFIG, *, url: str = redis_url, **kwargs: Any) -> Any:
        manager = CacheManager(
            redis.Redis.from_url(url, socket_timeout=config.redis_timeout_s),
            config,
            embed_fn=HashingEmbedder(),
            metrics=ReplicaMetrics(CollectorRegistry()),
        )
        made.append(manager)
        cache = ZerdaLLMCache(manager, tenant=kwargs.pop("tenant", "lc"), **kwargs)
        set_llm_cache(cache)
        return cache

    try:
        yield make
    finally:
        set_llm_cache(None)
        for manager in made:
            manager.close()


@pytest.fixture(autouse=True)
def _no_global_cache_left() -> Iterator[None]:
    yield
    set_llm_cache(None)


def test_a_repeated_prompt_does_not_reach_the_llm(make_cache: Any) -> None:
    make_cache()
    llm = FakeListLLM(responses=["Settings > Security.", "a second answer"])
    assert llm.invoke(QUESTION) == "Settings > Security."
    assert llm.invoke(QUESTION) == "Settings > Security."
    assert llm.i == 1  # one response consumed: the second call was served by the cache


def test_a_chat_model_gets_its_chat_generation_back(make_cache: Any) -> None:
    cache = make_cache()
    answer = AIMessage(
        content="Settings > Security > Reset password.",
        additional_kwargs={"refusal": None, "note": [1, 2]},
        response_metadata={"model_name": "fake-1", "finish_reason": "stop"},
    )
    chat = FakeMessagesListChatModel(responses=[answer, AIMessage(content="another answer")])
    first = chat.invoke(QUESTION)
    second = chat.invoke(QUESTION)
    assert chat.i == 1
    assert isinstance(second, AIMessage)
    assert second.content == answer.content
    assert second.additional_kwargs == answer.additional_kwargs
    assert second.response_metadata["model_name"] == "fake-1"
    assert second.response_metadata["finish_reason"] == "stop"
    assert first.response_metadata["zerda_cache"]["hit"] is False
    info = second.response_metadata["zerda_cache"]
    assert info["hit"] is True and info["tenant"] == "lc"
    assert info["entry_id"] == first.response_metadata["zerda_cache"]["entry_id"]
    # What was stored: the response text the cache compares, the messages in metadata.
    assert cache.binding.sync is not None
    hit = cache.binding.sync.lookup("human: " + QUESTION, tenant="lc", scope=_scope_of(cache, chat))
    assert hit is not None and hit.response == answer.content
    assert GENERATIONS_KEY in hit.metadata


def test_other_model_parameters_never_meet(make_cache: Any) -> None:
    make_cache()
    llm = FakeListLLM(responses=["answer one", "answer two", "answer three"])
    assert llm.invoke(QUESTION) == "answer one"
    # stop words are part of LangChain's llm_string: another scope, so the LLM is called
    assert llm.invoke(QUESTION, stop=["\n"]) == "answer two"
    other = FakeListLLM(responses=["other model's answer"])  # other params (its responses)
    assert other.invoke(QUESTION) == "other model's answer"
    assert other.i == 0 and llm.i == 2  # FakeListLLM wraps its index after the last
    assert llm.invoke(QUESTION) == "answer one"  # and each still has its own
    assert llm.invoke(QUESTION, stop=["\n"]) == "answer two"
    assert llm.i == 2


def test_a_near_duplicate_prompt_hits_and_an_unrelated_one_does_not(make_cache: Any) -> None:
    make_cache()
    chat = FakeListChatModel(responses=["Settings > Security.", "Paris.", "unused"])
    chat.invoke(QUESTION)
    near = chat.invoke(REPHRASED)
    assert near.content == "Settings > Security."
    assert 0.8 <= near.response_metadata["zerda_cache"]["similarity"] < 0.99
    assert chat.invoke(UNRELATED).content == "Paris."
    assert chat.i == 2


def test_a_strict_threshold_keeps_the_near_duplicate_a_miss(make_cache: Any) -> None:
    make_cache(CacheConfig(similarity_threshold=0.95))
    chat = FakeListChatModel(responses=["Settings > Security.", "a fresh answer"])
    chat.invoke(QUESTION)
    assert chat.invoke(REPHRASED).content == "a fresh answer"
    assert chat.invoke(QUESTION).content == "Settings > Security."  # exact: always a hit


def test_an_error_bound_verifies_near_duplicates_before_serving_them(make_cache: Any) -> None:
    """The cache's policy decides: with ``max_error_rate`` and no labels yet, a near
    duplicate is verified (the model is asked) rather than served; the exact repeat is."""
    make_cache(CacheConfig(similarity_threshold=0.8, max_error_rate=0.02, verify_rate=0.0))
    chat = FakeListChatModel(responses=["Settings > Security.", "Settings > Security.", "x"])
    chat.invoke(QUESTION)
    assert chat.invoke(REPHRASED).content == "Settings > Security."
    assert chat.i == 2  # the model answered the near duplicate
    served = chat.invoke(QUESTION)
    assert served.response_metadata["zerda_cache"]["hit"] is True and chat.i == 2


def test_the_system_prompt_is_part_of_the_query(make_cache: Any) -> None:
    make_cache(CacheConfig(similarity_threshold=0.95))
    chat = FakeListChatModel(responses=["in English", "auf Deutsch"])
    english = [SystemMessage(content="Answer in English."), HumanMessage(content=QUESTION)]
    german = [SystemMessage(content="Antworte auf Deutsch."), HumanMessage(content=QUESTION)]
    assert chat.invoke(english).content == "in English"
    assert chat.invoke(german).content == "auf Deutsch"
    assert chat.invoke(english).content == "in English"
    assert chat.i == 0  # both consumed (the index wrapped), the third call was a hit


def test_async_calls_with_an_async_manager(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> tuple[Any, Any, int, bool]:
        manager = AsyncCacheManager(
            redis.asyncio.Redis.from_url(redis_url),
            CONFIG,
            embed_fn=HashingEmbedder(),
            metrics=ReplicaMetrics(CollectorRegistry()),
        )
        cache = ZerdaLLMCache(manager, tenant="lc-async")
        set_llm_cache(cache)
        chat = FakeListChatModel(responses=["Settings > Security.", "unused"])
        try:
            first = await chat.ainvoke(QUESTION)
            second = await chat.ainvoke(REPHRASED)
            sent = await cache.afeedback(second, True)
            return first, second, chat.i, sent
        finally:
            await manager.aclose()

    first, second, calls, sent = asyncio.run(main())
    assert calls == 1
    assert second.content == first.content == "Settings > Security."
    assert second.response_metadata["zerda_cache"]["hit"] is True
    assert sent


def test_async_calls_with_a_sync_manager_run_it_in_a_thread(make_cache: Any) -> None:
    make_cache()
    llm = FakeListLLM(responses=["Settings > Security.", "unused"])

    async def main() -> list[str]:
        return [await llm.ainvoke(QUESTION), await llm.ainvoke(QUESTION)]

    assert asyncio.run(main()) == ["Settings > Security."] * 2
    assert llm.i == 1
    assert llm.invoke(QUESTION) == "Settings > Security."  # the sync path sees it too
    assert llm.i == 1


def test_sync_calls_need_a_sync_manager(redis_url: str, redis_client: redis.Redis) -> None:
    async def make() -> ZerdaLLMCache:
        return ZerdaLLMCache(
            AsyncCacheManager(redis.asyncio.Redis.from_url(redis_url), CONFIG),
            tenant="lc",
        )

    cache = asyncio.run(make())
    with pytest.raises(TypeError, match="only an AsyncCacheManager"):
        cache.lookup(QUESTION, "llm")


def test_redis_down_calls_the_llm_and_crashes_nothing(
    make_cache: Any, redis_server_factory: Callable[..., RedisServer], caplog: Any
) -> None:
    server = redis_server_factory()
    make_cache(CacheConfig(similarity_threshold=0.8, redis_timeout_s=0.5), url=server.url)
    chat = FakeListChatModel(responses=["one", "two", "three"])
    assert chat.invoke(QUESTION).content == "one"
    server.stop()
    caplog.set_level(logging.WARNING)
    assert chat.invoke(QUESTION).content == "two"  # the lookup failed open: a miss
    answer = chat.invoke(QUESTION)  # the update failed too: logged, not raised
    assert answer.content == "three"
    assert "zerda_cache" not in answer.response_metadata  # nothing to give feedback on
    assert chat.i == 0  # all three responses consumed: every call reached the model
    warnings = [r for r in caplog.records if r.name == "zerda_cache.integrations"]
    assert len(warnings) == 1 and "put failed" in warnings[0].getMessage()


def test_an_update_that_fails_does_not_fail_the_call(make_cache: Any, caplog: Any) -> None:
    cache = make_cache()

    def broken(text: str) -> Any:
        raise ConnectionError("embedding API unreachable")

    assert cache.binding.sync is not None
    cache.binding.sync.embed_fn = broken
    llm = FakeListLLM(responses=["answer one", "answer two"])
    caplog.set_level(logging.WARNING)
    assert llm.invoke(QUESTION) == "answer one"
    assert llm.invoke(QUESTION) == "answer two"
    assert any("embedding API unreachable" in r.getMessage() for r in caplog.records)


def test_negative_feedback_stops_the_answer_being_served(make_cache: Any) -> None:
    cache = make_cache(CacheConfig(similarity_threshold=0.8, rl=RLConfig(min_reward_to_serve=0.4)))
    chat = FakeListChatModel(responses=["a wrong answer", "the right answer"])
    wrong = chat.invoke(QUESTION)
    served = chat.invoke(QUESTION)
    assert served.content == "a wrong answer" and chat.i == 1
    assert cache.feedback(served, False)  # the user says it is wrong
    fresh = chat.invoke(QUESTION)
    assert fresh.content == "the right answer"  # no longer served: the model was asked
    new_id = fresh.response_metadata["zerda_cache"]["entry_id"]
    assert new_id != wrong.response_metadata["zerda_cache"]["entry_id"]
    assert cache.feedback(fresh, True)  # about the fresh answer just cached
    assert chat.invoke(QUESTION).content == "the right answer"
    assert not cache.feedback(AIMessage(content="not from the cache"), True)


def test_feedback_through_generate_on_an_llm(make_cache: Any) -> None:
    cache = make_cache(CacheConfig(similarity_threshold=0.8, rl=RLConfig(min_reward_to_serve=0.4)))
    llm = FakeListLLM(responses=["a wrong answer", "the right answer"])
    llm.invoke(QUESTION)
    result = llm.generate([QUESTION])
    assert result.generations[0][0].text == "a wrong answer"
    assert cache.feedback(result, False)
    assert llm.invoke(QUESTION) == "the right answer"


def test_clear_forgets_every_answer(make_cache: Any) -> None:
    cache = make_cache()
    llm = FakeListLLM(responses=["answer one", "answer two"])
    llm.invoke(QUESTION)
    cache.clear()
    assert llm.invoke(QUESTION) == "answer two"


def test_caches_with_other_scopes_never_meet(make_cache: Any) -> None:
    make_cache(scope="en")
    llm = FakeListLLM(responses=["in English", "auf Deutsch"])
    assert llm.invoke(QUESTION) == "in English"
    make_cache(scope="de")  # the same tenant, model and prompt; another scope
    assert llm.invoke(QUESTION) == "auf Deutsch"
    assert isinstance(get_llm_cache(), ZerdaLLMCache)


def test_a_prompt_too_long_to_cache_goes_to_the_llm(make_cache: Any) -> None:
    make_cache(CacheConfig(similarity_threshold=0.8, max_query_chars=64))
    llm = FakeListLLM(responses=["answer one", "answer two"])
    long_prompt = "Please summarise: " + "lorem ipsum " * 20
    assert llm.invoke(long_prompt) == "answer one"
    assert llm.invoke(long_prompt) == "answer two"  # uncached, and nothing raised


def test_generations_too_large_for_metadata_are_cached_as_text(make_cache: Any) -> None:
    cache = make_cache(CacheConfig(similarity_threshold=0.8, max_metadata_bytes=256))
    answer = AIMessage(content="Settings > Security.", additional_kwargs={"blob": "x" * 1000})
    chat = FakeMessagesListChatModel(responses=[answer, AIMessage(content="unused")])
    chat.invoke(QUESTION)
    served = chat.invoke(QUESTION)
    assert chat.i == 1
    assert isinstance(served, AIMessage) and served.content == "Settings > Security."
    assert served.additional_kwargs == {}  # the text only: the rest did not fit
    hit = cache.binding.sync.lookup(
        prompt_text(_chat_prompt(QUESTION)), tenant="lc", scope=_scope_of(cache, chat)
    )
    assert hit is not None and GENERATIONS_KEY not in hit.metadata


def test_generations_round_trip() -> None:
    gens = [
        ChatGeneration(
            message=AIMessage(content="hi", id="run-1", response_metadata={"a": 1}),
            generation_info={"finish_reason": "stop", "obj": object()},
        ),
        Generation(text="plain", generation_info={"logprobs": [0.5]}),
    ]
    back = load_generations(dump_generations(gens))
    assert isinstance(back[0], ChatGeneration)
    assert back[0].message.content == "hi" and back[0].message.id is None
    assert back[0].message.response_metadata == {"a": 1}
    assert back[0].generation_info is None  # not JSON: dropped, not a failed put
    assert type(back[1]) is Generation and back[1].generation_info == {"logprobs": [0.5]}


def test_prompt_text_renders_plain_conversations_only() -> None:
    plain = _chat_prompt(QUESTION)
    assert prompt_text(plain) == "human: " + QUESTION
    assert prompt_text("just a prompt") == "just a prompt"
    tool_call = dumps([AIMessage(content="", tool_calls=[{"name": "f", "args": {}, "id": "1"}])])
    assert prompt_text(tool_call) == tool_call  # not plain text: matches only itself
    named = dumps([HumanMessage(content=QUESTION, name="alice")])
    assert prompt_text(named) == named


def _chat_prompt(text: str) -> str:
    return dumps([HumanMessage(content=text)])


def _scope_of(cache: ZerdaLLMCache, chat: Any) -> str:
    return cache.key("", chat._get_llm_string()).scope
