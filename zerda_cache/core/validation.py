"""Validation of what callers pass in: tenant ids, entry ids, key prefixes, and the
query, answer and scope of an entry.

Core-level: the learner, the config, the manager and storage all use it, and it imports
nothing of ours but the errors. Tenant ids are checked before they come near a Redis key: a brace,
colon, space or newline would change which Cluster slot (or which tenant) a key belongs
to, so such an id is a clear ``InvalidTenantError``, never a key.
"""

from __future__ import annotations

import math
import numbers
import re
import secrets

from zerda_cache.core.errors import InvalidEntryError, InvalidFeedbackError, InvalidTenantError

TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
ENTRY_ID_RE = re.compile(r"[0-9a-f]{32}")
PREFIX_RE = re.compile(r"[A-Za-z0-9._-]{1,32}")
#: A scope is a digest or a short label (``prompt_scope`` makes 32 hex characters).
MAX_SCOPE_CHARS = 256
#: A tag is a short label (a document id, a source, a version): printable, no spaces.
TAG_RE = re.compile(r"[!-~]{1,128}")
#: Tags one entry may carry.
MAX_TAGS = 16


def validate_tenant(tenant: object) -> str:
    """Return ``tenant`` if it is a valid tenant id, else raise ``InvalidTenantError``."""
    if not isinstance(tenant, str):
        raise InvalidTenantError(f"tenant id must be a str, got {type(tenant).__name__}")
    if not TENANT_RE.fullmatch(tenant):
        shown = tenant if len(tenant) <= 80 else tenant[:77] + "..."
        raise InvalidTenantError(
            f"invalid tenant id {shown!r}: use 1 to 64 characters from [A-Za-z0-9._-]"
        )
    return tenant


def validate_entry_id(
    entry_id: object, error: type[InvalidEntryError | InvalidFeedbackError] = InvalidFeedbackError
) -> str:
    """Return ``entry_id`` if it looks like an id this library made (32 hex chars), else
    raise ``error``."""
    if not isinstance(entry_id, str) or not ENTRY_ID_RE.fullmatch(entry_id):
        raise error(f"invalid entry id {entry_id!r}: expected 32 hex characters")
    return entry_id


def check_text(value: str, what: str, error: type[ValueError] = InvalidEntryError) -> str:
    """``value`` if it encodes as UTF-8 (a lone surrogate such as ``"\\udc80"`` does not:
    Redis and msgpack store bytes), else ``error``."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not valid text: {exc.reason} at position {exc.start}") from None
    return value


def finite_number(value: object) -> float | None:
    """``value`` as a float if it is a real number (not a bool) that a float holds as a
    finite value, else ``None``. An int past a float's range (``10**400``) is ``None``:
    ``math.isfinite`` would raise ``OverflowError`` on it, which is no validation error."""
    kind = type(value)
    if kind is float or kind is int:  # the common case, without the ABC check below
        try:
            number = float(value)  # type: ignore[arg-type]
        except OverflowError:
            return None
        return number if math.isfinite(number) else None
    if kind is bool or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def whole_number(value: object, low: int = 0, high: int = 2**53) -> int | None:
    """``value`` as an int if it is a whole number in ``[low, high]`` (an int, or a float
    without a fraction: msgpack and JSON may carry either; not a bool), else ``None``.
    Never ``int()`` of an unchecked float: ``int(inf)`` raises ``OverflowError``."""
    if type(value) is int:
        return value if low <= value <= high else None
    number = finite_number(value)
    if number is None or number != math.floor(number) or not low <= number <= high:
        return None
    return int(number)


def count_or_zero(raw: object) -> int:
    """A counter read best effort from Redis (bytes, str or a number: ``b"12"``, ``"3.0"``)
    as an int, truncated; 0 for what is not a finite number (missing, garbage, ``inf``,
    ``nan``), where reading it must not fail: a fit's label counts, a level's number.
    ``int(float(...))`` alone raises ``OverflowError`` on ``inf``."""
    try:
        return int(float(raw))  # type: ignore[arg-type]
    except (OverflowError, TypeError, ValueError):
        return 0


def parse_digits(text: str, max_digits: int) -> int | None:
    """``text`` as an int if it is 1 to ``max_digits`` ASCII digits, else ``None``.

    ``str.isdigit`` (and ``isdecimal``) alone is no check for outside text:
    ``"\u00b2".isdigit()`` is true and ``int("\u00b2")`` raises, while ``int`` takes
    ``" 7"``, ``"1_0"`` and Arabic-Indic digits, which no header or field of ours holds."""
    if not 0 < len(text) <= max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def check_expiry(value: object, what: str = "expires_at") -> float:
    """An expiry in unix seconds (``None``: none, read as ``inf``): a finite number,
    else ``InvalidEntryError`` (an int of 401 digits does not fit a float)."""
    if value is None:
        return math.inf
    number = finite_number(value)
    if number is None:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InvalidEntryError(f"{what} must be a finite number or null, got {shown}")
    return number


def check_dim(value: object, what: str = "dim") -> int:
    """An embedding dimension: a whole number in [1, 2**31), else ``InvalidEntryError``
    (``"abc"``, ``1e400``, ``2.5`` and ``True`` are not)."""
    dim = whole_number(value, 1, 2**31 - 1)
    if dim is None:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InvalidEntryError(f"{what} must be a whole number >= 1, got {shown}")
    return dim


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a valid key prefix, else raise ``ValueError``."""
    if not isinstance(prefix, str) or not PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"key_prefix must match [A-Za-z0-9._-]{{1,32}}, got {prefix!r}")
    return prefix


