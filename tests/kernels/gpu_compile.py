"""Compile every Triton kernel, as the engine launches it, for the GPUs it serves on, on a machine
without a GPU: the CPU CI's check that the kernels build for each target and fit its shared memory.

Triton's interpreter runs the kernels' logic on CPU but never compiles them, so an error that
only the compiler sees (a type it cannot lower, an instruction the target lacks, a tile that does
not fit shared memory) would otherwise surface only on a GPU machine of that kind. Here the real
entry points run on CPU tensors with Triton's driver replaced by a compile-only target: every
launch compiles through Triton's whole pipeline to a cubin (ptxas included), with the
constexprs, tiles and launch options the launchers compute for that target (dependent launches
from sm_90 on; tiles fitted to the target's shared memory), and nothing runs.

Targets (TARGETS): sm_90 (H100/H200: the fused MoE at every entry of every shipped H200 tile table,
and the heuristic configs any other device gets), sm_89 (L4/L40S/RTX 40, 99 KiB a program; what
sm_86 and sm_120 parts offer too) and sm_80 (A100, 163 KiB). By default (`make test`) sm_90 and
sm_89: sm_80 lowers through the same pre-Hopper path as sm_89 with more shared memory, and each
target costs CI about a minute of a core.

    python3 tests/kernels/gpu_compile.py            # sm90 and sm89, each in a process of its own
    python3 tests/kernels/gpu_compile.py sm90 sm80 sm89     # these targets, side by side
    python3 tests/kernels/gpu_compile.py sm80       # one target, in this process

`make test` runs it on machines without a GPU. Prints one JSON line per compiled kernel and one
summary line per target; exits 1 if any kernel failed to compile or needs more shared memory
than a program of its target may take.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

# target -> (compute capability, shared memory one program may opt into, the parts it stands for)
TARGETS: dict[str, tuple[int, int, str]] = {
    "sm90": (90, 227 * 1024, "H100/H200"),
    "sm80": (80, 163 * 1024, "A100"),
    "sm89": (89, 99 * 1024, "L4/L40S/RTX 40 (99 KiB: also sm_86, sm_120)"),
}
DEFAULT_TARGETS = ("sm90", "sm89")


def _install_compile_only_target(capability: int) -> list[dict]:
    """Triton's active driver becomes a target of this compute capability that compiles and
    never launches."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnly:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    driver.set_active(CompileOnly())
    compiled: list[dict] = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        md = kernel.metadata
        compiled.append(
            {
                "kernel": self.fn.__name__,
                "shared": md.shared,
                "num_warps": md.num_warps,
                "num_stages": md.num_stages,
                "has_cubin": "cubin" in kernel.asm,
            }
        )
        return kernel

    JITFunction.run = compile_only
    return compiled


def _kernel_paths_on(capability: int, shared: int) -> None:
    """The entry points of every module of `safeserve.kernels` take the kernel path for CPU
    tensors, with the target's dependent launches and shared memory."""
    import importlib
    import pkgutil

    import safeserve.kernels as kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"{kernels.__name__}.{info.name}")
        if hasattr(mod, "use_kernels"):
            mod.use_kernels = lambda t: True
        if hasattr(mod, "pdl_supported"):
            mod.pdl_supported = lambda device: capability >= 90
        if hasattr(mod, "shared_memory_per_program"):
            mod.shared_memory_per_program = lambda device: shared


