"""What the cache saved: LLM calls, tokens and money that hits avoided, less what wrong
answers cost.

A put that says what its answer cost upstream (``usage=``: the model and its prompt and
completion tokens, the OpenAI ``usage`` shape) stores it with the entry; every hit of the
entry saves that call. A hit later judged wrong (negative feedback about a served answer,
``CacheHit.feedback``) is counted apart: the user had to ask the LLM again, so its tokens
were bought after all. Net saving = saved - wrong.

Money comes from a price table in US dollars per million tokens (prompt, completion), by
model: ``DEFAULT_PRICES``, a snapshot of list prices given as a starting point, merged
with ``CacheConfig.token_prices`` (yours: prices change, and a model missing from both is
counted in calls and tokens at no money).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zerda_cache.core.config import CacheConfig
from zerda_cache.core.entry import LLMUsage

#: US dollars per million tokens (prompt, completion): a starting point; set your own in
#: ``CacheConfig.token_prices`` (merged over these, model by model).
DEFAULT_PRICES: Mapping[str, tuple[float, float]] = {
    "gpt-4o": (2.50, 10.00),
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1-nano": (0.10, 0.40),
    "gpt-3.5-turbo": (0.50, 1.50),
}


def price_table(
    overrides: Mapping[str, tuple[float, float]] | None,
) -> dict[str, tuple[float, float]]:
    """``DEFAULT_PRICES`` with ``overrides`` on top."""
    return {**DEFAULT_PRICES, **(overrides or {})}


def prices_of(config: CacheConfig) -> dict[str, tuple[float, float]]:
    """The price table a configuration counts money with: ``DEFAULT_PRICES`` with its
    ``token_prices`` on top (the replicas' savings metrics and ``stats`` alike)."""
    return price_table({model: (p, c) for model, p, c in config.token_prices})


def cost(usage: LLMUsage, prices: Mapping[str, tuple[float, float]]) -> float:
    """What ``usage`` costs in US dollars (0 for a model without a price)."""
    return tokens_cost(usage.model, usage.prompt_tokens, usage.completion_tokens, prices)


def tokens_cost(
    model: str, prompt: int, completion: int, prices: Mapping[str, tuple[float, float]]
) -> float:
    per_prompt, per_completion = prices.get(model, (0.0, 0.0))
    return (prompt * per_prompt + completion * per_completion) / 1e6


@dataclass(slots=True)
class Savings:
    """Totals of one model (or all): calls, tokens and dollars saved by hits, and those of
    the hits judged wrong; ``net_usd`` is what the cache saved after all."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usd: float = 0.0
    wrong_calls: int = 0
    wrong_prompt_tokens: int = 0
    wrong_completion_tokens: int = 0
    wrong_usd: float = 0.0

    @property
    def net_usd(self) -> float:
        return self.usd - self.wrong_usd

    @property
    def net_calls(self) -> int:
        return self.calls - self.wrong_calls

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "usd": round(self.usd, 6),
            "wrong_calls": self.wrong_calls,
            "wrong_prompt_tokens": self.wrong_prompt_tokens,
            "wrong_completion_tokens": self.wrong_completion_tokens,
            "wrong_usd": round(self.wrong_usd, 6),
            "net_calls": self.net_calls,
            "net_usd": round(self.net_usd, 6),
        }


#: The tenant's stats fields (``p:{t}:stats``) that hold the counts, by model:
#: ``saved:<model>:calls`` and so on; ``wrong:<model>:...`` for hits judged wrong. The
#: Lua scripts write them (``_lib.lua``'s ``zc_count_usage``): the hit script a hit's
#: saved call as it serves it, the feedback script a wrong hit's, once per hit.
FIELDS = ("calls", "prompt", "completion")


def from_stats(
    stats: Mapping[str, int], prices: Mapping[str, tuple[float, float]]
) -> dict[str, Savings]:
    """Per model and in all (``"*"``), from a tenant's stats hash."""
    by_model: dict[str, Savings] = {}
    for name, value in stats.items():
        kind, sep, rest = name.partition(":")
        if not sep or kind not in ("saved", "wrong"):
            continue
        model, _, field = rest.rpartition(":")
        if not model or field not in FIELDS:
            continue
        s = by_model.setdefault(model, Savings())
        prefix = "" if kind == "saved" else "wrong_"
        attr = {"calls": "calls", "prompt": "prompt_tokens", "completion": "completion_tokens"}
        setattr(s, prefix + attr[field], getattr(s, prefix + attr[field]) + int(value))
    total = Savings()
    for model, s in by_model.items():
        s.usd = tokens_cost(model, s.prompt_tokens, s.completion_tokens, prices)
        s.wrong_usd = tokens_cost(model, s.wrong_prompt_tokens, s.wrong_completion_tokens, prices)
        for f in Savings.__slots__:
            setattr(total, f, getattr(total, f) + getattr(s, f))
    return {**by_model, "*": total} if by_model else {}


__all__ = ["DEFAULT_PRICES", "Savings", "cost", "from_stats", "price_table", "prices_of"]
