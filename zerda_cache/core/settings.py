"""The settings a tenant may store in Redis: their names, types and validation.

A tenant's settings hash (``p:{t}:cfg``) holds its overrides of ``CacheConfig``, one
field each, by the names of ``POLICY_FIELDS``: ``similarity_threshold``,
``rl.min_reward_to_serve``, ``eviction.reward_weight``, ... (the four older settings
keep their short names: ``max_entries``, ``max_bytes``, ``ttl``, ``max_error_rate``).
This module is the schema of that hash, beside ``config.py``: storage validates a change
with ``check_changes`` before its script writes it, and
``zerda_cache.learning.tenant_policy.TenantPolicy`` applies the stored overrides with
``resolve``, and ``zerda-cache tenant show`` the values processes report with
``apply_values``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from zerda_cache.core.config import CacheConfig, RLConfig
from zerda_cache.core.errors import InvalidSettingError

#: Fields of the settings hash that are bookkeeping, not settings.
RESERVED = frozenset({"dim", "fence", "ver", "updated", "evx"})


def _parse_float(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"must be finite, got {raw!r}")
    return value


def _parse_int(raw: str) -> int:
    value = float(raw)
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"must be an integer, got {raw!r}")
    return int(value)


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {raw!r}")


@dataclass(frozen=True, slots=True)
class PolicyField:
    """One setting a tenant may store: where it lands in ``CacheConfig``, and its type."""

    name: str  # the field's name in the settings hash (and on the CLI)
    section: str  # "" (CacheConfig), "rl" (RLConfig) or "eviction" (EvictionConfig)
    attr: str  # the dataclass attribute
    kind: type
    doc: str

    def parse(self, raw: object) -> Any:
        """The typed value of a stored (or typed-in) value; ``ValueError`` if it is none."""
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        if self.kind is bool:
            if isinstance(raw, bool):
                return raw
            return _parse_bool(text)
        if isinstance(raw, bool):
            raise ValueError(f"{self.name} must be a number, got {raw!r}")
        try:
            return _parse_int(text) if self.kind is int else _parse_float(text)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None

    @staticmethod
    def encode(value: Any) -> str:
        """The stored form of a typed value (repr round-trips floats)."""
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float):
            return repr(value)
        return str(value)


def _fields() -> dict[str, PolicyField]:
    serving = [
        ("similarity_threshold", "similarity_threshold", float, "minimum cosine of a candidate"),
        ("top_k", "top_k", int, "candidates taken from the index per lookup"),
        ("ttl", "default_ttl_s", float, "TTL (s) of the tenant's puts made without one"),
        ("max_error_rate", "max_error_rate", float, "the error bound δ, in (0, 1)"),
        ("max_serve_error", "max_serve_error", float, "ceiling of the error among serves"),
        ("verify_rate", "verify_rate", float, "most of the servable candidates verified"),
        ("dedup_threshold", "dedup_threshold", float, "cosine at which a put replaces"),
        ("refresh_ttl_on_hit", "refresh_ttl_on_hit", bool, "a hit restarts the TTL"),
        ("label_window", "label_window", int, "labels kept at full weight"),
    ]
    out = {name: PolicyField(name, "", attr, kind, doc) for name, attr, kind, doc in serving}
    for f in dataclasses.fields(RLConfig):
        if f.name == "seed":  # a process's random generator, not a policy
            continue
        out["rl." + f.name] = PolicyField("rl." + f.name, "rl", f.name, float, "RLConfig")
    for name, stored, kind in (
        ("max_entries", "max_entries", int),
        ("max_bytes", "max_bytes", int),
        ("reward_weight", "eviction.reward_weight", float),
        ("usage_weight", "eviction.usage_weight", float),
        ("recency_weight", "eviction.recency_weight", float),
        ("low_watermark", "eviction.low_watermark", float),
    ):
        out[stored] = PolicyField(stored, "eviction", name, kind, "EvictionConfig")
    return out


#: Every setting a tenant may store, by its name in the settings hash.
POLICY_FIELDS: dict[str, PolicyField] = _fields()


def _apply(base: CacheConfig, values: Mapping[str, Any]) -> CacheConfig:
    """``base`` with ``values`` (by field name) in place; ``ValueError`` if invalid."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {"rl": {}, "eviction": {}}
    for name, value in values.items():
        f = POLICY_FIELDS[name]
        (nested[f.section] if f.section else top)[f.attr] = value
    if nested["rl"]:
        top["rl"] = dataclasses.replace(base.rl, **nested["rl"])
    if nested["eviction"]:
        top["eviction"] = dataclasses.replace(base.eviction, **nested["eviction"])
    return dataclasses.replace(base, **top) if top else base


