"""The CURRENT tables at the top of kernels/RESULTS.md, generated from the raw JSON in kernels/results/.

    python kernels/results_tables.py           # rewrite the section between the markers
    python kernels/results_tables.py --check   # exit 1 if that section is stale (or missing)
    python kernels/results_tables.py --list    # per kind: its files, newest first; files skipped

Standard library only. Only the text between `<!-- tables:begin -->` and `<!-- tables:end -->` is
rewritten; everything else in the file stays as it is.

A benchmark kind is one script measuring one workload on the tree as committed. The script is
told by the JSON's shape (each benchmark writes its own); the workload by the fields that change
what is measured (the engine bench: prompt length; bench_tp_decode: the layout; chaos runs: the
scenario). A file does not count for a kind when it did not measure the committed tree with the
kind's settings:

- it ran through a copy or a wrapper of the package (a command under a dot-folder such as
  `.ab_old/` or `.exp/`: the other side of an A/B, or a temporary variant);
- a flag that changes what is measured is off its default (the engine bench and bench_serve:
  the serve flags in SERVE_DEFAULTS; the fused MoE bench: a `--configs` table, `--dtype`, shape);
- its name marks it as the baseline or a variant of an A/B (a `_`-separated word of the name in
  VARIANT_WORDS), or it is listed in NOT_THE_TREE (older A/B files whose variant side carries
  a neutral name).

The newest file of a kind wins: by date (the JSON's own `meta.date` where it records one, else
the date in the file name), then the session's run number (`_runN`), then the device call
(`_callM`; `_start` comes before every call, `_final` after every numbered call of its run),
then the file name. Name new files `<what>_<device>_<YYYY-MM-DD>_run<N>_call<M>[_label].json`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "kernels" / "results"
DOC = ROOT / "kernels" / "RESULTS.md"
BEGIN = "<!-- tables:begin -->"
END = "<!-- tables:end -->"

# Serve flags that change what a bench measures, at serve's defaults (safeserve/config.py;
# tests/test_results_tables.py checks these against ServerArgs).
SERVE_DEFAULTS: dict[str, Any] = {
    "max_model_len": None,
    "max_running_requests": 64,
    "max_num_batched_tokens": 2048,
    "chunked_prefill_size": None,
    "block_size": 16,
    "num_kv_blocks": None,
    "mem_fraction_static": 0.85,
    "tp_size": 1,
    "ep_size": 1,
    "moe_a2a_backend": "none",
    "enable_dp_attention": False,
    "enable_two_batch_overlap": False,
    "enable_single_batch_overlap": False,
    "placement": "local",
    "cuda_graph_max_bs": 64,
    "cuda_graph_max_tokens": 2048,
    "disable_cuda_graph": False,
    "disable_pdl": False,
    "quantization": None,
    "kv_cache_dtype": "auto",
    "enable_deterministic_inference": False,
}
QWEN3_MODEL = "kernels/configs/qwen3-30b-a3b"

VARIANT_WORDS = {
    "old",
    "base",
    "base0",
    "base1",
    "baseline",
    "before",
    "sdpa",
    "unfused",
    "nopdl",
    "moecut",
    "heuristic",
}
NOT_THE_TREE = {
    "bench_norm_2_new_h200_2026-12-01_run12_call3": "the router-norm variant (dropped)",
    "bench_norm_4_new_h200_2026-12-01_run12_call3": "the router-norm variant (dropped)",
    "bench_min_tiles_run2_tiles2_l_h200_2026-12-01_run12_call4": "minimum split of 2 (dropped)",
    "bench_min_tiles_run2_tiles2_s_h200_2026-12-01_run12_call4": "minimum split of 2 (dropped)",
    "bench_min_tiles_run2_tiles2_x_h200_2026-12-01_run12_call4": "minimum split of 2 (dropped)",
    "bench_min_tiles_run3_tiles4_l_h200_2026-12-01_run12_call4": "minimum split of 4 (dropped)",
    "bench_min_tiles_run3_tiles4_s_h200_2026-12-01_run12_call4": "minimum split of 4 (dropped)",
    "bench_min_tiles_run3_tiles4_x_h200_2026-12-01_run12_call4": "minimum split of 4 (dropped)",
    "bench_min_tiles_run5_tiles2_l_h200_2026-12-01_run12_call4": "minimum split of 2 (dropped)",
    "bench_min_tiles_run5_tiles2_s_h200_2026-12-01_run12_call4": "minimum split of 2 (dropped)",
    "bench_min_tiles_run5_tiles2_x_h200_2026-12-01_run12_call4": "minimum split of 2 (dropped)",
}

# The peer's published figures for the Qwen3-30B-A3B MoE layer on an H200 (a Triton fused MoE
# with tuned H200 configs, same timing method), µs by token count; and the goals per token count
# (floor share, except 4,096 tokens: also >= 50 % of the bf16 matmul rate).
MOE_PEER_US = {
    1: 39.6, 8: 131.8, 16: 201.9, 32: 257.0, 64: 300.8, 128: 311.0, 256: 337.8, 1024: 415.9,
    4096: 928.6,
}  # fmt: skip
MOE_GOALS = {
    1: 0.65, 8: 0.82, 16: 0.90, 32: 0.90, 64: 0.90, 128: 0.90, 256: 0.86, 1024: 0.70, 4096: 0.32,
}  # fmt: skip
# The peer's published serving figure: vLLM on one H100 (not an H200), same model, ITL ms.
SERVE_PEER_ITL_MS = {8: 12.9, 64: 28.9}

NAME = re.compile(r"_(?P<device>h200x\d+|h200)?_?(?P<date>20\d\d-\d\d-\d\d)(?P<tail>(?:_[^_]+)*)$")


# ---------------------------------------------------------------------------------------------
# Files and their order


@dataclass
class Result:
    path: Path
    data: Any

    @property
    def stem(self) -> str:
        return self.path.stem

    @property
    def name(self) -> str:
        return self.path.name

    def _name_match(self) -> re.Match[str] | None:
        return NAME.search(self.stem)

    @property
    def date(self) -> str:
        meta = self.data.get("meta") if isinstance(self.data, dict) else None
        if isinstance(meta, dict) and meta.get("date"):
            return str(meta["date"])
        m = self._name_match()
        return m["date"] if m else "0000-00-00"

    @property
    def device(self) -> str:
        d = self.data if isinstance(self.data, dict) else {}
        meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
        found = d.get("device") or meta.get("device")
        if found:
            return str(found)
        m = self._name_match()
        tag = (m["device"] if m else None) or ""
        if tag.startswith("h200x"):
            return f"{tag[5:]} × NVIDIA H200 (from the file name)"
        return "NVIDIA H200 (from the file name)" if tag == "h200" else "not recorded"

    def order(self) -> tuple[str, int, int, str]:
        m = self._name_match()
        tail = m["tail"] if m else ""
        run = re.search(r"_run(\d+)", tail)
        call = re.search(r"_call(\d+)", tail)
        if call:
            c = int(call[1])
        elif re.search(r"_start(?:_|$)", tail):
            c = 0
        elif re.search(r"_final(?:_|$)", tail):
            c = 10**6
        else:
            c = 1
        return (self.date, int(run[1]) if run else 0, c, self.stem)


def load_results(results_dir: Path) -> list[Result]:
    out = []
    for p in sorted(results_dir.glob("*.json")):
        try:
            out.append(Result(p, json.loads(p.read_text())))
        except (OSError, json.JSONDecodeError) as e:
            print(f"results_tables: skipping {p.name}: {e}", file=sys.stderr)
    return out


def variant_reason(r: Result) -> str | None:
    """Why a file did not measure the committed tree (None when it did)."""
    if r.stem in NOT_THE_TREE:
        return NOT_THE_TREE[r.stem]
    words = set(r.stem.split("_"))
    hit = sorted(words & VARIANT_WORDS)
    if hit:
        return f"named as an A/B baseline or variant ({', '.join(hit)})"
    cmd = r.data.get("command") if isinstance(r.data, dict) else None
    if isinstance(cmd, str) and re.search(r"(?:^|/)\.[\w-]+/", cmd.split(" ", 1)[0]):
        return "ran through a copy or wrapper of the package"
    return None


# ---------------------------------------------------------------------------------------------
# Formatting


def num(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def times(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}×"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def recorded_command(cmd: str) -> str:
    """A JSON's recorded command with the repository's absolute paths made relative."""
    parts = cmd.split()
    out = []
    for i, p in enumerate(parts):
        p = re.sub(r"^/\S*?/(kernels/|safeserve/)", r"\1", p)
        if i == 0 and p.endswith("safeserve/cli.py"):
            p = "python3 -m safeserve.cli"
        elif i == 0 and p.endswith(".py"):
            p = f"python3 {p}"
        elif i == 0 and p == "safeserve":
            p = "safeserve"
        out.append(p)
    return " ".join(out)


def flag_args(pairs: list[tuple[str, Any, Any]]) -> str:
    """`--flag value` for every (flag, value, default) whose value is not the default."""
    out = []
    for flag, value, default in pairs:
        if value is None or value == default:
            continue
        out.append(flag if value is True else f"{flag} {value}")
    return " ".join(out)


def header(r: Result, title: str, command: str, rebuilt: bool, extra: str = "") -> list[str]:
    how = " (rebuilt from the options the JSON records; any it does not record are not shown)"
    how = how if rebuilt else ""
    facts = f"{r.date}, {r.device}{extra}"
    return [
        f"### {title}",
        "",
        f"{facts}. From [`{r.name}`](results/{r.name}). Command{how}:",
        "",
        "```",
        command,
        "```",
        "",
    ]


# ---------------------------------------------------------------------------------------------
# Kinds


@dataclass
class Kind:
    key: str
    title: str
    script: str
    # (result) -> workload key, None when the file is not of this kind's shape
    shape: Callable[[Result], str | None]
    # (result) -> why the file does not count for the kind (None when it does)
    settings: Callable[[Result], str | None]
    # (chosen results by workload key) -> markdown lines
    render: Callable[[dict[str, Result]], list[str]]


def _d(r: Result) -> dict[str, Any]:
    return r.data if isinstance(r.data, dict) else {}


# Fused MoE layer ------------------------------------------------------------------------------


def moe_shape(r: Result) -> str | None:
    d = _d(r)
    rows = d.get("rows")
    if isinstance(d.get("meta"), dict) and rows and "median_us" in rows[0]:
        return ""
    return None


def moe_settings(r: Result) -> str | None:
    shape = _d(r)["meta"].get("shape", {})
    if shape.get("configs"):
        return f"timed a --configs table ({shape['configs']}), not the shipped lookup"
    want = {"experts": 128, "hidden": 2048, "inter": 768, "top_k": 8, "dtype": "bfloat16"}
    off = {k: shape.get(k) for k, v in want.items() if shape.get(k, v) != v}
    return f"another layer shape {off}" if off else None


def moe_plan(cfg: dict[str, Any]) -> str:
    if not cfg:
        return "–"
    mode = cfg.get("mode", "?")
    g1, g2 = cfg.get("gemm1", {}), cfg.get("gemm2", {})
    text = f"{mode} {cfg.get('BLOCK_M', '')}".strip()
    if mode in ("pair", "chunk"):
        text = mode
    tile1 = (
        f"g1 {g1.get('BLOCK_N')}×{g1.get('BLOCK_K')} w{g1.get('num_warps')} s{g1.get('num_stages')}"
    )
    tile2 = (
        f"g2 {g2.get('BLOCK_N')}×{g2.get('BLOCK_K')} w{g2.get('num_warps')} s{g2.get('num_stages')}"
    )
    if g1.get("interleave"):
        tile1 += " il"
    if g1.get("slice"):
        tile1 += f" slice {g1['slice']}"
    if g2.get("split"):
        tile2 += f" split {g2['split']}"
    pdl = f", pdl {cfg['pdl']}" if cfg.get("pdl") not in (None, False) else ""
    return f"{text}{pdl}; {tile1}; {tile2}"


def moe_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    meta = _d(r)["meta"]
    shape = meta.get("shape", {})
    cmd = "python3 kernels/bench_fused_moe.py " + flag_args(
        [
            ("--tokens", shape.get("tokens"), None),
            ("--ceilings", shape.get("ceilings"), False),
            ("--paired-matmul", shape.get("paired_matmul"), 0),
            ("--breakdown", shape.get("breakdown"), False),
            ("--read-baseline", shape.get("read_baseline"), False),
            ("--rotations", shape.get("rotations"), 8),
            ("--reps", shape.get("reps"), 40),
        ]
    )
    versions = ", ".join(
        f"{k} {meta[k.lower()]}" for k in ("torch", "Triton") if meta.get(k.lower())
    )
    out = header(r, "Fused MoE layer, Qwen3-30B-A3B shape", cmd.strip(), True, f", {versions}")
    rows = []
    for row in _d(r)["rows"]:
        t = row["tokens"]
        peer = MOE_PEER_US.get(t)
        goal = MOE_GOALS.get(t)
        share = row.get("floor_share")
        mark = "" if goal is None or share is None else (" ✓" if share >= goal else " ✗")
        rows.append(
            [
                f"{t:,}",
                num(row.get("experts_read")),
                num(row.get("floor_us")),
                f"**{num(row.get('median_us'))}**",
                f"{num(row.get('p10_us'))}–{num(row.get('p90_us'))}",
                f"**{pct(share)}**" if goal else pct(share),
                "–" if goal is None else f"{'>' if t >= 1024 else '≥'} {goal * 100:.0f} %{mark}",
                num(row.get("TFLOPs"), 0),
                "–" if peer is None else num(peer),
                "–" if peer is None else times(peer / row["median_us"]),
                f"{row.get('rel_err', 0):.1e}",
                moe_plan(row.get("config", {})),
            ]
        )
    out += table(
        [
            "tokens",
            "experts read",
            "floor µs",
            "median µs",
            "p10–p90 µs",
            "floor share",
            "goal",
            "TFLOP/s",
            "peer µs",
            "peer / ours",
            "rel err",
            "plan / tiles",
        ],
        rows,
    )
    measured = meta.get("measured") or {}
    ceil = f"{meta.get('hbm_read_ceiling_TBps_assumed', 4.24)} TB/s"
    out += [
        "",
        f"Floor = distinct experts read × 9.44 MB ÷ {ceil} (an assumed H200 read ceiling, fixed for"
        " every run); share = floor ÷ median. Peer = the peer's published figures (a Triton fused"
        " MoE with tuned H200 configs, same method). At 4,096 tokens the goal is also ≥ 50 % of"
        " the bf16 matmul rate.",
    ]
    if measured:
        out[-1] += (
            f" Ceilings measured in this run: HBM read {num(measured.get('hbm_read_TBps'), 2)}"
            f" TB/s, bf16 matmul {num(measured.get('bf16_matmul_TFLOPs'))} TFLOP/s."
        )
    return out


# Router GEMM + top-k --------------------------------------------------------------------------


def router_shape(r: Result) -> str | None:
    rows = _d(r).get("rows")
    if rows and isinstance(rows, list) and "gemm_then_topk_us" in rows[0]:
        return ""
    return None


def router_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    args = _d(r).get("args", {})
    cmd = "python3 kernels/bench_router_topk.py " + flag_args(
        [("--tokens", args.get("tokens"), None), ("--warps", args.get("warps"), "1,2,4")]
    )
    out = header(r, "Router GEMM + top-k in one launch", cmd.strip(), True)
    rows = []
    for row in _d(r)["rows"]:
        ours = [k for k in row if k.startswith("router_topk_w") and k.endswith("_us")]
        for k in ours:
            w = k[len("router_topk_w") : -3]
            rows.append(
                [
                    f"{row['tokens']:,}",
                    num(row["gemm_then_topk_us"], 2),
                    f"**{num(row[k], 2)}** ({w} warps)",
                    times(row["gemm_then_topk_us"] / row[k]),
                    pct(row.get(f"ids_agree_w{w}")),
                ]
            )
    out += table(
        [
            "tokens",
            "GEMM + top-k µs (2 launches)",
            "router_topk µs (1 launch)",
            "2 / 1",
            "ids equal",
        ],
        rows,
    )
    out += [
        "",
        "Kernel time from a profiler trace; the engine uses the one launch up to 16 tokens.",
    ]
    return out


# q|k|v and o_proj as one-tile launches --------------------------------------------------------


def linear_shape(r: Result) -> str | None:
    d = _d(r)
    return "" if "ceiling_gbs" in d and d.get("rows") and "library_us" in d["rows"][0] else None


def linear_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    rows_seen = sorted({row["rows"] for row in _d(r)["rows"]})
    sweep = any("best" in row for row in _d(r)["rows"])
    cmd = "python3 kernels/bench_linear.py " + flag_args(
        [("--rows", ",".join(map(str, rows_seen)), "1,4,8,16"), ("--sweep", sweep, False)]
    )
    extra = f", read ceiling {num(_d(r)['ceiling_gbs'], 0)} GB/s"
    out = header(
        r, "Skinny linear (q|k|v, o_proj) against the library GEMM", cmd.strip(), True, extra
    )
    rows = []
    for row in _d(r)["rows"]:
        best = row.get("best")
        if not best:
            continue
        stages = f"{best['stages']} stage{'s' if best['stages'] != 1 else ''}"
        plan = "(" + ", ".join(map(str, best["plan"])) + f"), {stages}"
        rows.append(
            [
                f"{row['shape']} {row['n']:,} × {row['k']:,}",
                str(row["rows"]),
                num(row["floor_us"], 2),
                num(row["library_us"], 2),
                f"**{num(best['us'], 2)}**",
                plan,
                pct(row["floor_us"] / best["us"]),
                f"{100 * (best['us'] / row['library_us'] - 1):+.0f} %",
            ]
        )
    out += table(
        [
            "shape",
            "rows",
            "floor µs",
            "library µs",
            "best plan µs",
            "plan (BLOCK_N, BLOCK_K, SPLIT_K)",
            "floor share",
            "vs library",
        ],
        rows,
    )
    out += ["", "Per call: a graph of 48 calls, each with its own weight, replay ÷ 48."]
    return out


# Engine bench (safeserve bench) ---------------------------------------------------------------


def engine_is(r: Result) -> bool:
    d = _d(r)
    return "model_bytes" in d and "points" in d and "read_ceiling_gbs" in d


def engine_settings(r: Result) -> str | None:
    args = _d(r).get("args", {})
    if not str(args.get("model", "")).endswith(QWEN3_MODEL):
        return f"another model ({args.get('model')})"
    if (args.get("load_format"), args.get("dtype"), args.get("device")) != (
        "dummy",
        "bfloat16",
        "cuda",
    ):
        return "not dummy bf16 weights on CUDA"
    off = {k: args[k] for k, v in SERVE_DEFAULTS.items() if k in args and args[k] != v}
    return f"serve flags off their defaults {off}" if off else None


def engine_cmd(r: Result) -> str:
    return recorded_command(_d(r)["command"])


def engine_extra(r: Result) -> str:
    d = _d(r)
    mb = d.get("model_bytes", {})
    ctx = f", context {mb['max_model_len']:,}" if mb.get("max_model_len") else ""
    return f", torch {d.get('torch')}, read ceiling {num(d['read_ceiling_gbs'], 0)} GB/s{ctx}"


def decode_goal(conc: int, ratio: float) -> str:
    if conc == 1:
        return "≤ 2.5 " + ("✓" if ratio <= 2.5 else "✗")
    if conc >= 8:
        return "≤ 1.5 " + ("✓" if ratio <= 1.5 else "✗")
    return "–"


def engine_shape_short(r: Result) -> str | None:
    return "" if engine_is(r) and _d(r).get("input_len") == 512 else None


def engine_shape_long(r: Result) -> str | None:
    return "" if engine_is(r) and _d(r).get("input_len") == 8192 else None


def engine_shape_peer(r: Result) -> str | None:
    d = _d(r)
    return "" if engine_is(r) and d.get("input_len") == 512 and "peer" in d else None


def engine_render_short(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    d = _d(r)
    title = (
        f"Engine decode, {d['input_len']}-token prompts, {d['output_len']} out (`safeserve bench`)"
    )
    out = header(r, title, engine_cmd(r), False, engine_extra(r))
    rows = [
        [
            str(p["concurrency"]),
            num(p["tpot_ms"], 2),
            num(p["output_tok_s"], 0),
            f"**{num(p['decode_step_ms'], 2)}**",
            num(p["floor_ms"], 2),
            f"**{times(p['step_over_floor'])}**",
            decode_goal(p["concurrency"], p["step_over_floor"]),
            pct(p["ceiling_share"]),
            num(p["experts_per_layer"]),
        ]
        for p in d["points"]
    ]
    out += table(
        [
            "conc",
            "TPOT ms",
            "out tok/s",
            "step ms",
            "floor ms",
            "step/floor",
            "goal",
            "share of ceiling",
            "experts/layer",
        ],
        rows,
    )
    out += [
        "",
        "Floor = the bytes a decode step must read (dense weights, the experts its routing chose in"
        " each layer, the KV cache) ÷ the read ceiling measured at the start of the run.",
    ]
    return out


def engine_render_peer(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    d = _d(r)
    title = "Engine decode against transformers (`safeserve bench --peer transformers`)"
    out = header(r, title, engine_cmd(r), False, engine_extra(r))
    mine = {p["concurrency"]: p for p in d["points"]}
    rows = []
    for p in d["peer"]["points"]:
        m = mine.get(p["concurrency"], {})
        ratio = p.get("speedup_decode_tok_s")
        rows.append(
            [
                str(p["concurrency"]),
                num(m.get("decode_step_ms"), 2),
                times(m.get("step_over_floor")),
                num(p["decode_step_ms"], 2),
                num(p["decode_tok_s"], 1),
                num(m.get("decode_tok_s"), 1),
                f"**{times(ratio, 1)}**",
                "≥ 30× " + ("✓" if ratio and ratio >= 30 else "✗"),
            ]
        )
    out += table(
        [
            "conc",
            "our step ms",
            "our step/floor",
            "transformers step ms",
            "transformers decode tok/s",
            "our decode tok/s",
            "ours / transformers",
            "goal",
        ],
        rows,
    )
    out += [
        "",
        f"transformers: its own random weights, same config and prompts, same process,"
        f" {d['peer'].get('output_len')} tokens out. Its eager decode follows the host's speed, so"
        " the ratio moves between machines of the same kind.",
    ]
    return out


def engine_render_long(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    d = _d(r)
    title = f"Engine, {d['input_len']:,}-token prompts, {d['output_len']} out (`safeserve bench`)"
    out = header(r, title, engine_cmd(r), False, engine_extra(r))
    rows = [
        [
            str(p["concurrency"]),
            num(p["ttft_ms"], 1),
            f"**{num(p['decode_step_ms'], 3)}**",
            num(p["floor_ms"], 3),
            f"**{times(p['step_over_floor'])}**",
            pct(p["ceiling_share"]),
        ]
        for p in d["points"]
    ]
    out += table(["conc", "TTFT ms", "step ms", "floor ms", "step/floor", "share of ceiling"], rows)
    out += ["", "TTFT: until every prompt of the batch has its first token."]
    return out


# HTTP server (kernels/bench_serve.py) ---------------------------------------------------------


def serve_shape(r: Result) -> str | None:
    d = _d(r)
    if "serve_args" in d and "points" in d and d.get("input_len") == 512:
        return ""
    return None


def serve_settings(r: Result) -> str | None:
    d = _d(r)
    if d.get("url"):
        return "timed a server it did not start"
    args = list(d.get("serve_args") or [])
    seen: dict[str, str] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            key, _, val = a[2:].partition("=")
            if not val and i + 1 < len(args) and not args[i + 1].startswith("--"):
                val = args[i + 1]
            seen[key.replace("-", "_")] = val
    if not seen.get("model", "").endswith(QWEN3_MODEL):
        return f"another model ({seen.get('model')})"
    off = {}
    for k, v in seen.items():
        if k in SERVE_DEFAULTS and str(SERVE_DEFAULTS[k]) != v:
            off[k] = v
    return f"serve flags off their defaults {off}" if off else None


def serve_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    d = _d(r)
    title = f"Through the HTTP server, {d['input_len']}-token prompts, {d['output_len']} out"
    extra = f", {d.get('rounds')} rounds a point (the first a warm-up)"
    out = header(r, title, recorded_command(d["command"]), False, extra)
    rows = []
    for p in d["points"]:
        m = p["measured"]
        peer = SERVE_PEER_ITL_MS.get(p["concurrency"])
        rows.append(
            [
                str(p["concurrency"]),
                num(m["ttft_ms_median"], 1),
                f"**{num(m['itl_ms_median'], 2)}** / {num(m['itl_ms_p90'], 2)}",
                num(m["tpot_ms_median"], 2),
                num(m["output_tok_s"], 0),
                str(m.get("unfinished", 0)),
                "–" if peer is None else num(peer),
            ]
        )
    out += table(
        [
            "conc",
            "TTFT ms",
            "ITL ms (median / p90)",
            "TPOT ms",
            "out tok/s",
            "unfinished",
            "peer ITL ms (published, one H100)",
        ],
        rows,
    )
    out += [
        "",
        "Medians of the measured rounds. Peer: the peer's published figures (vLLM on one H100,"
        " same model); an H200 has about 1.4× an H100's memory bandwidth, so the comparison is"
        " indicative only.",
    ]
    return out


# Prefill of one prompt (kernels/bench_prefill.py) ---------------------------------------------


def prefill_is(r: Result) -> bool:
    d = _d(r)
    return "disable_pdl" in d and d.get("points") and "prompt_len" in d["points"][0]


def prefill_shape(r: Result) -> str | None:
    return "" if prefill_is(r) else None


def prefill_profile_shape(r: Result) -> str | None:
    return "" if prefill_is(r) and "kernels" in _d(r)["points"][0] else None


def prefill_settings(r: Result) -> str | None:
    return "--disable-pdl" if _d(r).get("disable_pdl") else None


def prefill_cmd(r: Result, profile: bool) -> str:
    pts = _d(r)["points"]
    lens = ",".join(str(p["prompt_len"]) for p in pts)
    return "python3 kernels/bench_prefill.py " + flag_args(
        [
            ("--prompt-len", lens, None),
            ("--chunk", pts[0].get("chunk"), 2048),
            ("--profile", profile, False),
        ]
    )


def prefill_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    out = header(r, "Prefill of one prompt, chunk steps", prefill_cmd(r, False).strip(), True)
    rows = []
    for p in _d(r)["points"]:
        ch = p["chunk_ms"]
        rows.append(
            [
                f"{p['prompt_len']:,}",
                f"{p['chunk']:,}",
                f"**{num(p['total_ms'], 1)}**",
                f"{len(ch)}",
                num(ch[0], 2),
                num(ch[-1], 2),
            ]
        )
    out += table(
        ["prompt tokens", "chunk", "prefill ms", "chunks", "first chunk ms", "last chunk ms"], rows
    )
    out += [
        "",
        "Prefill ms = the sum of the chunk steps' host wall times through `ModelRunner.execute`"
        " (each the median over `--runs` prompts, 3 by default); no queueing.",
    ]
    return out


def prefill_profile_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    title = "Where a long prompt's prefill kernel time goes (`bench_prefill.py --profile`)"
    out = header(r, title, prefill_cmd(r, True).strip(), True)
    pts = _d(r)["points"]
    fams = sorted(
        {f for p in pts for f in p["kernels"]},
        key=lambda f: -max(p["kernels"].get(f, {}).get("ms", 0) for p in pts),
    )
    head = ["kernel family"] + [f"{p['prompt_len']:,} tokens: launches / ms" for p in pts]
    rows = []
    for f in fams:
        if max(p["kernels"].get(f, {}).get("ms", 0) for p in pts) < 1.0:
            continue
        cells = [f]
        for p in pts:
            k = p["kernels"].get(f)
            cells.append("–" if not k else f"{k['launches']:,} / {num(k['ms'], 1)}")
        rows.append(cells)
    out += table(head, rows)
    totals = ", ".join(f"{p['prompt_len']:,} tokens {num(p['total_ms'], 1)} ms" for p in pts)
    out += [
        "",
        f"Families over 1 ms. Prefill wall time in the same run: {totals}. With dependent launches"
        " on, a kernel's span includes its wait for the one before.",
    ]
    return out


# Prefill attention (kernels/bench_prefill_attention.py) ---------------------------------------


def pattn_shape(r: Result) -> str | None:
    rows = _d(r).get("rows")
    if rows and isinstance(rows, list) and isinstance(rows[0], dict) and "peer_us" in rows[0]:
        return ""
    return None


def pattn_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    rows_in = _d(r)["rows"]
    cases = ",".join(row["case"] for row in rows_in)
    sweep = any(len(row.get("all", [])) > 1 for row in rows_in)
    cmd = "python3 kernels/bench_prefill_attention.py " + flag_args(
        [("--cases", cases, "2048@2048,2048@8192,2048@32768,4x512@512"), ("--sweep", sweep, False)]
    )
    extra = f", torch {_d(r).get('torch')}" if _d(r).get("torch") else ""
    out = header(r, "Paged prefill attention at the shipped tiles", cmd.strip(), True, extra)
    rows = []
    for row in rows_in:
        s = row["shipped"]
        c = s["config"]
        rows.append(
            [
                row["case"],
                f"{c['rows']}×{c['block_n']} w{c['num_warps']} s{c['num_stages']}",
                f"**{num(s['us'], 1)}**",
                num(s.get("tflops"), 0),
                num(row["peer_us"], 1),
                times(row["peer_us"] / s["us"]),
                f"{s.get('rel_err', 0):.1e}",
            ]
        )
    peer = rows_in[0].get("peer_backend", "SDPA")
    out += table(
        [
            "case (chunk @ context)",
            "tiles",
            "ours µs",
            "TFLOP/s",
            f"SDPA µs ({peer})",
            "SDPA / ours",
            "rel err",
        ],
        rows,
    )
    out += [
        "",
        "Peer: torch's SDPA on contiguous K/V (gathered untimed, heads repeated for GQA), causal"
        " from the bottom right. Above 1× we are ahead.",
    ]
    return out


# Where a decode step's time goes (kernels/profile_decode.py) ----------------------------------


def profile_shape(r: Result) -> str | None:
    d = _d(r)
    return "" if "label" in d and d.get("points") and "replay_ms" in d["points"][0] else None


def profile_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    pts = _d(r)["points"]
    cmd = "python3 kernels/profile_decode.py " + flag_args(
        [("--concurrency", ",".join(str(p["concurrency"]) for p in pts), "1,64")]
    )
    out = header(r, "Where a decode step's time goes", cmd.strip(), True)
    rows = []
    for p in pts:
        fams = sorted(p["families"].items(), key=lambda kv: -kv[1]["us"])[:5]
        top = "; ".join(f"{f} {v['launches']:.0f} / {v['us'] / 1000:.2f}" for f, v in fams)
        rows.append(
            [
                str(p["concurrency"]),
                num(p["step_ms"], 2),
                num(p["replay_ms"], 2),
                num(p["kernel_us_per_step"] / 1000, 2),
                f"{p['launches_per_step']:,.0f}",
                top,
            ]
        )
    out += table(
        [
            "conc",
            "step ms",
            "graph replay ms",
            "kernels ms",
            "launches/step",
            "top kernel families (launches, ms per step)",
        ],
        rows,
    )
    out += [
        "",
        "Kernel times from a torch.profiler trace of whole steps; with dependent launches a"
        " kernel's span can include its wait, so the sum can pass the replay.",
    ]
    return out


# Eager against graph steps (kernels/bench_step_host.py) ---------------------------------------


def step_host_shape(r: Result) -> str | None:
    d = _d(r)
    if isinstance(d.get("rows"), dict) and "batch" in d.get("args", {}):
        return ""
    return None


def step_host_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    a = _d(r)["args"]
    cmd = "python3 kernels/bench_step_host.py " + flag_args(
        [
            ("--batch", a.get("batch"), "8"),
            ("--prefill-len", a.get("prefill_len"), "512"),
            ("--chunk", a.get("chunk"), "256"),
            ("--steps", a.get("steps"), "10"),
        ]
    )
    out = header(r, "Decode, prefill and mixed steps: eager against CUDA graphs", cmd.strip(), True)
    rows = [
        [
            kind,
            num(v["gpu_kernels_ms"], 2),
            num(v["eager_wall_ms"], 2),
            f"**{num(v['graphs_wall_ms'], 2)}**",
            times(v["eager_wall_ms"] / v["graphs_wall_ms"], 1),
            times(v["graphs_wall_ms"] / v["gpu_kernels_ms"]),
        ]
        for kind, v in _d(r)["rows"].items()
    ]
    out += table(
        [
            "step",
            "GPU kernels ms (eager step)",
            "eager wall ms",
            "graphs wall ms",
            "eager / graphs",
            "graphs / kernels",
        ],
        rows,
    )
    return out


# Tensor-parallel decode (kernels/bench_tp_decode.py) ------------------------------------------


def tp_shape(r: Result) -> str | None:
    d = _d(r)
    a = d.get("args", {})
    if not (isinstance(d.get("rows"), list) and "tp_size" in a):
        return None
    dp = "-dp" if a.get("enable_dp_attention") else ""
    return f"tp{a['tp_size']}-ep{a['ep_size']}-{a.get('moe_a2a_backend', 'none')}{dp}"


def tp_render(chosen: dict[str, Result]) -> list[str]:
    out = ["### Tensor-parallel groups: decode steps eagerly and as CUDA graphs", ""]
    out += [
        "One file per layout, the newest of each. Command:",
        "",
        "```",
        "python3 kernels/bench_tp_decode.py --tp-size T --ep-size E [--moe-a2a-backend alltoall]"
        " [--enable-dp-attention] --concurrency 1,8,64 [--steps N]",
        "```",
        "",
    ]
    rows = []
    for layout in sorted(chosen):
        r = chosen[layout]
        d = _d(r)
        by = {(x["mode"], x["concurrency"]): x for x in d["rows"]}
        for conc in sorted({x["concurrency"] for x in d["rows"]}):
            e, g = by.get(("eager", conc)), by.get(("graphs", conc))
            rows.append(
                [
                    layout,
                    str(conc),
                    "–" if not e else num(e["step_ms_median"], 2),
                    "–" if not g else f"**{num(g['step_ms_median'], 2)}**",
                    "–" if not (e and g) else times(e["step_ms_median"] / g["step_ms_median"], 1),
                    f"[{r.date}](results/{r.name}), steps {d['args'].get('steps')}",
                ]
            )
    out += table(
        ["layout", "conc", "eager step ms", "graph step ms", "eager / graph", "from"], rows
    )
    out += [
        "",
        f"Device: {next(iter(chosen.values())).device}. Model: Qwen3-30B-A3B shapes, dummy bf16"
        " weights, 512-token prompts; a step timed on the leader from its plan to its sampled"
        " tokens.",
    ]
    return out


# Start-up warm-up (kernels/bench_first_requests.py) -------------------------------------------


def first_shape(r: Result) -> str | None:
    d = r.data
    if isinstance(d, list) and d and isinstance(d[0], dict) and "warm_up" in d[0]:
        return ""
    return None


def first_render(chosen: dict[str, Result]) -> list[str]:
    r = chosen[""]
    runs = r.data
    warm = ",".join(x["warm_up"] for x in runs)
    layers = re.search(r"_(\d+)layers", r.stem)
    note = f" ({layers[1]} layers, per the file name)" if layers else ""
    cmd = "python3 kernels/bench_first_requests.py " + flag_args(
        [("--warm-up", warm, "none,short,full")]
    )
    out = header(r, f"What the first requests after start-up pay{note}", cmd.strip(), True)
    sizes = list(runs[0]["ttft_ms"])
    rows = [
        [x["warm_up"], num(x["startup_s"], 1)]
        + [
            f"{num(x['ttft_ms'][s]['first'], 0)} / {num(x['ttft_ms'][s]['again'], 0)}"
            for s in sizes
        ]
        for x in runs
    ]
    out += table(["warm-up", "start-up s"] + [f"{int(s):,}" for s in sizes], rows)
    out += [
        "",
        "Time to first token in ms of the first request of each length / the same length again;"
        " each run a fresh process with an empty Triton cache.",
    ]
    return out


# Chaos runs (safeserve chaos run) -------------------------------------------------------------


def chaos_shape(r: Result) -> str | None:
    d = _d(r)
    return str(d["scenario"]) if "scenario" in d and "goals" in d else None


def chaos_fault(f: dict[str, Any]) -> str:
    text = f"{f['action']} @ {f.get('scheduled_s', 0):g} s"
    if f.get("node") is not None:  # a node fault: detected (node LOST or a group out of READY)
        text = f"{f['action']} node {f['node']} @ {f.get('scheduled_s', 0):g} s"
        if "detect_s" in f:
            text += f": detected in {num(f.get('detect_s'), 2)} s"
        if f["action"] == "heal":
            ready = f.get("ready_s")
            text += ": not READY by the end" if ready is None else f": READY in {num(ready, 1)} s"
    if f.get("verdict"):
        text += f": `{f['verdict']}` in {num(f.get('detect_s'), 2)} s"
    if "recovered_s" in f:
        back = f.get("recovered_s")
        text += ", not back before the end" if back is None else f", back in {num(back, 1)} s"
    surv = [num(v.get("goodput_ratio"), 2) for v in (f.get("survivors") or {}).values()]
    if surv:
        text += f", survivor goodput {', '.join(surv)}"
    return text


def chaos_render(chosen: dict[str, Result]) -> list[str]:
    out = ["### Chaos runs (`safeserve chaos run chaos/<scenario>.toml`)", ""]
    out += ["One file per scenario, the newest of each.", ""]
    rows = []
    for scen in sorted(chosen):
        r = chosen[scen]
        d = _d(r)
        req = d["requests"]
        faults = "; ".join(chaos_fault(f) for f in d.get("faults", []))
        growth = []
        by_group: dict[Any, list[float]] = {}
        rows_d = d.get("dispatch", [])
        # Only runs whose ranks reset their peak after start-up record a start-up peak apart;
        # in the others the peak is start-up's, and growth says nothing.
        if any("memory_startup_peak_bytes" in x for x in rows_d):
            for x in rows_d:
                start = x.get("memory_bytes_at_start", x.get("memory_bytes"))
                if start is not None and x.get("memory_peak_bytes") is not None:
                    gib = (x["memory_peak_bytes"] - start) / 2**30
                    growth.append(f"g{x['group']} r{x['rank']} {gib:.2f}")
                    by_group.setdefault(x["group"], []).append(gib)
        spreads = [max(v) - min(v) for v in by_group.values() if len(v) >= 2]
        spread = max(spreads) if spreads else None
        if spread is not None:
            growth.append(f"spread {spread:.2f}")
        missed = []
        for g in d["goals"]:
            if "memory growth spread" in g["goal"]:
                limit = float(str(g["target"]).lstrip("<= "))
                if spread is not None and spread > limit:
                    missed.append(f"rank memory growth spread {spread:.2f} GiB > {limit:g}")
            elif not g["ok"]:
                missed.append(g["goal"])
        rows.append(
            [
                f"[{scen}](results/{r.name})",
                r.date,
                f"{req['sent']:,} / {req['failed']} / {req['lost']}",
                pct(req.get("consistent")) + " / " + pct(req.get("reference_equal")),
                faults or "–",
                ", ".join(growth) or "–",
                "; ".join(missed) or "none",
            ]
        )
    out += table(
        [
            "scenario",
            "date",
            "requests sent / failed / lost",
            "consistent / equal to the lone reference",
            "faults",
            "memory growth GiB per rank",
            "goals missed",
        ],
        rows,
    )
    out += [
        "",
        "Consistent: completions equal to their prompt's most common output in the run; equal to"
        " the lone reference: equal to their prompt's answer sent alone after the load (runs with"
        " `[load] reference`). Survivor goodput: the other group's tokens/s in the fault window"
        " over its baseline. Memory growth (runs that record it apart from start-up): a rank's peak while serving"
        " minus the memory it held when the run began; the rank-memory spread goal (most − least"
        " growth in a group) is computed from these, not taken from the file, whose runner of"
        " 2026-11-30 measured growth from an earlier baseline.",
    ]
    return out


KINDS = [
    Kind(
        "engine-decode",
        "Engine decode, 512-token prompts",
        "safeserve bench",
        engine_shape_short,
        engine_settings,
        engine_render_short,
    ),
    Kind(
        "engine-peer",
        "Engine against transformers",
        "safeserve bench --peer transformers",
        engine_shape_peer,
        engine_settings,
        engine_render_peer,
    ),
    Kind(
        "engine-long",
        "Engine, 8,192-token prompts",
        "safeserve bench",
        engine_shape_long,
        engine_settings,
        engine_render_long,
    ),
    Kind(
        "serve", "HTTP server", "kernels/bench_serve.py", serve_shape, serve_settings, serve_render
    ),
    Kind(
        "prefill",
        "Prefill of one prompt",
        "kernels/bench_prefill.py",
        prefill_shape,
        prefill_settings,
        prefill_render,
    ),
    Kind(
        "prefill-profile",
        "Prefill kernel time",
        "kernels/bench_prefill.py --profile",
        prefill_profile_shape,
        prefill_settings,
        prefill_profile_render,
    ),
    Kind(
        "fused-moe",
        "Fused MoE layer",
        "kernels/bench_fused_moe.py",
        moe_shape,
        moe_settings,
        moe_render,
    ),
    Kind(
        "prefill-attention",
        "Prefill attention",
        "kernels/bench_prefill_attention.py",
        pattn_shape,
        lambda r: None,
        pattn_render,
    ),
    Kind(
        "router-topk",
        "Router + top-k",
        "kernels/bench_router_topk.py",
        router_shape,
        lambda r: None,
        router_render,
    ),
    Kind(
        "linear",
        "Skinny linear",
        "kernels/bench_linear.py",
        linear_shape,
        lambda r: None,
        linear_render,
    ),
    Kind(
        "profile-decode",
        "Decode profile",
        "kernels/profile_decode.py",
        profile_shape,
        lambda r: None,
        profile_render,
    ),
    Kind(
        "step-host",
        "Eager against graph steps",
        "kernels/bench_step_host.py",
        step_host_shape,
        lambda r: None,
        step_host_render,
    ),
    Kind(
        "tp-decode",
        "Tensor-parallel decode",
        "kernels/bench_tp_decode.py",
        tp_shape,
        lambda r: None,
        tp_render,
    ),
    Kind(
        "first-requests",
        "First requests",
        "kernels/bench_first_requests.py",
        first_shape,
        lambda r: None,
        first_render,
    ),
    Kind("chaos", "Chaos runs", "safeserve chaos run", chaos_shape, lambda r: None, chaos_render),
]


# ---------------------------------------------------------------------------------------------
# Selection and the section


@dataclass
class Selection:
    chosen: dict[str, dict[str, Result]]  # kind key -> workload key -> newest file
    candidates: dict[str, dict[str, list[Result]]]  # newest first
    skipped: dict[str, list[tuple[str, str]]]  # kind key -> (file, why)
    unmatched: list[str]


def select(results: list[Result]) -> Selection:
    chosen: dict[str, dict[str, Result]] = {}
    cands: dict[str, dict[str, list[Result]]] = {}
    skipped: dict[str, list[tuple[str, str]]] = {}
    matched: set[str] = set()
    for kind in KINDS:
        for r in results:
            try:
                key = kind.shape(r)
            except (KeyError, TypeError, IndexError, AttributeError):
                key = None
            if key is None:
                continue
            matched.add(r.name)
            why = variant_reason(r) or kind.settings(r)
            if why:
                skipped.setdefault(kind.key, []).append((r.name, why))
                continue
            cands.setdefault(kind.key, {}).setdefault(key, []).append(r)
        for key, rs in cands.get(kind.key, {}).items():
            rs.sort(key=Result.order, reverse=True)
            chosen.setdefault(kind.key, {})[key] = rs[0]
    unmatched = [r.name for r in results if r.name not in matched]
    return Selection(chosen, cands, skipped, unmatched)


def render(sel: Selection) -> str:
    lines = [
        "<!-- Generated by kernels/results_tables.py from kernels/results/*.json: do not edit by"
        " hand; run `python kernels/results_tables.py` after adding results. -->",
        "",
    ]
    for kind in KINDS:
        got = sel.chosen.get(kind.key)
        if not got:
            continue
        lines += kind.render(got)
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def splice(doc: str, section: str) -> str:
    """doc with the text between the markers replaced by section (markers kept)."""
    b, e = doc.find(BEGIN), doc.find(END)
    if b < 0 or e < 0 or e < b:
        raise ValueError(f"markers {BEGIN} ... {END} not found in order")
    return doc[: b + len(BEGIN)] + "\n" + section + doc[e:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the section is stale")
    ap.add_argument("--list", action="store_true", help="print each kind's files and the skips")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="folder of raw JSON")
    ap.add_argument("--doc", type=Path, default=DOC, help="the Markdown file to update")
    ns = ap.parse_args(argv)
    sel = select(load_results(ns.results))
    if ns.list:
        for kind in KINDS:
            print(f"{kind.key} ({kind.script}):")
            for key, rs in sorted(sel.candidates.get(kind.key, {}).items()):
                label = f" [{key}]" if key else ""
                for i, r in enumerate(rs):
                    print(f"  {'*' if i == 0 else ' '}{label} {r.name}")
            for name, why in sel.skipped.get(kind.key, []):
                print(f"   - {name}: {why}")
        print("not of any kind (sweeps, config tables, workloads no kind tracks):")
        for name in sel.unmatched:
            print(f"   - {name}")
        return 0
    section = render(sel)
    try:
        doc = ns.doc.read_text()
        new = splice(doc, section)
    except (OSError, ValueError) as e:
        print(f"results_tables: {ns.doc}: {e}", file=sys.stderr)
        return 1 if ns.check else 2
    if ns.check:
        if new != doc:
            print(
                f"results_tables: the generated tables in {ns.doc} are stale; run"
                " `python kernels/results_tables.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    if new != doc:
        ns.doc.write_text(new)
        print(f"results_tables: updated {ns.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