def new_entry_id() -> str:
    """A 128-bit random id, as 32 lowercase hex characters."""
    return secrets.token_hex(16)


def check_query(query: object, max_chars: int) -> str:
    """A non-empty question of at most ``max_chars`` characters, else ``InvalidEntryError``."""
    if not isinstance(query, str) or not query.strip():
        raise InvalidEntryError("query must be a non-empty str")
    if len(query) > max_chars:
        raise InvalidEntryError(
            f"query has {len(query)} characters, over max_query_chars={max_chars}"
        )
    return check_text(query, "query")


def check_response(response: object, max_bytes: int) -> str:
    """An answer of at most ``max_bytes`` UTF-8 bytes, else ``InvalidEntryError``."""
    if not isinstance(response, str):
        raise InvalidEntryError(f"response must be a str, got {type(response).__name__}")
    size = len(check_text(response, "response").encode("utf-8"))
    if size > max_bytes:
        raise InvalidEntryError(f"response has {size} bytes, over max_response_bytes={max_bytes}")
    return response


def check_tags(tags: object) -> tuple[str, ...]:
    """Tags for a put (``None``: none): at most ``MAX_TAGS`` distinct strings of 1 to 128
    printable ASCII characters without spaces, else ``InvalidEntryError``."""
    if tags is None:
        return ()
    if isinstance(tags, str) or not isinstance(tags, list | tuple | set | frozenset):
        raise InvalidEntryError(f"tags must be a list of str, got {type(tags).__name__}")
    out = tuple(dict.fromkeys(check_tag(t) for t in tags))
    if len(out) > MAX_TAGS:
        raise InvalidEntryError(f"at most {MAX_TAGS} tags an entry, got {len(out)}")
    return out


def check_tag(tag: object) -> str:
    """One tag: 1 to 128 printable ASCII characters without spaces."""
    if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):
        shown = repr(tag) if not isinstance(tag, str) or len(tag) <= 80 else repr(tag[:77]) + "..."
        raise InvalidEntryError(
            f"invalid tag {shown}: use 1 to 128 printable ASCII characters without spaces"
        )
    return tag


def check_scope(scope: object) -> str:
    """A scope label (``None`` is the default scope, ``""``), else ``InvalidEntryError``."""
    if scope is None:
        return ""
    if not isinstance(scope, str) or len(scope) > MAX_SCOPE_CHARS:
        raise InvalidEntryError(f"scope must be a str of at most {MAX_SCOPE_CHARS} characters")
    return check_text(scope, "scope")