def _launch_everything(capability: int, shared: int) -> None:
    from safeserve.kernels import expert_count as ec
    from safeserve.kernels import fused_moe as fm
    from safeserve.kernels import grouped_topk as gt
    from safeserve.kernels import linear as lin
    from safeserve.kernels import mla_attention as mla
    from safeserve.kernels import mla_prepare as mp
    from safeserve.kernels import moe_config as mc
    from safeserve.kernels import norm_rope as nr
    from safeserve.kernels import paged_attention as pa
    from safeserve.kernels import paged_prefill as pp
    from safeserve.kernels import qkv_rope as qr
    from safeserve.kernels import replica_spread as rs
    from safeserve.kernels import router_topk as rt
    from safeserve.kernels import topk_softmax as tk
    from safeserve.kernels.common import HOPPER_SHARED_BYTES
    from safeserve.kernels.moe_align import moe_align

    e, h, inter, k, heads, kv_heads, d = 128, 2048, 768, 8, 32, 4, 128
    bf16 = torch.bfloat16
    for dtype in (bf16, torch.float32):
        x = torch.empty(3, h, dtype=dtype)
        nr.rms_norm(x, torch.empty(h, dtype=dtype), 1e-6)
        nr.rms_norm(x, torch.empty(h, dtype=dtype), 1e-6, torch.empty(3, h, dtype=dtype))
        caches = [torch.empty(64, kv_heads, d, dtype=dtype) for _ in range(2)]
        for t in (3, nr.QK_BLOCK_MIN_TOKENS):  # a program per token, and per block of tokens
            nr.qk_norm_rope_store(
                torch.empty(t, (heads + 2 * kv_heads) * d, dtype=dtype),
                torch.empty(d, dtype=dtype),
                torch.empty(d, dtype=dtype),
                torch.empty(t, d, dtype=dtype),
                torch.empty(t, d, dtype=dtype),
                1e-6,
                heads,
                kv_heads,
                *caches,
                torch.zeros(t, dtype=torch.int64),
            )
        slots = torch.zeros(3, dtype=torch.int64)
        kv = torch.empty(3, kv_heads, d, dtype=dtype)
        pa.store_kv(kv, kv, *caches, slots)
        out = torch.empty(40, heads, d, dtype=dtype)
        info = torch.tensor([[40, 0, 33], [7, 33, 7]], dtype=torch.int32)
        tables = torch.zeros(2, 4, dtype=torch.int32)
        hopper = capability >= 90 and shared >= HOPPER_SHARED_BYTES
        for _, cfg in pp.PREFILL_CONFIGS["sm90" if hopper else "default"]:  # the class's tiles
            pp.paged_prefill(out, *caches, tables, info, 33, 16, 0.1, out, cfg)
        for batch, width in ((1, 4), (64, 256)):  # one split; split contexts, merged in-kernel
            q = torch.empty(batch, heads, d, dtype=dtype)
            tables = torch.zeros(batch, width, dtype=torch.int32)
            ctx = torch.ones(batch, dtype=torch.int32)
            pa.paged_decode(q, *caches, tables, ctx, 16, d**-0.5)
        for tokens in (1, 16, 64):
            logits = torch.empty(tokens, e, dtype=dtype)
            tk.fused_topk_softmax(logits, k, True, dtype, torch.zeros(e, dtype=torch.int64))
            skew = torch.zeros(1, dtype=torch.int64)  # the router passes its skew tensor
            rt.router_topk(
                torch.empty(tokens, h, dtype=dtype), torch.empty(e, h, dtype=dtype), k, True
            )
            rt.router_topk(
                torch.empty(tokens, h, dtype=dtype),
                torch.empty(e, h, dtype=dtype),
                k,
                True,
                dtype,
                torch.zeros(e, dtype=torch.int64),
                skew=skew,
            )
    # grouped top-k with the correction bias: DeepSeek-V3 (256 experts in 8 groups, float32
    # logits), Moonlight (64, no groups), 72 experts in groups of 9 (padded to 16), softmax
    for tokens in (1, 64, 4096):
        for experts, groups, kept, top_k, scoring, dtype in (
            (256, 8, 4, 8, "sigmoid", torch.float32),
            (64, 1, 1, 6, "sigmoid", bf16),
            (72, 8, 4, 6, "softmax", bf16),
        ):
            gt.fused_grouped_topk(
                torch.empty(tokens, experts, dtype=dtype),
                top_k,
                True,
                scoring,
                groups,
                kept,
                torch.empty(experts, dtype=torch.float32),
                2.5,
                bf16,
                torch.zeros(experts, dtype=torch.int64),
                skew=torch.zeros(1, dtype=torch.int64),
            )
    for dtype in (bf16, torch.float32):  # MLA over a latent cache (DeepSeek-V3 shapes)
        latent, entry, mla_heads = 512, 576, 16
        cache = torch.empty(64, 1, entry, dtype=dtype)
        for batch, width in ((1, 4), (64, 256)):  # one split; split contexts and the merge
            mla.mla_decode(
                torch.empty(batch, mla_heads, entry, dtype=dtype),
                cache,
                torch.zeros(batch, width, dtype=torch.int32),
                torch.ones(batch, dtype=torch.int32),
                16,
                0.1,
                latent,
            )
        info = torch.tensor([[40, 0, 33], [7, 33, 7]], dtype=torch.int32)
        mla.mla_prefill(
            torch.empty(40, mla_heads, entry, dtype=dtype),
            cache,
            torch.zeros(2, 4, dtype=torch.int32),
            info,
            33,
            16,
            0.1,
            latent,
            torch.empty(40, mla_heads, latent, dtype=dtype),
        )
    for dtype in (bf16, torch.float32):  # MLA cache entry and latent query, both RoPE layouts
        cache = torch.empty(64, 1, 576, dtype=dtype)
        for t in (1, mp.LATENT_BLOCK_MIN_TOKENS):
            for interleave in (True, False):
                cos, sin = torch.empty(t, 64, dtype=dtype), torch.empty(t, 64, dtype=dtype)
                mp.store_latent_entry(
                    torch.empty(t, 576, dtype=dtype), torch.empty(512, dtype=dtype), 1e-6, cos,
                    sin, interleave, cache, torch.zeros(t, dtype=torch.int32),
                )  # fmt: skip
                mp.latent_query(
                    torch.empty(16, t, 512, dtype=dtype).transpose(0, 1),
                    torch.empty(t, 16, 192, dtype=dtype)[..., 128:], cos, sin, interleave,
                )  # fmt: skip
    for n_out, n_in in ((5120, 2048), (2048, 4096)):  # q|k|v and o_proj at their plans
        for dtype in (bf16, torch.float32):
            lin.linear(torch.empty(1, n_in, dtype=dtype), torch.empty(n_out, n_in, dtype=dtype))
    if capability >= 89:  # the FP8 KV cache (float8_e4m3fn; serve refuses it below sm_89)
        for dtype in (bf16, torch.float32):
            caches = [torch.empty(64, kv_heads, d, dtype=torch.float8_e4m3fn) for _ in range(2)]
            for t in (3, nr.QK_BLOCK_MIN_TOKENS):
                nr.qk_norm_rope_store(
                    torch.empty(t, (heads + 2 * kv_heads) * d, dtype=dtype),
                    torch.empty(d, dtype=dtype),
                    torch.empty(d, dtype=dtype),
                    torch.empty(t, d, dtype=dtype),
                    torch.empty(t, d, dtype=dtype),
                    1e-6,
                    heads,
                    kv_heads,
                    *caches,
                    torch.zeros(t, dtype=torch.int64),
                )
            kv = torch.empty(3, kv_heads, d, dtype=dtype)
            pa.store_kv(kv, kv, *caches, torch.zeros(3, dtype=torch.int64))
            out = torch.empty(40, heads, d, dtype=dtype)
            info = torch.tensor([[40, 0, 33], [7, 33, 7]], dtype=torch.int32)
            tables = torch.zeros(2, 4, dtype=torch.int32)
            hopper = capability >= 90 and shared >= HOPPER_SHARED_BYTES
            for _, cfg in pp.PREFILL_CONFIGS["sm90" if hopper else "default"]:
                pp.paged_prefill(out, *caches, tables, info, 33, 16, 0.1, out, cfg)
            for batch, width in ((1, 4), (64, 256)):
                q = torch.empty(batch, heads, d, dtype=dtype)
                tables = torch.zeros(batch, width, dtype=torch.int32)
                pa.paged_decode(q, *caches, tables, torch.ones(batch, dtype=torch.int32), 16, 0.1)
            qr.qkv_norm_rope_store(
                torch.empty(1, h, dtype=dtype),
                torch.empty((heads + 2 * kv_heads) * d, h, dtype=dtype),
                None,
                torch.empty(d, dtype=dtype),
                torch.empty(d, dtype=dtype),
                torch.empty(1, d, dtype=dtype),
                torch.empty(1, d, dtype=dtype),
                1e-6,
                heads,
                kv_heads,
                *caches,
                torch.zeros(1, dtype=torch.int64),
            )
    for dtype in (bf16, torch.float32):  # q|k|v with q/k norm, RoPE and the KV store folded in
        cache = torch.empty(64, kv_heads, d, dtype=dtype)
        qr.qkv_norm_rope_store(
            torch.empty(1, h, dtype=dtype),
            torch.empty((heads + 2 * kv_heads) * d, h, dtype=dtype),
            None,
            torch.empty(d, dtype=dtype),
            torch.empty(d, dtype=dtype),
            torch.empty(1, d, dtype=dtype),
            torch.empty(1, d, dtype=dtype),
            1e-6,
            heads,
            kv_heads,
            cache,
            cache.clone(),
            torch.zeros(1, dtype=torch.int64),
        )
    lin.skinny_linear(  # one K slice (no counter), with a bias
        torch.empty(2, 64, dtype=bf16),
        torch.empty(48, 64, dtype=bf16),
        torch.empty(48, dtype=bf16),
        plan=(16, 64, 1),
    )
    for pairs in (64, 5000):  # one program; count + scatter
        moe_align(torch.zeros(pairs, 1, dtype=torch.int32), e, 64)
    for ids_dtype in (torch.int32, torch.int64):  # EPLB's counting, with and without padding
        ids = torch.zeros(64, k, dtype=ids_dtype)
        ec.count_experts(ids, torch.zeros(e, dtype=torch.int32))
        ec.count_experts(ids, torch.zeros(e, dtype=torch.int32), torch.ones(64, dtype=torch.bool))
    # redundant experts' spread over replicas: one share and four, counting and not
    for sources in (1, 4):
        spread = torch.zeros(sources, e, 3, dtype=torch.int64)
        count = torch.ones(sources, e, dtype=torch.int64)
        ids = torch.zeros(64, k, dtype=torch.int64)
        rs.spread_ids(ids, spread, count)
        rs.spread_ids(ids, spread, count, torch.zeros(e + 16, dtype=torch.int32),
                      torch.ones(64, dtype=torch.bool))  # fmt: skip
    w13 = torch.empty(e, 2 * inter, h, dtype=bf16)
    w2 = torch.empty(e, h, inter, dtype=bf16)
    from safeserve.kernels.fused_moe_fp8 import FP8_TABLE_PREFIX

    if capability == 90:  # the fused MoE at every entry of every shipped H200 table
        table = mc.load_config_table(
            str(mc.CONFIG_DIR / mc.config_file_name(e, h, inter, "NVIDIA H200"))
        )
        assert table, "no shipped H200 table"
        for path in sorted(mc.CONFIG_DIR.glob("*_NVIDIA_H200.json")):
            if path.name.startswith(FP8_TABLE_PREFIX):
                continue  # the block-FP8 tables: below
            shape = json.loads(path.read_text())["meta"]["shape"]
            te, th, ti, tk = shape["E"], shape["H"], shape["I"], shape["top_k"]
            tw13 = torch.empty(te, 2 * ti, th, dtype=bf16)  # never touched: nothing runs
            tw2 = torch.empty(te, th, ti, dtype=bf16)
            shipped = mc.load_config_table(str(path))
            assert shipped, path
            for tokens, cfg in sorted(shipped.items()):
                ids = torch.zeros(tokens, tk, dtype=torch.int32)
                weights = torch.empty(tokens, tk, dtype=torch.float32)
                x = torch.empty(tokens, th, dtype=bf16)
                fm.fused_moe(x, tw13, tw2, weights, ids, config=cfg)
        # the pair plan's optional L2 prefetch of the down weights before its wait ("pdl": true)
        ids = torch.zeros(1, k, dtype=torch.int32)
        pair = {**table[min(table)], "pdl": True}
        fm.fused_moe(torch.empty(1, h, dtype=bf16), w13, w2, torch.empty(1, k), ids, config=pair)
    # Every device without a table of its own (and float32, the engine's correctness runs): the
    # heuristic configs, fitted to the target's shared memory, at token counts that reach each
    # of its branches (the pair plan; 16, 32, 64 and 128 rows per expert tile).
    for dtype in (bf16, torch.float32):
        w13d = torch.empty(e, 2 * inter, h, dtype=dtype)
        w2d = torch.empty(e, h, inter, dtype=dtype)
        for tokens in (1, 8, 512, 2048, 4096):
            ids = torch.zeros(tokens, k, dtype=torch.int32)
            x = torch.empty(tokens, h, dtype=dtype)
            fm.fused_moe(x, w13d, w2d, torch.empty(tokens, k), ids)
    # The block-FP8 fused MoE (W8A8): its quantizer, gate/up and down at each row-tile size of
    # its default configs, with the target's pipeline depth.
    from safeserve.kernels import fused_moe_fp8 as f8

    fp8 = torch.float8_e4m3fn
    w13q, w2q = torch.empty(e, 2 * inter, h, dtype=fp8), torch.empty(e, h, inter, dtype=fp8)
    w13s = torch.empty(e, 2 * -(-inter // 128), -(-h // 128))
    w2s = torch.empty(e, -(-h // 128), -(-inter // 128))
    for dtype in (bf16, torch.float32):
        for tokens in (1, 512, 4096):
            ids = torch.zeros(tokens, k, dtype=torch.int32)
            x = torch.empty(tokens, h, dtype=dtype)
            f8.fused_moe_fp8(x, w13q, w13s, w2q, w2s, torch.empty(tokens, k), ids)
    if capability == 90:  # the block-FP8 fused MoE at every entry of every shipped H200 table
        for path in sorted(mc.CONFIG_DIR.glob(f"{f8.FP8_TABLE_PREFIX}*_NVIDIA_H200.json")):
            shape = json.loads(path.read_text())["meta"]["shape"]
            te, th, ti, tk = shape["E"], shape["H"], shape["I"], shape["top_k"]
            tw13q = torch.empty(te, 2 * ti, th, dtype=fp8)
            tw2q = torch.empty(te, th, ti, dtype=fp8)
            tw13s = torch.empty(te, -(-2 * ti // 128), -(-th // 128))
            tw2s = torch.empty(te, -(-th // 128), -(-ti // 128))
            for tokens, cfg in sorted(f8.load_fp8_table(str(path)).items()):  # type: ignore[union-attr]
                cfg = {key: v for key, v in cfg.items() if key != "tuned_us"}
                ids = torch.zeros(tokens, tk, dtype=torch.int32)
                x = torch.empty(tokens, th, dtype=bf16)
                f8.fused_moe_fp8(
                    x, tw13q, tw13s, tw2q, tw2s, torch.empty(tokens, tk), ids, config=cfg
                )
    # The block-FP8 linear (W8A8) at each row-tile size of its default configs and its split-K
    # kernel (up to 64 rows), with a bias.
    from safeserve.kernels import fp8_linear as fl

    wq, ws = torch.empty(5120, h, dtype=fp8), torch.empty(40, -(-h // 128))
    for dtype in (bf16, torch.float32):
        for rows in (1, 64, 512, 4096):
            fl.fp8_linear_w8a8(torch.empty(rows, h, dtype=dtype), wq, ws, torch.empty(5120))


def run_target(name: str) -> int:
    capability, shared, parts = TARGETS[name]
    compiled = _install_compile_only_target(capability)
    _kernel_paths_on(capability, shared)
    start = time.monotonic()
    try:
        _launch_everything(capability, shared)
    except Exception:  # noqa: BLE001 - report the compiler's message and fail
        traceback.print_exc()
        print(
            json.dumps(
                {"target": name, "error": "compile failed", "compiled_before": len(compiled)}
            )
        )
        return 1
    bad = [c for c in compiled if c["shared"] > shared or not c["has_cubin"]]
    for c in compiled:
        print(json.dumps(c))
    summary = {
        "target": name,
        "parts": parts,
        "shared_limit": shared,
        "compiled": len(compiled),
        "max_shared": max(c["shared"] for c in compiled),
        "seconds": round(time.monotonic() - start, 1),
        "over_shared_memory_or_no_cubin": bad,
    }
    print(json.dumps(summary))
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    unknown = [a for a in argv if a not in TARGETS]
    if unknown:
        print(f"unknown targets {unknown}; known: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    if len(argv) == 1:
        return run_target(argv[0])
    # each target in a process of its own (Triton's driver and kernel caches are process-wide),
    # side by side: most of the time goes to single-threaded compiles
    procs = {
        name: subprocess.Popen(
            [sys.executable, __file__, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in argv or DEFAULT_TARGETS
    }
    rc = 0
    for name, proc in procs.items():
        out, _ = proc.communicate()
        sys.stdout.write(out)
        if proc.returncode != 0:
            print(f"{name}: failed (exit {proc.returncode})")
            rc = 1
    return rc


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main(sys.argv[1:]))
