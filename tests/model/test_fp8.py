"""Block-FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 format) and `--quantization fp8`: Qwen3-MoE,
and Mixtral and Qwen2-MoE once (DeepSeek-V3: `test_fp8_deepseek_v3.py`).

The checkpoints are written by transformers, then quantized by the tests' own quantizer
(`tests/fp8.py`, checked here against the format's definition). The reference is transformers'
float32 model on a copy holding the dequantized weights: the FP8 model computes the same
products (activations in high precision on CPU), so logits agree within 1e-4.

The test model's hidden size (192) is not a multiple of the 128 block, so the last tiles are
partial; attention rows (128 per head), the dense width (256) and the expert width (192, whole
per rank under EP) are cut at tile boundaries in the layouts used here.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import greedy_continuations, write_qwen3_moe_checkpoint
from fp8 import (
    QUANTIZATION_CONFIG,
    build_ours,
    dequantize,
    fake_quant,
    quantize,
    same_weights,
    write_dequantized_copy,
    write_fp8_checkpoint,
)
from layouts import run_layout
from model_checks import broken_copy, paged_logits, paged_logits_match_transformers
from seeds import seeded
from serving import free_port, start_server, stop_server

from safeserve.config import ServerArgs
from safeserve.kernels import fp8_reference as ref
from safeserve.kernels.moe_reference import grouped_experts_torch
from safeserve.layers.linear import BlockFp8Linear, fuse_fp8_linears
from safeserve.model.checkpoint import (
    LoadError,
    check_checkpoint,
    load_model_config,
    stored_dtypes,
)
from safeserve.model.config import ModelConfigError
from safeserve.model.loader import build_model
from safeserve.model.registry import check_layout, parse_config
from safeserve.model.sharding import LayoutError
from safeserve.moe.dispatch import LocalDispatcher
from safeserve.moe.placement import ExpertPlacement
from safeserve.parallel.layout import Layout

SHAPES = dict(hidden_size=192, head_dim=128, intermediate_size=256, moe_intermediate_size=192)
FP8 = torch.float8_e4m3fn


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The float32 checkpoint transformers wrote, its FP8 copy, and the dequantized copy."""
    base = tmp_path_factory.mktemp("fp8")
    hp = write_qwen3_moe_checkpoint(base / "hp", seed=3, **SHAPES)
    fp8 = write_fp8_checkpoint(hp, base / "fp8")
    return {"hp": hp, "fp8": fp8, "deq": write_dequantized_copy(fp8, base / "deq")}


# -- the format and the reference math -----------------------------------------------------------


def test_quantizer_follows_the_format_definition() -> None:
    gen = seeded(0)
    w = torch.randn(300, 200, generator=gen) * 0.1
    w[128:256, :128] = 0.0  # an all-zero tile
    w[:128, 128:] *= 1e4  # a tile of large values
    q, s = quantize(w)
    assert q.dtype == FP8 and q.shape == w.shape and s.shape == (3, 2) and s.dtype == torch.float32
    # each tile's largest magnitude is FP8's largest; the zero tile stays zero
    for i in range(3):
        for j in range(2):
            tile = q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs()
            assert tile.max() == (0.0 if (i, j) == (1, 0) else 448.0)
    # dequantized = fp8 * scale of its tile, within half an FP8 step of the weight: 2^-4
    # relative for normal values, 2^-10 of the scale for subnormal ones
    per_element = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    bound = torch.maximum(w.abs() * 2**-4, per_element * 2**-10)
    assert ((dequantize(q, s) - w).abs() <= bound).all()
    assert torch.equal(dequantize(q, s), q.float() * per_element)
    # safeserve's quantizer (online quantization) is the same, bit for bit, batched too
    q2, s2 = ref.block_quantize(w)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    assert torch.equal(ref.block_dequantize(q, s), dequantize(q, s))
    qb, sb = ref.block_quantize(torch.stack([w, -w]))
    assert torch.equal(qb[1].float(), -q.float()) and torch.equal(sb[0], s)


