"""DeepSeek-V3 served over HTTP (`--dtype float32`), token for token against transformers'
`generate`: concurrent greedy completions, streamed against non-streamed, and a chat completion
against `generate` on the chat-templated prompt.

Over HTTP in two representative layouts (a server start is the expensive part): tensor-parallel
attention with the all-to-all dispatch (`tp2-ep2-alltoall`) and attention data-parallel with
the experts split by width (`tp2-ep1-none-dp`). Every layout of LAYOUTS is checked at the engine
level, logits against transformers (tests/engine/test_deepseek_v3_layouts.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint
from layouts import layout_args
from serving import (
    CHAT_MESSAGES,
    LAYOUT_PROMPTS,
    Server,
    api_client,
    assert_greedy_chat,
    chat_prompt_ids,
    concurrent_completions,
    hf_greedy,
    start_server,
    stop_server,
    stream_completion,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

HTTP_LAYOUTS = ["tp2-ep2-alltoall", "tp2-ep1-none-dp"]
MODEL = "tiny"  # the served name (`stream_completion` asks for it)
PROMPTS = LAYOUT_PROMPTS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3-http"), seed=2)


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(ckpt), {}


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids`, cut before the EOS (cached per prompt)."""
    model, tok, cache = hf
    key = (tuple(ids), n)
    if key not in cache:
        cache[key] = hf_greedy(model, tok, ids, n)
    return cache[key]


@pytest.fixture(scope="module", params=HTTP_LAYOUTS)
def server(request, ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / f"{request.param}.log"
    args = ["--model", str(ckpt), "--served-model-name", MODEL, "--dtype", "float32"]
    s = start_server([*args, "--chunked-prefill-size", "8", *layout_args(request.param)], log)
    yield s
    stop_server(s.proc)


def test_concurrent_greedy_completions_equal_generate(server: Server, hf) -> None:
    _, tok, _ = hf
    assert max(len(tok(p)["input_ids"]) for p in PROMPTS) > 8  # chunked prefill
    results = concurrent_completions(server, MODEL, PROMPTS, 20)
    for p, res in zip(PROMPTS, results, strict=True):
        assert res.choices[0].model_extra["token_ids"] == _greedy(hf, tok(p)["input_ids"], 20), p


def test_streaming_equals_non_streaming(server: Server, hf) -> None:
    _, tok, _ = hf
    ids = tok(PROMPTS[1])["input_ids"]
    client = api_client(server)
    full = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
    )
    streamed, error = stream_completion(server, ids, 16, ignore_eos=False)
    assert error is None
    assert streamed == full.choices[0].model_extra["token_ids"] == _greedy(hf, ids, 16)
    msgs = [{"role": "user", "content": "Mixture of experts"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=16, temperature=0.0)
    text = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert len(chunks) > 2  # it really streamed
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_chat_completion_equals_generate_on_the_chat_template(server: Server, hf) -> None:
    _, tok, _ = hf
    ref = _greedy(hf, chat_prompt_ids(tok, CHAT_MESSAGES), 20)
    assert_greedy_chat(server, MODEL, tok, CHAT_MESSAGES, 20, ref)
