"""The peer of kernels/bench_fused_moe_fp8.py: SGLang's Triton `fused_moe` in its block-FP8 W8A8
mode (`use_fp8_w8a8=True`, `block_shape=[128, 128]`), run on our tensors.

SGLang's code is never in this repository: kernels/fetch_peer_sglang.sh copies its files from an
SGLang checkout into the git-ignored .peer/sglang/ (COMMIT names the commit). `load` takes from
those files only the `@triton.jit` functions it launches, cut out with `ast` and executed in a
namespace holding `triton` and `tl` (the sglang package is never imported; the GPU machine has
neither sglang nor sgl_kernel nor vllm):

- `fused_moe_kernel` (and `write_zeros_to_output`, which it calls) of
  fused_moe_triton_kernels.py: both GEMMs;
- `_per_token_group_quant_8bit` of fp8_kernel.py: the activation quantizer, per token and 128
  columns (SGLang's `per_token_group_quant_fp8` off CUDA; on CUDA SGLang calls sgl_kernel's CUDA
  quantizer instead, same math).

Everything around them is ours, mirroring `_fused_moe_kernel_sequence` and
`invoke_fused_moe_kernel` of the copied commit (moe_runner/triton_utils/fused_moe.py,
fused_moe_triton_kernels.py) for block FP8 with a gated SiLU, no bias, no EP (`filter_expert`
False: all experts local, as a TP run), no fused all-reduce, routed scaling 1:

1. quantize x per token and 128 columns (the Triton kernel above), launched as
   `_per_token_group_quant_8bit_raw` launches it;
2. align: our `safeserve.kernels.moe_align`, whose outputs are the format the peer kernel reads
   (int32 pair ids sorted by expert, each expert padded to BLOCK_SIZE_M, sentinel = number of
   pairs; int32 expert of each row tile; int32 rows in use). SGLang's own align is a CUDA op of
   sgl_kernel. Ours sizes its buffer to the pairs' bound (`max_padded_blocks`), SGLang's to
   pairs + (E + 1) * (BLOCK_SIZE_M - 1): the peer's grid has fewer programs that exit at once;
3. gate/up: `fused_moe_kernel` into a bf16 [pairs, 2I] buffer, the launch arguments of
   `invoke_fused_moe_kernel` (strides, group_n = group_k = 128, even_Ks, swap_ab by SGLang's
   `should_enable_swap_ab` rule);
4. SiLU-and-mul as plain torch ops (on CUDA SGLang calls `silu_and_mul` of its JIT-compiled
   CUDA kernels, `sglang.jit_kernel.activation`, which needs the sglang package; this is the
   torch fallback of the same file): two launches instead of one;
5. quantize the bf16 intermediate (as 1.) and down: `fused_moe_kernel` with the routing weight,
   one row per pair into [T, top_k, H] (top-1: straight into the result);
6. the top-k sum as plain torch (`torch.add` for top-2, else `torch.sum`; SGLang uses
   sgl_kernel's `moe_sum_reduce` above 32 tokens and a torch.compile'd sum at or below).

Tiles (`config=None`): SGLang's tuned table of the shape
(`configs/triton_<version>/E=..,N=<I>,device_name=..,dtype=fp8_w8a8,block_shape=[128, 128].json`,
the running Triton's version first, else the other versions newest first; the entry nearest by
token count; a `_down` table, where one exists, for the down GEMM), else SGLang's
`get_default_config` for block FP8 (re-implemented here, `fused_moe_triton_config.py`). A down
table's `USE_TMA` (tensor-descriptor loads, sorted intermediate) is not mirrored: that launch runs
without TMA and the config says so.

Layouts match ours: w13 [E, 2I, H] gate rows then up rows, its scales [E, 2I/128, H/128] gate's
tiles then up's (SGLang's w13_weight_scale_inv), w2 [E, H, I] with [E, H/128, I/128]; H and I
must be multiples of 128 (SGLang requires it of block-FP8 experts too).
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from safeserve.kernels.common import HAS_TRITON, tl, triton
from safeserve.kernels.fp8_reference import token_group_quantize
from safeserve.kernels.moe_align import moe_align

GROUP = 128  # block_shape [128, 128]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max, SGLang's bit8_max on CUDA
EPS = 1e-10  # _per_token_group_quant_8bit_raw's default eps
TABLE_SUFFIX = ",dtype=fp8_w8a8,block_shape=[128, 128]"
# `get_default_config` for dtype fp8_w8a8 with a block shape, not on ROCm
# (fused_moe_triton_config.py: BLOCK_SIZE_N = block_shape[0], BLOCK_SIZE_K = block_shape[1]).
DEFAULT_CONFIG = {
    "BLOCK_SIZE_M": 64,
    "BLOCK_SIZE_N": GROUP,
    "BLOCK_SIZE_K": GROUP,
    "GROUP_SIZE_M": 32,
    "num_warps": 4,
    "num_stages": 3,
}
LAUNCH_KEYS = ("num_warps", "num_stages")
KERNELS = {  # file of the copy -> the jit functions taken from it
    "fused_moe_triton_kernels.py": ("fused_moe_kernel", "write_zeros_to_output"),
    "fp8_kernel.py": ("_per_token_group_quant_8bit",),
}
# Older SGLang kept fused_moe_kernel in fused_moe.py.
FALLBACK_FILES = {"fused_moe_triton_kernels.py": "fused_moe.py"}


def _is_triton_jit(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return (
        isinstance(target, ast.Attribute)
        and target.attr == "jit"
        and isinstance(target.value, ast.Name)
        and target.value.id == "triton"
    )


def _free_names(fn: ast.FunctionDef) -> set[str]:
    """Names a function reads that it neither takes nor binds (its globals and builtins)."""
    bound = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    loaded = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    return loaded - bound


def extract_jit_functions(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The module-level `@triton.jit` functions `names` of the file `path`, without running the
    rest of it: every other line is blanked (so line numbers, and `inspect.getsource`, which
    Triton reads, stay those of the file), decorators other than `triton.jit` included, and
    the result executed in a namespace of `triton` and `tl`."""
    src = path.read_text()
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    keep = [False] * (len(lines) + 1)  # 1-based
    found: dict[str, ast.FunctionDef] = {}

    def mark(node: ast.AST) -> None:
        for n in range(node.lineno, node.end_lineno + 1):  # type: ignore[attr-defined]
            keep[n] = True

    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            mark(node)  # SGLang's `from __future__ import annotations`: same annotations
        elif isinstance(node, ast.FunctionDef) and node.name in names:
            jits = [d for d in node.decorator_list if _is_triton_jit(d)]
            if not jits:
                raise RuntimeError(f"{path}: {node.name} is not a @triton.jit function")
            for dec in jits:
                mark(dec)
            for n in range(node.lineno, node.end_lineno + 1):  # the def and its body
                keep[n] = True
            found[node.name] = node
    missing = set(names) - set(found)
    if missing:
        raise RuntimeError(f"{path}: no module-level jit function {sorted(missing)}")
    namespace: dict[str, Any] = {"__name__": f"_peer_sglang_{path.stem}", "triton": triton}
    namespace["tl"] = tl
    known = set(namespace) | set(names) | set(dir(builtins))
    for name, node in found.items():
        unknown = _free_names(node) - known
        if unknown:
            raise RuntimeError(f"{path}: {name} needs {sorted(unknown)}, not provided")
    blanked = "".join(line if keep[i + 1] else "\n" for i, line in enumerate(lines))
    exec(compile(blanked, str(path), "exec", dont_inherit=True), namespace)
    return {name: namespace[name] for name in names}