def test_reference_linear_and_experts_compute_the_definition() -> None:
    gen = seeded(1)
    x = torch.randn(5, 300, generator=gen)
    w, bias = torch.randn(200, 300, generator=gen) * 0.1, torch.randn(200, generator=gen)
    q, s = quantize(w)
    wd = dequantize(q, s)
    got = ref.fp8_linear(x, q, s, bias)  # the model's CPU path: activations in float32
    torch.testing.assert_close(got, F.linear(x, wd, bias), atol=1e-5, rtol=0)
    w8a8 = ref.fp8_linear(x, q, s, bias, quantize_input=True)  # the dynamic scheme (GPU oracle)
    torch.testing.assert_close(w8a8, F.linear(fake_quant(x), wd, bias), atol=1e-5, rtol=0)
    assert ref.token_group_quantize(x)[1].shape == (5, 3)
    # experts: gate and up tiled each on its own (width 192: partial tiles inside w13)
    experts, hidden, width = 3, 200, 192
    w13 = torch.randn(experts, 2 * width, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, width, generator=gen) * 0.1
    parts = [[quantize(w13[e, :width]), quantize(w13[e, width:])] for e in range(experts)]
    q13 = torch.stack([torch.cat([g[0].float(), u[0].float()]) for g, u in parts]).to(FP8)
    s13 = torch.stack([torch.cat([g[1], u[1]]) for g, u in parts])
    q2, s2 = zip(*(quantize(w2[e]) for e in range(experts)), strict=True)
    d13 = torch.stack([torch.cat([dequantize(*g), dequantize(*u)]) for g, u in parts])
    d2 = torch.stack([dequantize(a, b) for a, b in zip(q2, s2, strict=True)])
    xs = torch.randn(6, hidden, generator=gen)
    ids = torch.tensor([[0, 2], [1, -1], [2, 1], [0, 1], [-1, -1], [2, 0]])
    weights = torch.rand(6, 2, generator=gen)
    fp8_experts = (xs, q13, s13, torch.stack(q2), torch.stack(s2), ids, weights)
    got = ref.grouped_experts_fp8(*fp8_experts)
    want = grouped_experts_torch(xs, d13, d2, ids, weights)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # W8A8: both GEMMs' inputs quantized per token and 128 columns
    w8a8 = torch.zeros_like(xs)
    for t, slot in zip(*torch.where(ids >= 0), strict=True):
        e = int(ids[t, slot])
        gate, up = F.linear(fake_quant(xs[t]), d13[e]).chunk(2)
        w8a8[t] += weights[t, slot] * F.linear(fake_quant(F.silu(gate) * up), d2[e])
    got = ref.grouped_experts_fp8(*fp8_experts, quantize_input=True)
    torch.testing.assert_close(got, w8a8, atol=1e-5, rtol=0)


def test_fp8_projections_fuse_only_on_whole_tiles_and_compute_as_their_parts() -> None:
    gen = seeded(2)

    def part(rows: int, bias: bool = False) -> BlockFp8Linear:
        m = BlockFp8Linear(300, rows, bias, (128, 128))
        q, s = quantize(torch.randn(rows, 300, generator=gen) * 0.1)
        m.weight.data.copy_(q)
        m.weight_scale_inv.data.copy_(s)
        if bias:
            m.bias.data.copy_(torch.randn(rows, generator=gen))  # type: ignore[union-attr]
        return m

    x = torch.randn(4, 300, generator=gen)
    for bias in (False, True):
        parts = [part(256, bias), part(128, bias), part(200, bias)]  # the last may end mid-tile
        alone = [p(x) for p in parts]
        fused = fuse_fp8_linears(parts)  # type: ignore[arg-type]
        assert fused is not None and fused.parts == tuple(parts)
        assert fused.weight.shape == (584, 300) and fused.weight_scale_inv.shape == (5, 3)
        torch.testing.assert_close(fused(x), torch.cat(alone, dim=-1), atol=0, rtol=0)
        # the parts are views of the fused tensors: what a loader writes through a part's name
        # is what the fused launch reads
        parts[1].weight_scale_inv.data.mul_(2)
        changed = parts[1](x)
        assert not torch.equal(changed, alone[1])
        torch.testing.assert_close(fused(x)[:, 256:384], changed, atol=0, rtol=0)
    # a part other than the last ending inside a tile, mixed blocks or biases, a plain linear
    assert fuse_fp8_linears([part(200), part(128)]) is None  # type: ignore[arg-type]
    assert fuse_fp8_linears([part(128), part(128, True)]) is None  # type: ignore[arg-type]
    odd = BlockFp8Linear(300, 128, False, (64, 64))
    assert fuse_fp8_linears([part(128), odd]) is None  # type: ignore[arg-type]
    assert fuse_fp8_linears([part(128), torch.nn.Linear(300, 128)]) is None


