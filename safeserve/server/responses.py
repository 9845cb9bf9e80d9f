"""A generation as an HTTP response: a server-sent event stream (completion or chat chunks), or,
not streaming, one body gathered while watching for the client going away.

Both carry `X-Safeserve-Group`: a collected answer names the group that finished the request; a
stream waits for its first delta before it sends its headers (nothing, not even the chat role
chunk, goes out before it), so it names the group that produced the first token, where the
request stays unless that group fails (its continuation's group is not in the headers, which are
sent by then). A request that is still waiting may move to another group until that first token.

`AnswerShape` says what a choice carries besides its text: generated token ids, logprobs and,
for completions, the echoed prompt. The final status of a stream (an error event's, 499 when the
client went away) is left in the request's state for the request counter (request_count.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from safeserve.messages import TokenLogprob
from safeserve.server import protocol as P
from safeserve.server.errors import APIError
from safeserve.server.generate import Delta, Generation
from safeserve.server.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    merge_completion_logprobs,
)
from safeserve.server.request_count import set_final_status
from safeserve.server.state import ServerState

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request"


@dataclass
class AnswerShape:
    chat: bool
    return_ids: bool = False
    top_logprobs: int | None = None  # None: no logprobs
    usage_chunk: bool = False  # stream_options.include_usage: usage in one extra chunk
    echo_text: str | None = None  # completions' echo: the prompt text, first
    echo_ids: list[int] = field(default_factory=list)  # ... and with logprobs its tokens' entries
    drop_output: bool = False  # max_tokens 0 with echo: the one generated token is not shown


async def stream_response(
    request: Request, state: ServerState, gen: Generation, shape: AnswerShape
) -> Response:
    source = gen.deltas()
    got = asyncio.ensure_future(anext(source, None))
    try:
        here = await _until_done_or_gone(request, got)
    except asyncio.CancelledError:  # the server is stopping
        got.cancel()
        gen.close()
        raise
    if not here:
        got.cancel()
        await asyncio.wait({got})  # the generator ends with the cancellation
        await source.aclose()
        gen.close()
        return Response(status_code=CLIENT_CLOSED)
    failed = got.exception()
    if isinstance(failed, APIError):  # before anything was sent: a real status, not 200
        await source.aclose()
        gen.close()
        raise failed
    deltas = _replay(got, source)
    chunks = (
        _chat_chunks(deltas, gen, shape, state)
        if shape.chat
        else _completion_chunks(deltas, gen, shape, state)
    )

    async def body() -> AsyncIterator[bytes]:
        status = 200
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()  # ASCII: no line separator can split an event
            yield b"data: [DONE]\n\n"
        except APIError as e:  # the group failed mid-stream: say so in the stream, then end it
            status = e.status
            yield f"data: {json.dumps(e.body())}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status = CLIENT_CLOSED
            raise
        except Exception:  # a bug: end the stream as a failed group's would, not with a reset
            logger.exception("stream of %s failed", gen.rid)
            status = 500
            err = APIError(500, "internal server error", "internal_error")
            yield f"data: {json.dumps(err.body())}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            gen.close()
            set_final_status(request.scope, status)

    headers = {"Cache-Control": "no-cache", "X-Safeserve-Group": str(gen.supervisor.group)}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


async def _until_done_or_gone(request: Request, task: asyncio.Future) -> bool:
    """Waits for `task`; False if the client went away first."""
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            return False
    return True


async def _replay(first: asyncio.Future, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """The first delta (or its exception other than APIError, raised here inside the stream),
    then the rest."""
    delta = first.result()
    if delta is None:
        return
    yield delta
    async for delta in rest:
        yield delta


def _usage(gen: Generation, shape: AnswerShape) -> dict:
    return P.usage(gen.num_prompt_tokens, 0 if shape.drop_output else gen.num_output_tokens)


def _visible(delta: Delta, shape: AnswerShape) -> Delta:
    if shape.drop_output:
        return Delta("", [], "length" if delta.finish_reason else None, None)
    return delta


async def _completion_chunks(
    deltas: AsyncIterator[Delta], gen: Generation, shape: AnswerShape, state: ServerState
) -> AsyncIterator[dict]:
    lp = CompletionLogprobs(state.tokenizer, shape.top_logprobs or 0)
    first = True
    async for raw in deltas:
        delta = _visible(raw, shape)
        if first and shape.echo_text is not None:  # the prompt's logprobs come with the first
            logprobs = _echo_logprobs(lp, gen, shape)
            yield P.completion_chunk(gen.rid, gen.model, shape.echo_text, None, logprobs=logprobs)
        first = False
        ids = delta.token_ids if shape.return_ids else None
        use = _usage(gen, shape) if delta.finish_reason and not shape.usage_chunk else None
        if delta.text or delta.finish_reason or delta.token_ids:
            logprobs = (
                lp.entries(delta.token_ids, delta.logprobs)
                if shape.top_logprobs is not None
                else None
            )
            yield P.completion_chunk(
                gen.rid, gen.model, delta.text, delta.finish_reason, use, ids, logprobs=logprobs
            )
    if shape.usage_chunk:
        yield P.completion_chunk(gen.rid, gen.model, "", None, _usage(gen, shape), empty=True)


async def _chat_chunks(
    deltas: AsyncIterator[Delta], gen: Generation, shape: AnswerShape, state: ServerState
) -> AsyncIterator[dict]:
    yield P.chat_chunk(gen.rid, gen.model, {"role": "assistant", "content": ""}, None)
    async for delta in deltas:
        ids = delta.token_ids if shape.return_ids else None
        use = _usage(gen, shape) if delta.finish_reason and not shape.usage_chunk else None
        if delta.text or delta.finish_reason or delta.token_ids:
            d = {"content": delta.text} if delta.text else {}
            logprobs = None
            if shape.top_logprobs is not None:
                logprobs = chat_logprobs(
                    state.tokenizer, shape.top_logprobs, delta.token_ids, delta.logprobs
                )
            yield P.chat_chunk(
                gen.rid, gen.model, d, delta.finish_reason, use, ids, logprobs=logprobs
            )
    if shape.usage_chunk:
        yield P.chat_chunk(gen.rid, gen.model, {}, None, _usage(gen, shape), empty=True)


def _echo_logprobs(lp: CompletionLogprobs, gen: Generation, shape: AnswerShape) -> dict | None:
    if shape.top_logprobs is None:
        lp.offset += len(shape.echo_text or "")
        return None
    return lp.entries(shape.echo_ids, gen.prompt_logprobs)


async def collect_response(
    request: Request, state: ServerState, gen: Generation, shape: AnswerShape
) -> Response:
    """Non-streaming: gather every delta, while watching for the client going away."""
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    finish: str | None = None

    async def gather() -> None:
        nonlocal finish
        async for raw in gen.deltas():
            delta = _visible(raw, shape)
            text.append(delta.text)
            ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs or [None] * len(delta.token_ids))
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
            return Response(status_code=CLIENT_CLOSED)
        work.result()  # re-raises APIError (e.g. the group failed)
    finally:
        watch.cancel()
        gen.close()
    use = _usage(gen, shape)
    token_ids = ids if shape.return_ids else None
    out = "".join(text)
    if shape.chat:
        lps = None
        if shape.top_logprobs is not None:
            got = [x for x in logprobs if x is not None]
            lps = chat_logprobs(state.tokenizer, shape.top_logprobs, ids[: len(got)], got)
        body = P.chat_response(gen.rid, gen.model, out, finish, use, token_ids, logprobs=lps)
    else:
        lps = None
        if shape.top_logprobs is not None:
            lp = CompletionLogprobs(state.tokenizer, shape.top_logprobs)
            parts = [_echo_logprobs(lp, gen, shape)] if shape.echo_text is not None else []
            parts.append(lp.entries(ids, logprobs))
            lps = merge_completion_logprobs([p for p in parts if p is not None])
        out = (shape.echo_text or "") + out
        body = P.completion_response(gen.rid, gen.model, out, finish, use, token_ids, logprobs=lps)
    return JSONResponse(
        body, headers={"X-Safeserve-Group": str(gen.supervisor.group)}
    )  # the group that finished it
