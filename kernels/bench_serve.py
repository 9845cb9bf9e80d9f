"""Decode speed as a client of the HTTP server sees it: `safeserve serve` started here (or one
already running, `--url`), hit by `c` streaming clients at each concurrency `c`.

Each point runs `--rounds` rounds; in a round every client sends one greedy completion of
`--input-len` prompt tokens and `--output-len` output tokens (ignore_eos), all at once, as
`safeserve bench` starts its batches, with its prompts (`bench_prompts`). The first round only warms up (the first requests of a
shape pay compiles) unless `--rounds 1`. Per point it prints the median time to first token,
the median and p90 inter-token latency (gaps between streamed tokens, the number peer serving
benchmarks report as ITL; tokens that arrive in one streamed chunk share its arrival time, as
the client sees them), the median per-request TPOT ((last - first token) / (tokens - 1)),
output tokens/s over the round, and requests that did not finish with every token (must be 0).

    python3 kernels/bench_serve.py --concurrency 1,8,64 --input-len 512 --output-len 128 \\
        --json serve.json -- --model kernels/configs/qwen3-30b-a3b --load-format dummy \\
        --device cuda --dtype bfloat16

Everything after `--` goes to `safeserve serve` (host and ports are chosen here); the server's
log is written next to `--json` (or to a temporary folder) and the server is stopped at the end.
Compare with `safeserve bench` on the same flags: the difference is what serving adds to a step
(scheduling, inter-process messages, detokenization, HTTP streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from safeserve.bench import make_prompts
from safeserve.chaos.cli import check_server_args
from safeserve.chaos.load import Load, RequestRecord
from safeserve.chaos.report import percentile
from safeserve.chaos.runner import LocalServer, ServerStartError, served_model
from safeserve.chaos.scenario import LoadSpec


def summarize(records: list[RequestRecord], output_len: int) -> dict:
    """One round's numbers (milliseconds); `unfinished` counts requests without every token."""
    done = [r for r in records if r.status == 200 and len(r.times) == output_len]
    finished = {id(r) for r in done}
    ttft = [1e3 * (r.times[0] - r.start) for r in done]
    itl = [1e3 * (b - a) for r in done for a, b in zip(r.times, r.times[1:], strict=False)]
    tpot = [1e3 * t for r in done if (t := r.tpot()) is not None]
    span = max((r.end for r in done), default=0.0) - min((r.start for r in done), default=0.0)
    tokens = sum(len(r.times) for r in done)
    return {
        "requests": len(records),
        "unfinished": len(records) - len(done),
        "errors": sorted({r.error or r.broken or "" for r in records if id(r) not in finished}),
        "ttft_ms_median": percentile(ttft, 0.5),
        "itl_ms_median": percentile(itl, 0.5),
        "itl_ms_p90": percentile(itl, 0.9),
        "tpot_ms_median": percentile(tpot, 0.5),
        "output_tok_s": tokens / span if span > 0 else None,
    }


def bench_prompts(opts: argparse.Namespace, serve_args: list[str]) -> list[list[int]] | None:
    """`safeserve bench`'s prompts (random ids over the vocabulary, seed 0: client c gets the
    c-th), so the two measure the same inputs, and with dummy weights the same routing; the
    vocabulary is `--vocab`, else that of the model started here (the server arguments are
    checked as `serve` checks them, before it starts). None: the chaos load's
    prompts (ids 10-249, which any tokenizer has; their routing is not the bench's)."""
    vocab = opts.vocab
    if vocab is None and opts.url is None:
        from safeserve.model.checkpoint import load_model_config

        model = check_server_args(serve_args, "the server arguments after --").model
        vocab = load_model_config(model).vocab_size
    if vocab is None:
        return None
    return make_prompts(max(opts.concurrency), opts.input_len, vocab, opts.seed)


async def run_point(
    url: str, model: str, c: int, opts: argparse.Namespace, prompts: list[list[int]] | None
) -> dict:
    spec = LoadSpec(
        concurrency=c,
        prompt_tokens=opts.input_len,
        max_tokens=opts.output_len,
        warmup_s=0.0,
        distinct_prompts=c,
        request_timeout_s=opts.request_timeout,
    )
    rounds = []
    for i in range(opts.rounds):
        load = Load(url, spec, model, opts.api_key)
        if prompts is not None:
            load.prompts = prompts[:c]
        await load.one_round(time.monotonic())
        rounds.append(summarize(load.records, opts.output_len))
        tag = "warm-up" if i == 0 and opts.rounds > 1 else "round"
        _progress(f"concurrency {c}: {tag} {i + 1}/{opts.rounds}: {_line(rounds[-1])}")
    measured = rounds[1:] if len(rounds) > 1 else rounds
    return {"concurrency": c, "rounds": rounds, "measured": _merge(measured)}