# -- loading and computing -----------------------------------------------------------------------


def test_fp8_checkpoint_logits_match_the_dequantized_model(ckpts: dict[str, Path]) -> None:
    net = paged_logits_match_transformers(ckpts["fp8"], reference=ckpts["deq"])
    attn, experts = net.layers[0].self_attn, net.layers[0].mlp.experts
    assert isinstance(attn.q_proj, BlockFp8Linear) and attn.q_proj.weight.dtype == FP8
    assert attn.qkv_weight is None  # FP8 projections are not fused
    assert attn.q_proj.weight_scale_inv.shape == (4, 2)  # [512, 192] in 128-tiles
    assert isinstance(net.layers[1].mlp.down_proj, BlockFp8Linear)  # the dense layer
    assert experts.w13.dtype == experts.w2.dtype == FP8
    assert experts.w13_scale_inv.shape == (8, 4, 2) and experts.w2_scale_inv.shape == (8, 2, 2)
    for unquantized in (net.embed_tokens, net.lm_head, net.layers[0].mlp.gate, net.norm):
        assert unquantized.weight.dtype == torch.float32


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_other_families_fp8_checkpoints_match_the_dequantized_model(
    family: str, tmp_path: Path
) -> None:
    """Mixtral (experts w1/w3/w2) and Qwen2-MoE (q/k/v biases, a gated shared expert) through
    the same shared specs: logits within 1e-4 of transformers on the dequantized weights."""
    from checkpoints_families import write_mixtral_checkpoint, write_qwen2_moe_checkpoint

    write = {"mixtral": write_mixtral_checkpoint, "qwen2_moe": write_qwen2_moe_checkpoint}[family]
    fp8 = write_fp8_checkpoint(write(tmp_path / "hp", seed=2), tmp_path / "fp8")
    net = paged_logits_match_transformers(
        fp8, reference=write_dequantized_copy(fp8, tmp_path / "deq")
    )
    assert isinstance(net.layers[0].self_attn.q_proj, BlockFp8Linear)
    assert net.layers[0].mlp.experts.w13.dtype == FP8


