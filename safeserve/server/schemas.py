"""The answers of the OpenAI API as pydantic models: what `/openapi.json` documents for every
200 and every error. The builders in protocol.py and responses.py write these shapes as plain
dicts (no model on the hot path); tests/server/test_edge_fuzz.py checks real answers against
the served schema."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """One entry per token (with `echo`, the prompt's first; the very first one null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    logits_digests: list[str | None] | None = Field(
        default=None,
        description="--enable-deterministic-inference on CUDA: a hash of each position's whole "
        "logits row (equal digests: equal logits, to the bit)",
    )


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, description="with return_token_ids")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (`data: {...}`, then `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]
    logits_digest: str | None = Field(
        default=None,
        description="--enable-deterministic-inference on CUDA: a hash of the position's whole "
        "logits row (equal digests: equal logits, to the bit)",
    )


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, description="with return_token_ids")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]
