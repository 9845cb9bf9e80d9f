"""kernels/results_tables.py: the generated tables of kernels/RESULTS.md are current, the newest
file of a benchmark kind feeds its table, and only the text between the markers is rewritten."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from safeserve.config import ServerArgs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "kernels" / "results_tables.py"


def load_script():
    spec = importlib.util.spec_from_file_location("results_tables", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def engine_json(step_ms: float, command_prefix: str = "/repo/safeserve/cli.py") -> dict:
    """The fields `safeserve bench --json` writes that the engine tables read."""
    return {
        "command": f"{command_prefix} bench --model kernels/configs/qwen3-30b-a3b --input-len 512",
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "args": {
            "model": "kernels/configs/qwen3-30b-a3b",
            "load_format": "dummy",
            "dtype": "bfloat16",
            "device": "cuda",
            "max_num_batched_tokens": 2048,
        },
        "input_len": 512,
        "output_len": 64,
        "read_ceiling_gbs": 4100.0,
        "points": [
            {
                "concurrency": 1,
                "ttft_ms": 14.0,
                "tpot_ms": step_ms,
                "output_tok_s": 300.0,
                "decode_tok_s": 320.0,
                "decode_step_ms": step_ms,
                "floor_ms": 1.5,
                "step_over_floor": step_ms / 1.5,
                "ceiling_share": 0.5,
                "experts_per_layer": 8.0,
            }
        ],
        "model_bytes": {"max_model_len": 40960},
    }


def test_generated_tables_of_results_md_are_current():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, (
        "kernels/RESULTS.md's generated tables are stale: run `python kernels/results_tables.py`"
        f"\n{proc.stdout}{proc.stderr}"
    )


def test_newer_file_of_a_kind_wins_and_only_the_marked_section_is_rewritten(tmp_path):
    mod = load_script()
    results = tmp_path / "results"
    results.mkdir()
    older = "bench_qwen3-30b-a3b_h200_2026-03-01_run1_final.json"
    newer = "bench_qwen3-30b-a3b_h200_2026-03-02_run2_call1.json"
    # Newest of all by date, but the baseline side of an A/B: it must not feed the table.
    baseline = "bench_qwen3-30b-a3b_h200_2026-03-03_run3_call1_old.json"
    (results / older).write_text(json.dumps(engine_json(9.87)))
    (results / newer).write_text(json.dumps(engine_json(2.46)))
    (results / baseline).write_text(json.dumps(engine_json(5.55)))
    before = "# Results\n\nhand-written intro\n\n"
    after = "\n\n## Hand-kept\n\nnot generated: 1.23 ms\n"
    doc = tmp_path / "RESULTS.md"
    doc.write_text(f"{before}{mod.BEGIN}\nstale tables\n{mod.END}{after}")
    args = ["--results", str(results), "--doc", str(doc)]

    assert mod.main([*args, "--check"]) == 1
    assert "stale tables" in doc.read_text()  # --check writes nothing

    assert mod.main(args) == 0
    text = doc.read_text()
    assert text.startswith(before + mod.BEGIN + "\n")
    assert text.endswith(mod.END + after)
    section = text[len(before) : -len(after)]
    assert "stale tables" not in section
    assert newer in section and "**2.46**" in section
    assert older not in section and "9.87" not in section
    assert baseline not in section and "5.55" not in section
    assert "2026-03-02" in section
    assert mod.main([*args, "--check"]) == 0

    # A file dated later still takes over; the text outside the markers stays as it was.
    newest = "bench_qwen3-30b-a3b_h200_2026-03-04_run4_call2.json"
    (results / newest).write_text(json.dumps(engine_json(3.21)))
    assert mod.main([*args, "--check"]) == 1
    assert mod.main(args) == 0
    text = doc.read_text()
    assert newest in text and "**3.21**" in text and newer not in text
    assert text.startswith(before + mod.BEGIN) and text.endswith(mod.END + after)


def test_order_prefers_the_json_date_then_run_then_call(tmp_path):
    mod = load_script()

    def result(name: str, data: dict) -> object:
        return mod.Result(tmp_path / name, data)

    # The JSON's own date beats the file name's.
    named_late = result(
        "bench_fused_moe_h200_2026-05-09_run1.json", {"meta": {"date": "2026-05-01"}}
    )
    dated_late = result(
        "bench_fused_moe_h200_2026-05-02_run1.json", {"meta": {"date": "2026-05-08"}}
    )
    assert max([named_late, dated_late], key=mod.Result.order) is dated_late
    # Same date: run, then call; `_start` before every call, `_final` after them.
    names = [
        "x_h200_2026-05-01_run3_start.json",
        "x_h200_2026-05-01_run3_call2.json",
        "x_h200_2026-05-01_run3_call10.json",
        "x_h200_2026-05-01_run3_final.json",
        "x_h200_2026-05-01_run4_call1.json",
    ]
    ordered = sorted((result(n, {}) for n in reversed(names)), key=mod.Result.order)
    assert [r.name for r in ordered] == names


def test_a_command_run_from_a_copy_of_the_package_is_not_the_tree(tmp_path):
    mod = load_script()
    copy = mod.Result(
        tmp_path / "x_h200_2026-05-01_run1.json", engine_json(1.0, "/w/.ab_old/safeserve/cli.py")
    )
    tree = mod.Result(tmp_path / "x_h200_2026-05-01_run1.json", engine_json(1.0))
    assert mod.variant_reason(copy) and mod.variant_reason(tree) is None


def test_serve_defaults_the_script_checks_are_servers():
    mod = load_script()
    defaults = dataclasses.asdict(ServerArgs())
    assert {k: defaults[k] for k in mod.SERVE_DEFAULTS} == mod.SERVE_DEFAULTS
