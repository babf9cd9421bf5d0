"""Stand-in models behind a loopback OpenAI-compatible server (CPU tests and demos only).

:func:`chat_app` turns a plain function ``fn(messages) -> str`` into an ASGI app that answers
``POST /v1/chat/completions`` (non-streamed, or streamed as one content chunk, a finish chunk and
``[DONE]``) and ``GET /v1/models``; :func:`serve_chat_model` runs it on a free loopback port and
yields the base URL. Every call is counted in ``app.state.calls``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse

from reef_core.api import serve_asgi


def chat_app(fn: Callable[[list[dict]], str], model: str = "stand-in") -> FastAPI:
    """An OpenAI-compatible app whose every answer is ``fn(messages)``."""
    app = FastAPI()
    app.state.calls = 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "reef"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return JSONResponse({"error": {"message": "messages must be a non-empty list",
                                           "type": "invalid_request_error"}}, status_code=400)
        app.state.calls += 1
        text = await asyncio.to_thread(fn, messages)
        created = int(time.time())
        name = body.get("model") or model
        cid = f"chatcmpl-standin-{app.state.calls}"
        if body.get("stream"):
            def events():
                base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name}
                yield f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': text}, 'finish_reason': None}]})}\n\n"
                yield f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        words = len(text.split())
        return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": words, "total_tokens": words}}

    return app


@contextlib.contextmanager
def serve_chat_model(fn: Callable[[list[dict]], str], model: str = "stand-in") -> Iterator[str]:
    """Serve ``fn`` as an OpenAI-compatible model on a free loopback port; yield the base URL."""
    with serve_asgi(chat_app(fn, model)) as url:
        yield url
