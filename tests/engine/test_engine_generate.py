"""The engine in-process against transformers' greedy `generate`, under chunking and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from seeds import seeded
from transformers import AutoModelForCausalLM

from safeserve.config import ServerArgs
from safeserve.engine.engine import Engine
from safeserve.engine.warm_up import warm_up_sizes
from safeserve.messages import SamplingParams


def _drain(engine: Engine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.rid] = o.finish_reason
    assert set(finish) == set(outs)
    return outs


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _reference(hf, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    # transformers keeps the EOS token; the engine reports it as a stop, not as text.
    for i, t in enumerate(out):
        if t in eos:
            return out[:i]
    return out


@pytest.mark.parametrize(
    "blocks,chunk,max_running",
    [(None, 6, 8), (12, 5, 8), (40, 512, 2)],
    ids=["chunked", "preempting", "max-running-2"],
)
def test_greedy_equals_transformers(checkpoint: Path, hf, blocks, chunk, max_running) -> None:
    _check_greedy(checkpoint, hf, blocks, chunk, max_running)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "blocks,chunk,max_running",
    [(None, 6, 8), (12, 5, 8), (40, 512, 2)],
    ids=["chunked", "preempting", "max-running-2"],
)
def test_greedy_through_cuda_graphs_equals_transformers(
    checkpoint: Path, hf, blocks, chunk, max_running
) -> None:
    """The same on CUDA in float32, decode steps replayed as graphs: their block tables go up
    only as far as the device lacks them (layers/block_tables.py, TableMirror), while requests
    finish, rows change hands, preempted requests come back with new blocks, and tables cross
    block boundaries every 4 tokens."""
    engine = _check_greedy(
        checkpoint, hf, blocks, chunk, max_running, device="cuda", dtype="float32"
    )
    graphs = engine.runner.cuda_graphs
    assert graphs is not None and graphs.replays >= 5  # decode-only steps replayed


def _check_greedy(checkpoint: Path, hf, blocks, chunk, max_running, **kw) -> Engine:
    args = ServerArgs(
        model=str(checkpoint),
        chunked_prefill_size=chunk,
        num_kv_blocks=blocks,
        block_size=4,
        max_model_len=48,
        max_running_requests=max_running,
        max_num_batched_tokens=16,
        **kw,
    )
    engine = Engine(args)
    gen = seeded(7)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 17, 9, 1, 12)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0.0))
    outs = _drain(engine)
    for i, p in enumerate(prompts):
        assert outs[str(i)] == _reference(hf, p, 20, engine.eos_token_ids), f"prompt {i}"
    if blocks == 12:
        assert engine.scheduler.num_preemptions > 0  # the case really preempted
    assert engine.scheduler.num_blocks_used == 0  # every block back in the free list
    return engine


def test_seeded_sampling_is_reproducible_and_batch_independent(checkpoint: Path) -> None:
    args = ServerArgs(model=str(checkpoint), max_model_len=64)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a = Engine(args)
    a.add_request("x", [5, 6, 7], params)
    alone = _drain(a)["x"]
    b = Engine(args)
    b.add_request("y", [9, 9, 9, 9], SamplingParams(max_tokens=12, temperature=1.0, seed=99))
    b.add_request("x", [5, 6, 7], params)
    assert _drain(b)["x"] == alone
    c = Engine(args)
    c.add_request(
        "x",
        [5, 6, 7],
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=4321),
    )
    assert _drain(c)["x"] != alone


def test_stop_token_ids_and_max_tokens(checkpoint: Path) -> None:
    engine = Engine(ServerArgs(model=str(checkpoint), max_model_len=64))
    engine.add_request(
        "a", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    full = _drain(engine)["a"]
    assert len(full) == 10
    stop_at = full[4]
    first = full.index(stop_at)
    engine.add_request(
        "b", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at])
    )
    assert _drain(engine)["b"] == full[:first]


def test_abort_frees_blocks_and_bad_requests_are_refused(checkpoint: Path) -> None:
    engine = Engine(ServerArgs(model=str(checkpoint), max_model_len=64))
    engine.add_request("a", list(range(30)), SamplingParams(max_tokens=30, temperature=0.0))
    engine.step()
    assert engine.scheduler.num_blocks_used > 0
    assert engine.abort_request("a")
    assert engine.scheduler.num_blocks_used == 0 and not engine.has_work()
    with pytest.raises(ValueError):
        engine.add_request("b", [1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError):
        engine.add_request("c", [10**6], SamplingParams(max_tokens=1))


def test_warm_up_sizes_cover_every_doubling_and_the_largest_step() -> None:
    assert warm_up_sizes(2048, compiles=True) == [
        1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048
    ]  # fmt: skip
    assert warm_up_sizes(100, compiles=True) == [1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 100]
    assert warm_up_sizes(17, compiles=True) == [1, 2, 4, 8, 16, 17]
    assert warm_up_sizes(2048, compiles=False) == [3]  # CPU: nothing to compile
    assert warm_up_sizes(2, compiles=True) == [1, 2]
    assert warm_up_sizes(2, compiles=False) == [2]
    assert warm_up_sizes(0, compiles=True) == warm_up_sizes(0, compiles=False) == []


def test_warm_up_leaves_nothing_behind(checkpoint: Path, hf) -> None:
    engine = Engine(ServerArgs(model=str(checkpoint), max_model_len=64, block_size=4))
    engine.warm_up()
    assert engine.step_id == 2  # CPU: one 3-token prefill, then one decode step
    assert not engine.has_work() and engine.scheduler.num_blocks_used == 0
    prompt = [5, 9, 200, 3, 77]
    engine.add_request("a", prompt, SamplingParams(max_tokens=12, temperature=0.0))
    assert _drain(engine)["a"] == _reference(hf, prompt, 12, engine.eos_token_ids)


def test_warm_up_that_runs_out_of_memory_names_the_size_and_the_flags(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(ServerArgs(model=str(checkpoint), max_model_len=64))

    def out_of_memory() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine, "step", out_of_memory)
    with pytest.raises(RuntimeError) as e:
        engine.warm_up()
    msg = str(e.value)
    assert "3-token prefill does not fit in device memory" in msg
    assert "--mem-fraction-static" in msg and "--max-num-batched-tokens" in msg
    assert "Tried to allocate 2.00 GiB" in msg
