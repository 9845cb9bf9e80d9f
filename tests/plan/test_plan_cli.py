"""`safeserve plan` from the command line: its output, and bad input (one line, exit 2; a target
no layout meets: the best it can do, exit 1)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from plan_cli import ROOT, plan

from safeserve.moe.eplb.distribution import write_expert_distribution

QWEN3 = "kernels/configs/qwen3-30b-a3b"


def one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("safeserve plan: error: "), lines[0]
    return lines[0]


def test_the_table_names_every_layout_and_recommends_one() -> None:
    r = plan("--model", QWEN3, "--gpu", "h200", "--concurrency", "1,64")
    assert r.returncode == 0, r.stderr
    for name in ("8x EP1", "4x EP2 TP-attn", "4x EP2 DP-attn", "1x EP8 DP-attn"):
        assert name in r.stdout
    assert "recommended: safeserve serve --tp-size 1 --ep-size 1 --num-groups 8" in r.stdout
    assert "[plan]" in r.stderr  # progress goes to stderr, the plan to stdout


def test_the_documented_example_prints_what_the_docs_show() -> None:
    """docs/plan.md's worked example, run: its output is the block the page shows."""
    import re
    import shlex

    page = (ROOT / "docs" / "plan.md").read_text()
    example = page[page.index("## Example") :]
    (lang, command), (_, shown) = re.findall(r"```(\w*)\n(.*?)```", example, re.S)[:2]
    assert lang == "sh"
    command = command.replace("\\\n", " ")
    argv = shlex.split(command)
    assert argv[:2] == ["safeserve", "plan"]
    r = plan(*argv[2:])
    assert r.returncode == 0, r.stderr
    assert r.stdout == shown


