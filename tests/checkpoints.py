"""Small random Hugging Face checkpoints for tests, written by `transformers` itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Experts route tokens; the router picks the top k experts for every token.",
    "Mixture of experts models serve many requests at once on many GPUs.",
    "A paged key value cache stores attention keys in fixed size blocks.",
    "Héllo wörld, naïve café — unicode text with accents and emoji 🙂.",
    "0123456789 + - * / = ( ) [ ] { } < > , ; : ! ?",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(out_dir: Path, vocab_size: int = 400) -> Any:
    """A byte-level BPE tokenizer trained on a small corpus, saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def write_checkpoint(
    out_dir: Path,
    family: str,
    params: dict[str, Any],
    seed: int = 0,
    max_shard_size: str | None = None,
    init: Any = None,
) -> Path:
    """Random weights of transformers' `{family}Config` / `{family}ForCausalLM` (e.g. "Mixtral")
    saved with `save_pretrained`, plus a tokenizer; `params` override the config's fields
    (`vocab_size` and `eos_token_id` default to the tokenizer's). Weights other than norms are
    drawn from N(0, 0.08), larger than the default init, so that greedy choices are well
    separated; `init(model)` may then adjust them (e.g. non-zero biases)."""
    import torch
    import transformers
    from seeds import seed_all

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    full: dict[str, Any] = dict(
        vocab_size=max(len(tokenizer), 256) + 7,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tie_word_embeddings=False,
    )
    full.update(params)
    config = getattr(transformers, f"{family}Config")(**full)
    if getattr(init, "calibrated", False):
        torch.manual_seed(seed)  # the run's seed offset does not apply (see `skew_router`)
    else:
        seed_all(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
        if init is not None:
            init(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def write_qwen3_moe_checkpoint(
    out_dir: Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    init: Any = None,
    **overrides: Any,
) -> Path:
    """Random Qwen3-MoE weights saved with `save_pretrained`, plus a tokenizer (`init`: as
    `write_checkpoint`'s)."""
    params: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        rope_theta=10000.0,
    )
    params.update(overrides)
    return write_checkpoint(out_dir, "Qwen3Moe", params, seed, max_shard_size, init)


# The experts `skew_router` makes the routers prefer (the weight of the shared direction in their
# gate rows).
FAVOURED_EXPERTS = {0: 0.2, 1: 0.25}


def skew_router(model: Any) -> None:
    """A `write_checkpoint` init for a Qwen3-MoE model: every token's hidden state gets a shared
    direction (dimension 0 of the embeddings) that the routers score high for
    FAVOURED_EXPERTS, so most tokens pick them, as a trained model's router favours a few.

    How strongly depends on the random weights around it: on other draws the other dimensions'
    common part outweighs the shared direction and the favoured experts get almost no tokens
    (the EPLB tests' balancedness bounds then mean nothing). So checkpoints written with this
    init keep their own seed: `SAFESERVE_TEST_SEED` does not move it (`calibrated`)."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 1.0
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight[:, 0] = 0.0
                for e, w in FAVOURED_EXPERTS.items():
                    layer.mlp.gate.weight[e, 0] = w


skew_router.calibrated = True  # type: ignore[attr-defined]


def greedy_continuations(
    model: Path, prompts: list[list[int]], n: int, cached: bool = False
) -> list[list[int]]:
    """transformers' float32 greedy continuations of `prompts`, `n` tokens each (EOS not
    special: what a request with ignore_eos returns). Each token is computed over the whole
    sequence again, or with `cached`, from transformers' KV cache, the prompts of equal length
    in one batch (for long continuations)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if cached:
        return _cached_continuations(hf, prompts, n)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(n):
                nxt = hf(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            out.append(ids[0, len(p) :].tolist())
    return out


def _cached_continuations(hf: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch

    out: dict[int, list[int]] = {}
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for rows in by_length.values():
            res = hf(torch.tensor([prompts[i] for i in rows]), use_cache=True)
            tokens = []
            while True:
                nxt = res.logits[:, -1].argmax(dim=-1)
                tokens.append(nxt)
                if len(tokens) == n:
                    break
                res = hf(nxt[:, None], cache=res.cache, use_cache=True)
            for j, i in enumerate(rows):
                out[i] = [int(t[j]) for t in tokens]
    return [out[i] for i in range(len(prompts))]