def test_modules_the_checkpoint_keeps_unquantized_stay_in_the_model_dtype(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    keep = ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj")
    fp8 = write_fp8_checkpoint(ckpts["hp"], tmp_path / "fp8", keep=keep)
    check_checkpoint(str(fp8), load_model_config(str(fp8)))
    net = paged_logits_match_transformers(
        fp8, reference=write_dequantized_copy(fp8, tmp_path / "deq")
    )
    assert type(net.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert net.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert isinstance(net.layers[1].mlp.gate_proj, BlockFp8Linear)
    assert type(net.layers[1].mlp.down_proj) is torch.nn.Linear


def test_a_bfloat16_model_keeps_fp8_weights_and_float32_scales(ckpts: dict[str, Path]) -> None:
    """--dtype bfloat16: the FP8 weights and their float32 scales as stored, the rest in bf16;
    logits within bf16's rounding of the float32 model's (measured 0.05 on logits up to 4)."""
    d = LocalDispatcher(ExpertPlacement(8))
    net = build_model(str(ckpts["fp8"]), "auto", "bfloat16", "cpu", d)
    q = net.layers[0].self_attn.q_proj
    assert (q.weight.dtype, q.weight_scale_inv.dtype) == (FP8, torch.float32)
    assert net.layers[0].mlp.experts.w2_scale_inv.dtype == torch.float32
    assert net.embed_tokens.weight.dtype == net.layers[0].input_layernorm.weight.dtype
    assert net.embed_tokens.weight.dtype == torch.bfloat16
    ids = list(range(5, 17))
    table = list(range(8))
    ours = paged_logits(net, ids, [len(ids)], 4, table, torch.bfloat16)
    full = paged_logits(build_ours(ckpts["fp8"]), ids, [len(ids)], 4, table)
    torch.testing.assert_close(ours, full, atol=0.15, rtol=0)


def test_a_sharded_fp8_checkpoint_loads_the_same_weights(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    sharded = write_fp8_checkpoint(ckpts["hp"], tmp_path / "sharded", shards=3)
    check_checkpoint(str(sharded), load_model_config(str(sharded)))
    same_weights(build_ours(sharded), build_ours(ckpts["fp8"]))


def test_greedy_generation_equals_the_reference(ckpts: dict[str, Path]) -> None:
    from safeserve.engine.engine import Engine
    from safeserve.messages import SamplingParams

    prompts = [[5, 17, 40, 2, 99], [300, 12], [7, 7, 7, 150, 33, 61, 8, 250]]
    engine = Engine(ServerArgs(model=str(ckpts["fp8"]), num_kv_blocks=32))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.rid] += o.new_token_ids
    assert [out[str(i)] for i in range(len(prompts))] == greedy_continuations(
        ckpts["deq"], prompts, 10
    )


@pytest.mark.parametrize("rank", [None, 1])
def test_online_quantization_equals_the_fp8_checkpoint(
    ckpts: dict[str, Path], rank: int | None
) -> None:
    """`--quantization fp8` on the float32 checkpoint holds the FP8 checkpoint's weights and
    scales, bit for bit: on one rank, and on rank 1 of tp2-ep2 (each rank quantizes its own
    shard as it reads it)."""
    layout = None if rank is None else Layout(rank, 2, 2)
    online = build_ours(ckpts["hp"], layout, quantization="fp8")
    same_weights(online, build_ours(ckpts["fp8"], layout))
    assert online.layers[0].mlp.experts.w13.shape[0] == (8 if rank is None else 4)


def test_dummy_weights_quantized_are_the_quantized_dummy_weights() -> None:
    full = build_model("tiny", "dummy", "float32", "cpu", LocalDispatcher(ExpertPlacement(8)))
    fp8 = build_model(
        "tiny", "dummy", "float32", "cpu", LocalDispatcher(ExpertPlacement(8)), quantization="fp8"
    )
    hp = dict(full.named_parameters())
    q = dict(fp8.named_parameters())
    attn = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(q[attn].float(), quantize(hp[attn])[0].float())
    assert torch.equal(q[attn + "_scale_inv"], quantize(hp[attn])[1])
    w13 = hp["layers.0.mlp.experts.w13"][3]  # gate rows, then up rows: each tiled alone
    gate, up = quantize(w13[:32]), quantize(w13[32:])
    assert torch.equal(
        q["layers.0.mlp.experts.w13"][3].float(), torch.cat([gate[0], up[0]]).float()
    )
    assert torch.equal(q["layers.0.mlp.experts.w13_scale_inv"][3], torch.cat([gate[1], up[1]]))
    assert torch.equal(q["embed_tokens.weight"], hp["embed_tokens.weight"])


# -- parallel layouts --------------------------------------------------------------------------


def test_layouts_give_the_logits_of_one_rank(ckpts: dict[str, Path]) -> None:
    """tp2-ep2-alltoall on the FP8 checkpoint, and tp2-ep2-alltoall-dp quantizing the float32
    one at load: every chunk's last logits within 1e-4 of the single rank's."""
    gen = seeded(5)
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    chunks = [5, 6, 1, 1, 3, 1, 1, 1, 1]
    one = build_ours(ckpts["fp8"])
    single = {i: paged_logits(one, s, [len(s)], 4, list(range(8))) for i, s in enumerate(seqs)}
    runs = {
        "tp2-ep2-alltoall": (ckpts["fp8"], None),
        "tp2-ep2-alltoall-dp": (ckpts["hp"], {"quantization": "fp8"}),
    }
    for name, (model, kw) in runs.items():
        got = run_layout(model, name, seqs, chunks, free_port(), server_kw=kw)
        starts = [sum(chunks[:k]) for k in range(len(chunks))]
        assert set(got) == {  # every chunk's last row
            (i, min(start + n, len(s)) - 1)
            for i, s in enumerate(seqs)
            for start, n in zip(starts, chunks, strict=True)
            if start < len(s)
        }
        for (i, pos), row in got.items():
            torch.testing.assert_close(
                row, single[i][pos], atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )


# -- what is refused ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"quant_method": "gptq"},
        {"fmt": "e5m2"},
        {"activation_scheme": "static"},
        {"weight_block_size": [64, 64]},
        {"weight_block_size": None},
    ],
)
def test_unsupported_quantization_configs_name_what_is_supported(change: dict) -> None:
    d = dict(
        model_type="qwen3_moe",
        vocab_size=10,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        quantization_config={**QUANTIZATION_CONFIG, **change},
    )
    with pytest.raises(ModelConfigError, match="not supported \\(supported: quant_method 'fp8'"):
        parse_config(d)


