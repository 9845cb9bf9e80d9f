"""Run scripted plans on a real multi-process group (gloo) and collect each rank's logits."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import traceback
from pathlib import Path

import torch
from seeds import seeded

from safeserve.spawn import rendezvous, run_ranks, spawn_ranks

LAYOUTS = {
    # name: (tp, ep, backend, dp_attention)
    "tp2-ep2-alltoall": (2, 2, "alltoall", False),
    "tp2-ep2-none": (2, 2, "none", False),
    "tp2-ep1-none": (2, 1, "none", False),
    "tp4-ep4-alltoall-dp": (4, 4, "alltoall", True),
    "tp4-ep4-none": (4, 4, "none", False),  # more ranks than kv heads: each holds a copy of one
    "tp2-ep2-alltoall-dp": (2, 2, "alltoall", True),
    "tp2-ep1-none-dp": (2, 1, "none", True),
}


def layout_args(name: str) -> list[str]:
    tp, ep, backend, dp = LAYOUTS[name]
    args = ["--tp-size", str(tp), "--ep-size", str(ep), "--moe-a2a-backend", backend]
    return args + (["--enable-dp-attention"] if dp else [])


def layout_server_args(model: str, layout: tuple, **kw: object):  # type: ignore[no-untyped-def]
    """The ServerArgs of a LAYOUTS entry (tp, ep, backend, dp attention) on `model`, plus `kw`."""
    from safeserve.config import ServerArgs

    tp, ep, backend, dp = layout
    return ServerArgs(
        model=model,
        tp_size=tp,
        ep_size=ep,
        moe_a2a_backend=backend,
        enable_dp_attention=dp,
        **kw,  # type: ignore[arg-type]
    )


def _rank_main(
    device: str,
    model: str,
    layout: tuple,
    rank: int,
    init: str,
    seqs: list[list[int]],
    chunks: list[int],
    phy2log: list[list[int]] | None,
    queue: mp.Queue,
    server_kw: dict | None = None,
) -> None:
    """One rank of `run_layout` (spawned by safeserve.spawn, which reports it if it raises);
    `server_kw`: more ServerArgs fields."""
    from safeserve.engine.model_runner import ModelRunner
    from safeserve.engine.overlap import decide_split
    from safeserve.engine.plan import SeqPlan, StepPlan
    from safeserve.messages import SamplingParams
    from safeserve.model.loader import load_model_config
    from safeserve.moe.expert_map import ExpertMap

    tp, ep, _, dp = layout
    args = layout_server_args(
        model, layout, num_kv_blocks=64, block_size=4, device=device, **(server_kw or {})
    )
    m = None
    if phy2log is not None:
        m = ExpertMap.from_phy2log(phy2log, load_model_config(model).num_experts, ep, seed=7)
    runner = ModelRunner(args, rank, init, expert_map=m)
    if runner.expert_map is not None:  # each rank holds the weights of its slots
        for layer in runner.model.layers:
            if layer.is_moe:
                assert layer.mlp.experts.w13.shape[0] == runner.expert_map.slots_per_rank
    dp_size = tp if dp else 1
    tables = {
        i: list(range(16 * (i // dp_size), 16 * (i // dp_size) + 16)) for i in range(len(seqs))
    }
    pos, step, splits = 0, 0, 0
    for n in chunks:
        per_rank: list[list[SeqPlan]] = [[] for _ in range(dp_size)]
        owners = []
        for i, ids in enumerate(seqs):
            if pos >= len(ids):
                continue
            piece = ids[pos : pos + n]
            per_rank[i % dp_size].append(
                SeqPlan(piece, pos, tables[i], SamplingParams(temperature=0.0), 0)
            )
            owners.append((i % dp_size, i, pos + len(piece) - 1))
        step += 1
        plan = StepPlan(step, per_rank)
        if args.enable_two_batch_overlap:  # as the leader decides (engine/overlap.py)
            plan.split, _ = decide_split(
                [[len(s.token_ids) for s in seqs] for seqs in per_rank],
                args.tbo_token_distribution_threshold,
                args.tbo_min_decode_batch,
            )
            splits += plan.split is not None
        logits, _ = runner.run_plan(plan)
        if logits is not None:
            mine = [(i, p) for r, i, p in owners if r == (rank if dp else 0)]
            for (i, p), row in zip(mine, logits, strict=True):
                queue.put((i, p, row.float().cpu().tolist()))  # plain data: the rank may exit first
        pos += n
    graphs = [runner.cuda_graphs, runner.piecewise]
    queue.put(("splits", rank, splits))
    queue.put(("done", rank, tuple(g.replays if g is not None else None for g in graphs)))
    runner.comm.shutdown()


def run_layout(
    model: Path,
    name: str,
    seqs: list[list[int]],
    chunks: list[int],
    port: int,
    device: str = "cpu",
    replays: dict | None = None,
    phy2log: list[list[int]] | None = None,
    server_kw: dict | None = None,
    splits: dict | None = None,
) -> dict:
    """{(seq, position): logits row} from a real group of processes; `replays` (if given) gets
    each rank's (decode, piecewise) CUDA graph replays (None where the rank captured none);
    `phy2log` (if given) the experts' placement (`ExpertMap.from_phy2log`), else the trivial
    one; `server_kw`: more ServerArgs fields of every rank; `splits` (if given) gets each
    rank's count of steps run as two micro-batches (with --enable-two-batch-overlap)."""
    layout = LAYOUTS[name]
    out, done = {}, 0
    with spawn_ranks(
        layout[0],
        _rank_main,
        lambda r, init, q: (
            device,
            str(model),
            layout,
            r,
            init,
            seqs,
            chunks,
            phy2log,
            q,
            server_kw,
        ),
        port=port,
    ) as ranks:
        while done < layout[0]:
            a, b, c = ranks.get(timeout=180)
            if a == "done":
                done += 1
                if replays is not None:
                    replays[b] = c
                continue
            if a == "splits":
                if splits is not None:
                    splits[b] = c
                continue
            out[(a, b)] = torch.tensor(c)
    return out


