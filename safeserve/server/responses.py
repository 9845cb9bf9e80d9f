"""A generation as an HTTP response: a server-sent event stream (completion or chat chunks), or,
not streaming, one body gathered while watching for the client going away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from safeserve.server import protocol as P
from safeserve.server.errors import APIError
from safeserve.server.generate import Generation

if TYPE_CHECKING:
    from safeserve.server.app import ServerState


def _sse(
    request: Request, state: ServerState, gen: Generation, chunks: AsyncIterator[dict]
) -> Response:
    path = request.url.path

    async def body() -> AsyncIterator[bytes]:
        status = "200"
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()  # ASCII: no line separator can split an event
            yield b"data: [DONE]\n\n"
        except APIError as e:  # the group failed mid-stream: say so in the stream, then end it
            status = str(e.status)
            yield f"data: {json.dumps(e.body())}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status = "499"  # client went away
            raise
        finally:
            gen.close()
            state.metrics.requests.labels(path, status).inc()

    headers = {"Cache-Control": "no-cache", "X-Safeserve-Group": str(gen.supervisor.group)}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


def _usage_chunk_only(req: P.CompletionRequest | P.ChatCompletionRequest) -> bool:
    """With `stream_options.include_usage` the usage goes in one extra chunk of no choices at
    the end (OpenAI's contract: clients that add up the usage of every chunk count it once);
    without it, on the final chunk."""
    return bool(req.stream_options and req.stream_options.include_usage)


def _finish_usage(gen: Generation, finish: str | None, usage_chunk: bool) -> dict | None:
    if finish is None or usage_chunk:
        return None
    return P.usage(gen.num_prompt_tokens, gen.num_output_tokens)


async def _completion_stream(gen: Generation, req: P.CompletionRequest) -> AsyncIterator[dict]:
    usage_chunk = _usage_chunk_only(req)
    async for delta in gen.deltas():
        ids = delta.token_ids if req.return_token_ids else None
        use = _finish_usage(gen, delta.finish_reason, usage_chunk)
        if delta.text or delta.finish_reason or ids:
            yield P.completion_chunk(gen.rid, gen.model, delta.text, delta.finish_reason, use, ids)
    if usage_chunk:
        use = P.usage(gen.num_prompt_tokens, gen.num_output_tokens)
        yield P.completion_chunk(gen.rid, gen.model, "", None, use, empty=True)


async def _chat_stream(gen: Generation, req: P.ChatCompletionRequest) -> AsyncIterator[dict]:
    usage_chunk = _usage_chunk_only(req)
    yield P.chat_chunk(gen.rid, gen.model, {"role": "assistant", "content": ""}, None)
    async for delta in gen.deltas():
        ids = delta.token_ids if req.return_token_ids else None
        use = _finish_usage(gen, delta.finish_reason, usage_chunk)
        if delta.text or delta.finish_reason or ids:
            d = {"content": delta.text} if delta.text else {}
            yield P.chat_chunk(gen.rid, gen.model, d, delta.finish_reason, use, ids)
    if usage_chunk:
        use = P.usage(gen.num_prompt_tokens, gen.num_output_tokens)
        yield P.chat_chunk(gen.rid, gen.model, {}, None, use, empty=True)


async def _collect(
    request: Request, state: ServerState, gen: Generation, chat: bool, return_ids: bool
) -> Response:
    """Non-streaming: gather every delta, while watching for the client going away."""
    text: list[str] = []
    ids: list[int] = []
    finish: str | None = None

    async def gather() -> None:
        nonlocal finish
        async for delta in gen.deltas():
            text.append(delta.text)
            ids.extend(delta.token_ids)
            finish = delta.finish_reason or finish

    async def disconnected() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    work = asyncio.create_task(gather())
    watch = asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            state.metrics.requests.labels(request.url.path, "499").inc()
            return Response(status_code=499)
        work.result()  # re-raises APIError (e.g. the group failed)
    finally:
        watch.cancel()
        gen.close()
    use = P.usage(gen.num_prompt_tokens, gen.num_output_tokens)
    token_ids = ids if return_ids else None
    build = P.chat_response if chat else P.completion_response
    state.metrics.requests.labels(request.url.path, "200").inc()
    return JSONResponse(
        build(gen.rid, gen.model, "".join(text), finish, use, token_ids),
        headers={"X-Safeserve-Group": str(gen.supervisor.group)},  # the group that finished it
    )