def _off(value: Any) -> bool:
    return value is None or (type(value) in (bool, int) and value == 0)


def _launch(kernel: Any, grid: tuple[int, ...], args: dict[str, Any]) -> None:
    """Launch `kernel` with `args` by parameter name (launch options aside): a parameter of the
    kernel not in `args` is an error, and so is an argument the kernel lacks unless it is off
    (None, False or 0: a feature of a later SGLang that this one does not have)."""
    params = inspect.signature(kernel.fn).parameters
    call = {k: v for k, v in args.items() if k in params or k in LAUNCH_KEYS}
    extra = [k for k, v in args.items() if k not in call and not _off(v)]
    missing = [k for k in params if k not in args]
    if extra or missing:
        raise RuntimeError(
            f"{kernel.fn.__name__}: the copied peer's parameters differ from the harness's "
            f"(missing {missing}, unknown {extra})"
        )
    kernel[grid](**call)


def _version_dirs(configs: Path, triton_version: str) -> list[str]:
    """`get_moe_configs`' search order: the running Triton's directory, then the others
    newest first."""
    current = "triton_" + triton_version.replace(".", "_")
    others = sorted(
        (
            d.name.removeprefix("triton_").replace("_", ".")
            for d in configs.iterdir()
            if d.is_dir() and d.name.startswith("triton_") and d.name != current
        ),
        key=lambda v: tuple(int(x) for x in v.split(".")),
        reverse=True,
    )
    return [current] + ["triton_" + v.replace(".", "_") for v in others]


