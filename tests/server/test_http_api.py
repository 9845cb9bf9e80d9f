"""A real server process, a real client (`openai`), a checkpoint written by `transformers`
(the server: tests/server/conftest.py): what answers carry, against transformers' own."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serving import API_KEY as KEY
from serving import API_MODEL as MODEL
from serving import (
    CHAT_MESSAGES,
    Server,
    assert_greedy_chat,
    chat_prompt_ids,
    concurrent_completions,
    hf_greedy,
)
from serving import api_client as _client
from serving import metric as _metric
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    return AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(ckpt)


PROMPTS = [
    "The quick",
    "Experts route tokens; the router picks the top k experts for every token in the batch.",
    "A paged key value cache stores attention keys in fixed size blocks, and mixture of experts models "
    "serve many requests at once on many GPUs.",
    "Héllo wörld 🙂",
]


def test_concurrent_greedy_completions_equal_transformers(server: Server, hf) -> None:
    _, tok = hf
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert max(len(p) for p in prompt_ids) > 8  # longer than --chunked-prefill-size
    results = concurrent_completions(server, MODEL, PROMPTS, 32)
    for ids, res in zip(prompt_ids, results, strict=True):
        ref = hf_greedy(*hf, ids, 32)
        choice = res.choices[0]
        assert choice.model_extra["token_ids"] == ref
        assert choice.text == tok.decode(ref, skip_special_tokens=True)
        assert res.usage.prompt_tokens == len(ids)
        assert choice.finish_reason == ("length" if len(ref) == 32 else "stop")


def test_token_id_prompt_and_chat_template(server: Server, hf) -> None:
    _, tok = hf
    client = _client(server)
    ids = [5, 77, 130, 2, 9]
    res = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
    )
    assert res.choices[0].model_extra["token_ids"] == hf_greedy(*hf, ids, 16)
    ref = hf_greedy(*hf, chat_prompt_ids(tok, CHAT_MESSAGES), 20)
    assert_greedy_chat(server, MODEL, tok, CHAT_MESSAGES, 20, ref)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_concatenation_equals_non_streamed(server: Server, endpoint: str) -> None:
    client = _client(server)
    kw = dict(model=MODEL, max_tokens=40, temperature=0.0)
    if endpoint == "completions":
        full = client.completions.create(prompt="Mixture of experts", **kw)
        stream = client.completions.create(
            prompt="Mixture of experts", stream=True, stream_options={"include_usage": True}, **kw
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        full_text = full.choices[0].text
    else:
        msgs = [{"role": "user", "content": "Mixture of experts"}]
        full = client.chat.completions.create(messages=msgs, **kw)
        stream = client.chat.completions.create(
            messages=msgs, stream=True, stream_options={"include_usage": True}, **kw
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        full_text = full.choices[0].message.content
    assert len([c for c in chunks if c.choices]) > 2  # it really streamed
    assert text == full_text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    # include_usage: the usage is in the last chunk only (no choices), so a client that adds up
    # every chunk's usage (as LangChain's chunks do) counts the tokens once
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # without it, the usage rides on the final (finishing) chunk, once
    if endpoint == "completions":
        plain = list(client.completions.create(prompt="Mixture of experts", stream=True, **kw))
    else:
        plain = list(client.chat.completions.create(messages=msgs, stream=True, **kw))
    with_usage = [c for c in plain if c.usage is not None]
    assert with_usage == [plain[-1]] and plain[-1].choices[0].finish_reason
    assert plain[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done_and_stop_string_cuts_text(server: Server) -> None:
    client = _client(server)
    base = client.completions.create(
        model=MODEL,
        prompt="The quick brown",
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    assert len(text) > 6
    stop = text[3:6]
    first = text.index(stop)
    cut = client.completions.create(
        model=MODEL,
        prompt="The quick brown",
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[:first]
    assert cut.choices[0].finish_reason == "stop"
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": MODEL,
            "prompt": "The quick brown",
            "max_tokens": 30,
            "temperature": 0,
            "stop": [stop],
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    streamed = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert streamed == text[:first]


def test_a_stop_string_that_the_last_allowed_token_completes_finishes_as_stop(
    server: Server,
) -> None:
    """max_tokens k, and a stop string that first occurs ending with the k-th token's text: the
    text is cut before it and the finish reason is "stop" (not "length"), streamed or not."""
    client = _client(server)
    kw = dict(model=MODEL, prompt="A last stop", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=24, **kw).choices[0].text
    picked = None
    for k in range(4, 20):
        head = client.completions.create(max_tokens=k, **kw).choices[0].text
        if not head or not full.startswith(head) or "\ufffd" in head:
            continue  # only a prefix that later tokens do not change
        ends = [head[-c:] for c in range(1, len(head) + 1)]
        stop = next((e for e in ends if head.find(e) == len(head) - len(e)), None)
        if stop is not None and len(head) > len(
            client.completions.create(max_tokens=k - 1, **kw).choices[0].text
        ):
            picked = (k, head, stop)
            break
    assert picked is not None, full
    k, head, stop = picked
    cut = client.completions.create(max_tokens=k, stop=[stop], **kw).choices[0]
    assert (cut.text, cut.finish_reason) == (head[: -len(stop)], "stop")
    chunks = list(client.completions.create(max_tokens=k, stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == head[: -len(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_metrics_exposed(server: Server) -> None:
    _client(server).completions.create(model=MODEL, prompt="count me", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "safeserve:requests_total",
        "safeserve:time_to_first_token_seconds_count",
        "safeserve:time_per_output_token_seconds_count",
        "safeserve:num_requests_running",
        "safeserve:num_requests_waiting",
        "safeserve:kv_blocks_used",
        "safeserve:kv_blocks_total",
        "safeserve:rank_heartbeat_age_seconds",
    ):
        assert name in text, name
    assert re.search(
        r'safeserve:requests_total\{endpoint="/v1/completions",status="200"\} [1-9]', text
    )
    assert _metric(server, "safeserve:kv_blocks_total") > 0
    assert _metric(server, "safeserve:rank_heartbeat_age_seconds") < 5


def test_every_answer_names_its_group_streamed_or_not(server: Server) -> None:
    """`X-Safeserve-Group` on completions and chat, streamed and not (one group here: 0), and
    each placement counted in router_picks_total."""
    picks = 'safeserve:router_picks_total{group="0",reason="new"}'
    before = _metric(server, picks)
    client = _client(server)
    kw = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    raw = client.completions.with_raw_response.create(prompt="which group", **kw)
    assert raw.headers["x-safeserve-group"] == "0" and raw.parse().choices[0].text is not None
    raw = client.chat.completions.with_raw_response.create(messages=CHAT_MESSAGES, **kw)
    assert raw.headers["x-safeserve-group"] == "0"
    with client.completions.with_streaming_response.create(
        prompt="which group", stream=True, **kw
    ) as r:
        assert r.headers["x-safeserve-group"] == "0"
        assert sum(1 for line in r.iter_lines() if line.startswith("data: ")) >= 2
    with client.chat.completions.with_streaming_response.create(
        messages=CHAT_MESSAGES, stream=True, **kw
    ) as r:
        assert r.headers["x-safeserve-group"] == "0"
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    assert _metric(server, picks) == before + 4
    assert _metric(server, "safeserve:router_picks_total") == _metric(server, picks)


def test_disconnect_mid_stream_frees_kv_blocks(server: Server) -> None:
    deadline = time.monotonic() + 10
    while _metric(server, "safeserve:kv_blocks_used") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    baseline = _metric(server, "safeserve:kv_blocks_used")
    assert baseline == 0
    body = {
        "model": MODEL,
        "prompt": "a long answer please",
        "max_tokens": 1900,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as c,
        c.stream(
            "POST",
            server.url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r,
    ):
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 20:
                break
        assert _metric(server, "safeserve:kv_blocks_used") > baseline
    # The response is closed: the engine must drop the request and return its blocks, long
    # before 1,900 tokens could have been generated.
    closed = time.monotonic()
    while _metric(server, "safeserve:kv_blocks_used") != baseline:
        assert time.monotonic() - closed < 3.0, "KV blocks not returned after the disconnect"
        time.sleep(0.05)
    gen_before = _metric(server, "safeserve:generation_tokens_total")
    time.sleep(0.5)
    assert _metric(server, "safeserve:generation_tokens_total") == gen_before


def test_openapi_docs_and_model_retrieve(server: Server) -> None:
    """/openapi.json documents every /v1 endpoint with its request body and its answers (the
    same models as the answers: test_edge_fuzz.py checks real ones against it); /docs serves
    Swagger UI; the openai client retrieves the model, and an unknown one is a 404."""
    spec = httpx.get(server.url + "/openapi.json").json()
    paths = spec["paths"]
    assert {p for p in paths if p.startswith("/v1/")} == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model_id}",
    }
    comp = paths["/v1/completions"]["post"]
    body = comp["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    ok = comp["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/Completion"}
    assert "text/event-stream" in ok
    for status in ("400", "401", "404", "413", "415", "503"):
        err = comp["responses"][status]["content"]["application/json"]["schema"]
        assert err == {"$ref": "#/components/schemas/ErrorResponse"}
    schemas = spec["components"]["schemas"]
    for name in ("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "ModelList"):
        assert name in schemas
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
    assert "logprobs" in schemas["CompletionRequest"]["properties"]
    docs = httpx.get(server.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    client = _client(server)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def _greedy_logprobs(hf, ids: list[int]) -> torch.Tensor:
    model, _ = hf
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_echo_and_logprobs_as_lm_eval_sends_them(server: Server, hf) -> None:
    """lm-eval's `local-completions` log-likelihood request (token-id prompts, max_tokens 1,
    logprobs 1, echo, temperature 0, a seed): the choice carries the prompt's tokens first
    (the first one's logprob null), then the generated one, and every top_logprobs dict holds
    the token's own logprob, which is the dict's largest exactly where the token is greedy."""
    _, tok = hf
    ids = tok("The quick brown fox jumps")["input_ids"]
    body = {"model": MODEL, "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True}
    body |= {"temperature": 0, "seed": 1234}
    r = httpx.post(
        server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    n = len(ids) + 1
    assert [len(lp[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [
        n
    ] * 4
    prompt_text = tok.decode(ids)
    assert choice["text"].startswith(prompt_text)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # max_tokens 0 with echo: scoring only, no token shown
    r0 = httpx.post(
        server.url + "/v1/completions",
        json=body | {"max_tokens": 0},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r0.status_code == 200, r0.text
    assert r0.json()["choices"][0]["text"] == prompt_text
    assert r0.json()["usage"]["completion_tokens"] == 0
    assert len(r0.json()["choices"][0]["logprobs"]["tokens"]) == len(ids)
    if all(v is None for v in lp["token_logprobs"]):
        pytest.skip("the engine returns no logprobs yet (the shape above is checked)")
    ref = _greedy_logprobs(hf, ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-3)
        top = lp["top_logprobs"][i]
        assert lp["token_logprobs"][i] in top.values()
        greedy = int(ref[i - 1].argmax()) == ids[i]
        assert (lp["token_logprobs"][i] == max(top.values())) == greedy


def test_chat_logprobs_stream_and_not(server: Server) -> None:
    """Chat `logprobs` / `top_logprobs`: one entry per generated token, streamed per delta
    too; a greedy token's logprob is the largest of its top_logprobs."""
    client = _client(server)
    msgs = [{"role": "user", "content": "Route the tokens."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True)
    full = client.chat.completions.create(top_logprobs=3, **kw)
    content = full.choices[0].logprobs.content
    chunks = list(client.chat.completions.create(top_logprobs=3, stream=True, **kw))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    if not content:
        pytest.skip("the engine returns no logprobs yet")
    assert len(content) == full.usage.completion_tokens
    assert [e.token for e in streamed] == [e.token for e in content]
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert e.bytes is not None  # the token's bytes, valid UTF-8 or not
