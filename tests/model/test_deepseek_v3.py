"""Our DeepSeek-V3 against transformers' own, through the paged (latent) KV cache, in float32;
its router, rotary embedding and softmax scale against transformers' modules; the config's
rules and refusals; the start-up check of a broken checkpoint."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint
from model_checks import broken_copy, dummy_load_generates, paged_logits
from safetensors.torch import load_file
from seeds import seeded
from transformers import AutoModelForCausalLM, DeepseekV3Config

from safeserve.engine.kv_cache import KVCache
from safeserve.kernels.mla_prepare import store_rows, store_rows_no_sync
from safeserve.layers.paged_attention import AttentionMetadata
from safeserve.layers.rotary import RotaryEmbedding
from safeserve.model.config import ModelConfigError
from safeserve.model.deepseek_v3.model import router_config, softmax_scale
from safeserve.model.loader import LoadError, build_model, check_checkpoint, load_model_config
from safeserve.model.registry import kv_spec, parse_config
from safeserve.moe.dispatch import LocalDispatcher
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import Router, grouped_topk
from safeserve.parallel.layout import Layout

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8)
# What changes the code path: the q LoRA or one q_proj, default or YaRN rope (with and without
# mscale), interleaved or rotate-half RoPE, groups or none, renormalized or not, attention
# biases, a tied head, shared experts 2 or 1, sharded safetensors.
VARIANTS = {
    "default": {},
    "no_q_lora_yarn_rotate_half": dict(
        q_lora_rank=None,
        rope_interleave=False,
        max_position_embeddings=256,
        rope_parameters={**YARN, "original_max_position_embeddings": 64},
    ),
    "sharded_tied_bias_one_group": dict(
        tie_word_embeddings=True,
        attention_bias=True,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        n_shared_experts=1,
        first_k_dense_replace=2,
        num_experts_per_tok=2,
        # YaRN with mscale_all_dim but no mscale: transformers' attention factor from `factor`
        rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=2.0, mscale_all_dim=1.0),
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory: pytest.TempPathFactory):
    """(name, checkpoint, our model, transformers' model) of one variant."""
    name = request.param
    shard = "40KB" if name.startswith("sharded") else None
    out = tmp_path_factory.mktemp(name)
    ckpt = write_deepseek_v3_checkpoint(out, seed=3, max_shard_size=shard, **VARIANTS[name])
    assert (ckpt / "model.safetensors.index.json").exists() == (shard is not None)
    cfg = load_model_config(str(ckpt))
    net = build_model(
        str(ckpt), "auto", "float32", "cpu", LocalDispatcher(ExpertPlacement(cfg.num_experts))
    )
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return name, ckpt, net, hf


def _prompt(vocab: int, n: int = 29) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=seeded(1)).tolist()


def test_logits_match_transformers_prefill_and_decode(variant) -> None:
    name, _, net, hf = variant
    ids = _prompt(net.config.vocab_size)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # A prefill in uneven chunks, then single-token decode steps, through scattered blocks.
    table = [9, 2, 14, 5, 11, 0, 7, 3]
    ours = paged_logits(net, ids, [7, 12, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], block_size=4, table=table)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


def test_groups_and_correction_bias_change_the_routing(variant) -> None:
    """On the model's own router logits: the choice differs from plain top-k of the scores,
    from the group-limited choice without the bias, and (with groups) from the biased choice
    without groups; so the test above checks all three."""
    name, _, net, _ = variant
    cfg = net.config
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(gate, _inputs, out) -> None:  # type: ignore[no-untyped-def]
        seen.append((out.router_logits, out.topk_ids, gate.e_score_correction_bias))

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in net.layers if layer.is_moe]
    try:
        paged_logits(net, _prompt(cfg.vocab_size), [29], block_size=4, table=list(range(8)))
    finally:
        for h in hooks:
            h.remove()
    rc = router_config(cfg)
    no_groups = replace(rc, n_group=1, topk_group=1)
    for logits, ids, bias in seen:
        assert bias.abs().min() > 0
        chosen = ids.sort(-1).values
        plain = logits.sigmoid().topk(cfg.num_experts_per_tok, -1).indices.sort(-1).values
        unbiased = grouped_topk(logits, rc, None, torch.float32)[1].sort(-1).values
        ungrouped = grouped_topk(logits, no_groups, bias, torch.float32)[1].sort(-1).values
        assert (chosen != plain).any(-1).sum() >= 3, name
        assert (chosen != unbiased).any(-1).sum() >= 3, name
        if cfg.n_group > 1:
            assert (chosen != ungrouped).any(-1).sum() >= 1, name


