"""Paged prefill attention (`safeserve.kernels.paged_prefill`) at the target model's heads: each
tile configuration against the shipped one and against torch's SDPA on contiguous K/V (the peer:
FlashAttention-class kernels, bottom-right causal), on the chunk shapes a long prompt's prefill
steps have, with the output checked against the torch reference.

    python3 kernels/bench_prefill_attention.py [--cases 2048@2048,2048@8192,4x512@512]
        [--sweep | --configs '[{"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}]']
        [--json PATH]

A case `QxL@C`: Q sequences, each a chunk of L query tokens whose context is C tokens (the
chunk's own plus C - L computed in earlier steps), all in one launch. Time: median of --reps
launches, each timed alone with CUDA events. TFLOP/s counts 4 * D * Hq per visible
(query, key) pair.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_bench_harness import _event_median_ms  # noqa: E402

from safeserve.kernels import paged_prefill as pp  # noqa: E402


def parse_case(text: str) -> tuple[int, int, int]:
    seqs, _, rest = text.rpartition("x")
    q_len, _, ctx = rest.partition("@")
    return int(seqs or 1), int(q_len), int(ctx)


def make_case(seqs: int, q_len: int, ctx: int, hq: int, hkv: int, d: int, bs: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(seqs * 7 + ctx)
    width = (ctx + bs - 1) // bs
    blocks = torch.randperm(seqs * width + 5, device=dev, generator=gen)
    tables = blocks[: seqs * width].view(seqs, width).to(torch.int32)
    n_blocks = seqs * width + 5
    kc = torch.randn(n_blocks * bs, hkv, d, device=dev, dtype=dt, generator=gen)
    vc = torch.randn(n_blocks * bs, hkv, d, device=dev, dtype=dt, generator=gen)
    q = torch.randn(seqs * q_len, hq, d, device=dev, dtype=dt, generator=gen)
    info = pp.prefill_info([s * q_len for s in range(seqs)], [q_len] * seqs, [ctx] * seqs)
    # visible pairs: row i of a chunk sees ctx - q_len + i + 1 keys
    pairs = seqs * (q_len * (ctx - q_len) + q_len * (q_len + 1) // 2)
    return {"q": q, "kc": kc, "vc": vc, "bt": tables, "info": info.to(dev), "q_len": q_len,
            "ctx": ctx, "seqs": seqs, "flop": 4.0 * d * hq * pairs}  # fmt: skip


def time_us(fn, reps: int) -> float:
    return _event_median_ms(fn, reps) * 1e3


def peer(case: dict, bs: int, scale: float, reps: int) -> tuple[float | None, str]:
    """torch SDPA over each sequence's context gathered into contiguous K/V (gather untimed),
    bottom-right causal (the chunk's last row sees the whole context); the backend it ran."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    seqs, q_len, ctx = case["seqs"], case["q_len"], case["ctx"]
    hq, hkv = case["q"].shape[1], case["kc"].shape[1]
    pos = torch.arange(ctx, device="cuda")
    slots = case["bt"].long()[:, pos // bs] * bs + pos % bs  # [seqs, ctx]
    k = case["kc"][slots].transpose(1, 2).repeat_interleave(hq // hkv, dim=1).contiguous()
    v = case["vc"][slots].transpose(1, 2).repeat_interleave(hq // hkv, dim=1).contiguous()
    q = case["q"].view(seqs, q_len, hq, -1).transpose(1, 2).contiguous()
    mask = causal_lower_right(q_len, ctx)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):  # fmt: skip
        try:
            with sdpa_kernel([backend]):
                fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # noqa: E731
                fn()
                return time_us(fn, reps), backend.name
        except RuntimeError:
            continue
    return None, "none"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="2048@2048,2048@8192,2048@32768,4x512@512")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time every tile configuration")
    ap.add_argument("--configs", default=None, help="JSON list of configurations to time too")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    configs: list[dict] = []
    if ns.sweep:
        for rows, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
            configs.append({"rows": rows, "block_n": bn, "num_warps": w, "num_stages": st})
    if ns.configs:
        configs += [c for c in json.loads(ns.configs) if c not in configs]
    scale = ns.head_dim**-0.5
    rows_out = []
    for text in ns.cases.split(","):
        seqs, q_len, ctx = parse_case(text)
        case = make_case(seqs, q_len, ctx, ns.heads, ns.kv_heads, ns.head_dim, ns.block_size)
        ref = pp.paged_prefill_torch(case["q"].float(), case["kc"].float(), case["vc"].float(),
                                     case["bt"], case["info"], ns.block_size, scale,
                                     torch.zeros_like(case["q"], dtype=torch.float32))  # fmt: skip
        peer_us, backend = peer(case, ns.block_size, scale, ns.reps)
        shipped = pp.prefill_config(torch.device("cuda"), q_len)
        results = []
        for cfg in [shipped] + [c for c in configs if c != shipped]:
            out = torch.full_like(case["q"], float("nan"))

            def run(cfg=cfg, out=out, c=case) -> None:
                pp.paged_prefill(c["q"], c["kc"], c["vc"], c["bt"], c["info"], c["q_len"],
                                 ns.block_size, scale, out, cfg)  # fmt: skip

            try:
                us = time_us(run, ns.reps)
            except Exception as exc:  # noqa: BLE001 - a tile shape that does not fit
                print(f"{text:>14s} {cfg} failed: {type(exc).__name__}", flush=True)
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            results.append({"config": cfg, "us": us, "tflops": case["flop"] / us / 1e6,
                            "rel_err": err, "ok": err <= 1e-2})  # fmt: skip
        results.sort(key=lambda r: r["us"] if r["ok"] else float("inf"))
        base = next(r for r in results if r["config"] == shipped)
        best = results[0]
        row = {"case": text, "shipped": base, "best": best, "peer_us": peer_us,
               "peer_backend": backend, "all": results}  # fmt: skip
        rows_out.append(row)
        peer_txt = f"{peer_us:8.1f} us ({backend})" if peer_us else "n/a"
        print(
            f"{text:>14s}: shipped {base['us']:8.1f} us {base['tflops']:5.0f} TFLOP/s "
            f"err {base['rel_err']:.1e} | best {best['us']:8.1f} us {best['tflops']:5.0f} "
            f"{best['config']} | peer {peer_txt}",
            flush=True,
        )
    if ns.json:
        Path(ns.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                             "torch": torch.__version__, "rows": rows_out},
                                            indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