@functools.lru_cache(maxsize=64)
def _table(
    configs: Path, file_name: str, triton_version: str
) -> tuple[dict[int, dict[str, Any]], str] | None:
    if not configs.is_dir():
        return None
    for version in _version_dirs(configs, triton_version):
        path = configs / version / file_name
        if path.is_file():
            table = {int(k): v for k, v in json.loads(path.read_text()).items()}
            return table, f"{version}/{file_name}"
    return None


def _nearest(table: dict[int, dict[str, Any]], num_tokens: int) -> dict[str, Any]:
    # try_get_optimal_moe_config: configs[min(configs.keys(), key=lambda x: abs(x - M))]
    return dict(table[min(table.keys(), key=lambda x: abs(x - num_tokens))])


def lookup_config(
    configs: Path,
    num_tokens: int,
    num_experts: int,
    inter: int,
    device_name: str,
    triton_version: str,
) -> dict[str, Any]:
    """SGLang's tiles for block FP8 (`try_get_optimal_moe_config` with return_down_config):
    {"up": the gate/up config, "down": the down GEMM's (None: the same), "table": the table
    file under `configs`, None for `get_default_config`'s}."""
    file_name = f"E={num_experts},N={inter},device_name={device_name.replace(' ', '_')}"
    file_name += TABLE_SUFFIX
    found = _table(configs, file_name + ".json", triton_version)
    if found is None:
        return {"up": dict(DEFAULT_CONFIG), "down": None, "table": None}
    down_found = _table(configs, file_name + "_down.json", triton_version)
    return {
        "up": _nearest(found[0], num_tokens),
        "down": _nearest(down_found[0], num_tokens) if down_found else None,
        "table": found[1],
    }