@pytest.mark.parametrize(
    ("tensor", "edit", "match"),
    [
        ("model.layers.0.self_attn.k_proj.weight_scale_inv", "drop", "no tensor '{}'"),
        ("model.layers.1.mlp.up_proj.weight_scale_inv", "truncate", "{}: checkpoint shape"),
        ("model.layers.2.mlp.experts.5.down_proj.weight_scale_inv", "drop", "no tensor '{}'"),
        ("model.layers.2.mlp.experts.0.up_proj.weight_scale_inv", "truncate", "{}: checkpoint"),
    ],
)
def test_a_missing_or_misshapen_scale_is_named(
    ckpts: dict[str, Path], tmp_path: Path, tensor: str, edit: str, match: str
) -> None:
    def change(t: dict) -> None:
        if edit == "drop":
            t.pop(tensor)
        else:
            t[tensor] = t[tensor][:-1].clone()

    broken = broken_copy(ckpts["fp8"], tmp_path / "broken", change)
    with pytest.raises(LoadError, match=match.format(tensor).replace("[", "\\[")):
        check_checkpoint(str(broken), load_model_config(str(broken)))


def test_fp8_tensors_without_a_quantization_config_are_refused(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "c").mkdir()
    for f in ckpts["fp8"].iterdir():
        (tmp_path / "c" / f.name).write_bytes(f.read_bytes())
    config = tmp_path / "c" / "config.json"
    config.write_text(config.read_text().replace('"quantization_config"', '"not_quantization"'))
    with pytest.raises(LoadError, match="weight is stored as FP8, which is read only for linear"):
        check_checkpoint(str(tmp_path / "c"), load_model_config(str(tmp_path / "c")))


