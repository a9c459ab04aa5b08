"""JSON request bodies, checked once for every route that takes one.

An ASGI middleware between the body limit and the routes: it parses the (already
size-limited) body of every request to a JSON route and refuses, with the service's JSON
error shape, what no route can use:

- a content type other than JSON: ``application/json`` (or ``...+json``), none at all, or
  ``application/x-www-form-urlencoded`` (what ``curl -d`` sends unless told otherwise) are
  read as JSON; anything else is a 415;
- bytes that are not UTF-8, text that is not JSON (``NaN`` and ``Infinity`` included, and
  numbers too large for a float), strings with lone surrogates (``"\\ud800"`` parses in
  Python but cannot be encoded: not in Redis, not upstream, not in a response), and
  nesting deeper than ``MAX_JSON_DEPTH``: a 422.

A body that passes is handed on unchanged, labelled ``application/json``, so FastAPI
parses it as the routes declare; every string in it encodes as UTF-8, at every depth of
every field, which is what lets the proxy hash and forward a request's fields as they
came.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from email.message import Message as MimeMessage
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from zerda_cache.service.limits import read_body, replaying, send_error

#: Deepest nesting of arrays and objects accepted in a request body. A chat completion's
#: tool schemas nest a few levels, metadata a few more; the JSON parser itself gives up
#: near a thousand, and every level past the first few is only a cost.
MAX_JSON_DEPTH = 64
#: Content types read as JSON (``curl -d`` sends the form type unless told otherwise).
JSON_LIKE = frozenset({"application/json", "application/x-www-form-urlencoded"})


class BodyError(ValueError):
    """A request body no route can use: ``status`` and ``code`` say why."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is too large for a float")
    return value


def check_content_type(value: str | None) -> None:
    """Refuse (415) a body whose content type says it is not JSON."""
    if value is None or not value.strip():
        return
    mime = MimeMessage()
    mime["content-type"] = value
    kind = mime.get_content_type()
    if kind in JSON_LIKE or (kind.startswith("application/") and kind.endswith("+json")):
        return
    raise BodyError(
        415,
        f"unsupported content type {kind!r}: send JSON (Content-Type: application/json)",
        "unsupported_media_type",
    )


def parse_json_body(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of ``body``, or a ``BodyError`` (422) saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(
            422, f"the body is not UTF-8 (byte {exc.start}): JSON is UTF-8", "invalid_utf8"
        ) from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise BodyError(
            422, f"JSON nested deeper than {max_depth} levels", "too_deeply_nested"
        ) from None
    except ValueError as exc:  # JSONDecodeError, and the number checks above
        raise BodyError(422, f"the body is not valid JSON: {exc}", "invalid_json") from None
    check_json_value(value, max_depth)
    return value


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse (422) nesting deeper than ``max_depth`` and strings (keys too) that are not
    encodable as UTF-8. Iterative: a hostile depth costs no Python stack."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth >= max_depth:
            raise BodyError(422, f"JSON nested deeper than {max_depth} levels", "too_deeply_nested")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key)
                stack.append((child, depth + 1))
        else:
            stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BodyError(
            422,
            f"a string holds a lone surrogate ({text[exc.start]!a}): not encodable as UTF-8",
            "invalid_unicode",
        ) from None


class JsonBody:
    """Check the JSON body of every request to ``paths`` before the app sees it (see the
    module docstring); other paths pass untouched."""

    def __init__(
        self, app: ASGIApp, paths: Collection[str], max_depth: int = MAX_JSON_DEPTH
    ) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return
        if body:
            headers = list(scope.get("headers") or ())
            declared = [v.decode("latin-1") for k, v in headers if k == b"content-type"]
            try:
                check_content_type(declared[0] if declared else None)
                parse_json_body(body, self.max_depth)
            except BodyError as exc:
                await send_error(
                    send, exc.status, str(exc), "invalid_request_error", exc.code, close=False
                )
                return
            headers = [(k, v) for k, v in headers if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, replaying(body, receive), send)


__all__ = [
    "JSON_LIKE",
    "MAX_JSON_DEPTH",
    "BodyError",
    "JsonBody",
    "check_content_type",
    "check_json_value",
    "parse_json_body",
]
