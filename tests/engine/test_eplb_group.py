"""EPLB on real 4-rank gloo groups (EP4): a checkpoint whose router favours a few experts (as a
trained model's does) is served with rebalances every few passes, weights moving between the
ranks while requests decode. Greedy outputs equal transformers' token for token (and the
trivial placement's) before, during and after the moves, with redundant experts, with
tensor-parallel attention (`alltoall`, `none`) and attention data-parallel; a threshold below
the measured balancedness skips the check and says why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import greedy_continuations, skew_router, write_qwen3_moe_checkpoint
from layouts import layout_server_args

from safeserve.messages import SamplingParams
from safeserve.spawn import run_ranks

pytestmark = pytest.mark.slow  # starts rank processes

# (tp, ep, backend, dp attention), as tests/layouts.py's
GROUPS = {
    "tp4-ep4-alltoall": (4, 4, "alltoall", False),
    "tp4-ep4-none": (4, 4, "none", False),
    "tp4-ep4-alltoall-dp": (4, 4, "alltoall", True),
}
PROMPT_LENGTHS = (6, 9, 13, 5, 11, 8, 7, 10, 12, 6, 9, 7, 14, 5, 8, 10)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_moe_checkpoint(tmp_path_factory.mktemp("skewed"), seed=3, init=skew_router)


def _prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(skewed: Path) -> list[list[int]]:
    return greedy_continuations(skewed, _prompts(), MAX_TOKENS)


def _rank_main(  # type: ignore[no-untyped-def]
    rank: int, world: int, init: str, model: str, layout: tuple, kw: dict, work: tuple
):
    """One rank; rank 0 serves `work` = (prompt lengths, max tokens, stagger: a new request
    every third step instead of all at once) and returns (outputs, finish reasons, EPLB
    status, the measured balancedness windows)."""
    from safeserve.engine.engine import Engine, follower_loop
    from safeserve.engine.model_runner import ModelRunner

    args = layout_server_args(model, layout, num_kv_blocks=96, block_size=4, **kw)
    runner = ModelRunner(args, rank, init)
    if rank != 0:
        follower_loop(runner, lambda step, idle: None)
        return None
    engine = Engine(args, runner)
    # The server's start-up; then requests at once: the group never idles before its first
    # rebalance is due, and must count its passes all the same.
    engine.warm_up()
    # requests arrive over time: some decode while the weights move
    lengths, max_tokens, stagger = work
    pending = [(f"r{i}", p) for i, p in enumerate(_prompts(lengths))]
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    checks = []
    while pending or engine.has_work():
        while pending and (not stagger or not engine.has_work() or engine.step_id % 3 == 0):
            rid, prompt = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, prompt, params)
            if stagger:
                break
        for o in engine.step():
            outputs.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.rid] = o.finish_reason
        st = engine.eplb.status() if engine.eplb is not None else None
        if st is not None and st.last is not None and (not checks or checks[-1] != st.last):
            checks.append(st.last)
    status = engine.stats().eplb
    balance = runner.dispatcher.balance.window_means()
    engine.broadcast_idle()
    engine.shutdown()
    return outputs, finished, status, balance


def _serve(model: Path, name: str, work: tuple | None = None, **kw: object):  # type: ignore[no-untyped-def]
    layout = GROUPS[name]
    work = work or (PROMPT_LENGTHS, MAX_TOKENS, True)
    return run_ranks(_rank_main, layout[0], (str(model), layout, kw, work), timeout=300)[0]


def _assert_outputs(got: tuple, reference: list[list[int]]) -> None:
    outputs, finished, _, _ = got
    assert set(finished) == {f"r{i}" for i in range(len(reference))}
    assert set(finished.values()) == {"length"}
    for i, want in enumerate(reference):
        assert outputs[f"r{i}"] == want, f"r{i}"


@pytest.mark.parametrize("name", ["tp4-ep4-alltoall", "tp4-ep4-none", "tp4-ep4-alltoall-dp"])
def test_outputs_equal_transformers_through_rebalances(
    skewed: Path, reference: list[list[int]], name: str
) -> None:
    got = _serve(
        skewed,
        name,
        enable_eplb=True,
        ep_num_redundant_experts=4,
        eplb_rebalance_num_iterations=6,
    )
    _assert_outputs(got, reference)
    status = got[2]
    assert status.enabled and status.num_physical == 12 and status.slots_per_rank == 3
    assert status.rebalances >= 1 and status.moved_bytes_total > 0
    assert status.last_rebalance.layers_moved >= 1


def test_a_threshold_below_the_balancedness_skips_the_rebalance(
    skewed: Path, reference: list[list[int]]
) -> None:
    got = _serve(
        skewed,
        "tp4-ep4-alltoall-dp",
        enable_eplb=True,
        eplb_rebalance_num_iterations=8,
        eplb_min_rebalancing_utilization_threshold=0.05,
    )
    _assert_outputs(got, reference)
    status = got[2]
    assert status.rebalances == 0 and status.skipped >= 1 and status.moved_bytes_total == 0
    assert status.last.outcome == "skipped"
    assert "above --eplb-min-rebalancing-utilization-threshold 0.05" in status.last.reason
