"""`safeserve bench` on the CPU with the tiny model: every number is there and positive."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safeserve.cli import main
from safeserve.model.checkpoint import load_model_config


def test_bench_tiny_cpu_with_transformers_peer(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--concurrency",
            "1,3",
            "--input-len",
            "12",
            "--output-len",
            "4",
            "--ceiling-gib",
            "0.02",
            "--peer",
            "transformers",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["read_ceiling_gbs"] > 0
    assert [p["concurrency"] for p in result["points"]] == [1, 3]
    fields = (
        "ttft_ms",
        "tpot_ms",
        "output_tok_s",
        "decode_tok_s",
        "decode_step_ms",
        "step_bytes",
        "floor_ms",
        "achieved_gbs",
        "ceiling_share",
        "step_over_floor",
        "experts_per_layer",
    )
    for p in result["points"]:
        for f in fields:
            assert p[f] > 0, f
        # The tiny model routes top-2 of 8 experts.
        assert 2 <= p["experts_per_layer"] <= 8
    assert result["points"][1]["step_bytes"] > result["points"][0]["step_bytes"]
    mb = result["model_bytes"]
    assert mb["dense_bytes"] > 0 and mb["expert_bytes"] > 0 and mb["kv_bytes_per_token"] > 0
    # serve's context length (the model's), not input + output: graph tables are that wide
    assert mb["max_model_len"] == load_model_config("tiny").max_position_embeddings > 16
    peer = result["peer"]["points"]
    assert [p["concurrency"] for p in peer] == [1, 3]
    for p in peer:
        assert p["decode_step_ms"] > 0 and p["speedup_decode_tok_s"] > 0
    table = capsys.readouterr().out
    assert "step/floor" in table and "TPOT growth 1 -> 3" in table


def test_bench_fp8_floor_counts_the_bytes_stored(tmp_path: Path) -> None:
    """`--quantization fp8 --kv-cache-dtype fp8_e4m3`: the floor's parts are FP8 weights with
    their float32 block scales and a one-byte KV cache, as the planner counts them."""
    from safeserve.parallel.layout import Layout
    from safeserve.plan.model import ModelFacts

    out = tmp_path / "bench.json"
    args = ["bench", "--concurrency", "2", "--input-len", "12", "--output-len", "4"]
    args += ["--ceiling-gib", "0.02", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    mb = result["model_bytes"]
    cfg = load_model_config("tiny", "fp8")
    itemsize = torch.empty(0, dtype=getattr(torch, result["args"]["dtype"])).element_size()
    want = ModelFacts(cfg, itemsize, "fp8", kv_itemsize=1).rank_bytes(Layout())
    assert (mb["dense_bytes"], mb["expert_bytes"]) == (want.dense, want.expert)
    assert mb["kv_bytes_per_token"] == want.kv_token
    (p,) = result["points"]
    assert p["step_bytes"] > 0 and p["floor_ms"] > 0 and p["step_over_floor"] > 0


def test_bench_rejects_bad_flags(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "--concurrency", "0,2"]) == 2
    assert "positive" in capsys.readouterr().err
    assert main(["bench", "--max-model-len", "100", "--input-len", "90", "--output-len", "20"]) == 2
    assert "--max-model-len 100 < input + output = 110" in capsys.readouterr().err
    assert main(["bench", "--model", "/nonexistent/ckpt"]) == 2
    assert "neither 'tiny' nor a local checkpoint" in capsys.readouterr().err
    # a layout of several ranks: one line naming the script that benchmarks it, no traceback
    assert main(["bench", "--tp-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "kernels/bench_tp_decode.py" in err and "Traceback" not in err


def test_bench_refuses_what_would_fail_late(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """An unwritable --json, a missing CUDA device and FP8 weights in deterministic mode are
    refused before the run (the JSON used to fail only after the whole run, losing its
    numbers); a --json in folders that do not exist yet gets them."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["bench", "--json", str(blocker / "out.json")]) == 2
    assert "cannot create its folder" in capsys.readouterr().err
    assert main(["bench", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--device", "cuda"]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err
    fp8_det = ["--quantization", "fp8", "--enable-deterministic-inference"]
    assert main(["bench", *fp8_det]) == 2
    assert "no batch-invariant FP8 path" in capsys.readouterr().err
    out = tmp_path / "new" / "deeper" / "bench.json"
    args = ["--concurrency", "1", "--input-len", "8", "--output-len", "3", "--json", str(out)]
    assert main(["bench", *args]) == 0
    assert json.loads(out.read_text())["points"][0]["concurrency"] == 1


def test_bench_writes_the_routing_the_planner_reads(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--expert-distribution-out`: the timed decode steps' choices per MoE layer and expert, a
    file `safeserve plan --expert-distribution` reads."""
    from safeserve.moe.eplb.distribution import read_expert_distribution

    cfg = load_model_config("tiny")
    dist = tmp_path / "routing.json"
    args = ["--concurrency", "1,3", "--input-len", "8", "--output-len", "4"]
    assert main(["bench", *args, "--expert-distribution-out", str(dist)]) == 0
    counts = read_expert_distribution(dist)
    moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert tuple(counts.shape) == (moe, cfg.num_experts)
    # 3 decode steps (output 4, the first token from prefill) of 1 then 3 sequences, top-k each
    assert counts.sum(dim=1).tolist() == [(1 + 3) * 3 * cfg.num_experts_per_tok] * moe
    capsys.readouterr()
    r = subprocess.run(
        [sys.executable, "-m", "safeserve.cli", "plan", "--model", "tiny", "--gpu", "cpu"]
        + ["--gpus-per-node", "1", "--concurrency", "1", "--expert-distribution", str(dist)]
        + ["-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # one token reads its k experts, whatever the distribution
    point = json.loads(r.stdout)["layouts"][0]["points"][0]
    assert point["experts_per_layer"] == pytest.approx(cfg.num_experts_per_tok, rel=0.2)
    assert main(["bench", *args, "--expert-distribution-out", str(tmp_path)]) == 2
    assert "--expert-distribution-out" in capsys.readouterr().err


def test_routing_counts_map_physical_slots_to_logical_experts() -> None:
    """With redundant slots, the counts are per logical expert: a slot's choices go to the
    expert it holds."""
    from types import SimpleNamespace

    from safeserve.bench.floor import RoutingProbe
    from safeserve.moe.expert_map import ExpertMap

    m = ExpertMap.from_phy2log([[0, 1, 2, 0], [2, 1, 0, 1]], num_logical=3, ep_size=1)
    probe = RoutingProbe.__new__(RoutingProbe)
    probe.runner = SimpleNamespace(expert_map=m)
    probe.num_experts = 4
    probe.num_layers = 2
    probe.eager = {
        0: torch.tensor([[0, 3], [1, 2], [9, 9]]),  # the third row is padding, not counted
        1: torch.tensor([[0, 3], [1, -1], [9, 9]]),  # -1: no expert
    }
    counts = probe.logical_counts(2, None)
    # layer 0: slots 0, 3 hold expert 0; 1 -> 1; 2 -> 2.  layer 1: 0 -> 2; 3 -> 1; 1 -> 1
    assert counts.tolist() == [[2, 1, 1], [0, 2, 1]]
    assert probe.experts_read(2, None) == [4, 3]


def _bench_serve():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "bench_serve", Path(__file__).parents[1] / "kernels" / "bench_serve.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bench_serve_times_a_real_server(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """kernels/bench_serve.py starts `safeserve serve`, streams c requests at once per round and
    times them as the client sees them; every request gets all its tokens."""
    out = tmp_path / "serve.json"
    argv = ["--concurrency", "1,3", "--input-len", "10", "--output-len", "6", "--json", str(out)]
    assert _bench_serve().main([*argv, "--", "--model", "tiny"]) == 0
    result = json.loads(out.read_text())
    assert [p["concurrency"] for p in result["points"]] == [1, 3]
    assert result["prompts"] == "safeserve bench's"  # the tiny model's vocabulary, seed 0
    for p in result["points"]:
        assert [r["requests"] for r in p["rounds"]] == [p["concurrency"]] * 2  # warm-up + 1
        m = p["measured"]
        assert m["unfinished"] == 0 and m["requests"] == p["concurrency"]
        assert m["ttft_ms_median"] > 0 and m["tpot_ms_median"] > 0 and m["output_tok_s"] > 0
        assert 0 <= m["itl_ms_median"] <= m["itl_ms_p90"]
    assert (tmp_path / "bench_serve_server.log").exists()
    assert "| 3 |" in capsys.readouterr().out


def test_bench_serve_refuses_bad_setups_in_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bench_serve = _bench_serve()
    with pytest.raises(SystemExit):
        bench_serve.main(["--concurrency", "1"])
    assert "give either --url or the server's arguments after --" in capsys.readouterr().err
    # a server that cannot start (no such checkpoint): its reason, no traceback
    out = tmp_path / "serve.json"
    assert (
        bench_serve.main(["--vocab", "100", "--json", str(out), "--", "--model", "/no/ckpt"]) == 2
    )
    err = capsys.readouterr().err
    assert "bench_serve: error: the server exited" in err and "Traceback" not in err
    # the model's vocabulary cannot be read: said before anything starts
    assert bench_serve.main(["--", "--model", "/no/ckpt"]) == 2
    assert "neither 'tiny' nor a local checkpoint" in capsys.readouterr().err
    # nothing answers at --url
    assert bench_serve.main(["--url", "http://127.0.0.1:9", "--vocab", "100"]) == 2
    assert "bench_serve: error:" in capsys.readouterr().err


def test_bench_prefill_times_every_chunk_of_a_prompt(tmp_path: Path) -> None:
    """kernels/bench_prefill.py on CPU (the tiny model): one time per chunk step of each prompt,
    the last chunk shorter, totals the sum of the chunks."""
    root = Path(__file__).parents[1]
    out = tmp_path / "prefill.json"
    cmd = [sys.executable, str(root / "kernels" / "bench_prefill.py"), "--model", "tiny",
           "--device", "cpu", "--prompt-len", "200,64", "--chunk", "64", "--runs", "2",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    points = json.loads(out.read_text())["points"]
    assert [(p["prompt_len"], len(p["chunk_ms"])) for p in points] == [(200, 4), (64, 1)]
    for p in points:
        assert all(t > 0 for t in p["chunk_ms"]) and len(p["totals_ms"]) == 2
        assert p["total_ms"] == pytest.approx(sum(p["chunk_ms"]))
    assert "prompt 200: prefill" in proc.stdout


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """kernels/NAME run as its users run it, from the repository root."""
    root = Path(__file__).parents[1]
    cmd = [sys.executable, str(root / "kernels" / name), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)


def test_bench_dispatch_runs_on_two_cpu_ranks(tmp_path: Path) -> None:
    """kernels/bench_dispatch.py on two gloo ranks, tiny shapes: a row per rank and token
    count, the rows it sent between one and top-k per token, both timings there."""
    out = tmp_path / "dispatch.json"
    proc = _run_script("bench_dispatch.py", "--device", "cpu", "--gpus", "2", "--tokens", "8,16",
                       "--hidden", "32", "--experts", "8", "--top-k", "2", "--iters", "2",
                       "--warmup", "1", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    points = sorted((r["rank"], r["tokens_per_rank"]) for r in rows)
    assert points == [(0, 8), (0, 16), (1, 8), (1, 16)]
    for r in rows:
        assert r["tokens_per_rank"] <= r["rows_sent"] <= 2 * r["tokens_per_rank"]
        assert 0 <= r["rows_sent_remote"] <= r["rows_sent"]
        assert r["bytes_moved"] >= r["rows_sent"] * 32 * 2  # bf16 rows out, and back
        assert r["ours_us"] > 0 and r["raw_us"] > 0 and r["ours_gbps"] > 0 and r["raw_gbps"] > 0
    assert "| 16 |" in proc.stdout


def test_bench_admission_runs_on_two_cpu_ranks(tmp_path: Path) -> None:
    """kernels/bench_admission.py on two gloo ranks, tiny shapes: under skew the budgeted layer
    runs in rounds within the budget, the unbudgeted one in none; no memory numbers on CPU."""
    out = tmp_path / "admission.json"
    proc = _run_script("bench_admission.py", "--device", "cpu", "--gpus", "2", "--skew-tokens", "64",
                       "--budget", "16", "--uniform-tokens", "16", "--iters", "2", "--hidden", "32",
                       "--experts", "8", "--top-k", "2", "--ffn", "16", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    by = {}
    for r in rows:
        by.setdefault((r["scenario"], r["rank"]), []).append(r)
    assert sorted(by) == [("skew", 0), ("skew", 1), ("uniform", 0), ("uniform", 1)]
    for (scenario, _), rs in by.items():
        assert [r["budget"] for r in rs] == ([16, None] if scenario == "skew" else [32, None] * 2)
        for r in rs:
            assert r["layer_us"] > 0 and "oom" not in r and "peak_bytes_above_weights" not in r
            assert ("rounds" in r) == (r["budget"] is not None)
    skewed = by[("skew", 0)][0]  # every token of both ranks to rank 0's experts: 128 rows
    assert skewed["rounds"] >= 128 // 16 and 0 < skewed["recv_peak"] <= 16
    roomy = [r for rank in (0, 1) for r in by[("uniform", rank)] if r["budget"]]
    assert len(roomy) == 4 and all(r["rounds"] == 1 for r in roomy)
    assert "uniform: admission on" in proc.stdout


def test_bench_tp_decode_runs_on_two_cpu_ranks(tmp_path: Path) -> None:
    """kernels/bench_tp_decode.py on a two-rank gloo group of the tiny model: eager decode step
    times per concurrency (no graphs on CPU), the flags it ran with."""
    out = tmp_path / "tp_decode.json"
    proc = _run_script("bench_tp_decode.py", "--device", "cpu", "--model", "tiny", "--dtype",
                       "float32", "--tp-size", "2", "--ep-size", "2", "--concurrency", "1,2",
                       "--input-len", "8", "--steps", "3", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["mode"], r["concurrency"]) for r in result["rows"]] == [("eager", 1), ("eager", 2)]
    for r in result["rows"]:
        assert 0 < r["step_ms_p10"] <= r["step_ms_median"] <= r["step_ms_p90"]
    assert result["replays"] == {"0": [], "1": []}
    assert result["args"]["tp_size"] == 2 and result["args"]["json"] == str(out)
    assert "eager step ms" in proc.stdout


def test_a_bench_script_whose_rank_fails_says_which_and_why() -> None:
    """A rank that raises ends the script (exit 1) with its rank and traceback, nothing hung."""
    proc = _run_script("bench_tp_decode.py", "--device", "cpu", "--model", "tiny",
                       "--tp-size", "2", "--ep-size", "3", "--concurrency", "1")  # fmt: skip
    assert proc.returncode == 1
    assert re.search(r"^rank [01] failed:\nTraceback", proc.stderr, re.M), proc.stderr[-3000:]
    assert "--ep-size 3 cannot exceed --tp-size 2" in proc.stderr
