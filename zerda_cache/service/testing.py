"""Run the service in-process, and stand in for an LLM API: for examples and for testing an
app against the proxy without spending tokens.

``ServerThread`` serves an ASGI app with uvicorn on a free loopback port in a background
thread; ``canned_upstream`` is a minimal OpenAI-compatible chat completions API whose
answers come from a function, counting its calls (``app.state.calls``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) in a daemon thread; a context
    manager. ``url`` is ``http://127.0.0.1:<port>``."""

    def __init__(self, app: Any, *, startup_timeout_s: float = 30.0) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.startup_timeout_s = startup_timeout_s

    def start(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start (see its log)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def canned_upstream(answer: Callable[[str], str]) -> FastAPI:
    """An OpenAI-compatible ``POST /v1/chat/completions`` answering ``answer(question)``
    (the last message's text), streamed when asked; ``app.state.calls`` counts requests."""
    app = FastAPI()
    app.state.calls = 0

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        app.state.calls += 1
        text = answer(str(body["messages"][-1].get("content", "")))
        base = {"id": f"chatcmpl-canned{app.state.calls}", "created": int(time.time())}
        base["model"] = body.get("model", "canned")
        if body.get("stream"):
            return StreamingResponse(_events(base, text), media_type="text/event-stream")
        message = {"role": "assistant", "content": text}
        return {
            **base,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    return app


async def _events(base: dict[str, Any], text: str) -> AsyncIterator[str]:
    import json

    base = {**base, "object": "chat.completion.chunk"}
    for delta, finish in (({"role": "assistant", "content": text}, None), ({}, "stop")):
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


__all__ = ["ServerThread", "canned_upstream"]
