"""Checks every model family's tests share: our model's logits through the paged KV cache
against transformers', the checkpoints of the families' variants, broken copies of a checkpoint
for the start-up check, an engine on dummy weights, and a small model runner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from seeds import seeded

# A prefill in uneven chunks, then single-token decode steps, through scattered blocks.
CHUNKS = [7, 12] + [1] * 10
TABLE = [9, 2, 14, 5, 11, 0, 7, 3]


def paged_logits(
    net: Any,
    ids: list[int],
    chunks: list[int],
    block_size: int,
    table: list[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Logits of every token of `ids`, computed in `chunks` through the cache blocks `table`
    (the family's KV specification, single rank, a cache of the model's `dtype`)."""
    from safeserve.engine.kv_cache import KVCache
    from safeserve.layers.paged_attention import AttentionMetadata
    from safeserve.model.registry import kv_spec
    from safeserve.parallel.layout import Layout

    spec = kv_spec(net.config, Layout())
    kv = KVCache.from_spec(spec, max(table) + 1, block_size, dtype, "cpu")
    logits, start = [], 0
    for n in chunks:
        end = start + n
        meta = AttentionMetadata.build([n], [end], [table], block_size, "cpu")
        hidden = net(torch.tensor(ids[start:end]), torch.arange(start, end), meta, kv.layers)
        logits.append(net.compute_logits(hidden))
        start = end
    return torch.cat(logits)


def load_ours(ckpt: Path) -> Any:
    from safeserve.model.loader import build_model, load_model_config
    from safeserve.moe.dispatch import LocalDispatcher
    from safeserve.moe.placement import ExpertPlacement

    cfg = load_model_config(str(ckpt))
    placement = ExpertPlacement(cfg.num_experts)
    return build_model(str(ckpt), "auto", "float32", "cpu", LocalDispatcher(placement))


def paged_logits_match_transformers(ckpt: Path, n: int = 29, reference: Path | None = None) -> Any:
    """Our model (in-process, float32) against `AutoModelForCausalLM.from_pretrained(ckpt)`
    (or of `reference`, a checkpoint of the same weights transformers reads): `n` tokens as a
    prefill in uneven chunks, then single-token decode steps, through scattered KV blocks;
    every position's logits within 1e-4. Returns our model."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: OpenMP barriers cost more than they split
    try:
        net = load_ours(ckpt)
        hf = AutoModelForCausalLM.from_pretrained(reference or ckpt, dtype=torch.float32).eval()
        gen = seeded(1)
        ids = torch.randint(0, net.config.vocab_size, (n,), generator=gen).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        ours = paged_logits(net, ids, CHUNKS, block_size=4, table=TABLE)
    finally:
        torch.set_num_threads(threads)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    return net


def variant_checkpoint(
    write: Callable[..., Path], good: Path, tmp_path: Path, variant: str, options: dict
) -> Path:
    """The checkpoint of a family's test variant: `good` for "default", else one `write` makes
    at `tmp_path` with the variant's `options` (seed 4), in 20 KB safetensors shards where the
    variant's name starts with "sharded" (checked: they have an index, the others none)."""
    if variant == "default":
        return good
    sharded = variant.startswith("sharded")
    ckpt = write(tmp_path, seed=4, max_shard_size="20KB" if sharded else None, **options)
    assert (ckpt / "model.safetensors.index.json").exists() == sharded
    return ckpt


def dummy_load_generates(config: dict, tmp_path: Path, tokens: int = 4) -> Any:
    """An engine on `--load-format dummy` from `config` alone (a config.json at `tmp_path`, no
    weights, seed 5) generates `tokens` greedy tokens, each in the vocabulary. Returns its
    model, for the family's own checks of the dummy weights."""
    import json

    from safeserve.config import ServerArgs
    from safeserve.engine.engine import Engine
    from safeserve.messages import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(ServerArgs(model=str(tmp_path), load_format="dummy", seed=5))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
    assert len(out) == tokens and all(0 <= t < config["vocab_size"] for t in out)
    return engine.runner.model


def broken_copy(good: Path, out: Path, edit: Callable[[dict], Any]) -> Path:
    """A copy of the (single-file) checkpoint `good` at `out` with its tensors passed through
    `edit` (a function of the name -> tensor dict)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in good.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(good / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def assert_check_names(good: Path, tmp_path: Path, name: str, edit: str) -> None:
    """The start-up check of a copy of `good` whose tensor `name` is dropped (`edit` "drop")
    or one row short ("truncate") fails naming it."""
    from safeserve.model.checkpoint import LoadError, check_checkpoint, load_model_config

    def change(t: dict) -> None:
        if edit == "drop":
            t.pop(name)
        else:
            t[name] = t[name][:-1].clone()

    ckpt = broken_copy(good, tmp_path / "broken", change)
    match = f"no tensor '{name}'" if edit == "drop" else f"{name}: checkpoint shape"
    with pytest.raises(LoadError, match=match):
        check_checkpoint(str(ckpt), load_model_config(str(ckpt)))


def small_runner(
    model: Path | str, device: str, dtype: str, graphs: bool, capture: bool = True, **flags: Any
) -> Any:
    """A `ModelRunner` of `model` sized for a few short sequences: 64 blocks of 4 tokens, up to
    8 running, CUDA graphs (where `graphs`) for batches up to 4; `capture` False: the graphs
    are left for the caller to capture; `flags`: further `ServerArgs`."""
    from safeserve.config import ServerArgs
    from safeserve.engine.model_runner import ModelRunner

    args = ServerArgs(
        model=str(model),
        device=device,
        dtype=dtype,
        num_kv_blocks=64,
        block_size=4,
        max_model_len=64,
        max_running_requests=8,
        cuda_graph_max_bs=4,
        disable_cuda_graph=not graphs,
        **flags,
    )
    return ModelRunner(args, capture_cuda_graphs=capture)
