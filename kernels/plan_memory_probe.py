"""Where a rank's device memory goes before its KV cache is sized (for `safeserve plan`'s KV
prediction): the model built as a rank builds it (dummy weights), then the driver's and the
allocator's counts, the parameters and buffers, and the allocator's segments.

    python kernels/plan_memory_probe.py --model kernels/configs/qwen3-30b-a3b [--max-model-len N] \
        --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from safeserve.config import ServerArgs
from safeserve.engine.model_runner import ModelRunner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--json", required=True)
    ns = ap.parse_args(argv)
    seen: dict = {}
    import safeserve.engine.kv_cache as kv

    real = kv.kv_blocks_from_memory

    def probe(args, per_block, device, max_model_len):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        segs = torch.cuda.memory_snapshot()
        seen.update(
            free=free,
            total=total,
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            segments=[
                {
                    "size": s["total_size"],
                    "allocated": s["allocated_size"],
                    "pool": s.get("segment_type"),
                    "blocks": [b["size"] for b in s["blocks"] if b["state"] == "active_allocated"],
                }
                for s in segs
            ],
        )
        return real(args, per_block, device, max_model_len)

    kv.kv_blocks_from_memory = probe
    import safeserve.engine.rank_setup as rs

    rs.kv_blocks_from_memory = probe
    args = ServerArgs(
        model=ns.model,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_model_len=ns.max_model_len,
    )
    runner = ModelRunner(args, capture_cuda_graphs=False)
    params = {id(p): p for p in runner.model.parameters()}.values()
    seen["weights"] = sum(p.numel() * p.element_size() for p in params)
    seen["param_sizes"] = [p.numel() * p.element_size() for p in params]
    seen["buffer_sizes"] = [
        (n, b.numel() * b.element_size()) for n, b in runner.model.named_buffers()
    ]
    seen["num_kv_blocks"] = runner.num_blocks
    Path(ns.json).write_text(json.dumps(seen))
    print(
        {
            k: seen[k]
            for k in ("free", "total", "allocated", "reserved", "weights", "num_kv_blocks")
        },
        f"segments {len(seen['segments'])}",
        f"context+other {seen['total'] - seen['free'] - seen['reserved']}",
        f"slack {seen['reserved'] - seen['allocated']}",
        f"buffers {seen['allocated'] - seen['weights']}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
