"""Errors of the HTTP API against a real server process (tests/server/conftest.py): bad input,
what cannot be honoured, keys and sizes, unknown paths; every one in the OpenAI error shape, and
the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import API_KEY as KEY
from serving import API_MODEL as MODEL
from serving import Server
from serving import api_client as _client
from serving import metric as _metric

BAD = [
    ("malformed json", b'{"model": "m", "prompt": ', 400),
    ("not an object", [1, 2, 3], 400),
    ("wrong type", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400),
    ("empty id list", {"model": MODEL, "prompt": []}, 400),
    ("max_tokens 0", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ("too long", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400),
    ("temperature", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400),
    ("top_p", {"model": MODEL, "prompt": "hi", "top_p": 0.0}, 400),
    ("n>1", {"model": MODEL, "prompt": "hi", "n": 2}, 400),
    ("bad token id", {"model": MODEL, "prompt": [1, 10**7]}, 400),
    ("missing prompt", {"model": MODEL}, 400),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, 404),
    # fields that would change the answer and cannot be honoured: refused, not ignored
    ("logit_bias", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 100}}, 400),
    ("best_of", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400),
    ("suffix", {"model": MODEL, "prompt": "hi", "suffix": " end"}, 400),
    ("best_of 0", {"model": MODEL, "prompt": "hi", "best_of": 0}, 400),
    # the extensions clients of other servers send (vLLM, SGLang): refused where not neutral
    ("repetition_penalty", {"model": MODEL, "prompt": "hi", "repetition_penalty": 1.2}, 400),
    ("min_p", {"model": MODEL, "prompt": "hi", "min_p": 0.5}, 400),
    ("min_tokens", {"model": MODEL, "prompt": "hi", "min_tokens": 4}, 400),
    ("guided_json", {"model": MODEL, "prompt": "hi", "guided_json": {"type": "object"}}, 400),
    ("stop_str_in_output", {"model": MODEL, "prompt": "a", "include_stop_str_in_output": 1}, 400),
    ("stream_options", {"model": MODEL, "prompt": "hi", "stream_options": {}}, 400),
    ("null model", {"model": None, "prompt": "hi"}, 400),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_and_server_keeps_serving(
    server: Server, name: str, body, status: int
) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=content, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"]
    ok = _client(server).completions.create(
        model=MODEL, prompt="still here", max_tokens=2, temperature=0
    )
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_chat_bad_inputs(server: Server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    user = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for body, says in (
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"model": MODEL, "messages": user, "max_completion_tokens": -1}, "max_completion"),
        # tool calls and constrained answers: no parser, no constrained decoding
        ({"model": MODEL, "messages": user, "tools": [tool]}, "tools are not supported"),
        ({"model": MODEL, "messages": user, "tools": [tool], "tool_choice": "required"}, "tools"),
        ({"model": MODEL, "messages": user, "tool_choice": {"type": "function"}}, "forced"),
        ({"model": MODEL, "messages": user, "functions": [tool["function"]]}, "functions"),
        ({"model": MODEL, "messages": user, "response_format": {"type": "json_object"}}, "json"),
        ({"model": MODEL, "messages": user, "top_logprobs": 2}, "logprobs"),
        ({"model": MODEL, "messages": user, "logit_bias": {"7": -100}}, "logit_bias"),
        ({"model": MODEL, "messages": user, "repetition_penalty": 0.5}, "repetition_penalty"),
    ):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 400, (body, r.text)
        assert says in r.json()["error"]["message"], r.text
        if says.split()[0] in body:  # the error names the field the client sent
            assert r.json()["error"]["param"] == says.split()[0], r.text
    # their neutral values pass: tools the model must not call, a text answer, no bias
    for extra in (
        {"tools": [tool], "tool_choice": "none"},
        {"response_format": {"type": "text"}, "logit_bias": {}, "tool_choice": "auto"},
        {"repetition_penalty": 1, "min_p": 0.0, "min_tokens": 0, "guided_json": None},
    ):
        body = {"model": MODEL, "messages": user, "max_tokens": 2, **extra}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, (extra, r.text)


def test_null_is_the_default_as_openai_takes_it(server: Server) -> None:
    """Fields sent as null (wrapper libraries pass None through) get their defaults: the same
    greedy answer as without them, on both endpoints."""
    client = _client(server)
    nulls = dict(top_p=None, n=None, presence_penalty=None, frequency_penalty=None, seed=None)
    plain = client.completions.create(model=MODEL, prompt="Null", max_tokens=6, temperature=0)
    with_nulls = client.completions.create(
        model=MODEL,
        prompt="Null",
        max_tokens=6,
        temperature=0,
        stream=None,
        echo=None,
        logprobs=None,
        extra_body={"top_k": None, "ignore_eos": None, "return_token_ids": None},
        **nulls,
    )
    assert with_nulls.choices[0].text == plain.choices[0].text
    assert with_nulls.usage == plain.usage
    user = [{"role": "user", "content": "Null"}]
    chat = client.chat.completions.create(model=MODEL, messages=user, max_tokens=6, temperature=0)
    chat_nulls = client.chat.completions.create(
        model=MODEL, messages=user, max_tokens=6, temperature=None, logprobs=None, **nulls
    )
    # temperature null is 1.0 (sampled): compare the greedy ones only by shape
    assert chat_nulls.choices[0].finish_reason in ("length", "stop")
    chat_greedy_nulls = client.chat.completions.create(
        model=MODEL, messages=user, max_tokens=6, temperature=0, logprobs=None, **nulls
    )
    assert chat_greedy_nulls.choices[0].message.content == chat.choices[0].message.content


def test_auth_and_body_size(server: Server) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
    r = httpx.post(
        server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    big = {"model": MODEL, "prompt": "x" * 100_000}
    r = httpx.post(
        server.url + "/v1/completions", json=big, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 413
    # Health, readiness and metrics need no key.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    # A load balancer's HEAD probe: the same status, no body.
    for path in ("/health", "/ready"):
        r = httpx.head(server.url + path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
    assert [m.id for m in _client(server).models.list()] == [MODEL]


def test_unknown_paths_and_methods_answer_in_the_error_shape(server: Server) -> None:
    """A path nobody serves (404), a method an endpoint does not take (405, with Allow) and a
    mistyped admin path parameter (400) answer as every other error does; the metric counts
    them under one label, not under paths that clients choose."""
    headers = {"Authorization": f"Bearer {KEY}"}
    before = _metric(server, 'safeserve:requests_total{endpoint="unmatched",status="404"}')
    for i in range(3):
        r = httpx.get(server.url + f"/v1/nothing-{i}", headers=headers)
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": f"no such endpoint: GET /v1/nothing-{i}",
            "type": "not_found_error",
            "param": None,
            "code": "not_found",
        }
    r = httpx.get(server.url + "/v1/completions", headers=headers)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    text = httpx.get(server.url + "/metrics").text
    assert "nothing-" not in text
    after = _metric(server, 'safeserve:requests_total{endpoint="unmatched",status="404"}')
    assert after - before == 3
    r = httpx.post(server.admin_url + "/admin/groups/abc/drain")
    assert r.status_code == 400 and r.json()["error"]["param"] == "group_id", r.text
    r = httpx.get(server.admin_url + "/admin/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_an_admin_dry_run_never_acts(server: Server) -> None:
    """Every spelling of yes is a dry run (nothing changes), a value that is neither yes nor no
    is a 400, and only an explicit no acts."""
    admin = server.admin_url + "/admin"

    def state() -> str:
        return httpx.get(admin + "/groups").json()["groups"][0]["state"]

    assert state() == "READY"
    for value in ("?dry_run", "?dry_run=", "?dry_run=1", "?dry_run=True", "?dry_run=YES"):
        for action in ("drain", "restart"):
            r = httpx.post(f"{admin}/groups/0/{action}{value}")
            assert r.status_code == 200 and r.json()["dry_run"] is True, (value, r.text)
            assert state() == "READY", value
    for value in ("?dry_run=banana", "?dry_run=2"):
        r = httpx.post(f"{admin}/groups/0/drain{value}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "dry_run", r.text
        r = httpx.delete(f"{admin}/quarantine{value}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "dry_run", r.text
    assert state() == "READY"
    r = httpx.delete(f"{admin}/quarantine?dry_run=on")
    assert r.status_code == 200 and r.json()["dry_run"] is True
    r = httpx.post(f"{admin}/groups/0/undrain?dry_run=false")  # acts: refused, READY
    assert r.status_code == 409 and state() == "READY"


JSON = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
USER = [{"role": "user", "content": "x"}]
# (endpoint, raw body, status, the error's param): faults that come in through the front door
FRONT_DOOR = [
    ("completions", b'{"model": "%s", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("completions", b'{"model": "%s", "prompt": ["\\udfff"]}', 400, "prompt[0]"),
    ("completions", b'{"model": "%s", "prompt": "a", "stop": ["ok", "\\ud800"]}', 400, "stop[1]"),
    (
        "chat/completions",
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}]}',
        400,
        "messages[0].content",
    ),
    ("completions", b'{"model": "%s", "prompt": "a", "temperature": NaN}', 400, None),
    ("completions", b'{"model": "%s", "prompt": "a", "top_p": Infinity}', 400, None),
    ("completions", b'{"model": "%s", "prompt": "a", "seed": 1' + b"0" * 5000 + b"}", 400, None),
    (
        "completions",
        b'{"model": "%s", "prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
        400,
        None,
    ),
    (
        "completions",
        b'{"model": "%s", "prompt": "a", "stop_token_ids": [1, 1000000]}',
        400,
        "stop_token_ids",
    ),
    (
        "completions",
        b'{"model": "%s", "prompt": "a", "stop_token_ids": [-1]}',
        400,
        "stop_token_ids",
    ),
    (
        "chat/completions",
        b'{"model": "%s", "messages": [{"role": "user"}]}',
        400,
        "messages[0].content",
    ),
    (
        "chat/completions",
        b'{"model": "%s", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null}]}',
        400,
        "messages[1].content",
    ),
    # user-level params, not pydantic's union internals (prompt.str, stop.list[str], ...)
    ("completions", b'{"model": "%s", "prompt": 5}', 400, "prompt"),
    ("completions", b'{"model": "%s", "prompt": [1, "a"]}', 400, "prompt[1]"),
    ("completions", b'{"model": "%s", "prompt": "a", "stop": 5}', 400, "stop"),
    (
        "completions",
        b'{"model": "%s", "prompt": "a", "stream_options": {"include_usage": "yes"}}',
        400,
        "stream_options.include_usage",
    ),
    (
        "chat/completions",
        b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        400,
        "messages[0].content[0].text",
    ),
    ("completions", b'{"model": "%s", "prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
    ("completions", b'{"model": "%s", "prompt": "a", "logprobs": 21}', 400, "logprobs"),
    (
        "chat/completions",
        b'{"model": "%s", "messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 21}',
        400,
        "top_logprobs",
    ),
    # a request-borne fault needs --enable-fault-injection
    (
        "completions",
        b'{"model": "%s", "prompt": "a", "safeserve_fault": "raise"}',
        400,
        "safeserve_fault",
    ),
    (
        "completions",
        b'{"model": "%s", "prompt": "a", "safeserve_fault": "melt"}',
        400,
        "safeserve_fault",
    ),
]


@pytest.mark.parametrize("endpoint,raw,status,param", FRONT_DOOR)
def test_front_door_faults_are_4xx_naming_the_field(
    server: Server, endpoint: str, raw: bytes, status: int, param: str | None
) -> None:
    raw = raw.replace(b"%s", MODEL.encode(), 1)
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=raw, headers=JSON, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if param:
        assert err["message"].startswith(param) or param in err["message"], err


def test_content_type_must_be_json_and_every_answer_is_counted(server: Server) -> None:
    """415 for a body that is not declared JSON (curl -d without -H sends form encoding); its
    parameters pass. Every answer, the body limit's 413 included, is in requests_total."""
    series = 'safeserve:requests_total{endpoint="/v1/completions",status="%s"}'
    before = {s: _metric(server, series % s) for s in ("200", "413", "415")}
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    auth = {"Authorization": f"Bearer {KEY}"}
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = auth | ({"Content-Type": ctype} if ctype else {})
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
    for ctype in ("application/json; charset=utf-8", "Application/JSON"):
        r = httpx.post(
            server.url + "/v1/completions", content=body, headers=auth | {"Content-Type": ctype}
        )
        assert r.status_code == 200, r.text
    big = json.dumps({"model": MODEL, "prompt": "x" * 100_000}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    after = {s: _metric(server, series % s) for s in ("200", "413", "415")}
    assert {s: after[s] - before[s] for s in after} == {"200": 2, "413": 1, "415": 3}
