"""Random requests through a running server, each answered alone and then among others at random
concurrencies: with `--enable-deterministic-inference` every request must get the same tokens
and the same logits digests (a hash of each position's whole logits row) both times.

Requests are drawn from `--seed`: token-id prompts of random lengths, random output lengths,
greedy or sampled (temperature, top-p, top-k, each with its own seed), all asking for logprobs
(the digests come with them). First every request runs alone, one at a time; then the same
requests in shuffled waves of random sizes (2..`--max-concurrency`), each request of a wave
starting after a random delay so prefills land beside decodes. Prints a summary, writes it with
every mismatch to `--json`, and exits 1 on any mismatch or failed request.

    python kernels/det_requests_check.py --url http://127.0.0.1:8000 --requests 200 \\
        --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx


def draw(n: int, seed: int, vocab: int, max_prompt: int, max_out: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body: dict[str, Any] = {
            "prompt": [rng.randrange(10, vocab) for _ in range(rng.randint(1, max_prompt))],
            "max_tokens": rng.randint(1, max_out),
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": 1,
        }
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body |= {
                "temperature": round(rng.uniform(0.3, 1.5), 3),
                "top_p": round(rng.uniform(0.5, 1.0), 3),
                "top_k": rng.choice([-1, 5, 50]),
                "seed": rng.randrange(2**31),
            }
        out.append(body)
    return out


async def ask(client: httpx.AsyncClient, url: str, model: str, body: dict) -> dict[str, Any]:
    r = await client.post(url + "/v1/completions", json={"model": model, **body})
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
    choice = r.json()["choices"][0]
    lp = choice.get("logprobs") or {}
    return {
        "tokens": choice.get("token_ids"),
        "digests": lp.get("logits_digests"),
        "group": r.headers.get("x-safeserve-group"),
    }


async def main_async(ns: argparse.Namespace) -> int:
    url = ns.url.rstrip("/")
    async with httpx.AsyncClient(timeout=600.0) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        bodies = draw(ns.requests, ns.seed, ns.vocab, ns.max_prompt, ns.max_tokens)
        t0 = time.monotonic()
        alone = [await ask(client, url, model, b) for b in bodies]
        t_alone = time.monotonic() - t0
        rng = random.Random(ns.seed + 1)
        order = list(range(len(bodies)))
        rng.shuffle(order)
        waves: list[list[int]] = []
        while order:
            size = rng.randint(2, ns.max_concurrency)
            waves.append(order[:size])
            order = order[size:]

        async def delayed(i: int) -> tuple[int, dict]:
            await asyncio.sleep(rng.uniform(0.0, ns.max_delay_s))
            return i, await ask(client, url, model, bodies[i])

        together: dict[int, dict] = {}
        t0 = time.monotonic()
        for wave in waves:
            for i, got in await asyncio.gather(*(delayed(i) for i in wave)):
                together[i] = got
        t_together = time.monotonic() - t0
    problems = []
    for i, (a, b) in enumerate(zip(alone, (together[i] for i in range(len(bodies))), strict=True)):
        if "error" in a or "error" in b:
            problems.append({"request": i, "why": "failed", "alone": a, "together": b})
            continue
        if not a["digests"] or None in a["digests"]:
            problems.append({"request": i, "why": "no logits digests (is the flag on, on CUDA?)"})
            continue
        if a["tokens"] != b["tokens"] or a["digests"] != b["digests"]:
            first = next(
                (
                    k
                    for k, (x, y) in enumerate(zip(a["digests"], b["digests"] or [], strict=False))
                    if x != y
                ),
                None,
            )
            problems.append(
                {
                    "request": i,
                    "why": "differs",
                    "first_digest_mismatch": first,
                    "tokens_equal": a["tokens"] == b["tokens"],
                    "body": {k: v for k, v in bodies[i].items() if k != "prompt"},
                    "prompt_len": len(bodies[i]["prompt"]),
                }
            )
    summary = {
        "requests": len(bodies),
        "greedy": sum(1 for b in bodies if b.get("temperature") == 0.0),
        "prompt_tokens": sum(len(b["prompt"]) for b in bodies),
        "output_tokens": sum(len(a.get("tokens") or []) for a in alone),
        "waves": [len(w) for w in waves],
        "alone_s": round(t_alone, 1),
        "together_s": round(t_together, 1),
        "equal": len(bodies) - len(problems),
        "problems": problems,
    }
    print(
        f"{summary['equal']}/{len(bodies)} requests equal alone and together (tokens and "
        f"logits digests); {summary['greedy']} greedy, {summary['prompt_tokens']} prompt "
        f"tokens, {summary['output_tokens']} output tokens; waves of "
        f"{min(summary['waves'])}-{max(summary['waves'])} ({len(waves)} waves); alone "
        f"{t_alone:.0f} s, together {t_together:.0f} s"
    )
    for p in problems[:10]:
        print(json.dumps(p)[:300])
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if problems else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids drawn from [10, vocab)")
    p.add_argument("--max-prompt", type=int, default=700)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-delay-s", type=float, default=0.3)
    p.add_argument("--json")
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