@pytest.mark.parametrize("groups", [(4, 2), (1, 1), (6, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_transformers_router(groups: tuple[int, int], renormalize: bool) -> None:
    """Our Router against transformers' `DeepseekV3TopkRouter`, with correction biases that
    push every score + bias below 0 for some experts: a dropped group must lose to them."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    n_group, topk_group = groups
    hf_cfg = DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=12,
        num_experts_per_tok=3,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=renormalize,
        routed_scaling_factor=2.5,
    )
    gen = seeded(7)
    hf = DeepseekV3TopkRouter(hf_cfg)
    ours = Router(16, 12, router_config(parse_config(hf_cfg.to_dict())))
    weight = torch.randn(12, 16, generator=gen)
    bias = torch.randn(12, generator=gen) * 0.5 - 0.9
    with torch.no_grad():
        for m in (hf, ours):
            m.weight.copy_(weight)
            m.e_score_correction_bias.copy_(bias)
    x = torch.randn(64, 16, generator=gen)
    _, ref_w, ref_ids = hf(x)
    got = ours(x)
    order, ref_order = got.topk_ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(got.topk_ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(
        got.topk_weights.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=0
    )
    if n_group > 1:  # some chosen expert's score + bias is below 0: a 0-fill would lose it
        choice = x.matmul(weight.T).sigmoid() + bias
        assert (choice.gather(1, ref_ids) < 0).any()


@pytest.mark.parametrize(
    "rope",
    [
        dict(factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=64),
        dict(factor=2.0, mscale_all_dim=1.0),  # no mscale
        dict(factor=8.0, mscale=0.7),  # no mscale_all_dim
        dict(factor=3.0, attention_factor=1.3, beta_fast=16, beta_slow=2, truncate=False),
        dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=32),
    ],
)
def test_yarn_rotary_and_softmax_scale_match_transformers(rope: dict) -> None:
    """inv_freq, the cos/sin factor (transformers' `_compute_yarn_parameters`) and the softmax
    scale (`DeepseekV3Attention.scaling`, `yarn_apply_mscale`) of YaRN rope dicts."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf_cfg = DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=16,
        v_head_dim=8,
        n_routed_experts=16,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **rope},
    )
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    cfg = parse_config(json.loads(hf_cfg.to_json_string()))
    ours = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope)
    torch.testing.assert_close(ours.inv_freq, ref_inv, atol=0, rtol=0)
    assert ours.attention_scaling == pytest.approx(ref_factor, rel=1e-12)
    hf_scale = DeepseekV3Attention(hf_cfg, 0).scaling
    assert softmax_scale(cfg) == pytest.approx(hf_scale, rel=1e-12)


BASE = dict(
    model_type="deepseek_v3",
    vocab_size=10,
    hidden_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
)


def test_config_rules_and_defaults() -> None:
    cfg = parse_config(BASE)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert (cfg.q_lora_rank, cfg.routed_scaling_factor, cfg.n_shared_experts) == (1536, 2.5, 1)
    assert cfg.rope_interleave and cfg.norm_topk_prob and cfg.head_dim == 4
    assert parse_config({**BASE, "q_lora_rank": None}).q_lora_rank is None
    # as transformers reads it: `num_local_experts` is `n_routed_experts`
    renamed = {k: v for k, v in BASE.items() if k != "n_routed_experts"}
    assert parse_config({**renamed, "num_local_experts": 6}).num_experts == 6
    # Kimi K2: its own model_type, transformers' DeepSeek-V3 architecture
    named = {**BASE, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    assert parse_config(named).model_type == "deepseek_v3"
    assert kv_spec(parse_config(named), Layout(0, 2, 2)).k_dim == 12
    # the YaRN rope of real DeepSeek-V3 / Kimi K2 configs (`rope_scaling`, `type`)
    real = parse_config(
        {
            **BASE,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 32,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 1,
                "beta_slow": 1,
            },  # fmt: skip
        }
    )
    assert (real.rope.type, real.rope.factor, real.rope.theta) == ("yarn", 32.0, 50000.0)
    assert kv_spec(cfg, Layout()).k_dim == 12 and kv_spec(cfg, Layout()).v_in_k


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"quantization_config": {"quant_method": "fp8"}},
            "supported: quant_method 'fp8', fmt 'e4m3'",
        ),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"topk_method": "group_limited_greedy"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
        ({"num_key_value_heads": 1}, "must equal num_attention_heads"),
        ({"n_group": 3}, "n_group 3 must divide"),
        ({"topk_group": 3}, "topk_group 3"),
        ({"n_group": 8, "topk_group": 1}, "at least 2 experts"),
        ({"num_experts_per_tok": 5}, "exceeds"),
        ({"qk_rope_head_dim": 5}, "even"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "needs its 'factor'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 2.0}}, "rope_type 'llama3'"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_config_refusals_are_one_line(change: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message) as e:
        parse_config({**BASE, **change})
    assert "\n" not in str(e.value)


def test_store_without_host_sync_skips_minus_one_slots() -> None:
    """The CUDA store (no host sync) writes what the masked store writes, with -1 rows mixed
    in, first or last, or every row -1."""
    gen = seeded(0)
    for slots in ([5, -1, 2, -1, 7], [-1, 3, 0], [4, 6, -1], [-1, -1]):
        s = torch.tensor(slots)
        entry = torch.randn(len(slots), 6, generator=gen)
        base = torch.randn(9, 1, 6, generator=gen)
        want, got = base.clone(), base.clone()
        store_rows(entry, want, s)
        store_rows_no_sync(entry[:, None, :], got, s)
        assert torch.equal(got, want), slots
        untouched = [i for i in range(9) if i not in slots]
        assert torch.equal(got[untouched], base[untouched])


def test_store_takes_the_decode_graphs_int32_slots() -> None:
    """The decode graphs hold their slots as int32 (engine/cuda_graph.py): the store writes
    with them what it writes with int64 slots."""
    gen = seeded(1)
    slots = torch.tensor([5, -1, 2, 7])
    entry = torch.randn(4, 6, generator=gen)
    base = torch.randn(9, 1, 6, generator=gen)
    want, got = base.clone(), base.clone()
    store_rows(entry, want, slots)
    store_rows(entry, got, slots.to(torch.int32))
    assert torch.equal(got, want)
    assert not torch.equal(got, base)


# -- the start-up check of a broken checkpoint ----------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("good"), seed=4)


def test_check_accepts_the_transformers_checkpoint(good: Path) -> None:
    check_checkpoint(str(good), load_model_config(str(good)))


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.experts.5.up_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
    ],
)
def test_check_names_a_missing_tensor(good: Path, tmp_path: Path, name: str) -> None:
    ckpt = broken_copy(good, tmp_path / "broken", lambda t: t.pop(name))
    with pytest.raises(LoadError, match=f"no tensor '{name}'"):
        check_checkpoint(str(ckpt), load_model_config(str(ckpt)))


