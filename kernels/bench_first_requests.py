"""What the first requests after start-up pay: time to first token, first time and again.

One fresh process per run, with an empty Triton cache (TRITON_CACHE_DIR in a new temporary
folder, as on a machine that never ran safeserve). The engine is built as `serve` builds a group
leader (CUDA graphs captured), then warmed up one of three ways:

* `none`: no warm-up;
* `short`: one 3-token request (prefill + one decode step), the server's warm-up until
  2026-11-30's sixth session;
* `full`: `Engine.warm_up()`, the server's warm-up since then.

Then, one after the other, a request of each --sizes prompt length (2 output tokens), and the
same lengths again. For each request: time to first token (host wall time of the engine steps up
to its first token). Reported: start-up time (engine + warm-up) and, per length, first and
repeat TTFT. The gap is first-time work in the serving path: kernel compilation, allocator
growth.

python3 kernels/bench_first_requests.py --model kernels/configs/qwen3-30b-a3b --num-layers 8 \\
    --warm-up none,short,full --json $OUT/first_requests.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = "512,2048,100,1000,3000"


def _model_dir(model: str, num_layers: int | None, tmp: Path) -> str:
    """The checkpoint folder, or a copy of its config.json with fewer layers (dummy weights)."""
    if num_layers is None:
        return model
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    out = tmp / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _one(ns: argparse.Namespace) -> dict:
    """One run, in this process (started by `main` with a fresh Triton cache)."""
    import torch

    from safeserve.bench import make_prompts
    from safeserve.config import ServerArgs
    from safeserve.engine.engine import Engine
    from safeserve.messages import SamplingParams

    args = ServerArgs(
        model=ns.model_dir,
        load_format="dummy",
        device=ns.device,
        dtype="bfloat16" if ns.device == "cuda" else "float32",
        max_model_len=ns.max_model_len,
        max_num_batched_tokens=ns.max_num_batched_tokens,
    )

    def sync() -> None:
        if ns.device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    engine = Engine(args)
    sync()
    built = time.perf_counter() - t0
    if ns.run == "short":
        engine.add_request("w", [0, 1, 2], SamplingParams(max_tokens=2, temperature=0))
        while engine.has_work():
            engine.step()
    elif ns.run == "full":
        engine.warm_up()
    sync()
    started = time.perf_counter() - t0
    sizes = [int(s) for s in ns.sizes.split(",")]
    vocab = engine.config.vocab_size
    ttft: dict[str, list[float]] = {}
    for rep in range(2):
        for i, n in enumerate(sizes):
            prompt = make_prompts(1, n, vocab, seed=100 * rep + i)[0]
            params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
            engine.add_request(f"{rep}-{i}", prompt, params)
            t = time.perf_counter()
            first = None
            while engine.has_work():
                outs = engine.step()
                if first is None and any(o.new_token_ids for o in outs):
                    first = time.perf_counter() - t
            ttft.setdefault(str(n), []).append(first if first is not None else float("nan"))
    return {
        "warm_up": ns.run,
        "engine_s": built,
        "startup_s": started,
        "ttft_ms": {n: {"first": v[0] * 1e3, "again": v[1] * 1e3} for n, v in ttft.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kernels/configs/qwen3-30b-a3b")
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers (dummy weights)")
    p.add_argument("--warm-up", default="none,short,full", help="comma list of none|short|full")
    p.add_argument("--sizes", default=SIZES, help="prompt lengths, comma-separated")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default="cuda", help="cuda, or cpu to try the script")
    p.add_argument("--json", default=None)
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one run
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.run is not None:
        print(json.dumps(_one(ns)))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(ns.model, ns.num_layers, Path(tmp))
        for mode in ns.warm_up.split(","):
            if mode not in ("none", "short", "full"):
                p.error(f"--warm-up: {mode!r} is not none, short or full")
            cache = tempfile.mkdtemp(prefix="triton-cache-", dir=tmp)
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            print(f"run: warm-up {mode}, empty Triton cache {cache}", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--run", mode, "--model-dir", model_dir]
            for flag in ("sizes", "max_model_len", "max_num_batched_tokens", "device"):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(ns, flag))]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-4000:], file=sys.stderr)
                return 1
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(res)
            cells = ", ".join(
                f"{n}: {v['first']:.0f} / {v['again']:.0f}" for n, v in res["ttft_ms"].items()
            )
            print(
                f"warm-up {mode}: start-up {res['startup_s']:.1f} s (engine {res['engine_s']:.1f}"
                f" s); TTFT ms first / again: {cells}",
                flush=True,
            )
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
