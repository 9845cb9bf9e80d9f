"""Mixtral and Qwen2-MoE served over HTTP (a real server, the `openai` client) against
transformers' `generate`, in float32: greedy completions token for token, streaming equal to
non-streaming, chat completions on the chat-templated prompt. Three layouts per family (below);
every layout's logits are checked at the engine level (tests/engine/test_families_layouts.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
import torch
from checkpoints_families import write_mixtral_checkpoint, write_qwen2_moe_checkpoint
from layouts import layout_args
from serving import Server, start_server, stop_server
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
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Route the tokens."},
]
MAX_TOKENS = 24


def _greedy(model, eos: int, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    out = gen[0, len(ids) :].tolist()
    return out[: out.index(eos)] if eos in out else out


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
        eos = tok.convert_tokens_to_ids("<|im_end|>")

        chat_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
        if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids"):
            chat_ids = chat_ids["input_ids"]
        chat_ids = list(chat_ids)
        prompts = [_greedy(model, eos, tok(p)["input_ids"]) for p in PROMPTS]
        out[family] = (ckpt, tok, prompts, chat_ids, _greedy(model, eos, chat_ids))
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


def _client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def test_concurrent_greedy_completions_equal_generate(served) -> None:
    s, (family, tok, refs, _, _) = served
    assert max(len(tok(p)["input_ids"]) for p in PROMPTS) > 8  # a chunked prefill
    client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)

    async def run():
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=family,
                    prompt=p,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    extra_body={"return_token_ids": True},
                )
                for p in PROMPTS
            )
        )

    for p, ref, res in zip(PROMPTS, refs, asyncio.run(run()), strict=True):
        choice = res.choices[0]
        assert choice.model_extra["token_ids"] == ref, p
        assert choice.text == tok.decode(ref, skip_special_tokens=True)
        assert choice.finish_reason == ("length" if len(ref) == MAX_TOKENS else "stop")


def test_streaming_equals_non_streaming(served) -> None:
    s, (family, _, refs, _, _) = served
    client = _client(s)
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
    s, (family, tok, _, chat_ids, ref) = served
    chat = _client(s).chat.completions.create(
        model=family,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.choices[0].model_extra["token_ids"] == ref
    assert chat.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
