"""Generated requests against one live server (tiny, two groups): `hypothesis` sends sampling
parameters and prompts at their extremes (floats from 1e-300 to inf and NaN, huge and negative
ints, empty and huge lists, lone surrogates, control characters, emoji) and `schemathesis` sends
what the served /openapi.json allows (and what it does not). No answer is a 5xx, every answer
is a completion of the documented shape or a 4xx in the OpenAI error shape, and at the end no
group has failed and both are READY."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving import Server, metric, start_server, stop_server

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 64  # keeps every generation short: the point is the edge, not the tokens
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples in every CI run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
OPENAPI = settings(FUZZ, max_examples=12)  # per operation and mode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    s = start_server(
        ["--model", "tiny", "--num-groups", "2", "--max-model-len", str(MAX_MODEL_LEN)], log
    )
    yield s
    stop_server(s.proc)


FLOATS = st.one_of(
    st.sampled_from(
        [0, 0.0, -0.0, 1e-300, -1e-300, 5e-324, 1e-6, 1e-5, 0.5, 1, 2.0, 2.0000001, -1.0]
        + [1e300, float("inf"), float("-inf"), float("nan")]
    ),
    st.floats(allow_nan=True, allow_infinity=True),
)
INTS = st.one_of(
    st.sampled_from([-(2**63), -1, 0, 1, 2, 5, 20, 21, 258, 259, 2**31, 2**63, 10**30]),
    st.integers(-3, 40),
)
PIECES = st.one_of(
    st.characters(),  # any code point but surrogates
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),  # lone surrogates
    st.sampled_from(["\x00", "\x1b", "\u2028", "\ufeff", "\ufffd", "🙂", "👩‍👩‍👧", "<|im_end|>"]),
)
TEXT = st.lists(PIECES, max_size=16).map("".join)
IDS = st.one_of(
    st.lists(st.integers(0, 258), max_size=12),
    st.lists(INTS, max_size=4),
    st.just(list(range(200)) * 10),  # past the context
)
COMMON = {
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS,
    "max_tokens": st.one_of(st.integers(0, 8), INTS, st.none()),
    "seed": st.one_of(INTS, st.none()),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=20), st.none()),
    "stop_token_ids": st.one_of(st.lists(INTS, max_size=3), st.none()),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": st.sampled_from([1, 2, 0]),
    "presence_penalty": FLOATS,
    "safeserve_fault": st.sampled_from(["raise", "exit", "other"]),
}
COMPLETION = st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": st.one_of(TEXT, IDS, st.lists(TEXT, max_size=2))},
    optional={**COMMON, "logprobs": INTS, "echo": st.booleans()},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "wizard"])},
    optional={
        "content": st.one_of(
            TEXT, st.none(), st.lists(st.builds(dict, type=st.just("text"), text=TEXT), max_size=2)
        )
    },
)
CHAT = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(MESSAGE, max_size=3)},
    optional={**COMMON, "logprobs": st.booleans(), "top_logprobs": INTS},
)


def _check_error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]


def _check_answer(r: httpx.Response, body: dict[str, Any], chat: bool) -> None:
    if r.status_code != 200:
        _check_error(r)
        return
    if not body.get("stream"):
        out = r.json()
        assert out["object"] == ("chat.completion" if chat else "text_completion")
        (choice,) = out["choices"]
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
        assert out["usage"]["total_tokens"] >= out["usage"]["prompt_tokens"] > 0
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", r.text
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), r.text
    assert [c["object"] for c in chunks] == [
        "chat.completion.chunk" if chat else "text_completion"
    ] * len(chunks)


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    # Python's json writes NaN and Infinity, which JSON has not: the server must say 400
    raw = json.dumps(body, ensure_ascii=True).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=60)


@FUZZ
@given(body=COMPLETION)
def test_generated_completions_answer_or_refuse(server: Server, body: dict[str, Any]) -> None:
    _check_answer(_post(server, "/v1/completions", body), body, chat=False)


@FUZZ
@given(body=CHAT)
def test_generated_chats_answer_or_refuse(server: Server, body: dict[str, Any]) -> None:
    _check_answer(_post(server, "/v1/chat/completions", body), body, chat=True)


def test_openapi_operations_conform(server: Server) -> None:
    """schemathesis, through its Python API (its pytest loader does not run on pytest 9): for
    every /v1 operation of the served schema, bodies it allows and bodies it does not; no 5xx,
    every status and body as documented."""
    schemathesis = pytest.importorskip(
        "schemathesis", reason="schemathesis is not installed (test extra)"
    )
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path.startswith("/v1/")]
    assert {op.path for op in operations} == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model_id}",
    }
    for op in operations:
        # a GET of no parameters has nothing to get wrong
        negative = [GenerationMode.NEGATIVE] if op.method.upper() == "POST" else []
        for mode in [GenerationMode.POSITIVE, *negative]:

            @OPENAPI
            @given(case=op.as_strategy(generation_mode=mode))
            def conforms(case) -> None:  # type: ignore[no-untyped-def]
                case.call_and_validate(checks=checks, timeout=60)

            conforms()


def test_no_group_failed_and_both_ready(server: Server) -> None:
    """Last in the module: everything above cost no group. (And the start-up said where it
    listens, once bound.)"""
    assert f"serving on {server.url} (admin API on {server.admin_url})" in server.output()
    assert metric(server, "safeserve:group_failures_total") == 0
    ready = httpx.get(server.url + "/ready").json()
    assert ready["groups_ready"] == 2, ready
    assert _metric_5xx(server) == 0  # /ready's 503s while the groups started do not count


def _metric_5xx(server: Server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('safeserve:requests_total{endpoint="/v1/') and 'status="5' in line
    )