def swap_ab_rule(config: dict[str, Any], device: torch.device) -> bool:
    """SGLang's `should_enable_swap_ab` (batch-invariant mode off): an SM90 part with CUDA >=
    12.3, BLOCK_SIZE_M < 64 and BLOCK_SIZE_N >= 64."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    sm90 = torch.cuda.get_device_capability(device)[0] == 9
    cuda = tuple(int(x) for x in torch.version.cuda.split(".")[:2]) >= (12, 3)
    return sm90 and cuda and config["BLOCK_SIZE_M"] < 64 and config["BLOCK_SIZE_N"] >= 64


class SGLangFusedMoE:
    """`__call__(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, config=None)`:
    the peer's block-FP8 fused MoE, [T, H] in x's dtype (bf16; fp16 or float32 run SGLang's
    fp16 compute type, as SGLang does for them)."""

    def __init__(self, peer_dir: Path) -> None:
        self.peer_dir = peer_dir
        commit_file = peer_dir / "COMMIT"
        self.commit = commit_file.read_text().split()[0] if commit_file.is_file() else "unknown"
        jit: dict[str, Any] = {}
        for file_name, names in KERNELS.items():
            path = peer_dir / file_name
            if not path.is_file() and file_name in FALLBACK_FILES:
                path = peer_dir / FALLBACK_FILES[file_name]
            jit.update(extract_jit_functions(path, names))
        self.moe_kernel = jit["fused_moe_kernel"]
        self.quant_kernel = jit["_per_token_group_quant_8bit"]

    def config_for(
        self, num_tokens: int, num_experts: int, inter: int, device: torch.device | str
    ) -> dict[str, Any]:
        """The peer's own tiles for this call: `lookup_config`'s (SGLang's tables in the copy,
        this device's name, the running Triton's version) and "swap_ab": [up, down]."""
        device = torch.device(device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        configs = self.peer_dir / "configs"
        out = lookup_config(configs, num_tokens, num_experts, inter, name, triton.__version__)
        if out["down"] is not None and out["down"].pop("USE_TMA", False):
            out["down_USE_TMA_not_mirrored"] = True
        down = out["down"] or out["up"]
        out["swap_ab"] = [swap_ab_rule(out["up"], device), swap_ab_rule(down, device)]
        return out

    def _quant(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_per_token_group_quant_8bit_raw(a, 128)`: FP8 a and float32 scales [rows, K/128]
        (row-major: what `invoke_fused_moe_kernel` passes as A_scale)."""
        assert a.is_contiguous() and a.shape[-1] % GROUP == 0
        q = torch.empty_like(a, dtype=FP8)
        s = torch.empty(*a.shape[:-1], a.shape[-1] // GROUP, dtype=torch.float32, device=a.device)
        groups = a.numel() // GROUP
        if groups:
            block = triton.next_power_of_2(GROUP)
            args = {
                "y_ptr": a,
                "y_q_ptr": q,
                "y_s_ptr": s,
                "y_stride": GROUP,
                "N": GROUP,
                "eps": EPS,
                "bit8_min": -FP8_MAX,
                "bit8_max": FP8_MAX,
                "BLOCK": block,
                "num_warps": min(max(block // 256, 1), 8),
                "num_stages": 1,
            }
            _launch(self.quant_kernel, (groups,), args)
        return q, s

    def _gemm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        b_scale: torch.Tensor,
        c: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        mul_routed_weight: bool,
        top_k: int,
        router_topk: int,
        config: dict[str, Any],
        swap_ab: bool,
        torch_quant: bool,
    ) -> None:
        """`invoke_fused_moe_kernel` with use_fp8_w8a8, block_shape [128, 128], no bias, no
        TMA, filter_expert False, no fused add or all-reduce."""
        sorted_ids, expert_ids, npost = align
        aq, a_scale = token_group_quantize(a, GROUP) if torch_quant else self._quant(a)
        assert triton.cdiv(b.shape[-2], GROUP) == b_scale.shape[-2]
        assert triton.cdiv(b.shape[-1], GROUP) == b_scale.shape[-1]
        bm, bn = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"]
        grid = (triton.cdiv(sorted_ids.shape[0], bm) * triton.cdiv(b.shape[1], bn),)
        args = {
            "a_ptr": aq,
            "a_desc": None,
            "b_ptr": b,
            "b_desc": None,
            "bias_ptr": None,
            "c_ptr": c,
            "a_scale_ptr": a_scale,
            "b_scale_ptr": b_scale,
            "topk_weights_ptr": topk_weights,
            "sorted_token_ids_ptr": sorted_ids,
            "expert_ids_ptr": expert_ids,
            "num_tokens_post_padded_ptr": npost,
            "add_mask_ptr": None,
            "N": b.shape[1],
            "K": b.shape[2],
            "EM": sorted_ids.shape[0],
            "num_valid_tokens": topk_ids.numel(),
            "stride_am": aq.stride(0),
            "stride_ak": aq.stride(1),
            "stride_be": b.stride(0),
            "stride_bk": b.stride(2),
            "stride_bn": b.stride(1),
            "stride_bias_e": 0,
            "stride_bias_n": 0,
            "stride_cm": c.stride(-2),
            "stride_cn": c.stride(-1),
            "stride_asm": a_scale.stride(0),
            "stride_ask": a_scale.stride(1),
            "stride_bse": b_scale.stride(0),
            "stride_bsk": b_scale.stride(2),
            "stride_bsn": b_scale.stride(1),
            "group_n": GROUP,
            "group_k": GROUP,
            "MUL_ROUTED_WEIGHT": mul_routed_weight,
            "top_k": top_k,
            "compute_type": tl.bfloat16 if c.dtype == torch.bfloat16 else tl.float16,
            "use_fp8_w8a8": True,
            "use_int8_w8a8": False,
            "use_int8_w8a16": False,
            "per_channel_quant": False,
            "even_Ks": b.shape[2] % config["BLOCK_SIZE_K"] == 0,
            "c_sorted": False,
            "filter_expert": False,
            "swap_ab": swap_ab,
            "FUSE_ADD_TO_OUTPUT": False,
            "FUSE_SUM_ALL_REDUCE": False,
            "ROUTER_TOPK": router_topk,
            **config,
        }
        _launch(self.moe_kernel, grid, args)

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w13_scale_inv: torch.Tensor,
        w2: torch.Tensor,
        w2_scale_inv: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        config: dict[str, Any] | None = None,
        *,
        swap_ab: bool | None = None,
        torch_quant: bool = False,
    ) -> torch.Tensor:
        """`config`: one config (SGLang's keys) for both GEMMs, else the peer's own
        (`config_for`); `swap_ab`: force SGLang's swap_ab on or off (default: its rule);
        `torch_quant`: quantize the activations with `fp8_reference.token_group_quantize` (same
        math) instead of the peer's Triton quantizer, for Triton's interpreter, whose
        float-to-FP8 cast does not round to nearest (`common.round_e4m3`)."""
        assert x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.is_contiguous()
        num_tokens, hidden = x.shape
        num_experts, two_i, _ = w13.shape
        inter = two_i // 2
        top_k = topk_ids.shape[1]
        assert hidden % GROUP == 0 and inter % GROUP == 0, "H and I must be multiples of 128"
        assert w13.is_contiguous() and w2.is_contiguous() and topk_weights.stride(1) == 1
        if config is None:
            chosen = self.config_for(num_tokens, num_experts, inter, x.device)
            up, down = chosen["up"], chosen["down"] or chosen["up"]
            swap_up, swap_down = chosen["swap_ab"]
        else:
            up = down = config
            swap_up = swap_down = swap_ab_rule(config, x.device)
        if swap_ab is not None:
            swap_up = swap_down = swap_ab
        assert up["BLOCK_SIZE_M"] == down["BLOCK_SIZE_M"]  # one align serves both GEMMs
        out = torch.empty_like(x)
        if num_tokens == 0:
            return out
        align = moe_align(topk_ids, num_experts, up["BLOCK_SIZE_M"])
        pairs = num_tokens * top_k
        cache1 = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
        self._gemm(
            x, w13, w13_scale_inv, cache1, topk_weights, topk_ids, align, False, top_k, 1, up,
            swap_up, torch_quant,
        )  # fmt: skip
        # silu_and_mul: a CUDA kernel of the sglang package in SGLang, unavailable here; torch
        cache2 = torch.mul(F.silu(cache1[:, :inter]), cache1[:, inter:])
        # top-1 writes straight into the result, as SGLang's `_use_intermediate` False
        cache3 = (
            out.unsqueeze(0)
            if top_k == 1
            else torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)
        )
        self._gemm(
            cache2, w2, w2_scale_inv, cache3, topk_weights, topk_ids, align, True, 1, top_k, down,
            swap_down, torch_quant,
        )  # fmt: skip
        # the top-k sum: sgl_kernel's moe_sum_reduce (or a torch.compile'd sum) in SGLang; torch
        if top_k == 2:
            torch.add(cache3[:, 0], cache3[:, 1], out=out)
        elif top_k > 2:
            torch.sum(cache3, dim=1, out=out)
        return out


def load(peer_dir: str | os.PathLike[str]) -> SGLangFusedMoE:
    """The peer from a copy made by kernels/fetch_peer_sglang.sh (needs Triton)."""
    if not HAS_TRITON:
        raise RuntimeError("the SGLang peer needs Triton")
    path = Path(peer_dir).resolve()
    if not (path / "COMMIT").is_file():
        raise FileNotFoundError(f"{path}: no SGLang copy (run kernels/fetch_peer_sglang.sh)")
    return SGLangFusedMoE(path)
