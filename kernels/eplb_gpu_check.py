"""The EPLB machinery on one GPU: one rank holds every physical slot of Qwen3-30B-A3B's shapes
(dummy weights; 128 experts + redundant slots), decodes a batch as CUDA graphs, then its expert
weights move to a new placement a chunk of layers at a time.

Reports (JSON lines, and a summary on the last line):
- after the move, the decode graphs' logits vs an eager run of the same step with the new
  placement (and vs the graphs' logits of the same step before the move: the placement does
  not change what the model computes), as the largest absolute difference and greedy agreement;
- the longest single EPLB step (the stall a chunked rebalance adds between two model steps);
- the decode step time with EPLB's counting on (no rebalance due) vs off (the same runner, with
  graphs captured with and without the counting, both held, timed in alternating blocks: on,
  off, off, on, ...; every timed step the same decode step at one position, so the sides differ
  only by the counting), overall medians and the ratio per block pair;
- every EPLB step's stall (`stalls_ms`), and what re-installing the placement alone costs
  (`map_update_ms`: the routers' tables and the dispatcher's view, no weights moved).

    python kernels/eplb_gpu_check.py --model kernels/configs/qwen3-30b-a3b-24-layers
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="kernels/configs/qwen3-30b-a3b")
    p.add_argument("--redundant", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers-per-chunk", type=int, default=1)
    p.add_argument("--timed-steps", type=int, default=30, help="per block of the on/off timing")
    p.add_argument(
        "--timing-rounds", type=int, default=6, help="on/off block pairs, alternating order"
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="per EPLB step: time in the weight moves, the placement's install and the count "
        "fold, the allocator's device mallocs, frees and retries, and garbage collections",
    )
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no graphs)")
    ns = p.parse_args()

    from safeserve.config import ServerArgs
    from safeserve.engine.kv_cache import new_table_id
    from safeserve.engine.model_runner import ModelRunner
    from safeserve.engine.plan import EplbMove, SeqPlan, StepPlan
    from safeserve.messages import SamplingParams

    args = ServerArgs(
        model=ns.model,
        load_format="dummy",
        dtype="bfloat16" if ns.device == "cuda" else "float32",
        device=ns.device,
        ep_num_redundant_experts=ns.redundant,
        max_running_requests=ns.batch,
        cuda_graph_max_bs=ns.batch,
        max_model_len=ns.prompt_len + ns.steps + 8,
        mem_fraction_static=0.8,
        num_kv_blocks=None if ns.device == "cuda" else 2048,
    )
    # EPLB's own checks want two EP ranks; the machinery runs on one (every slot local)
    args.enable_eplb = True
    t0 = time.perf_counter()
    runner = ModelRunner(args, 0, None)
    runner.freeze_gc_on_serving = True  # one runner in this process, as in a rank process
    runner.begin_serving()
    log(
        {"phase": "ready", "s": round(time.perf_counter() - t0, 1), "eplb": runner.eplb is not None}
    )
    m = runner.expert_map
    assert m is not None and runner.eplb is not None

    batch, bsz = ns.batch, args.block_size
    per_req = (ns.prompt_len + ns.steps + 8 + bsz - 1) // bsz
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(batch)]
    tids = [new_table_id() for _ in range(batch)]
    params = SamplingParams(max_tokens=ns.steps + 4, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    prompts = torch.randint(0, min(1000, vocab), (batch, ns.prompt_len), generator=gen).tolist()
    step = 1
    last = runner.execute(
        StepPlan(step, [[SeqPlan(prompts[i], 0, tables[i], params) for i in range(batch)]])
    )
    pos = ns.prompt_len

    def decode_plan(tokens: list, at: int, k: int) -> StepPlan:
        seqs = [SeqPlan([tokens[i]], at, tables[i], params, k, tids[i]) for i in range(batch)]
        return StepPlan(step, [seqs])

    def logits_of(plan: StepPlan) -> torch.Tensor:
        out, _ = runner.run_plan(plan)
        assert out is not None
        return out.float().clone()

    # decode some steps as graphs (EPLB counting on)
    for k in range(1, ns.steps // 2):
        step += 1
        last = runner.execute(decode_plan(last, pos, k))
        pos += 1
    replays_before = runner.cuda_graphs.replays if runner.cuda_graphs else None
    step += 1
    probe = decode_plan(last, pos, ns.steps // 2)
    before = logits_of(probe)  # graphs, old placement (writes this position's KV)

    # the move: every MoE layer to a shuffled placement (the most a rebalance can change)
    rng = random.Random(1)
    rows = []
    for _ in range(m.num_layers):
        row = list(range(m.num_logical)) + [
            rng.randrange(m.num_logical) for _ in range(ns.redundant)
        ]
        rng.shuffle(row)
        rows.append(tuple(row))
    stalls = []
    parts = _Breakdown() if ns.breakdown else None
    for k in range(0, m.num_layers, ns.layers_per_chunk):
        layers = tuple(range(k, min(m.num_layers, k + ns.layers_per_chunk)))
        step += 1
        if parts is not None:
            parts.begin()
        report = runner.execute_step(
            StepPlan(step, [[]], eplb=EplbMove(layers, tuple(rows[i] for i in layers)))
        )
        stalls.append(report.eplb.seconds)
        if parts is not None:
            log(
                {
                    "phase": "chunk",
                    "layers": list(layers),
                    "stall_ms": report.eplb.seconds * 1e3,
                    **parts.end(),
                }
            )
    if parts is not None:
        parts.remove()
    assert runner.expert_map.phy2log == tuple(rows)
    # the placement's bookkeeping alone: install the same map again
    from safeserve.engine.rank_eplb import set_expert_map

    sync()
    t = time.perf_counter()
    set_expert_map(runner, runner.eplb.layers, runner.expert_map)
    sync()
    map_update_ms = (time.perf_counter() - t) * 1e3

    after_graph = logits_of(probe)  # graphs, new placement (same position: same KV written)
    graphs, piecewise = runner.cuda_graphs, runner.piecewise
    runner.cuda_graphs, runner.piecewise = None, None
    after_eager = logits_of(probe)
    runner.cuda_graphs, runner.piecewise = graphs, piecewise
    replays_after = runner.cuda_graphs.replays if runner.cuda_graphs else None
    diff_eager = (after_graph - after_eager).abs().max().item()
    diff_before = (after_graph - before).abs().max().item()
    agree_eager = (after_graph.argmax(-1) == after_eager.argmax(-1)).float().mean().item()
    agree_before = (after_graph.argmax(-1) == before.argmax(-1)).float().mean().item()
    log(
        {
            "phase": "after-move",
            "graph_vs_eager_max_abs": diff_eager,
            "graph_vs_before_max_abs": diff_before,
            "greedy_agree_eager": agree_eager,
            "greedy_agree_before": agree_before,
            "logit_scale": after_eager.abs().max().item(),
            "graph_replays": [replays_before, replays_after],
            "chunks": len(stalls),
            "longest_stall_ms": max(stalls) * 1e3,
            "median_stall_ms": statistics.median(stalls) * 1e3,
            "stalls_ms": [round(x * 1e3, 2) for x in stalls],
            "map_update_ms": map_update_ms,
        }
    )

    # the step with the counting on, off (recorder detached, graphs recaptured), on again
    pos += 1
    timed = decode_plan(last, pos, ns.steps // 2 + 1)

    def time_steps() -> list[float]:
        nonlocal step
        times = []
        for _ in range(ns.timed_steps):
            step += 1
            sync()
            t = time.perf_counter()
            runner.execute(timed)  # the same step each time: same position, same KV written
            times.append(time.perf_counter() - t)
        return times[2:]

    # Both graph sets held at once, timed in alternating blocks (on, off, off, on, ...: a drift
    # of the clocks falls on both sides alike).
    eplb = runner.eplb
    sides = {"on": (eplb, runner.cuda_graphs, runner.piecewise)}
    for layer in eplb.layers:
        layer.recorder = None
    runner.eplb = None
    runner.capture_cuda_graphs()
    sides["off"] = (None, runner.cuda_graphs, runner.piecewise)
    for layer in eplb.layers:
        layer.recorder = eplb.recorder

    def use(side: str) -> None:
        runner.eplb, runner.cuda_graphs, runner.piecewise = sides[side]
        for layer in eplb.layers:
            layer.recorder = eplb.recorder if side == "on" else None

    times: dict[str, list[float]] = {"on": [], "off": []}
    ratios = []
    for r in range(ns.timing_rounds):
        block = {}
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            use(side)
            block[side] = time_steps()
            times[side] += block[side]
        ratios.append(statistics.median(block["on"]) / statistics.median(block["off"]))
    use("on")
    on_times, off_times = times["on"], times["off"]
    on_ms = statistics.median(on_times) * 1e3
    off_ms = statistics.median(off_times) * 1e3
    log(
        {
            "phase": "summary",
            "model": ns.model,
            "batch": batch,
            "physical_slots": m.num_physical,
            "layers": m.num_layers,
            "longest_stall_ms": max(stalls) * 1e3,
            "graph_vs_eager_max_abs": diff_eager,
            "greedy_agree_eager": agree_eager,
            "step_ms_eplb_on": on_ms,
            "step_ms_eplb_off": off_ms,
            "on_over_off": on_ms / off_ms,
            "on_over_off_per_round": [round(x, 4) for x in ratios],
            "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu",
        }
    )


class _Breakdown:
    """Wraps the move's parts with timers (each ends in a device sync) and watches the caching
    allocator and the garbage collector, per EPLB step."""

    def __init__(self) -> None:
        import gc

        import safeserve.engine.rank_eplb as rank_eplb

        self.mod, self.gc = rank_eplb, gc
        self.saved = {n: getattr(rank_eplb, n) for n in ("move_layer", "set_expert_map")}
        self.fold = rank_eplb.RankEplb._fold
        self.times: dict[str, float] = {}
        for name, fn in self.saved.items():
            setattr(rank_eplb, name, self._timed(name, fn))
        rank_eplb.RankEplb._fold = self._timed("fold", self.fold)
        self.gc_ms = 0.0
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _timed(self, name: str, fn):  # type: ignore[no-untyped-def]
        def run(*a, **kw):  # type: ignore[no-untyped-def]
            sync()
            t = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t
            return out

        return run

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_ms += (time.perf_counter() - self._gc_start) * 1e3

    def _alloc(self) -> dict[str, int]:
        if not torch.cuda.is_available():
            return {}
        st = torch.cuda.memory_stats()
        keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
        return {k: st.get(k, 0) for k in keys}

    def begin(self) -> None:
        self.times, self.gc_ms, self.a0 = {}, 0.0, self._alloc()

    def end(self) -> dict:
        a1 = self._alloc()
        out = {f"{k}_ms": round(v * 1e3, 2) for k, v in self.times.items()}
        out.update({k: a1[k] - self.a0.get(k, 0) for k in a1}, gc_ms=round(self.gc_ms, 2))
        return out

    def remove(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.mod, name, fn)
        self.mod.RankEplb._fold = self.fold
        self.gc.callbacks.remove(self._on_gc)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    main()
