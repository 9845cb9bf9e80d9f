"""The peer: Hugging Face transformers' own model of the same config, on the same prompts."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from safeserve.bench.floor import _sync
from safeserve.bench.options import progress
from safeserve.config import ServerArgs


def _hf_config(model: str) -> Any:
    from transformers import AutoConfig, Qwen3MoeConfig

    from safeserve.config import TINY_MODEL
    from safeserve.model.loader import TINY_CONFIG

    if model == TINY_MODEL:
        cfg = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
        return Qwen3MoeConfig(**cfg)
    return AutoConfig.from_pretrained(model)


def run_transformers(
    args: ServerArgs, prompts: list[list[int]], concurrency: list[int], output_len: int
) -> list[dict]:
    """transformers' model of the same config (random weights), greedy, its own KV cache."""
    from transformers import AutoModelForCausalLM

    from safeserve.model.loader import DTYPES

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    progress(f"peer transformers: building {args.model} on {device}")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_hf_config(args.model), dtype=DTYPES[args.dtype])
    model.eval()
    points = []
    with torch.inference_mode():
        for batch in [concurrency[0], *concurrency]:  # the first run is a warm-up
            ids = torch.tensor(prompts[:batch], device=device)
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            t_first = time.perf_counter()
            steps = []
            for _ in range(output_len - 1):
                s0 = time.perf_counter()
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.cpu()  # the engine's sampler syncs the same way
                steps.append(time.perf_counter() - s0)
            t_end = time.perf_counter()
            points.append(
                {
                    "concurrency": batch,
                    "ttft_ms": (t_first - t0) * 1e3,
                    "tpot_ms": statistics.mean(steps) * 1e3,
                    "decode_step_ms": statistics.median(steps) * 1e3,
                    "output_tok_s": batch * output_len / (t_end - t0),
                    "decode_tok_s": batch * len(steps) / sum(steps),
                }
            )
            del past, out
            progress(
                f"peer transformers: concurrency {batch}: step {points[-1]['decode_step_ms']:.2f} ms"
            )
    del model
    gc.collect()
    return points[1:]
