"""The engine of a group leader: `schedule -> run -> postprocess`, one step at a time."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from safeserve.config import ServerArgs
from safeserve.engine.attention import AttentionMetadata
from safeserve.engine.kv_cache import BlockAllocator, KVCache
from safeserve.engine.request import Request
from safeserve.engine.sampler import sample
from safeserve.engine.scheduler import Scheduler, SchedulerOutput
from safeserve.messages import EngineStats, RequestOutput, SamplingParams
from safeserve.model.loader import DTYPES, build_model
from safeserve.model.qwen3_moe import Qwen3MoeForCausalLM
from safeserve.model.tokenizer import load_tokenizer
from safeserve.moe.dispatch import LocalDispatcher
from safeserve.moe.placement import ExpertPlacement

logger = logging.getLogger(__name__)

PhaseCallback = Callable[[int, str], None]


def _num_kv_blocks(args: ServerArgs, net: Qwen3MoeForCausalLM, max_model_len: int) -> int:
    cfg = net.config
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers,
        args.block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
        DTYPES[args.dtype],
    )
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if args.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        budget = free - (1 - args.mem_fraction_static) * total
        if budget <= per_block:
            raise RuntimeError(
                "no device memory left for the KV cache; lower --mem-fraction-static"
            )
        blocks = int(budget // per_block)
    else:
        blocks = int(args.kv_cache_memory_gb * (1 << 30) // per_block)
    # More than every running request at full length is never used.
    useful = args.max_running_requests * ((max_model_len + args.block_size - 1) // args.block_size)
    return max(2, min(blocks, useful))


class Engine:
    """Owns the model, the KV cache and the scheduler of one group (single rank for now)."""

    def __init__(self, args: ServerArgs, on_phase: PhaseCallback | None = None) -> None:
        self.args = args
        self.device = torch.device(args.device)
        placement = ExpertPlacement(_num_experts_or_one(args))
        self.model = build_model(
            args.model,
            args.load_format,
            args.dtype,
            args.device,
            placement,
            LocalDispatcher(placement),
            args.seed,
        )
        cfg = self.model.config
        self.config = cfg
        max_len = args.max_model_len or cfg.max_position_embeddings
        self.num_blocks = _num_kv_blocks(args, self.model, max_len)
        capacity = self.num_blocks * args.block_size
        if max_len > capacity:
            logger.warning(
                "max model length lowered from %d to %d: the KV cache holds no more",
                max_len,
                capacity,
            )
            max_len = capacity
        self.max_model_len = max_len
        self.allocator = BlockAllocator(self.num_blocks, args.block_size)
        self.kv = KVCache(
            cfg.num_hidden_layers,
            self.num_blocks,
            args.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            DTYPES[args.dtype],
            self.device,
        )
        self.scheduler = Scheduler(
            self.allocator,
            args.max_running_requests,
            args.max_num_batched_tokens,
            args.prefill_chunk,
        )
        # The tokenizer's files (generation_config.json, eos_token) may name more stop ids.
        self.eos_token_ids = set(
            load_tokenizer(args.model, cfg.eos_token_ids, args.load_format == "dummy").eos_token_ids
        )
        self.step_id = 0
        self.on_phase = on_phase or (lambda step, phase: None)
        logger.info(
            "engine ready: %d KV blocks of %d tokens, max model length %d, chunk %d, budget %d",
            self.num_blocks,
            args.block_size,
            self.max_model_len,
            args.prefill_chunk,
            args.max_num_batched_tokens,
        )

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("prompt plus max_tokens exceeds the context length")
        if max(prompt_ids) >= self.config.vocab_size or min(prompt_ids) < 0:
            raise ValueError("prompt holds token ids outside the vocabulary")
        self.scheduler.add(Request(rid, list(prompt_ids), params))

    def abort_request(self, rid: str) -> bool:
        return self.scheduler.abort(rid) is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return EngineStats(
            step=self.step_id,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.allocator.num_used,
            kv_blocks_total=self.allocator.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
        )

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.step_id += 1
        self.on_phase(self.step_id, "schedule")
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        self.on_phase(self.step_id, "attention")
        logits = self._run(plan)
        self.on_phase(self.step_id, "sample")
        return self._postprocess(plan, logits)

    def _run(self, plan: SchedulerOutput) -> torch.Tensor:
        ids: list[int] = []
        positions: list[int] = []
        q_lens, ctx_lens, tables, sample_rows = [], [], [], []
        for s in plan.scheduled:
            start, end = s.req.num_computed, s.req.num_computed + s.num_tokens
            ids.extend(s.req.token_ids[start:end])
            positions.extend(range(start, end))
            q_lens.append(s.num_tokens)
            ctx_lens.append(end)
            tables.append(s.req.block_ids)
            if s.samples:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, self.args.block_size, self.device)
        hidden = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            self.kv.layers,
        )
        if not sample_rows:
            return torch.empty(0)
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])

    def forward_logits(self, plan: SchedulerOutput) -> torch.Tensor:
        """Runs a plan and returns the logits of its sampling rows (for tests and tools)."""
        return self._run(plan)

    def _postprocess(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        sampling = [s for s in plan.scheduled if s.samples]
        for s in plan.scheduled:
            s.req.num_computed += s.num_tokens
        if not sampling:
            return []
        tokens = sample(
            logits,
            [s.req.params for s in sampling],
            [s.req.num_output_tokens for s in sampling],
            self.args.seed,
        )
        outputs = []
        for s, tok in zip(sampling, tokens, strict=True):
            req = s.req
            req.token_ids.append(tok)
            reason = self._finish_reason(req, tok)
            new = [tok]
            if reason == "stop":
                new = []  # the stop token itself is not part of the answer
            if reason is not None:
                self.scheduler.finish(req, reason)
            outputs.append(
                RequestOutput(req.rid, new, reason, req.num_prompt_tokens, req.num_output_tokens)
            )
        return outputs

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None


def _num_experts_or_one(args: ServerArgs) -> int:
    from safeserve.model.loader import load_model_config

    return max(1, load_model_config(args.model).num_experts)
