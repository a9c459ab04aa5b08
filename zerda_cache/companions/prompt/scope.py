"""``prompt_scope``: the cache scope of the instructions a prompt was built with.

An answer produced under one set of instructions (guardrails, output format, language,
schema) should not be served for a prompt built under another. ``prompt_scope`` digests
what sets those instructions apart, so passing it as the cache's ``scope`` keeps such
answers apart: the same request gives the same scope, and any difference in the applied
guardrail names, the output format, the resolved language or the schema gives another.

Format: ``"p1:"`` + the first 24 hex digits (96 bits) of the SHA-256 of the canonical JSON
``{"format", "guardrails" (sorted names), "lang", "schema"}`` (sorted keys, no spaces,
UTF-8): 27 characters, well under the cache's 256-character scope limit. The ``p1``
prefix is the format's version.
"""

from __future__ import annotations

import hashlib
import json

from zerda_cache.companions.prompt.guardrails import GuardrailEngine
from zerda_cache.companions.prompt.templates import resolve_lang
from zerda_cache.companions.prompt.types import PromptRequest

SCOPE_PREFIX = "p1:"
SCOPE_HEX_DIGITS = 24


def prompt_scope(request: PromptRequest, engine: GuardrailEngine | None = None) -> str:
    """A short, stable digest of the instructions ``engine`` builds for ``request``.

    Args:
        request: the prompt request.
        engine: the engine that builds the prompt (its extra guardrails count); default: a
            plain :class:`GuardrailEngine`.

    Returns:
        ``"p1:"`` followed by 24 hex digits.

    Raises:
        ValueError: if ``request.output_schema`` cannot be encoded as JSON.
    """
    engine = engine if engine is not None else GuardrailEngine()
    _, names = engine.build(request)
    payload = {
        "format": request.output_format.value,
        "guardrails": sorted(names),
        "lang": resolve_lang(request.language),
        "schema": request.output_schema,
    }
    try:
        canonical = json.dumps(
            payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"output_schema must be JSON-encodable: {exc}") from exc
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    return SCOPE_PREFIX + digest[:SCOPE_HEX_DIGITS]


__all__ = ["SCOPE_PREFIX", "prompt_scope"]
