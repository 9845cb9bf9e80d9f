"""Start and stop real `safeserve serve` processes for tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from safeserve.chaos.runner import die_with_parent
from safeserve.ports import free_port


def two_groups(*extra: str) -> list[str]:
    """Server arguments of the failover setup: two groups of two ranks (alltoall), a 3 s stall
    timeout and a quick restart, plus `extra`."""
    return [
        "--num-groups",
        "2",
        "--tp-size",
        "2",
        "--moe-a2a-backend",
        "alltoall",
        "--watchdog-stall-timeout",
        "3",
        "--restart-backoff-s",
        "0.5",
        *extra,
    ]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    admin_url: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(
    args: list[str], log: Path, timeout: float = 120.0, env: dict | None = None
) -> Server:
    port = free_port()
    admin_port = free_port()
    if "--admin-port" not in args:
        args = [*args, "--admin-port", str(admin_port)]
    else:
        admin_port = int(args[args.index("--admin-port") + 1])
    cmd = [sys.executable, "-m", "safeserve.cli", "serve", "--port", str(port), *args]
    fh = log.open("w")
    proc = subprocess.Popen(
        cmd,
        stdout=fh,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,  # a pytest killed by a timeout leaves no server behind
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/ready", timeout=1.0).status_code == 200:
                return Server(proc, url, log, f"http://127.0.0.1:{admin_port}")
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"server not ready after {timeout} s:\n{log.read_text()}")


def stream_completion(
    s: Server, prompt: list[int], max_tokens: int, **extra: object
) -> tuple[list[int], str | None]:
    """A streamed greedy completion of `max_tokens` (EOS ignored): (every token id received,
    the error code if it was refused or ended with an error event)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True, "stream": True, **extra}
    ids: list[int] = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=180) as r:
        if r.status_code != 200:
            r.read()
            return ids, r.json()["error"]["code"]
        for line in r.iter_lines():
            chunk = sse_chunk(line)
            if chunk is None:
                continue
            if "error" in chunk:
                return ids, chunk["error"]["code"]
            for choice in chunk["choices"]:
                ids.extend(choice.get("token_ids") or [])
    return ids, None


def admin_groups(s: Server) -> list[dict]:
    return httpx.get(s.admin_url + "/admin/groups", timeout=10).json()["groups"]


def wait_all_ready(s: Server, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(g["state"] == "READY" for g in admin_groups(s)):
            return
        time.sleep(0.2)
    raise AssertionError(f"groups not READY: {admin_groups(s)}")


def oncall(s: Server, *args: str) -> subprocess.CompletedProcess:
    """`safeserve oncall ARGS` against the server's admin API (runbooks from the repository)."""
    cmd = [sys.executable, "-m", "safeserve.cli", "oncall", "--admin-url", s.admin_url, *args]
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)


def rank_processes(server_pid: int) -> list:
    """The rank processes of a server (`safeserve: group G rank R` in `ps`), as psutil
    processes."""
    import psutil

    ranks = []
    for p in psutil.Process(server_pid).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith("safeserve: group "):
                ranks.append(p)
        except psutil.NoSuchProcess:
            pass
    return ranks


def stop_server(proc: subprocess.Popen) -> None:
    """Stops the server and every process of its session (the group's ranks too)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=5)


# Server flags for `preempts_and_loses_nothing`: a KV cache too small for its six requests.
KV_PRESSURE = ["--num-kv-blocks", "12", "--max-running-requests", "6"]


def preempts_and_loses_nothing(s: Server) -> dict:
    """Six 40-token greedy completions at once against a server started with `KV_PRESSURE`
    (6 x 5 blocks wanted, 12 held a rank): the group preempts and recomputes, and every request
    ends with the tokens it gets when it runs alone. Returns the group's /admin/groups row."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[10 + (7 * i + j) % 200 for j in range(40)] for i in range(6)]

    def complete(prompt: list[int]) -> list[int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, prompts))
    (g,) = httpx.get(s.admin_url + "/admin/groups").json()["groups"]
    assert g["preemptions"] > 0
    alone = [complete(p) for p in prompts]  # one at a time: nothing to preempt
    assert together == alone and all(len(t) == 40 for t in together)
    return g


# The API tests' server (tests/server/conftest.py starts it): a key and a served model name.
API_KEY = "test-key"
API_MODEL = "qwen3-moe-test"