def _merge(rounds: list[dict]) -> dict:
    """Medians over the measured rounds (each already a median), counts summed."""

    def med(key: str) -> float | None:
        xs = [r[key] for r in rounds if r[key] is not None]
        return statistics.median(xs) if xs else None

    keys = ("ttft_ms_median", "itl_ms_median", "itl_ms_p90", "tpot_ms_median", "output_tok_s")
    out: dict = {k: med(k) for k in keys}
    out["requests"] = sum(r["requests"] for r in rounds)
    out["unfinished"] = sum(r["unfinished"] for r in rounds)
    return out


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _line(r: dict) -> str:
    return (
        f"TTFT {_fmt(r['ttft_ms_median'])} ms, ITL {_fmt(r['itl_ms_median'])} ms "
        f"(p90 {_fmt(r['itl_ms_p90'])}), TPOT {_fmt(r['tpot_ms_median'])} ms, "
        f"{_fmt(r['output_tok_s'], 0)} tok/s, unfinished {r['unfinished']}"
    )


def table(points: list[dict]) -> str:
    lines = [
        "| conc | TTFT ms | ITL ms (median) | ITL ms (p90) | TPOT ms | out tok/s | unfinished |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        m = p["measured"]
        lines.append(
            f"| {p['concurrency']} | {_fmt(m['ttft_ms_median'])} | {_fmt(m['itl_ms_median'])} | "
            f"{_fmt(m['itl_ms_p90'])} | {_fmt(m['tpot_ms_median'])} | "
            f"{_fmt(m['output_tok_s'], 0)} | {m['unfinished']} |"
        )
    return "\n".join(lines)


def _progress(msg: str) -> None:
    print(f"[bench_serve] {msg}", file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (else one is started with the args after --)")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="per point, the first one a warm-up")
    p.add_argument("--vocab", type=int, help="prompt ids below this (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="of the prompts (safeserve bench's: 0)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path)
    opts = p.parse_args(argv)
    if opts.input_len < 1 or opts.output_len < 2 or opts.rounds < 1:
        p.error("--input-len must be >= 1, --output-len >= 2 and --rounds >= 1")
    if (opts.url is None) == (not serve_args):
        p.error("give either --url or the server's arguments after --")
    return opts, serve_args


def main(argv: list[str] | None = None) -> int:
    opts, serve_args = parse(sys.argv[1:] if argv is None else argv)
    try:
        points, same_prompts = _run(opts, serve_args)
    except (ValueError, ServerStartError, httpx.HTTPError) as e:  # LoadError is a ValueError
        print(f"bench_serve: error: {e}", file=sys.stderr)
        return 2
    result = {
        "command": " ".join(sys.argv),
        "serve_args": serve_args,
        "url": opts.url,
        "input_len": opts.input_len,
        "output_len": opts.output_len,
        "rounds": opts.rounds,
        "prompts": "safeserve bench's" if same_prompts else "chaos load's (ids 10-249)",
        "points": points,
    }
    print(table(points), flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))
        _progress(f"wrote {opts.json}")
    return 1 if any(p["measured"]["unfinished"] for p in points) else 0


def _run(opts: argparse.Namespace, serve_args: list[str]) -> tuple[list[dict], bool]:
    """Every point, and whether the prompts were `safeserve bench`'s; starts (and stops) the
    server unless --url is given."""
    prompts = bench_prompts(opts, serve_args)
    server = None
    url = opts.url
    if url is None:
        folder = opts.json.parent if opts.json else Path(tempfile.mkdtemp(prefix="bench_serve_"))
        log = folder / "bench_serve_server.log"
        _progress(f"starting safeserve serve {' '.join(serve_args)} (log: {log})")
        server = LocalServer(serve_args, log)
        t0 = time.monotonic()
        server.wait_ready(opts.start_timeout, sys.stderr)  # stops it when it gives up
        _progress(f"server ready in {time.monotonic() - t0:.0f} s")
        url = server.url
    try:
        model = asyncio.run(served_model(url, opts.api_key))
        points = [asyncio.run(run_point(url, model, c, opts, prompts)) for c in opts.concurrency]
        return points, prompts is not None
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
