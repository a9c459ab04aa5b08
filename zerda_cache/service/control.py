"""Per-request control: ``Cache-Control`` and ``X-Zerda-Scope`` on the proxy and the API.

=============================  ==============================================================
request header                 effect
=============================  ==============================================================
``Cache-Control: no-cache``    the cache is not read: the question goes upstream (the API's
                               lookup answers a miss) and the fresh answer replaces the
                               cached one
``Cache-Control: no-store``    the cache is neither read nor written: Redis is unchanged
``Cache-Control: max-age=N``   the answer this request stores lives ``N`` seconds (the put's
                               ``ttl_s``; ``max-age=0`` stores nothing, as ``no-store``)
``X-Zerda-Scope: <partition>`` an extra partition (a user, a session) on top of the scope:
                               only requests with the same partition meet
``X-Zerda-Tags: a,b``          tags of the answer this request stores (comma-separated), to
                               invalidate it by later (``POST /v1/invalidate/tag``)
=============================  ==============================================================

``max-age`` on a request is, in HTTP, the oldest cached answer the client accepts; here
it is the lifetime of the answer the request stores, which is what a caller sets it for
(a hit is served as it is). Other directives are ignored, as HTTP caches do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from zerda_cache.core.errors import InvalidEntryError
from zerda_cache.core.validation import MAX_SCOPE_CHARS, check_tags, parse_digits
from zerda_cache.service.errors import ApiError

#: The header naming an extra scope partition.
SCOPE_HEADER = "x-zerda-scope"
#: The header listing the stored answer's tags.
TAGS_HEADER = "x-zerda-tags"
#: What a partition may hold (user ids, e-mail addresses, session ids).
PARTITION_RE = re.compile(r"[A-Za-z0-9._:@+=/-]{1,128}")
#: Between the scope and the partition.
PARTITION_SEP = "|"


@dataclass(frozen=True, slots=True)
class RequestControl:
    """What a request asks of the cache.

    Attributes:
        read: look the question up (false: ``no-cache``, ``no-store``).
        write: store the answer (false: ``no-store``).
        ttl_s: the stored answer's time to live (``max-age``).
        partition: ``X-Zerda-Scope``, combined with the scope (``scoped``).
        tags: ``X-Zerda-Tags``: the stored answer's tags.
    """

    read: bool = True
    write: bool = True
    ttl_s: float | None = None
    partition: str | None = None
    tags: tuple[str, ...] = ()

    @property
    def directive(self) -> str | None:
        """Why the cache is skipped, for ``x-zerda-bypass``: ``None`` when it is not."""
        if not self.write:
            return "Cache-Control: no-store"
        return None

    def scoped(self, scope: str | None) -> str | None:
        """``scope`` with the partition on top (the scope itself is never replaced)."""
        if self.partition is None:
            return scope
        combined = (scope or "") + PARTITION_SEP + self.partition
        if len(combined) > MAX_SCOPE_CHARS:
            raise ApiError(
                422,
                f"the scope and {SCOPE_HEADER} together are over {MAX_SCOPE_CHARS} characters",
                "invalid_request_error",
                "scope_too_long",
            )
        return combined


def _bad(message: str, code: str) -> ApiError:
    return ApiError(422, message, "invalid_request_error", code)


def request_control(headers: Mapping[str, str]) -> RequestControl:
    """The request's control (a 422 for a malformed ``max-age`` or partition)."""
    read = write = True
    ttl_s: float | None = None
    for value in _all(headers, "cache-control"):
        for part in value.split(","):
            name, _, arg = part.strip().partition("=")
            name = name.strip().lower()
            if name == "no-cache":
                read = False
            elif name == "no-store":
                read = write = False
            elif name == "max-age":
                seconds = parse_digits(arg.strip().strip('"'), 10)
                if seconds is None:
                    raise _bad(
                        f"Cache-Control: max-age must be whole seconds, got {arg.strip()!r}",
                        "invalid_cache_control",
                    )
                if seconds == 0:
                    read = write = False
                else:
                    ttl_s = float(seconds)
    partition: str | None = None
    raw = headers.get(SCOPE_HEADER)
    if raw is not None:
        partition = raw.strip()
        if not PARTITION_RE.fullmatch(partition):
            raise _bad(
                f"{SCOPE_HEADER} must be 1 to 128 of A-Z a-z 0-9 . _ : @ + = / -",
                "invalid_scope_partition",
            )
    names = [t.strip() for v in _all(headers, TAGS_HEADER) for t in v.split(",") if t.strip()]
    try:
        tags = check_tags(names)
    except InvalidEntryError as exc:
        raise _bad(f"{TAGS_HEADER}: {exc}", "invalid_tags") from exc
    return RequestControl(read=read, write=write, ttl_s=ttl_s, partition=partition, tags=tags)


def _all(headers: Mapping[str, str], name: str) -> list[str]:
    getlist = getattr(headers, "getlist", None)
    if getlist is not None:
        return [str(v) for v in getlist(name)]
    value = headers.get(name)
    return [value] if value is not None else []


__all__ = [
    "PARTITION_RE",
    "PARTITION_SEP",
    "SCOPE_HEADER",
    "TAGS_HEADER",
    "RequestControl",
    "request_control",
]
