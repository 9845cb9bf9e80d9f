"""Mixtral and Qwen2-MoE served over HTTP (a real server, the `openai` client) against
transformers' `generate`, in float32: greedy completions token for token, streaming equal to
non-streaming, chat completions on the chat-templated prompt. Three layouts per family (below);
every layout's logits are checked at the engine level (tests/engine/test_families_layouts.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from checkpoints_families import write_mixtral_checkpoint, write_qwen2_moe_checkpoint
from layouts import layout_args
from serving import (
    CHAT_MESSAGES,
    Server,
    api_client,
    assert_greedy_chat,
    chat_prompt_ids,
    concurrent_completions,
    hf_greedy,
    start_server,
    stop_server,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

WRITERS = {"mixtral": write_mixtral_checkpoint, "qwen2_moe": write_qwen2_moe_checkpoint}
# Per family: tensor-parallel attention with the alltoall backend, data-parallel attention,
# and a four-rank group (Mixtral's with data-parallel attention; Qwen2-MoE's with more ranks
# than KV heads, its shared expert split four ways).
SERVERS = [
    ("mixtral", "tp2-ep2-alltoall"),
    ("mixtral", "tp2-ep1-none-dp"),
    ("mixtral", "tp4-ep4-alltoall-dp"),
    ("qwen2_moe", "tp2-ep2-alltoall"),
    ("qwen2_moe", "tp2-ep1-none-dp"),
    ("qwen2_moe", "tp4-ep4-none"),
]
PROMPTS = [
    "The quick brown fox",
    "Experts route tokens; the router picks the top k experts for every token.",
    "A paged key value cache stores attention keys",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """By family: (checkpoint, tokenizer, greedy continuation of each prompt (token ids, cut at
    EOS), the chat prompt's ids and its greedy continuation), from transformers' `generate`."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: OpenMP barriers cost more than they split
    for family, write in WRITERS.items():
        ckpt = write(tmp_path_factory.mktemp(f"http-{family}"), seed=6)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(ckpt)
        chat_ids = chat_prompt_ids(tok, CHAT_MESSAGES)
        prompts = [hf_greedy(model, tok, tok(p)["input_ids"], MAX_TOKENS) for p in PROMPTS]
        out[family] = (ckpt, tok, prompts, chat_ids, hf_greedy(model, tok, chat_ids, MAX_TOKENS))
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module", params=SERVERS, ids=["-".join(s) for s in SERVERS])
def served(
    request: pytest.FixtureRequest, references: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, tuple]]:
    family, layout = request.param
    ckpt = references[family][0]
    args = ["--model", str(ckpt), "--served-model-name", family, "--dtype", "float32"]
    args += ["--chunked-prefill-size", "8", *layout_args(layout)]
    s = start_server(args, tmp_path_factory.mktemp("log") / f"{family}-{layout}.log")
    yield s, (family, *references[family][1:])
    stop_server(s.proc)


def test_concurrent_greedy_completions_equal_generate(served) -> None:
    s, (family, tok, refs, _, _) = served
    assert max(len(tok(p)["input_ids"]) for p in PROMPTS) > 8  # a chunked prefill
    results = concurrent_completions(s, family, PROMPTS, MAX_TOKENS)
    for p, ref, res in zip(PROMPTS, refs, results, strict=True):
        choice = res.choices[0]
        assert choice.model_extra["token_ids"] == ref, p
        assert choice.text == tok.decode(ref, skip_special_tokens=True)
        assert choice.finish_reason == ("length" if len(ref) == MAX_TOKENS else "stop")


def test_streaming_equals_non_streaming(served) -> None:
    s, (family, _, refs, _, _) = served
    client = api_client(s)
    kw = dict(model=family, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0)
    full = client.completions.create(**kw, extra_body={"return_token_ids": True})
    chunks = [
        c
        for c in client.completions.create(**kw, stream=True, extra_body={"return_token_ids": True})
        if c.choices
    ]
    assert len(chunks) > 2  # it really streamed
    ids = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []]
    assert ids == full.choices[0].model_extra["token_ids"] == refs[1]
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_chat_completion_equals_generate_on_the_chat_template(served) -> None:
    s, (family, tok, _, _, ref) = served
    assert_greedy_chat(s, family, tok, CHAT_MESSAGES, MAX_TOKENS, ref)
