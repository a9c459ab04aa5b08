"""Error responses of the HTTP service: one JSON shape for every refusal.

Every error is ``{"error": {"message": ..., "type": ..., "code": ...}}`` with a 4xx or 5xx
status: the shape of the OpenAI API, so the ``openai`` client pointed at the proxy raises
its usual exceptions with our message, and other clients get one format everywhere.
Library errors map by class: bad input 422, unknown entry 404, Redis down 503. Request
bodies are checked before any route reads them (``body``: a 415 for a type that is not
JSON, a 422 for bytes that are not UTF-8, text that is not JSON, lone surrogates or deep
nesting); text that still cannot be encoded or nests too deeply for a library call on the
way is a 422 as well, never a 500 that drops the connection.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from zerda_cache.core.errors import CorruptEntryError, EntryNotFoundError, StorageError, ZerdaError

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A refusal with its status, error type and code."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code if code is not None else type_


def error_body(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    # A message may quote its input: escape what UTF-8 cannot hold, or the error itself
    # could not be sent.
    text = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": text, "type": type_, "code": code or type_, "param": None}}


def error_response(
    status: int, message: str, type_: str, code: str | None = None, **headers: str
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


def _from_library(exc: ZerdaError) -> ApiError:
    if isinstance(exc, EntryNotFoundError):
        # Keys are per tenant: "another tenant's" and "no such" entry are the same answer.
        return ApiError(404, f"no entry {exc.entry_id!r} for this key's tenant", "not_found")
    if isinstance(exc, CorruptEntryError):
        return ApiError(500, "a stored value does not decode", "server_error", "corrupt")
    if isinstance(exc, StorageError):
        return ApiError(503, "the cache's Redis is unavailable", "storage_unavailable")
    if isinstance(exc, ValueError):
        return ApiError(422, str(exc), "invalid_request_error", type(exc).__name__)
    return ApiError(500, str(exc), "server_error")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Route every refusal through ``error_response``."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.code)

    @app.exception_handler(ZerdaError)
    async def library_error(request: Request, exc: ZerdaError) -> JSONResponse:
        api = _from_library(exc)
        if api.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc)
        return error_response(api.status, api.message, api.type, api.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(UnicodeError)
    async def unicode_error(request: Request, exc: UnicodeError) -> JSONResponse:
        log.warning("%s %s: text not encodable: %s", request.method, request.url.path, exc)
        message = f"text that is not valid Unicode: {exc}"
        return error_response(422, message, "invalid_request_error", "invalid_unicode")

    @app.exception_handler(RecursionError)
    async def recursion_error(request: Request, exc: RecursionError) -> JSONResponse:
        log.warning("%s %s: input nested too deeply", request.method, request.url.path)
        return error_response(
            422, "input nested too deeply", "invalid_request_error", "too_deeply_nested"
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_)


__all__ = ["ApiError", "error_body", "error_response", "install_error_handlers"]
