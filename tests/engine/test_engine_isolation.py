"""A request's failure stays with it: request-borne faults, step exceptions isolated by re-running
the step in halves, per-request postprocessing errors; and a broken rank still fails the group."""

from __future__ import annotations

from pathlib import Path

import pytest

from safeserve.config import ServerArgs
from safeserve.engine import outcome
from safeserve.engine.engine import Engine
from safeserve.engine.plan import SeqPlan, StepPlan
from safeserve.messages import RequestOutput, SamplingParams


def _drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _args(checkpoint: Path, **kw: object) -> ServerArgs:
    base: dict = dict(
        model=str(checkpoint),
        max_model_len=64,
        block_size=4,
        chunked_prefill_size=6,
        max_num_batched_tokens=32,
    )
    base.update(kw)
    return ServerArgs(**base)


PROMPTS = {
    "a": [5, 6, 7, 8, 9, 10, 11],
    "b": [40, 41],
    "c": [100, 3, 77, 12, 9, 200, 31, 5, 6],
    "d": [9, 9, 9],
}


def _params(rid: str, fault: str | None = None) -> SamplingParams:
    if rid == "b":  # seeded sampling: the same draws whatever the batch
        return SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, fault=fault)
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, fault=fault)


def _run(engine: Engine, culprit: str | None, fault: str = "raise") -> dict:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, _params(rid, fault if rid == culprit else None))
    return _drain(engine)


@pytest.fixture(scope="module")
def clean(checkpoint: Path) -> dict[str, list[int]]:
    outs = _run(Engine(_args(checkpoint)), None)
    return {rid: _tokens(o) for rid, o in outs.items()}


