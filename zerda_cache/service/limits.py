"""The request body limit, enforced before the application sees a byte of the body.

A plain ASGI middleware rather than a FastAPI dependency: a dependency runs after the
body is read, and an exception raised while the app reads it would reach Starlette's
error middleware (a 500) first. Here the body is read into memory up to the limit (the
limit is small: the default is 1 MiB) and replayed to the app; one byte more and the
client gets a 413 without the app running, so nothing is written.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zerda_cache.service.errors import error_body

#: Default request body limit (bytes): a chat completion request with a long
#: conversation, or a 3072-d embedding as JSON (~70 KB), fits easily.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with a JSON 413 (or 400 for a bad
    ``Content-Length``)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await send_error(send, 400, "bad Content-Length header", "invalid_request_error")
                return
            if declared > self.max_bytes:
                await self._too_large(send)
                return
        try:
            body = await read_body(receive, self.max_bytes)
        except BodyTooLarge:
            await self._too_large(send)
            return
        if body is not None:
            await self.app(scope, replaying(body, receive), send)

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send,
            413,
            f"request body over the limit of {self.max_bytes} bytes",
            "request_too_large",
        )


class BodyTooLarge(Exception):
    """A request body past the limit ``read_body`` was given."""


async def read_body(receive: Receive, max_bytes: int | None = None) -> bytes | None:
    """The request's whole body, read from ``receive``; ``None`` when the client went
    away first.

    Raises:
        BodyTooLarge: the body is over ``max_bytes`` (nothing past that is read).
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return None
        body = message.get("body", b"")
        size += len(body)
        if max_bytes is not None and size > max_bytes:
            raise BodyTooLarge(f"request body over {max_bytes} bytes")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` for the app once a middleware read the whole ``body``: it hands the
    body over as one message, then passes on what the client sends next."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def send_error(
    send: Send,
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    *,
    close: bool = True,
) -> None:
    """Answer with the service's JSON error shape, from an ASGI middleware (the app, and
    so its error handlers, never ran). ``close``: ask the client to close the connection,
    for a refusal sent before the body was read to its end."""
    payload: dict[str, Any] = error_body(message, type_, code)
    body = json.dumps(payload).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "BodyLimit",
    "BodyTooLarge",
    "read_body",
    "replaying",
    "send_error",
]