def api_client(s: Server, **kw: object):  # type: ignore[no-untyped-def]
    """The `openai` client of a server (no retries: a test sees every answer), with that
    server's key (a server started without --api-key takes any); `kw`: more of its options."""
    import openai

    return openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, **kw)


def concurrent_completions(
    s: Server,
    model: str,
    prompts: list,
    max_tokens: int,
    timeout: float | None = None,
    **extra: object,
) -> list:
    """Every prompt's greedy completion (token ids returned, `extra` more of the body), sent all
    at once through the `openai` async client: its answers, in the prompts' order."""
    import asyncio

    import openai

    kw = {} if timeout is None else {"timeout": timeout}
    client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, **kw)

    async def run() -> list:
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=model,
                    prompt=p,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    extra_body={"return_token_ids": True, **extra},
                )
                for p in prompts
            )
        )

    return asyncio.run(run())


def sse_chunk(line: str, errors: list | None = None) -> dict | None:
    """The JSON of a stream's `data:` line; None for any other line and for `data: [DONE]`.
    With `errors`, an error event's error goes there and it is None too."""
    import json

    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    chunk = json.loads(line[6:])
    if errors is not None and "error" in chunk:
        errors.append(chunk["error"])
        return None
    return chunk


# The test checkpoints' end of turn (tests/checkpoints.py): the EOS the server stops at.
EOS_TOKEN = "<|im_end|>"


def hf_greedy(model, tok, ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' greedy continuation of `ids` (`n` tokens at most), cut before the first
    EOS: what a greedy completion of `n` tokens returns."""
    import torch

    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    out = out[0, len(ids) :].tolist()
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    return out[: out.index(eos)] if eos in out else out


# The layout HTTP tests' prompts: four lengths, the longer ones over --chunked-prefill-size 8.
LAYOUT_PROMPTS = [
    "The quick brown fox",
    "Experts route tokens; the router picks the top k experts for every token.",
    "A paged key value cache",
    "Mixture of experts models serve many requests at once on many GPUs, and one failed GPU",
]

# The HTTP tests' chat: a system and a user message.
CHAT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Route the tokens."},
]


def assert_greedy_chat(  # type: ignore[no-untyped-def]
    s: Server, model: str, tok, messages: list[dict], max_tokens: int, ref: list[int]
) -> None:
    """A greedy chat completion of `messages` is `ref` (token ids; transformers' continuation
    of the chat-templated prompt), its text `ref` decoded, its prompt the templated one."""
    chat = api_client(s).chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert chat.choices[0].model_extra["token_ids"] == ref
    assert chat.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(chat_prompt_ids(tok, messages))


def chat_prompt_ids(tok, messages: list[dict]) -> list[int]:  # type: ignore[no-untyped-def]
    """The token ids of `messages` in the tokenizer's chat template, with the generation prompt
    (transformers returns a list or, in some versions, an encoding)."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def metric(s: Server, name: str) -> float:
    """The sum of a Prometheus series' samples (`name`, with or without labels) on /metrics."""
    text = httpx.get(s.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def greedy_streams_under_fault(  # type: ignore[no-untyped-def]
    url: str, model: str, prompts: list[list[int]], tokens: int, fault
) -> list[dict]:
    """Greedy completions of `prompts` (`tokens` each, ignore_eos), streamed at once with their
    token ids; once as many chunks as streams have arrived, `fault(running)` runs (`running`:
    group -> its streams not finished yet). Each stream's {"group", "ids", "errors"}."""
    results: list[dict] = [{} for _ in prompts]
    started = asyncio.Event()
    chunks = {"n": 0}
    running: dict[int, int] = {}

    async def one(i: int, c: httpx.AsyncClient) -> None:
        body = {
            "model": model,
            "prompt": prompts[i],
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        ids: list[int] = []
        errors: list = []
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            group = int(r.headers["x-safeserve-group"])
            running[group] = running.get(group, 0) + 1
            async for line in r.aiter_lines():
                chunk = sse_chunk(line, errors)
                if chunk is None:
                    continue
                ids.extend(chunk["choices"][0].get("token_ids") or [])
                chunks["n"] += 1
                if chunks["n"] >= len(prompts):
                    started.set()
            running[group] -= 1
        results[i] = {"group": group, "ids": ids, "errors": errors}

    async with httpx.AsyncClient(timeout=300) as c:
        tasks = [asyncio.create_task(one(i, c)) for i in range(len(prompts))]
        await started.wait()
        fault(running)
        await asyncio.gather(*tasks)
    return results
