"""Companion modules from the seed's prompt page (``prompt-guardrails``).

- :class:`GuardrailEngine`, :class:`Guardrail`, :class:`GuardrailLibrary`: prompt
  instructions selected per request and rendered in English or Turkish.
- :func:`prompt_scope`: a cache scope that keeps answers built under different
  instructions apart.
- The request types the seed uses without defining them.
"""

from zerda_cache.companions.prompt.guardrails import Guardrail, GuardrailEngine, GuardrailLibrary
from zerda_cache.companions.prompt.scope import prompt_scope
from zerda_cache.companions.prompt.templates import (
    format_instruction_text,
    guardrail_header,
    guardrail_text,
    resolve_lang,
)
from zerda_cache.companions.prompt.types import (
    OutputFormat,
    PromptRequest,
    PromptStrategy,
    PromptType,
    QueryComplexity,
)

__all__ = [
    "Guardrail",
    "GuardrailEngine",
    "GuardrailLibrary",
    "OutputFormat",
    "PromptRequest",
    "PromptStrategy",
    "PromptType",
    "QueryComplexity",
    "format_instruction_text",
    "guardrail_header",
    "guardrail_text",
    "prompt_scope",
    "resolve_lang",
]