def test_the_readme_example_is_lines_of_what_the_command_prints() -> None:
    """README's abridged plan example: its command, run, prints every line the README shows."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", readme, re.S)
    i = next(i for i, (lang, b) in enumerate(blocks) if lang == "sh" and "safeserve plan" in b)
    argv = shlex.split(blocks[i][1].replace("\\\n", " "))
    assert argv[:2] == ["safeserve", "plan"]
    r = plan(*argv[2:])
    assert r.returncode == 0, r.stderr
    printed = r.stdout.splitlines()
    shown = blocks[i + 1][1].splitlines()
    assert shown and all(line in printed for line in shown), (shown, printed)


def test_json_for_scripts() -> None:
    r = plan("--model", QWEN3 + "/config.json", "--gpu", "H200", "--nodes", "2", "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    ep16 = next(lp for lp in doc["layouts"] if lp["name"] == "1x EP16 DP-attn")
    assert ep16["in_node_share"] == 0.5
    assert {p["concurrency"] for p in ep16["points"]} == {1, 8, 16, 32, 64, 128, 256}
    assert doc["recommended"] and doc["target_met"] is True


def test_step_traffic_and_the_share_inside_a_node() -> None:
    """Mixtral-8x7B (8 experts, top-2, 32 MoE layers, hidden 4096) on two GPUs, one sequence per
    attention rank: a token misses the other rank's 4 experts with p = 4/8 x 3/7 = 3/14, so it
    sends 1 - 3/14 = 11/14 rows of 4096 bf16 there, in each layer's dispatch and combine."""
    args = ["--model", "kernels/configs/mixtral-8x7b", "--gpu", "h200", "--gpus-per-node", "2"]
    r = plan(*args, "--concurrency", "2", "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    ep2 = next(lp for lp in doc["layouts"] if lp["name"] == "1x EP2 DP-attn")
    (point,) = ep2["points"]
    assert point["a2a_bytes"] == pytest.approx(11 / 14 * 4096 * 2)
    assert point["a2a_step_bytes"] == pytest.approx(2 * 32 * 11 / 14 * 4096 * 2)  # 0.41 MB
    ep1 = next(lp for lp in doc["layouts"] if lp["name"] == "2x EP1")
    assert ep1["points"][0]["a2a_step_bytes"] == 0.0
    # two nodes of 8 GPUs, and four: the rows that stay on NVLink at each EP width
    r = plan("--model", QWEN3, "--gpu", "h200", "--nodes", "4", "--concurrency", "1,64")
    assert r.returncode == 0, r.stderr
    assert (
        "share of a token's dispatch and combine destinations inside its node (8 GPUs): "
        "EP2 100%, EP4 100%, EP8 100%, EP16 50%, EP32 25%"
    ) in r.stdout
    assert "a2a MB" in r.stdout


def plan_doc(*args: str) -> dict:
    r = plan("--model", QWEN3, "--gpu", "h200", *args, "-o", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_blast_radius_per_layout() -> None:
    """One failed GPU takes its group down: ceil(concurrency / groups) requests, 1/groups of
    the capacity."""
    doc = plan_doc("--concurrency", "1,64,255")
    want = {"8x EP1": 8, "4x EP2 TP-attn": 4, "2x EP4 DP-attn": 2, "1x EP8 DP-attn": 1}
    for lp in doc["layouts"]:
        if lp["name"] not in want:
            continue
        groups = want.pop(lp["name"])
        assert lp["num_groups"] == groups
        got = {
            p["concurrency"]: (p["blast_radius_requests"], p["blast_radius_share"])
            for p in lp["points"]
        }
        assert got == {c: (-(-c // groups), 1 / groups) for c in (1, 64, 255)}
    assert not want
    ep1 = next(lp for lp in doc["layouts"] if lp["name"] == "8x EP1")
    assert [p["blast_radius_requests"] for p in ep1["points"]] == [1, 8, 32]


def test_the_recommendation_and_its_reasons() -> None:
    """The smallest group width that holds the largest concurrency and meets the target there,
    the faster attention mode of that width; else the best possible."""
    # no target: 8 groups of one GPU hold 256 (8 x 1,043 requests of 40 blocks)
    doc = plan_doc("--concurrency", "1,256")
    assert doc["recommended"] == "8x EP1" and doc["target_met"]
    assert doc["reasons"] == [
        "smallest group that holds 256 requests of 512+128 tokens: 1 GPU (weights 56.9 GiB per "
        "GPU, KV cache 668,080 tokens per attention rank)",
        "8 groups: one failed GPU interrupts 32 requests (they move to the other groups) and "
        "12% of capacity",
    ]
    # 10,000 requests: one GPU's groups hold 8,344; two GPUs' hold 12,152 (TP) and 12,032 (DP)
    doc = plan_doc("--concurrency", "1,10000")
    by_name = {lp["name"]: lp for lp in doc["layouts"]}
    assert by_name["8x EP1"]["sizing"]["max_concurrency"] == 8344 < 10000
    assert doc["recommended"].startswith("4x EP2")
    assert doc["reasons"][0].startswith("smallest group that holds 10000 requests")
    # a target EP1 misses at 256 (14.92 ms) and EP2 meets: the faster of its two modes
    doc = plan_doc("--concurrency", "1,256", "--tpot-target-ms", "10")
    by_name = {lp["name"]: lp for lp in doc["layouts"]}
    tpot = {n: lp["points"][-1]["tpot_ms"] for n, lp in by_name.items()}
    assert tpot["8x EP1"] > 10 and tpot["4x EP2 TP-attn"] < tpot["4x EP2 DP-attn"] <= 10
    assert doc["recommended"] == "4x EP2 TP-attn" and doc["target_met"]
    assert doc["reasons"][1] == f"predicted TPOT {tpot['4x EP2 TP-attn']:.2f} ms <= target 10 ms"


def test_the_recommended_command_runs_the_planned_requests_at_once() -> None:
    """A group planned for more requests than --max-running-requests (64 by default) would queue
    the rest: the recommended command raises it; not where the flag already allows them."""
    doc = plan_doc("--concurrency", "1,256", "--tpot-target-ms", "6")
    assert doc["recommended"] == "1x EP8 DP-attn"
    assert doc["recommended_flags"] == (
        "--tp-size 8 --ep-size 8 --moe-a2a-backend alltoall --enable-dp-attention "
        "--max-running-requests 256"
    )
    assert doc["reasons"][-1] == (
        "256 requests per group: above --max-running-requests 64, so the command raises it "
        "(a preset sets it too)"
    )
    doc = plan_doc(
        "--concurrency", "1,256", "--tpot-target-ms", "6", "--max-running-requests", "256"
    )
    assert doc["recommended_flags"].endswith("--enable-dp-attention")
    assert not any("--max-running-requests" in r for r in doc["reasons"])
    doc = plan_doc("--concurrency", "1,256")  # 8 groups of 32
    assert doc["recommended_flags"] == "--tp-size 1 --ep-size 1 --num-groups 8"


def test_an_unmet_target_says_the_best_and_exits_1() -> None:
    r = plan("--model", QWEN3, "--gpu", "h200", "--concurrency", "64", "--tpot-target-ms", "0.5")
    assert r.returncode == 1
    assert "best possible:" in r.stdout
    assert "no layout meets TPOT 0.5 ms at concurrency 64; the best is" in r.stdout


def test_unknown_gpu_lists_the_known(tmp_path: Path) -> None:
    line = one_error_line(plan("--model", QWEN3, "--gpu", "tpu-v9"))
    assert "'tpu-v9' is not known; known: h200, h100" in line and "cpu" in line


def test_unsupported_family(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    r = plan("--model", str(cfg), "--gpu", "h200")
    assert r.returncode == 2
    assert "'llama' is not supported" in one_error_line(r)


@pytest.mark.parametrize(
    "shape,message",
    [
        ((24, 128), "num_layers is 24, the model has 48"),  # the 24-layer Qwen3 shape
        ((48, 64), "num_logical_experts is 64, the model has 128"),
        ((32, 8), "num_layers is 32, the model has 48"),  # Mixtral-8x7B's
    ],
)
def test_distribution_of_another_model(
    tmp_path: Path, shape: tuple[int, int], message: str
) -> None:
    path = tmp_path / "dist.json"
    write_expert_distribution(path, torch.ones(*shape, dtype=torch.int64))
    r = plan("--model", QWEN3, "--gpu", "h200", "--expert-distribution", str(path))
    assert r.returncode == 2
    assert r.stdout == ""
    line = one_error_line(r)
    assert line.startswith(f"safeserve plan: error: --expert-distribution: {path}: ")
    assert message in line


def test_a_skewed_distribution_reads_fewer_experts(tmp_path: Path) -> None:
    counts = torch.ones(48, 128, dtype=torch.int64)
    counts[:, :8] = 10_000  # eight experts take nearly every choice
    path = tmp_path / "dist.json"
    write_expert_distribution(path, counts)

    def experts(*extra: str) -> float:
        r = plan(
            "--model",
            QWEN3,
            "--gpu",
            "h200",
            "--gpus-per-node",
            "1",
            "--concurrency",
            "64",
            "-o",
            "json",
            *extra,
        )
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        return doc["layouts"][0]["points"][0]["experts_per_layer"]

    assert experts() == pytest.approx(128 * (1 - (1 - 8 / 128) ** 64))
    assert experts("--expert-distribution", str(path)) < 20


@pytest.mark.parametrize(
    "args,message",
    [
        (["--concurrency", "1,x"], "--concurrency takes comma-separated integers"),
        (["--concurrency", "0"], "--concurrency takes positive integers"),
        (["--input-len", "0"], "--input-len and --output-len must be at least 1"),
        (["--nodes", "0"], "--gpus-per-node and --nodes must be at least 1"),
        (["--mem-fraction-static", "1.5"], "mem-fraction-static"),
        (["--tpot-target-ms", "0"], "--tpot-target-ms must be a positive number of ms, got 0"),
        (["--tpot-target-ms", "-1"], "--tpot-target-ms must be a positive number of ms, got -1"),
        (["--tpot-target-ms", "nan"], "--tpot-target-ms must be a positive number of ms, got nan"),
    ],
)
def test_bad_numbers(args: list[str], message: str) -> None:
    r = plan("--model", QWEN3, "--gpu", "h200", *args)
    assert r.returncode == 2
    assert message in one_error_line(r)


def test_every_preset_in_guards_is_what_plan_writes_today(tmp_path: Path) -> None:
    """The shipped presets are reproducible: their header's command writes the same file, byte
    for byte; and every model of kernels/configs has one for one H200 and one for 8xH200."""
    presets = sorted((ROOT / "guards").glob("*.toml"))
    models = sorted(p.parent.name for p in (ROOT / "kernels" / "configs").glob("*/config.json"))
    assert models, "kernels/configs holds model configs"
    want = {f"{m}-{n}xh200.toml" for m in models for n in (1, 8)}
    assert {p.name for p in presets} == want
    for preset in presets:
        header = preset.read_text().splitlines()[0]
        assert header.startswith("# Written by: safeserve plan "), preset
        argv = header.removeprefix("# Written by: safeserve plan ").split()
        gpus = int(argv[argv.index("--gpus-per-node") + 1]) * int(argv[argv.index("--nodes") + 1])
        model = argv[argv.index("--model") + 1]
        assert preset.name == f"{Path(model).name}-{gpus}xh200.toml"
        assert argv[argv.index("--gpu") + 1] == "h200"
        out = tmp_path / preset.name
        r = plan(*argv, "--write-policy", str(out))
        assert r.returncode == 0, r.stderr
        assert out.read_bytes() == preset.read_bytes(), preset


DEEPSEEK_V3 = {  # DeepSeek-V3's published config.json, the fields the family reads
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip


def test_deepseek_v3_needs_fp8_on_eight_h200(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(DEEPSEEK_V3))
    r = plan("--model", str(cfg), "--gpu", "h200", "--concurrency", "1,64")
    assert r.returncode == 1
    assert "no layout to recommend" in r.stdout
    assert "the weights do not fit" in r.stdout and "--quantization fp8" in r.stdout
    preset = tmp_path / "none.toml"
    r = plan("--model", str(cfg), "--gpu", "h200", "--write-policy", str(preset))
    assert r.returncode == 1
    assert f"[plan] {preset} not written: no layout to recommend" in r.stderr
    assert not preset.exists()
    r = plan("--model", str(cfg), "--gpu", "h200", "--concurrency", "1,64", "--quantization", "fp8")
    assert r.returncode == 0, r.stderr
    assert "recommended: safeserve serve --tp-size 8 --ep-size 8" in r.stdout
    assert "the calibration is bf16's (FP8 steps are not calibrated yet)" in r.stdout
    r = plan(
        "--model", str(cfg), "--gpu", "h200", "--quantization", "fp8",
        "--write-policy", str(tmp_path / "p.toml"),
    )  # fmt: skip
    assert r.returncode == 2
    assert "a preset holds guard flags only, not --quantization or" in one_error_line(r)


def test_fp8_kv_cache_takes_serves_spelling_too() -> None:
    """`--kv-cache-dtype fp8_e4m3` (serve's name) plans what `fp8` plans: one byte a KV
    element, which leaves more of the memory to the cache than `auto`'s bf16."""
    docs = {}
    for kv in ("auto", "fp8", "fp8_e4m3"):
        r = plan("--model", QWEN3, "--gpu", "h200", "--concurrency", "1", "--kv-cache-dtype", kv,
                 "-o", "json")  # fmt: skip
        assert r.returncode == 0, r.stderr
        docs[kv] = json.loads(r.stdout)
    assert docs["fp8"] == docs["fp8_e4m3"]
    assert docs["fp8"] != docs["auto"]
