"""The memory floor: the read ceiling, the experts each step routed to, what a decode step reads."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_read_ceiling(device: torch.device, gib: float, repeats: int = 10) -> float:
    """Bytes/s of a large bf16 sum (reads every byte once): the HBM (or DRAM) read ceiling."""
    n = int(gib * (1 << 30)) // 2
    x = torch.empty(n, dtype=torch.bfloat16, device=device)
    x.uniform_(-1, 1)  # never time on zeros
    times = []
    for i in range(repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        x.sum(dtype=torch.float32)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del x
    return n * 2 / statistics.median(times)


class RoutingProbe:
    """Reads which experts each MoE layer's router chose in the last step.

    Forward hooks see eager steps; a CUDA graph's replays run no Python, so the hooks also keep,
    per graph and bucket, the router outputs recorded while it was captured: their memory is the
    graph's and holds each replay's routing. The runner captures its decode graphs first
    (`runner.cuda_graphs` is set once they all are), then its piecewise graphs (whose token
    buckets overlap the decode batch buckets): a step reads the record of what ran it.
    """

    def __init__(self, model: torch.nn.Module, num_experts: int, runner: Any = None) -> None:
        """`num_experts`: the physical slots per MoE layer (the routers' ids are physical; each
        slot is its own weights to read, replicas included); a runner's expert map gives them
        (`of_runner`)."""
        self.runner = runner
        self.num_experts = num_experts
        self.eager: dict[int, torch.Tensor] = {}
        self.captured: dict[str, dict[int, dict[int, torch.Tensor]]] = {
            "decode": {},
            "piecewise": {},
        }
        self.handles = []
        moe = [layer for layer in model.layers if layer.is_moe]
        for i, layer in enumerate(moe):
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(i)))
        self.num_layers = len(moe)

    @staticmethod
    def of_runner(runner: Any) -> RoutingProbe:
        """The probe of a `ModelRunner`'s model, over its expert map's physical slots."""
        m = runner.expert_map
        slots = m.num_physical if m is not None else runner.config.num_experts
        return RoutingProbe(runner.model, slots, runner)

    def _hook(self, index: int) -> Callable:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            ids = output.topk_ids
            if ids.is_cuda and torch.cuda.is_current_stream_capturing():
                kind = (
                    "decode" if getattr(self.runner, "cuda_graphs", None) is None else "piecewise"
                )
                self.captured[kind].setdefault(ids.shape[0], {})[index] = ids
            else:
                self.eager[index] = ids

        return hook

    def experts_read(self, batch: int, graph_bucket: int | None) -> list[int]:
        """Distinct physical experts (slots: the weights a step reads) of each MoE layer among
        the real `batch` rows of the last step."""
        ids = self._step_ids(batch, graph_bucket)
        flat = ids.reshape(self.num_layers, -1)
        seen = torch.zeros(self.num_layers, self.num_experts + 1, dtype=torch.bool)
        # -1 (no expert) lands in the extra last column, which is not counted.
        seen.scatter_(1, flat.where(flat >= 0, self.num_experts), True)
        return seen[:, : self.num_experts].sum(dim=1).tolist()

    def logical_counts(self, batch: int, graph_bucket: int | None) -> torch.Tensor:
        """Per MoE layer and logical expert, the choices of the real `batch` rows of the last
        step (int64 `[L, E]`): an expert distribution's counts (`moe/eplb/distribution.py`)."""
        ids = self._step_ids(batch, graph_bucket).reshape(self.num_layers, -1)
        m = getattr(self.runner, "expert_map", None)
        if m is not None:  # physical slots to the logical experts they hold
            phy2log = torch.tensor(m.phy2log, dtype=torch.int64)
            ids = torch.where(ids >= 0, phy2log.gather(1, ids.clamp(min=0)), -1)
            logical = m.num_logical
        else:
            logical = self.num_experts
        counts = torch.zeros(self.num_layers, logical + 1, dtype=torch.int64)
        counts.scatter_add_(1, ids.where(ids >= 0, logical), torch.ones_like(ids))
        return counts[:, :logical]

    def _step_ids(self, batch: int, graph_bucket: int | None) -> torch.Tensor:
        """The routers' expert ids `[L, batch, k]` (on the CPU) of the last step's real rows."""
        from safeserve.engine.cuda_graph import smallest_bucket

        piecewise = getattr(self.runner, "piecewise", None)
        if graph_bucket is not None:
            src = self.captured["decode"][graph_bucket]
        elif piecewise is not None and piecewise.can_run(batch):  # one token per sequence
            bucket = smallest_bucket(piecewise.buckets, batch)
            # where no decode graph was captured, the piecewise captures were taken for them
            kind = "decode" if getattr(self.runner, "cuda_graphs", None) is None else "piecewise"
            src = self.captured[kind][bucket]
        else:
            src = self.eager
        return torch.stack([src[i][:batch] for i in range(self.num_layers)]).cpu().long()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclasses.dataclass
class ModelBytes:
    """What one decode step must read, by part."""

    dense: int  # every weight except the experts and the embedding table
    embed_row: int  # one embedding row (a step reads B of them)
    expert: int  # one expert of one layer (gate + up + down; and their scales if block FP8)
    kv_token: int  # one token's cache entries over all layers (K and V, or MLA's latent)

    @staticmethod
    def of(runner: Any) -> ModelBytes:
        model = runner.model
        expert_ids: set[int] = set()
        expert_bytes = 0
        for layer in model.layers:
            if layer.is_moe:
                ex = layer.mlp.experts
                # block-FP8 experts: their float32 tile scales are read with them
                scales = [ex.w13_scale_inv, ex.w2_scale_inv] if ex.block is not None else []
                held = [ex.w13, ex.w2, *scales]
                expert_ids.update(id(p) for p in held)
                expert_bytes = sum(p[0].numel() * p.element_size() for p in held)
        embed = model.embed_tokens.weight
        tied = model.lm_head.weight is embed
        dense = 0
        seen: set[int] = set()
        for p in model.parameters():
            if id(p) in seen or id(p) in expert_ids or (p is embed and not tied):
                continue
            seen.add(id(p))
            dense += p.numel() * p.element_size()
        # from the family's KV specification: K and V heads, or one latent vector (MLA)
        kv_token = runner.kv.spec.token_bytes(runner.kv.layers[0][0].element_size())
        return ModelBytes(dense, embed[0].numel() * embed.element_size(), expert_bytes, kv_token)