@pytest.mark.parametrize("culprit", ["a", "c"])
def test_raise_fault_fails_only_its_request(
    checkpoint: Path, clean, culprit: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(_args(checkpoint))
    outs = _run(engine, culprit)
    bad = outs[culprit]
    assert [o.finish_reason for o in bad] == ["error"] and bad[0].new_token_ids == []
    assert bad[0].error.startswith("step: RequestFault: injected request fault 'raise'")
    for rid in PROMPTS:
        if rid != culprit:
            assert outs[rid][-1].finish_reason in ("length", "stop"), rid
            assert _tokens(outs[rid]) == clean[rid], rid
    assert any(culprit in r.message and "fails alone" in r.message for r in caplog.records)
    # the group goes on serving, and every block is back
    assert engine.scheduler.num_blocks_used == 0
    engine.add_request("again", PROMPTS["a"], _params("a"))
    assert _tokens(_drain(engine)["again"]) == clean["a"]


def test_step_exception_is_isolated_by_bisection(
    checkpoint: Path, clean, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception of a step (not only an injected fault) goes to the request it comes from:
    here one that the runner raises whenever request "c"'s first chunk is in the step."""
    engine = Engine(_args(checkpoint))
    real = engine.runner.execute_step
    runs: list[int] = []

    def flaky(plan: StepPlan):  # type: ignore[no-untyped-def]
        runs.append(sum(len(s) for s in plan.per_rank))
        if any(s.start == 0 and s.token_ids[:3] == [100, 3, 77] for s in plan.per_rank[0]):
            raise ValueError("boom")
        return real(plan)

    monkeypatch.setattr(engine.runner, "execute_step", flaky)
    outs = _run(engine, None)
    assert outs["c"][0].finish_reason == "error"
    assert outs["c"][0].error == "step: ValueError: boom"
    for rid in ("a", "b", "d"):
        assert _tokens(outs[rid]) == clean[rid], rid
    # the first step held all four: 4 -> (2, 2), the failing 2 -> (1, 1): 4 sub-steps
    assert runs[:5] == [4, 2, 2, 1, 1]


def test_a_rank_that_fails_every_step_still_fails_the_group(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(_args(checkpoint))

    def broken(plan: StepPlan):  # type: ignore[no-untyped-def]
        raise RuntimeError("device gone")

    monkeypatch.setattr(engine.runner, "execute_step", broken)
    engine.add_request("a", PROMPTS["a"], _params("a"))
    engine.add_request("b", PROMPTS["b"], _params("b"))
    with pytest.raises(RuntimeError, match="so does a probe step"):
        engine.step()


def test_fatal_errors_are_not_isolated(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(_args(checkpoint))

    def cuda_error(plan: StepPlan):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner, "execute_step", cuda_error)
    engine.add_request("a", PROMPTS["a"], _params("a"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()


def test_postprocess_exception_fails_only_its_request(
    checkpoint: Path, clean, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(_args(checkpoint))
    real = engine._finish_reason

    def finish_reason(req, tok):  # type: ignore[no-untyped-def]
        if req.rid == "d" and req.num_output_tokens == 3:
            raise KeyError("stop handling")
        return real(req, tok)

    monkeypatch.setattr(engine, "_finish_reason", finish_reason)
    outs = _run(engine, None)
    assert outs["d"][-1].finish_reason == "error"
    assert outs["d"][-1].error == "postprocess: KeyError: 'stop handling'"
    assert _tokens(outs["d"]) == clean["d"][:2]
    for rid in ("a", "b", "c"):
        assert _tokens(outs[rid]) == clean[rid], rid
    assert engine.scheduler.num_blocks_used == 0


def test_exit_fault_exits_the_rank_that_computes_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exits: list[int] = []

    class Exited(BaseException):
        pass

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise Exited

    monkeypatch.setattr(outcome.os, "_exit", fake_exit)
    monkeypatch.setattr(outcome.logging, "shutdown", lambda: None)
    seq = SeqPlan([1], 0, [0], fault="exit")
    other = SeqPlan([2], 0, [1])
    tp = StepPlan(3, [[other, seq]])
    outcome.apply_request_faults(tp, 1, dp_attention=False)  # tensor-parallel: rank 0 computes
    with pytest.raises(Exited):
        outcome.apply_request_faults(tp, 0, dp_attention=False)
    dp = StepPlan(3, [[other], [seq]])  # data-parallel attention: its attention rank
    outcome.apply_request_faults(dp, 0, dp_attention=True)
    with pytest.raises(Exited):
        outcome.apply_request_faults(dp, 1, dp_attention=True)
    assert exits == [1, 1]
    with pytest.raises(outcome.RequestFault):  # "raise": every rank, whoever holds it
        outcome.apply_request_faults(
            StepPlan(4, [[other], [SeqPlan([1], 0, [0], fault="raise")]]), 0, True
        )


def test_warm_up_that_runs_out_of_memory_in_a_step_still_fails_start_up(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Isolation turns a step's exception into its requests' error outputs: at start-up those
    still fail the warm-up, an out-of-memory one with its advice."""
    import torch

    engine = Engine(_args(checkpoint))
    real = engine.runner.execute_step

    def oom_on_prefill(plan: StepPlan):  # type: ignore[no-untyped-def]
        if sum(len(s.token_ids) for s in plan.per_rank[0]) > 1:  # the probe's one token runs
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(plan)

    monkeypatch.setattr(engine.runner, "execute_step", oom_on_prefill)
    with pytest.raises(RuntimeError, match="3-token prefill does not fit in device memory"):
        engine.warm_up()


def test_a_row_that_cannot_be_sampled_fails_only_its_request(checkpoint: Path, clean) -> None:
    engine = Engine(_args(checkpoint))
    for rid, prompt in PROMPTS.items():
        params = _params(rid)
        if rid == "c":  # not greedy, and no distribution: its row alone fails in sampling
            params = SamplingParams(max_tokens=8, temperature=float("nan"), seed=1)
        engine.add_request(rid, prompt, params)
    outs = _drain(engine)
    assert outs["c"][-1].finish_reason == "error"
    assert outs["c"][-1].error.startswith("sample: SamplingError: probabilities are not a")
    for rid in ("a", "b", "d"):
        assert _tokens(outs[rid]) == clean[rid], rid
