"""The LlamaIndex adapter around a small counting ``CustomLLM`` (LlamaIndex's own chat,
predict and async code paths), on the real servers of conftest."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from llama_index.core.llms import (
    ChatMessage,
    CompletionResponse,
    CompletionResponseGen,
    CustomLLM,
    ImageBlock,
    LLMMetadata,
    MockLLM,
)
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.prompts import PromptTemplate
from prometheus_client import CollectorRegistry
from pydantic import Field

from zerda_cache import AsyncCacheManager, CacheConfig, CacheManager, RLConfig
from zerda_cache.embedders import HashingEmbedder
from zerda_cache.integrations.llamaindex import ZerdaCachedLLM
from zerda_cache.metrics import ReplicaMetrics
from zerda_cache.testing import RedisServer

CONFIG = CacheConfig(similarity_threshold=0.8)
QUESTION = "How do I reset my password?"
#: HashingEmbedder cosine to QUESTION: ~0.82 as a prompt, ~0.86 as a user message.
REPHRASED = "How can I reset my password, please?"
UNRELATED = "What is the capital of France?"


class CountingLLM(CustomLLM):
    """Answers ``answer N`` to its N-th call and records the prompts it was given."""

    temperature: float = 0.0
    api_key: str = "sk-not-part-of-the-scope"
    # Excluded from the model's dump: call state is not the model's identity.
    prompts: list[str] = Field(default_factory=list, exclude=True)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(model_name="counting")

    @property
    def calls(self) -> int:
        return len(self.prompts)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        self.prompts.append(prompt)
        return CompletionResponse(text=f"answer {self.calls}", additional_kwargs={"usage": 7})

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        self.prompts.append(prompt)
        text = f"answer {self.calls}"

        def gen() -> CompletionResponseGen:
            yield CompletionResponse(text=text, delta=text)

        return gen()


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


@pytest.fixture
def make_hashing_manager(redis_url: str, redis_client: redis.Redis) -> Iterator[Callable[..., Any]]:
    """``make(config=CONFIG, *, url=redis_url)``: a sync manager (HashingEmbedder). Not
    conftest's ``make_manager``: the adapter's tests need an embed_fn, one flavour."""
    made: list[CacheManager] = []

    def make(config: CacheConfig = CONFIG, *, url: str = redis_url) -> CacheManager:
        manager = CacheManager(
            redis.Redis.from_url(url, socket_timeout=config.redis_timeout_s),
            config,
            embed_fn=HashingEmbedder(),
            metrics=ReplicaMetrics(CollectorRegistry()),
        )
        made.append(manager)
        return manager

    try:
        yield make
    finally:
        for manager in made:
            manager.close()


def test_a_repeated_completion_does_not_reach_the_llm(make_hashing_manager: Any) -> None:
    base = CountingLLM()
    llm = ZerdaCachedLLM(base, make_hashing_manager(), tenant="li")
    first = llm.complete(QUESTION)
    second = llm.complete(QUESTION)
    assert base.calls == 1
    assert second.text == first.text == "answer 1"
    assert second.additional_kwargs["usage"] == 7  # the stored additional_kwargs
    assert first.additional_kwargs["zerda_cache"]["hit"] is False
    assert second.additional_kwargs["zerda_cache"]["hit"] is True
    assert llm.metadata == base.metadata


class ToolCallingLLM(CountingLLM):
    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(model_name="tools", is_function_calling_model=True, is_chat_model=True)


def test_the_wrapper_never_claims_tool_calling(make_hashing_manager: Any) -> None:
    llm = ZerdaCachedLLM(ToolCallingLLM(), make_hashing_manager(), tenant="li")
    assert llm.metadata.is_function_calling_model is False  # it has no chat_with_tools
    assert llm.metadata.is_chat_model is True and llm.metadata.model_name == "tools"


def test_chat_near_duplicates_hit_and_unrelated_questions_do_not(make_hashing_manager: Any) -> None:
    base = CountingLLM()
    llm = ZerdaCachedLLM(base, make_hashing_manager(), tenant="li")
    first = llm.chat(user(QUESTION))
    near = llm.chat(user(REPHRASED))
    assert base.calls == 1
    assert near.message.content == first.message.content == "answer 1"
    assert near.message.role.value == "assistant"
    assert near.message.additional_kwargs == {"usage": 7}  # the stored message, whole
    assert 0.8 <= near.additional_kwargs["zerda_cache"]["similarity"] < 0.99
    assert llm.chat(user(UNRELATED)).message.content == "answer 2"


def test_other_parameters_endpoints_and_kwargs_never_meet(make_hashing_manager: Any) -> None:
    manager = make_hashing_manager()
    cold, warm = CountingLLM(temperature=0.0), CountingLLM(temperature=0.9)
    cached_cold = ZerdaCachedLLM(cold, manager, tenant="li")
    cached_warm = ZerdaCachedLLM(warm, manager, tenant="li")
    assert cached_cold.complete(QUESTION).text == "answer 1"
    assert cached_warm.complete(QUESTION).text == "answer 1"  # its own first call
    assert warm.calls == 1
    assert cached_cold.chat(user(QUESTION)).message.content == "answer 2"  # chat != complete
    assert cached_cold.complete(QUESTION, formatted=True).text == "answer 3"
    assert cached_cold.complete(QUESTION, max_tokens=5).text == "answer 4"
    assert cold.calls == 4
    assert cached_cold.complete(QUESTION).text == "answer 1"  # and each still has its own
    assert cached_cold.complete(QUESTION, max_tokens=5).text == "answer 4"
    assert cold.calls == 4


def test_credentials_are_not_part_of_the_identity(make_hashing_manager: Any) -> None:
    manager = make_hashing_manager()
    a = ZerdaCachedLLM(CountingLLM(api_key="sk-one"), manager, tenant="li")
    b = ZerdaCachedLLM(CountingLLM(api_key="sk-two"), manager, tenant="li")
    assert "sk-one" not in a.identity()
    assert a.identity() == b.identity()
    a.complete(QUESTION)
    assert b.complete(QUESTION).additional_kwargs["zerda_cache"]["hit"] is True


def test_predict_formats_as_the_wrapped_llm_would(make_hashing_manager: Any) -> None:
    base = CountingLLM(system_prompt="Answer briefly.")
    llm = ZerdaCachedLLM(base, make_hashing_manager(), tenant="li")
    template = PromptTemplate("Question: {q}")
    assert llm.predict(template, q=QUESTION) == "answer 1"
    assert base.predict(template, q=QUESTION) == "answer 2"  # the wrapped LLM alone
    assert base.prompts[0] == base.prompts[1]  # the same prompt, system prompt included
    assert "Answer briefly." in base.prompts[0]
    assert llm.predict(template, q=QUESTION) == "answer 1"
    assert base.calls == 2


def test_async_calls_with_an_async_manager(redis_url: str, redis_client: redis.Redis) -> None:
    base = CountingLLM()

    async def main() -> list[Any]:
        manager = AsyncCacheManager(
            redis.asyncio.Redis.from_url(redis_url),
            CONFIG,
            embed_fn=HashingEmbedder(),
            metrics=ReplicaMetrics(CollectorRegistry()),
        )
        llm = ZerdaCachedLLM(base, manager, tenant="li-async")
        try:
            out = [
                await llm.acomplete(QUESTION),
                await llm.acomplete(QUESTION),
                await llm.achat(user(QUESTION)),
                await llm.achat(user(REPHRASED)),
            ]
            out.append(await llm.afeedback(out[-1], True))
            return out
        finally:
            await manager.aclose()

    c1, c2, m1, m2, sent = asyncio.run(main())
    assert base.calls == 2
    assert c1.text == c2.text == "answer 1"
    assert m1.message.content == m2.message.content == "answer 2"
    assert m2.additional_kwargs["zerda_cache"]["hit"] is True
    assert sent


def test_async_calls_with_a_sync_manager(make_hashing_manager: Any) -> None:
    base = CountingLLM()
    llm = ZerdaCachedLLM(base, make_hashing_manager(), tenant="li")

    async def main() -> list[str]:
        return [(await llm.acomplete(QUESTION)).text, (await llm.acomplete(QUESTION)).text]

    assert asyncio.run(main()) == ["answer 1", "answer 1"]
    assert llm.complete(QUESTION).text == "answer 1"
    assert base.calls == 1


def test_streaming_passes_through_uncached(make_hashing_manager: Any) -> None:
    base = CountingLLM()
    llm = ZerdaCachedLLM(base, make_hashing_manager(), tenant="li")
    llm.complete(QUESTION)
    streamed = [r.delta for r in llm.stream_complete(QUESTION)]
    assert streamed == ["answer 2"]
    assert base.calls == 2


def test_messages_the_cache_cannot_key_go_uncached(make_hashing_manager: Any) -> None:
    base = CountingLLM()
    llm = ZerdaCachedLLM(base, make_hashing_manager(), tenant="li")
    tools = [ChatMessage(role="user", content=QUESTION, additional_kwargs={"tool": "x"})]
    image = [ChatMessage(role="user", blocks=[ImageBlock(url="http://example.com/a.png")])]
    for messages in (tools, tools, image, image):
        assert llm.chat_key(messages, {}) is None
    assert llm.complete_key(QUESTION, False, {"callback": object()}) is None
    llm.chat(tools)
    llm.chat(tools)
    assert base.calls == 2


def test_redis_down_calls_the_llm_and_crashes_nothing(
    make_hashing_manager: Any, redis_server_factory: Callable[..., RedisServer], caplog: Any
) -> None:
    server = redis_server_factory()
    manager = make_hashing_manager(
        CacheConfig(similarity_threshold=0.8, redis_timeout_s=0.5), url=server.url
    )
    base = CountingLLM()
    llm = ZerdaCachedLLM(base, manager, tenant="li")
    assert llm.complete(QUESTION).text == "answer 1"
    server.stop()
    caplog.set_level(logging.WARNING)
    assert llm.complete(QUESTION).text == "answer 2"
    third = llm.chat(user(QUESTION))
    assert third.message.content == "answer 3"
    assert "zerda_cache" not in third.additional_kwargs
    assert not llm.feedback(third, True)  # nothing to give feedback on
    assert base.calls == 3
    warnings = [r for r in caplog.records if r.name == "zerda_cache.integrations"]
    assert len(warnings) == 1 and "put failed" in warnings[0].getMessage()


def test_negative_feedback_stops_the_answer_being_served(make_hashing_manager: Any) -> None:
    manager = make_hashing_manager(
        CacheConfig(similarity_threshold=0.8, rl=RLConfig(min_reward_to_serve=0.4))
    )
    base = CountingLLM()
    llm = ZerdaCachedLLM(base, manager, tenant="li")
    llm.chat(user(QUESTION))
    served = llm.chat(user(QUESTION))
    assert base.calls == 1
    assert llm.feedback(served, False)
    fresh = llm.chat(user(QUESTION))
    assert fresh.message.content == "answer 2" and base.calls == 2
    assert llm.feedback(fresh, True)  # the fresh answer, just cached
    assert llm.chat(user(QUESTION)).message.content == "answer 2"
    assert base.calls == 2


def test_wraps_llama_index_mock_llm(make_hashing_manager: Any) -> None:
    llm = ZerdaCachedLLM(MockLLM(max_tokens=3), make_hashing_manager(), tenant="li")
    first = llm.complete(QUESTION)
    assert first.text == "text text text"
    assert llm.complete(QUESTION).additional_kwargs["zerda_cache"]["hit"] is True
    with pytest.raises(TypeError, match="LlamaIndex LLM"):
        ZerdaCachedLLM(object(), make_hashing_manager(), tenant="li")  # type: ignore[arg-type]


def test_generation_parameters_keep_models_apart(make_hashing_manager: Any) -> None:
    """A model configured for longer answers is never served another's shorter ones:
    ``max_tokens`` (and every parameter whose name merely contains "token" or "key") is
    part of the identity; only the listed credential fields are left out."""
    manager = make_hashing_manager()
    short = ZerdaCachedLLM(MockLLM(max_tokens=4), manager, tenant="li")
    long = ZerdaCachedLLM(MockLLM(max_tokens=8), manager, tenant="li")
    assert short.complete(QUESTION).text == "text text text text"
    served = long.complete(QUESTION)
    assert served.additional_kwargs["zerda_cache"]["hit"] is False
    assert served.text == " ".join(["text"] * 8)
    assert short.identity() != long.identity()


class ParameterLLM(CountingLLM):
    max_new_tokens: int = 16
    top_k: int = 40
    keywords: str = "none"
    auth_token: str = "tok-secret"
    aws_secret_access_key: str = "aws-secret"


@pytest.mark.parametrize(
    ("field", "a", "b"),
    [("max_new_tokens", 16, 512), ("top_k", 1, 40), ("keywords", "x", "y")],
)
def test_parameters_that_look_like_credentials_count(
    make_hashing_manager: Any, field: str, a: object, b: object
) -> None:
    manager = make_hashing_manager()
    one = ZerdaCachedLLM(ParameterLLM(**{field: a}), manager, tenant="li")
    two = ZerdaCachedLLM(ParameterLLM(**{field: b}), manager, tenant="li")
    assert one.identity() != two.identity()


def test_listed_credential_fields_are_left_out(make_hashing_manager: Any) -> None:
    manager = make_hashing_manager()
    one = ZerdaCachedLLM(ParameterLLM(auth_token="t1", api_key="k1"), manager, tenant="li")
    two = ZerdaCachedLLM(
        ParameterLLM(auth_token="t2", api_key="k2", aws_secret_access_key="s2"),
        manager,
        tenant="li",
    )
    assert one.identity() == two.identity()
    assert "t1" not in one.identity() and "aws-secret" not in one.identity()
