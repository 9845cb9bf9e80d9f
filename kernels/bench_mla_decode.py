"""MLA decode attention over the paged latent cache: time, GB/s and fraction of the read ceiling.
cache: time per decode step's launch(es) against the bytes of latent cache they must read, as
achieved GB/s and as a fraction of the device's measured read ceiling
(`safeserve.bench.floor.measure_read_ceiling`). GPU only.

    python3 kernels/bench_mla_decode.py --out mla_decode.json [--batches 1,8,32,64]
        [--contexts 512,4096] [--heads 16 --head-dim 576 --v-dim 512] [--block-size 16]
        [--sweep | --configs '[{"block_n": 64, "min_split": 128}]']

Every sequence of a case has the same context. A case's time is that of one `mla_decode` call
(decode launch, plus the combine launch where contexts are split) as the engine runs it, inside
a CUDA graph: `copies` calls, each over a different block table, sequences and blocks of a cache
larger than L2 (so a call reads HBM, not what the call before it left in L2), captured in one
graph; the median over --reps replays divided by the copies. Bytes: batch x context x head_dim
x 2 (the bf16 latent cache; the query and output, B x H x (576 + 512) x 2, are not counted).
Each config's output is checked against `mla_decode_torch` (relative error <= 1e-2). --sweep
(or --configs: entries merged over the shipped `DECODE_CONFIG`) times other tile configurations
beside the shipped one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safeserve.bench.floor import measure_read_ceiling  # noqa: E402
from safeserve.kernels import mla_attention as mla  # noqa: E402

L2_FLUSH_BYTES = 256 << 20  # a call's copies span at least this much cache (L2: 50 MB on H200)
MAX_COPIES = 256


def make_case(batch: int, ctx: int, ns: argparse.Namespace) -> dict:
    """`copies` problems of `batch` sequences of `ctx` tokens over one shared cache: distinct
    blocks (shuffled) per copy and sequence."""
    dev, dt, bs = "cuda", torch.bfloat16, ns.block_size
    per_call = batch * ctx * ns.head_dim * 2
    copies = max(2, min(MAX_COPIES, -(-L2_FLUSH_BYTES // per_call)))
    width = -(-ctx // bs)
    n_blocks = copies * batch * width + 1
    gen = torch.Generator(device=dev).manual_seed(batch * 131 + ctx)
    cache = torch.empty(n_blocks * bs, 1, ns.head_dim, device=dev, dtype=dt)
    cache.uniform_(-1, 1, generator=gen)  # never time on zeros
    perm = torch.randperm(n_blocks, device=dev, generator=gen)[: copies * batch * width]
    tables = perm.view(copies, batch, width).to(torch.int32)
    q = torch.randn(copies, batch, ns.heads, ns.head_dim, device=dev, dtype=dt, generator=gen)
    out = torch.empty(copies, batch, ns.heads, ns.v_dim, device=dev, dtype=dt)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return {"batch": batch, "ctx": ctx, "copies": copies, "cache": cache, "tables": tables,
            "q": q, "out": out, "ctx_lens": ctx_lens, "bytes": per_call}  # fmt: skip


def time_config(case: dict, cfg: dict, ns: argparse.Namespace) -> dict:
    c, bs, scale = case, ns.block_size, ns.head_dim**-0.5

    def calls() -> None:
        for i in range(c["copies"]):
            mla.mla_decode(c["q"][i], c["cache"], c["tables"][i], c["ctx_lens"], bs, scale,
                           ns.v_dim, out=c["out"][i], config=cfg)  # fmt: skip

    before = compiled_decode_kernels()
    calls()  # compiles
    torch.cuda.synchronize()
    new = [v for k, v in compiled_decode_kernels().items() if k not in before]
    ref = mla.mla_decode_torch(c["q"][0].float(), c["cache"], c["tables"][0], c["ctx_lens"], bs,
                               scale, ns.v_dim)  # fmt: skip
    err = ((c["out"][0].float() - ref).norm() / ref.norm()).item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(ns.reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / c["copies"])
    del graph
    us = statistics.median(times)
    splits = mla.decode_splits(c["batch"], -(-ns.heads // cfg["block_h"]),
                               c["tables"].shape[2] * bs, cfg)  # fmt: skip
    return {"config": cfg, "us": us, "gbps": c["bytes"] / us / 1e3, "splits": splits,
            "rel_err": err, "ok": err <= 1e-2, "kernel": new[0] if new else None}  # fmt: skip


def compiled_decode_kernels() -> dict[int, dict]:
    """Registers, spills and shared memory of every decode kernel variant compiled so far
    (Triton's JIT cache; empty where its layout differs)."""
    from safeserve.kernels.mla_attention_kernels import _mla_decode_kernel

    found = {}
    try:
        for entry in _mla_decode_kernel.device_caches.values():
            for k in entry[0].values():
                found[id(k)] = {"regs": getattr(k, "n_regs", None),
                                "spills": getattr(k, "n_spills", None),
                                "shared": k.metadata.shared, "warps": k.metadata.num_warps}  # fmt: skip
    except (AttributeError, IndexError, TypeError):
        pass
    return found


def sweep_configs() -> list[dict]:
    out = []
    for bn, ms, tp, w, st in itertools.product((32, 64), (64, 128, 256, 512), (264, 528, 1056),
                                               (4, 8), (2, 3)):  # fmt: skip
        if ms >= bn:
            out.append({"block_n": bn, "min_split": ms, "target_programs": tp, "num_warps": w,
                        "num_stages": st})  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=576, help="cache entry: latent + rope")
    ap.add_argument("--v-dim", type=int, default=512, help="the latent (kv_lora_rank)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ceiling-gib", type=float, default=4.0, help="read-ceiling buffer size")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs")
    ap.add_argument("--configs", default=None, help="JSON list of configs (over the shipped)")
    ap.add_argument("--verbose", action="store_true", help="print every config's time")
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shipped = mla.decode_config(device, torch.bfloat16, ns.head_dim, ns.v_dim)
    extra = sweep_configs() if ns.sweep else []
    if ns.configs:
        extra += json.loads(ns.configs)
    configs = [shipped] + [c for c in ({**shipped, **e} for e in extra) if c != shipped]
    ceiling = measure_read_ceiling(device, ns.ceiling_gib)
    print(f"read ceiling {ceiling / 1e9:.0f} GB/s", flush=True)
    rows = []
    for batch, ctx in itertools.product(
        [int(b) for b in ns.batches.split(",")], [int(c) for c in ns.contexts.split(",")]
    ):
        case = make_case(batch, ctx, ns)
        results = []
        for cfg in configs:
            try:
                results.append(time_config(case, cfg, ns))
                if ns.verbose:
                    r = results[-1]
                    print(f"  {r['us']:7.2f} us err {r['rel_err']:.0e} {r['kernel']} {cfg}")
            except Exception as exc:  # noqa: BLE001 - a tile shape that does not fit
                print(f"B={batch} ctx={ctx} {cfg} failed: {type(exc).__name__}: {exc}"[:300])
        for r in results:
            r["of_ceiling"] = r["gbps"] * 1e9 / ceiling
        base = next(r for r in results if r["config"] == shipped)
        best = min(results, key=lambda r: r["us"] if r["ok"] else float("inf"))
        rows.append({"batch": batch, "context": ctx, "bytes": case["bytes"],
                     "copies": case["copies"], "shipped": base, "best": best,
                     "all": results if len(results) > 1 else []})  # fmt: skip
        print(
            f"B={batch:3d} ctx={ctx:5d}: {base['us']:7.2f} us {base['gbps']:6.0f} GB/s "
            f"({base['of_ceiling']:.0%} of ceiling, {base['splits']} splits, err "
            f"{base['rel_err']:.1e})"
            + ("" if best is base else f" | best {best['us']:7.2f} us {best['config']}"),
            flush=True,
        )
        del case
        torch.cuda.empty_cache()
    Path(ns.out).write_text(json.dumps({
        "command": " ".join(["python3", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "heads": ns.heads, "head_dim": ns.head_dim, "v_dim": ns.v_dim,
        "block_size": ns.block_size, "dtype": "bfloat16", "read_ceiling_Bps": ceiling,
        "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