def apply_values(
    base: CacheConfig, values: Mapping[str, Any]
) -> tuple[CacheConfig, dict[str, Any], dict[str, str]]:
    """``base`` with ``values`` (typed, by ``POLICY_FIELDS`` name) in place, all of them
    when they apply together; else field by field, in name order (the same on every
    process), keeping those that apply: the configuration, the values applied and those
    left out (name -> why)."""
    try:
        return _apply(base, values), dict(values), {}
    except (ValueError, TypeError):
        pass
    good: dict[str, Any] = {}
    rejected: dict[str, str] = {}
    for name in sorted(values):
        try:
            _apply(base, {**good, name: values[name]})
        except (ValueError, TypeError) as exc:
            rejected[name] = str(exc)
        else:
            good[name] = values[name]
    return _apply(base, good), good, rejected


@lru_cache(maxsize=1024)
def _resolve(
    base: CacheConfig, stored: tuple[tuple[str, str], ...]
) -> tuple[CacheConfig, tuple[tuple[str, Any], ...], tuple[tuple[str, str], ...]]:
    values: dict[str, Any] = {}
    rejected: dict[str, str] = {}
    for name, raw in stored:
        try:
            values[name] = POLICY_FIELDS[name].parse(raw)
        except ValueError as exc:
            rejected[name] = str(exc)
    config, applied, left_out = apply_values(base, values)
    rejected.update(left_out)
    return config, tuple(sorted(applied.items())), tuple(sorted(rejected.items()))


def resolve(
    base: CacheConfig, stored: Mapping[str, str]
) -> tuple[CacheConfig, dict[str, Any], dict[str, str]]:
    """``base`` with the tenant's stored overrides on top: the effective configuration,
    the overrides applied (typed) and those left out (name -> why). Fields that are not
    settings (``dim``, ``ver``, ...) and unknown names are ignored."""
    known = tuple(sorted((k, v) for k, v in stored.items() if k in POLICY_FIELDS))
    config, applied, rejected = _resolve(base, known)
    return config, dict(applied), dict(rejected)


def check_changes(
    base: CacheConfig, stored: Mapping[str, str], changes: Mapping[str, object]
) -> dict[str, str]:
    """Validate ``changes`` (name -> value, ``None`` clears the override) on top of what
    is ``stored``, against ``base``; return them in their stored form ('' = clear).

    Raises:
        InvalidSettingError: an unknown name, a value that does not parse, or a policy
            that ``CacheConfig`` refuses (the message names the field).
    """
    try:
        return _check_changes(base, stored, changes)
    except InvalidSettingError:
        raise
    except ValueError as exc:
        raise InvalidSettingError(str(exc)) from exc


def _check_changes(
    base: CacheConfig, stored: Mapping[str, str], changes: Mapping[str, object]
) -> dict[str, str]:
    """Validate ``changes`` (name -> value, ``None`` clears the override) on top of what
    is ``stored``, against ``base``; return them in their stored form ('' = clear).

    Raises:
        ValueError: an unknown name, a value that does not parse, or a policy that
            ``CacheConfig`` refuses (the message names the field).
    """
    unknown = sorted(set(changes) - set(POLICY_FIELDS))
    if unknown:
        raise InvalidSettingError(
            f"unknown tenant settings {unknown}; known: {', '.join(sorted(POLICY_FIELDS))}"
        )
    encoded: dict[str, str] = {}
    values: dict[str, Any] = {}
    for name, raw in stored.items():
        if name in POLICY_FIELDS:  # a bad stored value is dropped unless this sets it
            with contextlib.suppress(ValueError):
                values[name] = POLICY_FIELDS[name].parse(raw)
    for name, value in changes.items():
        if value is None:
            encoded[name] = ""
            values.pop(name, None)
            continue
        typed = POLICY_FIELDS[name].parse(value)
        if name in ("max_entries", "max_bytes", "ttl") and typed <= 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
        encoded[name] = PolicyField.encode(typed)
        values[name] = typed
    _apply(base, values)  # raises ValueError naming the field
    return encoded


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables (TOML ``[rl]``, JSON ``{"rl": {...}}``) to dotted setting names."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = prefix + str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


__all__ = [
    "POLICY_FIELDS",
    "RESERVED",
    "PolicyField",
    "apply_values",
    "check_changes",
    "flatten",
    "resolve",
]
