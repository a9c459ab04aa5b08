"""Guardrails: prompt instructions that steer generation before it happens.

They are not post-hoc output filters. :class:`GuardrailEngine` selects the guardrails a
:class:`~zerda_cache.companions.prompt.types.PromptRequest` calls for, orders them by priority and
renders them, with the output-format instruction, as one block for the prompt.

Priorities (higher is rendered first). The seed fixes only the ends, SAFE_OUTPUT 110 and
NO_MARKDOWN_LEAKAGE 30; the rest are ours, safety before grounding before style:

======================  ========
guardrail               priority
======================  ========
safe_output             110
pii_protection          105
grounding               100
no_fabrication          95
cite_sources            90
uncertainty             80
stay_on_topic           75
self_check              65
show_reasoning          60
concise                 40
no_markdown_leakage     30
======================  ========

NO_MARKDOWN_LEAKAGE is in the library but, as in the seed's selection rules, never selected
automatically; pass it in ``extra_guardrails`` to use it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from zerda_cache.companions.prompt.templates import (
    format_instruction_text,
    guardrail_header,
    guardrail_text,
    resolve_lang,
    schema_label,
)
from zerda_cache.companions.prompt.types import (
    OutputFormat,
    PromptRequest,
    PromptStrategy,
    PromptType,
    QueryComplexity,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Guardrail:
    """A named, prioritised instruction.

    Attributes:
        name: its identity (lower_snake); two guardrails with one name are one guardrail.
        instruction: the English instruction, used when templates have no native text.
        priority: higher is rendered first (default 50).
    """

    name: str
    instruction: str
    priority: int = 50


class GuardrailLibrary:
    """The built-in guardrails, as class attributes (a namespace; not instantiated)."""

    SAFE_OUTPUT = Guardrail(
        "safe_output",
        "Do not produce harmful, hateful, illegal or sexually explicit content; if asked for "
        "it, decline briefly and say why.",
        110,
    )
    PII_PROTECTION = Guardrail(
        "pii_protection",
        "Do not reveal personal data such as home addresses, phone numbers, email addresses, "
        "or ID and account numbers; mask any that appear in the documents.",
        105,
    )
    GROUNDING = Guardrail(
        "grounding",
        "Base your answer only on the documents provided, not on outside knowledge.",
        100,
    )
    NO_FABRICATION = Guardrail(
        "no_fabrication",
        "Never make up facts, figures, names, quotes or references; if the documents do not "
        "contain the answer, say so.",
        95,
    )
    CITE_SOURCES = Guardrail(
        "cite_sources",
        "Cite the document behind each claim as [Source: N], where N is its number.",
        90,
    )
    UNCERTAINTY = Guardrail(
        "uncertainty",
        "When you are unsure or the evidence is incomplete, say so plainly and state how "
        "confident you are.",
        80,
    )
    STAY_ON_TOPIC = Guardrail(
        "stay_on_topic",
        "Keep to the question asked; do not wander into unrelated topics.",
        75,
    )
    SELF_CHECK = Guardrail(
        "self_check",
        "Before you answer, check your answer for errors, contradictions and gaps, and fix them.",
        65,
    )
    SHOW_REASONING = Guardrail(
        "show_reasoning",
        "Work through the problem step by step, then give the final answer on its own, "
        "clearly marked.",
        60,
    )
    CONCISE = Guardrail(
        "concise",
        "Be concise: answer directly, without filler or repetition.",
        40,
    )
    NO_MARKDOWN_LEAKAGE = Guardrail(
        "no_markdown_leakage",
        "Write plain text: no Markdown syntax such as #, **, backticks or tables.",
        30,
    )

    @classmethod
    def all(cls) -> list[Guardrail]:
        """Every built-in guardrail, highest priority first.

        Returns:
            The guardrails.
        """
        found = [v for v in vars(cls).values() if isinstance(v, Guardrail)]
        return sorted(found, key=lambda g: g.priority, reverse=True)


_REASONING_STRATEGIES = frozenset(
    {PromptStrategy.CHAIN_OF_THOUGHT, PromptStrategy.MULTI_HOP, PromptStrategy.LEAST_TO_MOST}
)
_HARD_COMPLEXITIES = frozenset({QueryComplexity.COMPLEX, QueryComplexity.EXPERT})
_OPEN_ENDED_TYPES = frozenset({PromptType.AGENT, PromptType.TOOL_USE})


class GuardrailEngine:
    """Selects, orders and renders the guardrails for a request.

    Args:
        extra_guardrails: always appended to the selection, even when the request has
            ``enable_guardrails=False``.

    Thread safety: holds only the constructor-fixed extras; safe to share between threads.
    """

    #: English-only fallback format instructions (no entry for TEXT).
    _FORMAT_INSTRUCTIONS: ClassVar[Mapping[OutputFormat, str]] = {
        OutputFormat.JSON: "Respond only with valid JSON, with no text before or after it.",
        OutputFormat.MARKDOWN: "Format the response in Markdown.",
        OutputFormat.STRUCTURED: "Respond with a JSON object that follows the given structure.",
        OutputFormat.BULLETS: "Respond as a bulleted list.",
    }

    def __init__(self, extra_guardrails: Sequence[Guardrail] | None = None) -> None:
        self._extra: tuple[Guardrail, ...] = tuple(extra_guardrails or ())

    def build(self, request: PromptRequest) -> tuple[str, list[str]]:
        """Select, sort (descending priority, stable), deduplicate by name, render.

        Args:
            request: the prompt request.

        Returns:
            ``(instruction_block, applied_guardrail_names)``.
        """
        candidates = self._select(request)
        candidates.extend(self._extra)
        ordered = sorted(candidates, key=lambda g: g.priority, reverse=True)
        seen: set[str] = set()
        unique: list[Guardrail] = []
        for g in ordered:
            if g.name not in seen:
                seen.add(g.name)
                unique.append(g)
        block = self._render(unique, request)
        names = [g.name for g in unique]
        logger.debug("guardrails applied: %s", names)
        return block, names

    def _select(self, req: PromptRequest) -> list[Guardrail]:
        """The guardrails the request calls for, by the seed's rules, in order.

        Args:
            req: the prompt request.

        Returns:
            The candidates (before extras, sorting and deduplication).
        """
        lib = GuardrailLibrary
        # 1. Always on.
        selected = [lib.SAFE_OUTPUT, lib.CONCISE]
        # 2. Request-dependent, only with enable_guardrails.
        if req.enable_guardrails:
            if req.documents:
                selected += [lib.GROUNDING, lib.NO_FABRICATION]
            if req.enable_uncertainty:
                selected.append(lib.UNCERTAINTY)
            if req.enable_citations and req.documents:
                selected.append(lib.CITE_SOURCES)
            if req.prompt_type not in _OPEN_ENDED_TYPES:
                selected.append(lib.STAY_ON_TOPIC)
            selected.append(lib.PII_PROTECTION)
        # 3. Strategy-driven, regardless of enable_guardrails.
        if req.strategy in _REASONING_STRATEGIES:
            selected.append(lib.SHOW_REASONING)
        # 4. Complexity-driven, regardless of enable_guardrails.
        if req.complexity in _HARD_COMPLEXITIES:
            selected.append(lib.SELF_CHECK)
        return selected

    def _render(self, guardrails: Sequence[Guardrail], req: PromptRequest) -> str:
        """The instruction block: header, numbered guardrails, format instruction, schema.

        Args:
            guardrails: the ordered, deduplicated guardrails.
            req: the prompt request.

        Returns:
            The block (empty when there are no guardrails and no format instruction).
        """
        lang = resolve_lang(req.language)
        parts: list[str] = []
        if guardrails:
            lines = [guardrail_header(lang)]
            lines += [
                f"{i}. {guardrail_text(g.name, lang, fallback=g.instruction)}"
                for i, g in enumerate(guardrails, start=1)
            ]
            parts.append("\n".join(lines))
        fmt = format_instruction_text(req.output_format, lang)
        if fmt is None:
            fmt = self._FORMAT_INSTRUCTIONS.get(req.output_format)
        if fmt is not None:
            if req.output_schema is not None and req.output_format == OutputFormat.STRUCTURED:
                schema = json.dumps(req.output_schema, indent=2, ensure_ascii=False)
                fmt = f"{fmt}\n{schema_label(lang)}\n```json\n{schema}\n```"
            parts.append(fmt)
        return "\n\n".join(parts)


__all__ = ["Guardrail", "GuardrailEngine", "GuardrailLibrary"]