# Chunked prefill, then decode steps.
CHUNKS = [5, 6, 1, 1, 3, 1, 1, 1, 1]


def layout_reference(checkpoint: Path) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """Three sequences of different lengths (with 4 attention ranks one rank has none) and
    transformers' float32 logits of every position of each."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    gen = seeded(5)
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    with torch.no_grad():
        ref = {i: hf(torch.tensor([s])).logits[0] for i, s in enumerate(seqs)}
    return seqs, ref


def assert_layout_matches(
    checkpoint: Path, name: str, reference: tuple, port: int, chunks: list[int] = CHUNKS
) -> None:
    """Layout `name` computes the reference's sequences in `chunks`: the logits of every
    chunk's last row within 1e-4 of transformers', and no other rows."""
    seqs, ref = reference
    assert_rows_match(run_layout(checkpoint, name, seqs, chunks, port), seqs, ref, chunks, name)


def assert_rows_match(
    got: dict, seqs: list[list[int]], ref: dict, chunks: list[int], name: str = ""
) -> None:
    """`got` ({(seq, position): logits row}) holds the last row of every chunk of every
    sequence and no other, each within 1e-4 of `ref[seq][position]` (transformers')."""
    starts = [sum(chunks[:k]) for k in range(len(chunks))]
    expected = {
        (i, min(start + n, len(s)) - 1)
        for i, s in enumerate(seqs)
        for start, n in zip(starts, chunks, strict=True)
        if start < len(s)
    }
    assert set(got) == expected
    for (i, pos), row in got.items():
        torch.testing.assert_close(
            row,
            ref[i][pos],
            atol=1e-4,
            rtol=0,
            msg=lambda m, i=i, pos=pos: f"{name}: seq {i} pos {pos}: {m}",
        )


class _Tagged:
    """A rank's queue, each message tagged with the group run it belongs to."""

    def __init__(self, queue: mp.Queue, key: tuple) -> None:
        self.queue, self.key = queue, key

    def put(self, item: tuple) -> None:
        self.queue.put((self.key, item))


def _every_group_rank(
    rank: int, runs: list[tuple], seqs: list[list[int]], chunks: list[int], queue: mp.Queue
) -> None:
    # One thread a rank (as the server's ranks have on a small host): four ranks of two OpenMP
    # threads each on two cores spend most of their time in each other's barriers.
    torch.set_num_threads(1)
    for key, model, layout, init, server_kw in runs:
        if rank < layout[0]:
            tagged = _Tagged(queue, key)
            try:
                _rank_main("cpu", model, layout, rank, init, seqs, chunks, None, tagged, server_kw)
            except Exception:  # that group's failure; the next runs go on
                tagged.put(("error", rank, traceback.format_exc()))


def run_layouts(
    groups: dict[tuple, tuple[Path, str, dict | None]],
    seqs: list[list[int]],
    chunks: list[int],
    timeout: float = 240.0,
) -> dict[tuple, tuple[dict, dict, str | None]]:
    """Several groups run one after another by one set of processes (starting processes is
    the slow part on CPU): `groups` maps a key to (checkpoint, LAYOUTS name, more ServerArgs
    fields). Per key: ({(seq, position): logits row}, {rank: steps run as two micro-batches},
    the error of a failed rank or None)."""
    # one file store per group (ports picked ahead would be bound minutes later, and another
    # process may take one first)
    store_dir = tempfile.mkdtemp(prefix="safeserve-layouts-")
    runs = [
        (key, str(model), LAYOUTS[name], rendezvous(directory=store_dir), kw)
        for key, (model, name, kw) in groups.items()
    ]
    out: dict = {key: ({}, {}, None) for key in groups}
    pending = sum(LAYOUTS[name][0] for _, name, _ in groups.values())  # a "done" or error a rank
    world = max(LAYOUTS[name][0] for _, name, _ in groups.values())
    try:
        with spawn_ranks(
            world, _every_group_rank, lambda r, init, q: (r, runs, seqs, chunks, q)
        ) as ranks:
            while pending:
                key, (a, b, c) = ranks.get(timeout=timeout)
                logits, splits, error = out[key]
                if a == "error":
                    out[key] = (logits, splits, f"rank {b} failed:\n{c}")
                elif a == "splits":
                    splits[b] = c
                    continue
                if a in ("error", "done"):
                    pending -= 1
                    continue
                logits[(a, b)] = torch.tensor(c)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    return out


def _dispatch_rank_main(rank: int, world: int, init: str) -> dict:
    """One rank of `run_alltoall_both_ways`: routed steps through the alltoall backend as eager
    steps and as steps a CUDA graph would capture (no graph on CPU: the same calls). First with
    the same tokens on every rank (tensor-parallel attention), then with each rank's own
    (attention data-parallel), which a graph step pads to one bucket on every rank."""
    from safeserve.moe.dispatch import AllToAllDispatcher, CombineInput, StepTokens
    from safeserve.moe.placement import ExpertPlacement
    from safeserve.moe.topk import TopKOutput
    from safeserve.parallel.comm import Comm, Layout

    experts, top_k, hidden = 8, 3, 16
    comm = Comm(Layout(rank, world, world), torch.device("cpu"))
    comm.init(init)
    placement = ExpertPlacement(experts, world, rank)
    d = AllToAllDispatcher(placement, comm)

    def routed(tokens: int, seed: int) -> tuple[torch.Tensor, TopKOutput]:
        gen = seeded(seed)
        x = torch.randn(tokens, hidden, generator=gen)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        w = torch.rand(tokens, top_k, generator=gen)
        return x, TopKOutput(ids, w, torch.zeros(tokens, experts))

    def run_experts(out):  # type: ignore[no-untyped-def]
        # expert p scales its rows by p + 1: the sum tells which experts ran, and how often
        local = out.topk_ids
        scale = torch.where(local >= 0, local + placement.local_start + 1, 0).to(torch.float)
        return CombineInput(out.hidden_states * (out.topk_weights * scale).sum(1, True))

    def step(x: torch.Tensor, topk: TopKOutput, tokens: StepTokens) -> tuple:
        d.balance.clear()
        d.begin_step(tokens)
        y = d.run(x, topk, run_experts)
        d.end_step()  # closes the step's one balancedness pass
        rows = y[: int(tokens.real.sum())] if tokens.real is not None else y
        return rows.tolist(), d.last_count_matrix.tolist(), d.balance.window_means()[10]

    def expected(x: torch.Tensor, topk: TopKOutput) -> list:
        return (x * (topk.topk_weights * (topk.topk_ids + 1)).sum(1, True)).tolist()

    results = {}
    x, topk = routed(7, 11)  # the same tokens on every rank
    for graph in (False, True):
        results[("tp", graph)] = step(x, topk, StepTokens([7] * world, True, graph))
    results["tp"] = expected(x, topk)
    own = [3 + 2 * r for r in range(world)]  # each rank its own tokens
    x, topk = routed(own[rank], 100 + rank)
    results[("dp", False)] = step(x, topk, StepTokens(own, False))
    # A graph step pads every rank's rows to one bucket; the padding rows here are routed
    # to experts 0..k-1 (rank 0's), as stale rows in a graph's buffers route somewhere.
    bucket = max(own) + 1
    xp = torch.ones(bucket, hidden)
    xp[: own[rank]] = x
    ids = torch.arange(top_k).repeat(bucket, 1)
    ids[: own[rank]] = topk.topk_ids
    w = torch.ones(bucket, top_k)
    w[: own[rank]] = topk.topk_weights
    padded = TopKOutput(ids, w, torch.zeros(bucket, experts))
    real = torch.arange(bucket) < own[rank]
    results[("dp", True)] = step(xp, padded, StepTokens([bucket] * world, False, True, real))
    results["dp"] = expected(x, topk)
    comm.shutdown()
    return results


def run_alltoall_both_ways(world: int, port: int) -> list[dict]:
    """Every rank's results, by rank: results[(layout, graph)] = (output rows, count matrix, the
    step's balancedness) and results[layout] = the expected rows, for layout "tp" and "dp"."""
    return run_ranks(_dispatch_rank_main, world, port=port, timeout=120)