@pytest.mark.parametrize(
    "name", ["model.layers.2.self_attn.kv_b_proj.weight", "model.layers.1.mlp.gate.weight"]
)
def test_check_names_a_wrong_shape(good: Path, tmp_path: Path, name: str) -> None:
    def truncate(t: dict) -> None:
        t[name] = t[name][:-1].clone()

    ckpt = broken_copy(good, tmp_path / "broken", truncate)
    with pytest.raises(LoadError, match=f"{name}: checkpoint shape"):
        check_checkpoint(str(ckpt), load_model_config(str(ckpt)))


def test_dummy_load_format_needs_only_config_json(tmp_path: Path) -> None:
    cfg = {**BASE, "vocab_size": 300, "intermediate_size": 32, "moe_intermediate_size": 16}
    model = dummy_load_generates({**cfg, "max_position_embeddings": 128}, tmp_path)
    gate = model.layers[1].mlp.gate
    assert gate.weight.abs().sum() > 0 and gate.e_score_correction_bias.abs().sum() == 0


def test_gate_stays_float32_in_a_bfloat16_model(good: Path) -> None:
    """As transformers keeps `gate.weight` and `e_score_correction_bias` in float32
    (`_keep_in_fp32_modules_strict`): the router's choice is made on unrounded weights."""
    cfg = load_model_config(str(good))
    net = build_model(
        str(good), "auto", "bfloat16", "cpu", LocalDispatcher(ExpertPlacement(cfg.num_experts))
    )
    gate = net.layers[1].mlp.gate
    tensors = load_file(str(good / "model.safetensors"))
    for name in ("weight", "e_score_correction_bias"):
        p = getattr(gate, name)
        assert p.dtype == torch.float32
        assert torch.equal(p, tensors[f"model.layers.1.mlp.gate.{name}"])
    assert net.layers[1].mlp.shared_experts.gate_proj.weight.dtype == torch.bfloat16
    ids = torch.tensor(_prompt(cfg.vocab_size, 9))
    kv = KVCache.from_spec(kv_spec(cfg, Layout()), 4, 4, torch.bfloat16, "cpu")
    meta = AttentionMetadata.build([9], [9], [[0, 1, 2]], 4, "cpu")
    assert net.compute_logits(net(ids, torch.arange(9), meta, kv.layers)).isfinite().all()