def test_a_shard_boundary_inside_a_block_is_refused(ckpts: dict[str, Path]) -> None:
    cfg = load_model_config(str(ckpts["fp8"]))
    check_layout(cfg, Layout(1, 2, 2))  # tp2-ep2: every cut on a tile boundary
    # tp2-ep1: each rank holds 96 of an expert's 192 rows
    with pytest.raises(
        LayoutError, match=r"experts.0.gate_proj.weight: .* rows \[96, 192\) of 192"
    ):
        check_layout(cfg, Layout(1, 2, 1))
    # tp4: 64 of the dense MLP's 256 rows
    with pytest.raises(LayoutError, match=r"layers.1.mlp.gate_proj.weight: .*multiples of 128"):
        check_layout(cfg, Layout(0, 4, 4))
    # online quantization follows the same rule
    online = load_model_config(str(ckpts["hp"]), "fp8")
    with pytest.raises(LayoutError, match="cuts a 128x128 FP8 block"):
        check_layout(online, Layout(1, 2, 1))
    check_layout(load_model_config(str(ckpts["hp"])), Layout(1, 2, 1))  # unquantized: fine


def test_the_stored_dtypes_decide_which_weights_must_keep_whole_tiles(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint that stores its experts unquantized without listing them: serve's start-up
    check reads the dtypes, so tp2-ep1 (96 of 192 expert rows a rank) is no longer refused,
    and the model it builds holds those experts in float32."""
    experts = tuple(
        f"model.layers.{i}.mlp.experts.{e}.{p}"
        for i in (0, 2)
        for e in range(8)
        for p in ("gate_proj", "up_proj", "down_proj")
    )
    fp8 = write_fp8_checkpoint(ckpts["hp"], tmp_path / "fp8", keep=experts)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"].pop("modules_to_not_convert")
    (fp8 / "config.json").write_text(json.dumps(config))
    cfg = load_model_config(str(fp8))
    with pytest.raises(LayoutError, match="experts.0.gate_proj"):
        check_layout(cfg, Layout(1, 2, 1))  # from config.json alone, every linear is FP8
    check_layout(cfg, Layout(1, 2, 1), stored_dtypes(str(fp8), cfg))
    with socket.socket() as taken:  # serve's checks pass up to the port, which is taken
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        r = _serve("--model", str(fp8), "--tp-size", "2", "--port", port)
    assert r.returncode == 2 and f"127.0.0.1:{port} (--port)" in r.stderr, r.stderr
    net = build_ours(fp8)
    assert net.layers[0].mlp.experts.w13.dtype == torch.float32
    assert isinstance(net.layers[0].self_attn.o_proj, BlockFp8Linear)


def _serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "safeserve.cli", "serve", "--port", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_serve_refuses_bad_fp8_setups_in_one_line_before_any_rank(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    broken = broken_copy(ckpts["fp8"], tmp_path / "broken", lambda t: t.pop(name))
    cases = {
        (str(broken),): f"no tensor '{name}'",
        (str(ckpts["fp8"]), "--tp-size", "2"): "cuts a 128x128 FP8 block",
        (str(ckpts["fp8"]), "--enable-deterministic-inference"): "no batch-invariant FP8 path",
    }
    for args, message in cases.items():
        r = _serve("--model", *args)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()  # one line, before any rank is spawned
        assert len(lines) == 1 and lines[0].startswith("safeserve: error: "), r.stderr
        assert message in lines[0]
    r = _serve("--model", str(ckpts["hp"]), "--quantization", "int4")
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr


# -- through the server ------------------------------------------------------------------------


@pytest.mark.slow
def test_http_greedy_completions_of_the_fp8_checkpoint_equal_the_reference(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    import httpx

    prompts = [[5, 17, 40, 2, 99, 3], [300, 12, 77]]
    server = start_server(
        ["--model", str(ckpts["fp8"]), "--served-model-name", "fp8"], tmp_path / "log"
    )
    try:
        got = []
        for p in prompts:
            body = dict(model="fp8", prompt=p, max_tokens=8, temperature=0, ignore_eos=True)
            r = httpx.post(
                server.url + "/v1/completions", json=body | {"return_token_ids": True}, timeout=120
            )
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
    finally:
        stop_server(server.proc)
    assert got == greedy_continuations(ckpts["deq"], prompts, 8)
