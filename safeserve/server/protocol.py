"""The OpenAI protocol: request models (validated at the edge) and response builders."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from safeserve.messages import REQUEST_FAULTS
from safeserve.server.edge import decode_json, user_path
from safeserve.server.errors import APIError, bad_request

__all__ = ["decode_json", "parse"]

MAX_STOP_STRINGS = 16
# Most likely tokens a request may ask for with each logprob (OpenAI: 5 for completions, 20
# for chat; both take 20 here).
MAX_TOP_LOGPROBS = 20

# Fields (of either request, OpenAI's and the vLLM/SGLang extensions clients send) that would
# change the answer and that this server cannot honour: refused with 400 when set to anything
# but their neutral value (or null), never ignored. name -> neutral value.
_UNSUPPORTED: dict[str, Any] = {
    "logit_bias": {},
    "suffix": "",
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "min_tokens": 0,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "allowed_token_ids": [],
    "bad_words": [],
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "logits_processors": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "guided_decoding_backend": None,
    "structured_outputs": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
}


_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Extensions (as vLLM and SGLang name them).
    top_k: int = Field(default=0, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    # Fault injection only (--enable-fault-injection): the engine fails this request.
    safeserve_fault: str | None = Field(
        default=None, json_schema_extra={"enum": list(REQUEST_FAULTS)}
    )

    @field_validator("safeserve_fault")
    @classmethod
    def _known_fault(cls, v: str | None) -> str | None:
        if v is not None and v not in REQUEST_FAULTS:
            raise ValueError(f"must be one of {', '.join(REQUEST_FAULTS)}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_unsupported(cls, body: Any) -> Any:
        """A top-level null is the field's default, as OpenAI's API takes it (clients send
        `"temperature": null`); an unsupported field set to anything but its neutral value is
        refused, whatever its type."""
        if not isinstance(body, dict):
            return body
        for name, neutral in _UNSUPPORTED.items():
            v = body.get(name)
            if v is not None and not (v == neutral or (v in ({}, []) and neutral is None)):
                raise bad_request(f"{name}: {name} is not supported", name)
        return {k: v for k, v in body.items() if v is not None and k not in _UNSUPPORTED}

    @field_validator("n")
    @classmethod
    def _only_one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n > 1 is not supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("presence and frequency penalties are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with `echo` (scoring the prompt: lm-eval's loglikelihood requests).
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v > 1:
            raise ValueError("best_of > 1 is not supported")
        return v

    @model_validator(mode="after")
    def _tokens_wanted(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        return self


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _has_content(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("must be a string or a list of text parts, not null")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # No tool-call parser and no constrained decoding: a request that asks for tool calls or a
    # JSON answer is refused rather than answered with plain text. Tools sent with tool_choice
    # "none" (the model must not call them) pass.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (v or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format {kind!r} is not supported (no constrained decoding)")
        return v

    @model_validator(mode="after")
    def _no_tool_calls(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        for tools, choice, name in (
            (self.tools, self.tool_choice, "tools"),
            (self.functions, self.function_call, "functions"),
        ):
            choice_name = "tool_choice" if name == "tools" else "function_call"
            if tools and choice != "none":
                raise bad_request(
                    f"{name}: {name} are not supported (no tool-call parser); send "
                    f'{choice_name} "none" to pass them without calls',
                    name,
                )
            if choice not in (None, "none", "auto"):
                raise bad_request(
                    f"{choice_name}: a forced call is not supported (no tool-call parser)",
                    choice_name,
                )
        return self


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; any problem is one 400 naming the field as the client
    wrote it (`messages[0].content`, never pydantic's `messages.0.content.str`)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = [(_field_of(x, body), _message(x)) for x in e.errors(include_url=False)]
        # The deepest field that failed (of a union, the member that came nearest), and what
        # each member would have needed there.
        param = max((f for f, _ in errors), key=lambda f: len(f or ""))
        msgs = [m for f, m in errors if f == param]
        msg = "; or ".join(dict.fromkeys(msgs))
        raise bad_request(f"{param}: {msg}" if param else msg, param=param) from e


def _message(err: Any) -> str:
    msg = str(err["msg"]).removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def _field_of(err: Any, body: Any) -> str | None:
    """The user-level path of a validation error: the location's parts that name keys and
    indices of the body, without the union members' tags (`str`, `list[int]`, ...)."""
    parts: list[str | int] = []
    node = body
    loc = list(err["loc"])
    for i, p in enumerate(loc):
        if isinstance(node, dict) and isinstance(p, str) and p in node:
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            node = node[p]
        elif err["type"] == "missing" and i == len(loc) - 1:
            parts.append(p)  # a missing field
            break
        else:
            continue  # a union member's tag
        parts.append(p)
    return user_path(parts) or None


def not_found_model(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model {name!r} does not exist; this server serves {served!r}",
        "model_not_found",
        "model",
    )


# -- responses ----------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _body(
    obj: str,
    rid: str,
    model: str,
    key: str,
    content: object,
    finish: str | None,
    use: dict | None,
    token_ids: list[int] | None,
    logprobs: dict | None,
    empty: bool = False,
) -> dict:
    """A completion or chat body, whole or a stream chunk: its one choice carries `content`
    under `key` ("text", "message" or "delta"); no choice when `empty` (a usage-only chunk),
    no "usage" when `use` is None."""
    choice: dict[str, Any] = {
        "index": 0,
        key: content,
        "logprobs": logprobs,
        "finish_reason": finish,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [] if empty else [choice],
    }
    if use is not None:
        body["usage"] = use
    return body


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    use: dict,
    token_ids: list[int] | None,
    logprobs: dict | None = None,
) -> dict:
    return _body("text_completion", rid, model, "text", text, finish, use, token_ids, logprobs)


def completion_chunk(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    use: dict | None = None,
    token_ids: list[int] | None = None,
    empty: bool = False,
    logprobs: dict | None = None,
) -> dict:
    return _body(
        "text_completion", rid, model, "text", text, finish, use, token_ids, logprobs, empty
    )


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    use: dict,
    token_ids: list[int] | None,
    logprobs: dict | None = None,
) -> dict:
    message = {"role": "assistant", "content": text}
    return _body(
        "chat.completion", rid, model, "message", message, finish, use, token_ids, logprobs
    )


def chat_chunk(
    rid: str,
    model: str,
    delta: dict,
    finish: str | None,
    use: dict | None = None,
    token_ids: list[int] | None = None,
    empty: bool = False,
    logprobs: dict | None = None,
) -> dict:
    return _body(
        "chat.completion.chunk", rid, model, "delta", delta, finish, use, token_ids, logprobs, empty
    )
