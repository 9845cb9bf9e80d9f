"""From a validated request to a started generation: the prompt's token ids, the limits of the
context and the vocabulary, the engine's sampling parameters, and what the answer carries
(`AnswerShape`). Everything here answers 400 (or 503 when no group is ready) before anything is
queued."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from safeserve.messages import SamplingParams
from safeserve.server import protocol as P
from safeserve.server.errors import bad_request, unavailable
from safeserve.server.generate import Generation
from safeserve.server.responses import AnswerShape
from safeserve.server.router import NoGroupReady
from safeserve.server.state import ServerState


def max_model_len(state: ServerState) -> int:
    for g in state.groups:
        if g.ready_info is not None:
            return g.ready_info.max_model_len
    return state.args.max_model_len or state.model_config.max_position_embeddings


def completion_prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(
                "batched prompts are not supported; send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        _check_vocab(state, ids, "prompt")
    if not ids:
        raise bad_request("prompt is empty", "prompt")
    return ids


def chat_prompt_ids(state: ServerState, req: P.ChatCompletionRequest) -> list[int]:
    from safeserve.model.tokenizer import TokenizerError

    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = state.tokenizer.apply_chat_template(messages)
    except TokenizerError as e:
        raise bad_request(str(e), "messages") from e
    return state.tokenizer.encode(text, add_special_tokens=False)


def _check_vocab(state: ServerState, ids: list[int], param: str) -> None:
    vocab = state.model_config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"{param}: token ids must be in [0, {vocab})", param)


def completion_shape(
    state: ServerState, req: P.CompletionRequest, prompt_ids: list[int]
) -> AnswerShape:
    echo_text = None
    if req.echo:
        prompt = req.prompt[0] if isinstance(req.prompt, list) and req.prompt else req.prompt
        echo_text = prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt_ids)
    return AnswerShape(
        chat=False,
        return_ids=req.return_token_ids,
        top_logprobs=req.logprobs,
        usage_chunk=bool(req.stream_options and req.stream_options.include_usage),
        echo_text=echo_text,
        echo_ids=prompt_ids if req.echo else [],
        drop_output=req.max_tokens == 0,
    )


def chat_shape(req: P.ChatCompletionRequest) -> AnswerShape:
    return AnswerShape(
        chat=True,
        return_ids=req.return_token_ids,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        usage_chunk=bool(req.stream_options and req.stream_options.include_usage),
    )


def _seed(state: ServerState, seed: int | None) -> int | None:
    """The request's seed; with --enable-deterministic-inference one for a request that gave
    none (drawn here, so a migrated continuation samples as the first group would have)."""
    if seed is None and state.args.enable_deterministic_inference:
        return secrets.randbits(63)
    return seed


def start(
    state: ServerState,
    prefix: str,
    prompt_ids: list[int],
    req: P.CompletionRequest | P.ChatCompletionRequest,
    max_tokens: int | None,
    shape: AnswerShape,
    default_to_remaining: bool,
) -> Generation:
    if req.safeserve_fault is not None and not state.args.enable_fault_injection:
        raise bad_request(
            "safeserve_fault needs a server started with --enable-fault-injection",
            "safeserve_fault",
        )
    _check_vocab(state, list(req.stop_token_ids or []), "stop_token_ids")
    gen = state.generator
    if gen is None or state.router is None:
        raise unavailable("no group is ready to serve; retry later")
    max_len = max_model_len(state)
    remaining = max_len - len(prompt_ids)
    if remaining < 1:
        raise bad_request(
            f"prompt has {len(prompt_ids)} tokens; the context length is {max_len}", "prompt"
        )
    if max_tokens is None:
        max_tokens = remaining if default_to_remaining else min(16, remaining)
    if max_tokens == 0:  # echo only (scoring the prompt): one token is generated and dropped
        max_tokens = 1
    if len(prompt_ids) + max_tokens > max_len:
        raise bad_request(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context "
            f"length {max_len}",
            "max_tokens",
        )
    top_k = 0 if req.top_k in (-1, 0) else req.top_k
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=top_k,
        seed=_seed(state, req.seed),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=shape.top_logprobs,
        prompt_logprobs=shape.top_logprobs if shape.echo_ids else None,
        fault=req.safeserve_fault,
    )
    try:  # a quarantined request is refused (422) first, even while no group is READY
        return gen.start(prefix + uuid.uuid4().hex, prompt_ids, params, req.stop_strings())
    except NoGroupReady as e:
        raise unavailable("no group is ready to serve; retry later") from e
