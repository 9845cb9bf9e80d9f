from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from safeserve.config import ConfigError, ServerArgs

# a DeepSeek-V3-family config (one latent per token in the KV cache)
MLA_CONFIG = Path(__file__).resolve().parents[1] / "kernels" / "configs" / "moonlight-16b-a3b"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "safeserve.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_grouped_flags() -> None:
    r = _cli("serve", "--help")
    assert r.returncode == 0
    for title in ("model:", "HTTP server:", "scheduling and KV cache:", "parallelism:"):
        assert title in r.stdout
    for flag in (
        "--model",
        "--host",
        "--port",
        "--seed",
        "--dtype",
        "--device",
        "--load-format",
        "--chunked-prefill-size",
        "--max-running-requests",
        "--api-key",
    ):
        assert flag in r.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-running-requests", "0"], "--max-running-requests must be at least 1"),
        (["--dtype", "int3"], "invalid choice"),
        (["--model", "/nonexistent/dir"], "neither 'tiny' nor a local checkpoint"),
        (["--admin-host", "0.0.0.0"], "--admin-host off loopback needs --admin-api-key"),
        (["--num-groups", "0"], "must be >= 1"),
        (["--port", "99999"], "--port must be in 0..65535"),
        (["--port", "65535"], "--admin-port must be in 0..65535, got 65536"),
        (["--port", "9000", "--admin-port", "9000"], "--admin-port must differ from --port"),
        (["--enable-eplb"], "--enable-eplb needs at least 2 expert-parallel ranks"),
        (
            ["--enable-eplb", "--tp-size", "2", "--ep-size", "1"],
            "--enable-eplb needs at least 2 expert-parallel ranks",
        ),
        (["--eplb-min-rebalancing-utilization-threshold", "0"], "must be in (0, 1]"),
        (["--init-expert-location", "/nonexistent/dist.json"], "cannot read it"),
        (
            ["--ep-num-redundant-experts", "3", "--tp-size", "2", "--ep-size", "2"],
            "cannot be split evenly",
        ),
        (["--ep-num-redundant-experts", "3"], "more than the model's 8 experts"),
        (["--kv-cache-dtype", "int8"], "invalid choice"),
        (["--tbo-token-distribution-threshold", "0.6"], "must be in (0, 0.5]"),
        (["--tbo-min-decode-batch", "0"], "--tbo-min-decode-batch must be at least 1"),
        (
            ["--enable-two-batch-overlap", "--tp-size", "2"],
            "--enable-two-batch-overlap needs --moe-a2a-backend alltoall or --enable-dp-attention",
        ),
        (
            ["--enable-two-batch-overlap", "--tp-size", "2", "--moe-a2a-backend", "alltoall"]
            + ["--dispatch-budget-tokens", "1"],
            "--enable-two-batch-overlap needs --dispatch-budget-tokens of at least 2",
        ),
        (
            ["--model", str(MLA_CONFIG), "--load-format", "dummy"] + ["--kv-cache-dtype", "fp8"],
            "--kv-cache-dtype fp8_e4m3: deepseek_v3 keeps a latent (MLA) cache",
        ),
        (
            ["--enable-deterministic-inference", "--tp-size", "2"],
            "--enable-deterministic-inference runs groups of one rank for now",
        ),
        (
            ["--model", str(MLA_CONFIG), "--load-format", "dummy"]
            + ["--enable-deterministic-inference"],
            "--enable-deterministic-inference: deepseek_v3 keeps a latent (MLA) cache",
        ),
        # the node agent's flags given to the frontend: where they belong
        (
            ["--nnodes", "2", "--node-rank", "1"],
            "--node-rank is a flag of `safeserve node`, not of `safeserve serve` (the node agent",
        ),
        (["--dist-init-addr=10.0.0.1:5000"], "--dist-init-addr is a flag of `safeserve node`"),
    ],
)
def test_bad_flags_exit_non_zero_with_one_line(args: list[str], message: str) -> None:
    r = _cli("serve", *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_server_args_checks() -> None:
    with pytest.raises(ConfigError):
        ServerArgs(block_size=0)
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8_e4m3, fp8"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")
    assert ServerArgs(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # plan's spelling
    assert ServerArgs(chunked_prefill_size=4096, max_num_batched_tokens=512).prefill_chunk == 512
    assert ServerArgs(model="tiny", served_model_name="x").model_name == "x"


def test_overlap_checks() -> None:
    """The overlap flags' ranges, and two-batch overlap against the layout: refused where there
    is no dispatch to overlap (tensor-parallel attention with backend none) or no half of the
    receive budget for each micro-batch; allowed with alltoall or data-parallel attention."""
    for bad in (0.0, 0.51, float("nan")):
        with pytest.raises(ConfigError, match=r"--tbo-token-distribution-threshold must be in"):
            ServerArgs(tbo_token_distribution_threshold=bad)
    with pytest.raises(ConfigError, match="--tbo-min-decode-batch must be at least 1"):
        ServerArgs(tbo_min_decode_batch=0)
    tbo = dict(enable_two_batch_overlap=True, tp_size=2)
    with pytest.raises(ConfigError, match="there is nothing to overlap$"):
        ServerArgs(**tbo)
    with pytest.raises(ConfigError, match="each micro-batch gets half the receive budget$"):
        ServerArgs(**tbo, enable_dp_attention=True, dispatch_budget_tokens=1)
    ServerArgs(**tbo, enable_dp_attention=True, tbo_token_distribution_threshold=0.5)
    ServerArgs(**tbo, moe_a2a_backend="alltoall", dispatch_budget_tokens=2)
    ServerArgs(**tbo, moe_a2a_backend="alltoall", dispatch_budget_tokens=0)  # admission off


def test_overlap_with_one_rank_does_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """--tp-size 1: no collective to overlap; one INFO line, no refusal (backend none is the
    only backend one rank has)."""
    with caplog.at_level("INFO", logger="safeserve.config"):
        ServerArgs(enable_two_batch_overlap=True, enable_single_batch_overlap=True)
    lines = [r.getMessage() for r in caplog.records if "overlap" in r.getMessage()]
    assert lines == [
        "--enable-two-batch-overlap and --enable-single-batch-overlap do nothing with one rank "
        "(--tp-size 1): there is no dispatch or combine collective to overlap"
    ]
    caplog.clear()
    with caplog.at_level("INFO", logger="safeserve.config"):
        ServerArgs(enable_two_batch_overlap=True, tp_size=2, enable_dp_attention=True)
        ServerArgs()
    assert not [r for r in caplog.records if "overlap" in r.getMessage()]


def test_single_batch_overlap_needs_shared_experts() -> None:
    """Refused at start, one line naming the family, where the model has no shared experts
    (tiny is Qwen3-MoE); the families that have them say so in their config."""
    from safeserve.model import registry
    from safeserve.model.checkpoint import load_model_config

    r = _cli("serve", "--enable-single-batch-overlap", "--tp-size", "2", "--port", "0")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "safeserve: error: --enable-single-batch-overlap: qwen3_moe has no shared experts to run "
        "while the routed experts' combine is in flight"
    ]
    configs = Path(__file__).resolve().parents[1] / "kernels" / "configs"
    assert load_model_config("tiny").shared_intermediate_size == 0
    assert load_model_config(str(configs / "mixtral-8x7b")).shared_intermediate_size == 0
    assert load_model_config(str(MLA_CONFIG)).shared_intermediate_size > 0  # DeepSeek-V3
    qwen2 = dict(
        model_type="qwen2_moe",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=12,
        moe_intermediate_size=4,
        shared_expert_intermediate_size=6,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    assert registry.parse_config(qwen2).shared_intermediate_size == 6


def test_bad_checkpoint_fails_start_with_clear_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = _cli("serve", "--model", str(tmp_path), "--port", "0")
    assert r.returncode == 2
    assert "model_type 'llama' is not supported" in r.stderr


def test_bad_fused_moe_table_is_refused_before_start(tmp_path) -> None:
    """SAFESERVE_FUSED_MOE_CONFIG naming a missing or broken table: exit 2 at start-up, not a
    silent fallback or a rank failing at its first MoE layer."""
    table = tmp_path / "table.json"
    table.write_text('{"configs": {"1": {"mode": "pair", "BLOCK_M": 16}}}')
    for path, message in ((tmp_path / "missing.json", "no such file"), (table, "gemm1 is missing")):
        r = subprocess.run(
            [sys.executable, "-m", "safeserve.cli", "serve", "--model", "tiny", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SAFESERVE_FUSED_MOE_CONFIG": str(path)},
        )
        assert r.returncode == 2, r.stderr[-2000:]
        assert message in r.stderr and str(path) in r.stderr


@pytest.mark.parametrize(
    "args", [["oncall", "runbook", "rank-dead"], ["chaos", "list", "chaos"], ["--help"]]
)
def test_a_reader_that_goes_away_ends_the_output_quietly(args: list[str]) -> None:
    """`safeserve … | head -1`: the reader closes the pipe; the command stops writing, exits as
    it would have (0) and prints no traceback."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "safeserve.cli", *args],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[1],
        )
    finally:
        os.close(w)
    assert done.returncode == 0 and done.stderr == ""


@pytest.mark.parametrize("flag", ["--port", "--admin-port"])
def test_a_port_in_use_is_refused_before_any_group_starts(flag: str) -> None:
    """Another process listens on the port: one line naming it, exit 2, and no rank process was
    started (the refusal comes before the groups load their models)."""
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        other = port + 2 if port < 65000 else port - 2
        ports = [flag, str(port)] + (["--port", str(other)] if flag == "--admin-port" else [])
        t0 = time.monotonic()
        r = _cli("serve", "--model", "tiny", *ports)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"cannot listen on 127.0.0.1:{port} ({flag})" in r.stderr
        assert "Traceback" not in r.stderr and "group 0" not in r.stderr
        assert time.monotonic() - t0 < 30


TOKENIZER_TEXTS = [
    "Hello, world",
    "  leading spaces\n\ttabs and\r\nnewlines",
    "Héllo wörld, naïve café, 日本語, Ελληνικά",
    "emoji 🙂 👩‍👩‍👧 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "\x00\x1b control",
]


def test_tokenizer_command_writes_what_transformers_loads_as_tiny_tokenizes(tmp_path) -> None:
    """`safeserve tokenizer tiny --out DIR`: AutoTokenizer.from_pretrained(DIR) (lm-eval's
    tokenizer backend, for one) encodes and decodes exactly as the server's tiny tokenizer,
    special tokens, partial UTF-8 and the chat template included."""
    transformers = pytest.importorskip("transformers")
    from safeserve.model.tokenizer import ByteTokenizer

    out = tmp_path / "tok"
    r = _cli("tokenizer", "tiny", "--out", str(out))
    assert r.returncode == 0, r.stderr
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert str(out / name) in r.stdout
    hf = transformers.AutoTokenizer.from_pretrained(out)
    tiny = ByteTokenizer()
    for text in TOKENIZER_TEXTS:
        ids = tiny.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == tiny.decode(ids)
    for ids in ([0xE2, 0x82], [0xFF, 65, 0xC3], [0xF0, 0x9F, 0x99, 0x82], [0xED, 0xA0, 0x80]):
        assert hf.decode(ids) == tiny.decode(ids), ids
    msgs = [{"role": "user", "content": "hi"}]
    rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == tiny.apply_chat_template(msgs)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>" and hf.bos_token is None
    assert len(hf) == tiny.vocab_size
    # a checkpoint directory's tokenizer files are copied; a directory without one is refused
    again = tmp_path / "copy"
    assert _cli("tokenizer", str(out), "--out", str(again)).returncode == 0
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    r = _cli("tokenizer", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "no tokenizer.json" in r.stderr and "Traceback" not in r.stderr


def test_fp8_kv_cache_on_a_gpu_without_fp8_is_refused_before_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An A100 (compute capability 8.0) has no FP8 conversions for the kernels: exit 2 with one
    line before any rank is spawned (the CUDA queries faked: CI has no GPU)."""
    import logging

    import torch

    from safeserve import cli

    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # leave the root logger be
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    rc = cli.main(["serve", "--device", "cuda", "--kv-cache-dtype", "fp8", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--kv-cache-dtype fp8_e4m3 needs FP8 support (compute capability 8.9 or newer)" in err
    assert len(err.strip().splitlines()) == 1


def test_remote_placement_needs_no_local_cuda_device(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--placement remote --device cuda on a host without GPUs (a frontend pod): the ranks run
    on the node agents' devices, so the local device count is not checked (the start is cut
    short where the app would be built)."""
    import logging

    import torch

    from safeserve import cli
    from safeserve.ports import free_port
    from safeserve.server import app as server_app
    from safeserve.wire import keys

    def stop_here(*a: object, **kw: object) -> None:
        raise OSError("stopped before the app was built")

    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # leave the root logger be
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(server_app, "build_app", stop_here)
    keys.generate(tmp_path / "keys")
    argv = ["serve", "--device", "cuda", "--placement", "remote", "--num-groups", "2"]
    argv += ["--tp-size", "2", "--curve-keys-dir", str(tmp_path / "keys")]
    argv += ["--port", "0", "--admin-port", "0", "--node-port", str(free_port("127.0.0.1"))]
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "stopped before the app was built" in err, err
    assert "CUDA devices" not in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "--nnodes", "2"], "--nnodes 2 needs --placement remote"),
        (["serve", "--nnodes", "0"], "--nnodes must be at least 1, got 0"),
        (
            ["serve", "--placement", "remote", "--insecure-nodes", "--tp-size", "3"]
            + ["--nnodes", "2"],
            "--tp-size 3 does not split evenly over --nnodes 2",
        ),
        (["node", "--nnodes", "2"], "--nnodes needs --node-rank"),
        (["node", "--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is not below --nnodes 2"),
        (["node", "--node-rank", "-1"], "--node-rank must be 0 or more, got -1"),
        (["node", "--nnodes", "0", "--node-rank", "0"], "--nnodes must be at least 1"),
        (["node", "--dist-init-addr", "10.0.0.1"], "--dist-init-addr must be HOST:PORT"),
        (["node", "--dist-init-addr", "10.0.0.1:70000"], "with a port in 1..65535"),
        (["node", "--dist-init-addr", ":29500"], "--dist-init-addr must be HOST:PORT"),
        (["node", "--dist-init-addr", "::1:29500"], "--dist-init-addr must be HOST:PORT"),
        (["node", "--node-set", " "], "--node-set must not be empty"),
        (["node", "--frontend", "frontend"], "--frontend must be HOST:PORT"),
    ],
)
def test_span_flags_are_refused_with_one_line(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`serve --nnodes`, `node --nnodes --node-rank --dist-init-addr --node-set`: a bad value
    is one line on stderr and exit 2, before anything starts."""
    import logging

    from safeserve import cli

    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # leave the root logger be
    if argv[0] == "node":
        argv = ["node", "--frontend", "127.0.0.1:8002", "--insecure", *argv[1:]]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert message in err and not out, (out, err)
    assert len(err.strip().splitlines()) == 1, err


def test_span_addresses_parse() -> None:
    from safeserve.node.agent import join_addr, parse_addr

    assert parse_addr("safeserve-agents-0.safeserve-agents:29500", "--x") == (
        "safeserve-agents-0.safeserve-agents",
        29500,
    )
    assert parse_addr("[fd00::7]:29500", "--x") == ("fd00::7", 29500)
    assert join_addr("fd00::7", 29500) == "[fd00::7]:29500"
    assert ServerArgs(nnodes=1).nnodes == 1  # one node: fine with --placement local
