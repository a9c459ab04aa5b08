"""Prompt request types the seed's guardrails page uses but does not define.

Minimal definitions that fit every use the seed shows: ``OutputFormat``, ``PromptType``,
``PromptStrategy``, ``QueryComplexity`` (the prompt builder's own four levels, distinct from
the context analyzer's three) and ``PromptRequest``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class OutputFormat(StrEnum):
    """The shape the answer should take. ``TEXT`` adds no format instruction."""

    TEXT = "text"
    JSON = "json"
    MARKDOWN = "markdown"
    STRUCTURED = "structured"
    BULLETS = "bullets"


class PromptType(StrEnum):
    """What kind of prompt is built. ``AGENT`` and ``TOOL_USE`` get no STAY_ON_TOPIC."""

    QA = "qa"
    CHAT = "chat"
    SUMMARIZATION = "summarization"
    EXTRACTION = "extraction"
    AGENT = "agent"
    TOOL_USE = "tool_use"


class PromptStrategy(StrEnum):
    """How the model is asked to reason. The multi-step ones add SHOW_REASONING."""

    DIRECT = "direct"
    FEW_SHOT = "few_shot"
    CHAIN_OF_THOUGHT = "chain_of_thought"
    MULTI_HOP = "multi_hop"
    LEAST_TO_MOST = "least_to_most"


class QueryComplexity(StrEnum):
    """How hard the question is. ``COMPLEX`` and ``EXPERT`` add SELF_CHECK."""

    SIMPLE = "simple"
    MODERATE = "moderate"
    COMPLEX = "complex"
    EXPERT = "expert"


@dataclass
class PromptRequest:
    """One prompt to build.

    Attributes:
        query: the user's question.
        documents: retrieved documents (strings or mappings); here only whether there are
            any matters.
        enable_guardrails: add the request-dependent guardrails (default ``True``);
            SAFE_OUTPUT and CONCISE, and the strategy and complexity guardrails, apply
            regardless.
        enable_uncertainty: ask the model to state its uncertainty (default ``False``).
        enable_citations: ask for citations when there are documents (default ``False``).
        prompt_type: default ``QA``.
        strategy: default ``DIRECT``.
        complexity: default ``SIMPLE``.
        output_format: default ``TEXT``.
        output_schema: a JSON schema, rendered when ``output_format`` is ``STRUCTURED``.
        language: ``"en"`` or ``"tr"``; anything else renders in English.
    """

    query: str
    documents: list[Any] = field(default_factory=list)
    enable_guardrails: bool = True
    enable_uncertainty: bool = False
    enable_citations: bool = False
    prompt_type: PromptType = PromptType.QA
    strategy: PromptStrategy = PromptStrategy.DIRECT
    complexity: QueryComplexity = QueryComplexity.SIMPLE
    output_format: OutputFormat = OutputFormat.TEXT
    output_schema: Mapping[str, Any] | None = None
    language: str = "en"


__all__ = ["OutputFormat", "PromptRequest", "PromptStrategy", "PromptType", "QueryComplexity"]
