"""The engine on CUDA (Triton fused MoE, top-k, decode attention, CUDA graphs) against the same
engine on the CPU torch paths: float32 logits within 1e-4 through prefill and decode steps."""

from __future__ import annotations

import pytest
import torch
from model_checks import small_runner
from seeds import seeded

from safeserve.config import ServerArgs
from safeserve.engine.plan import SeqPlan, StepPlan
from safeserve.messages import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def _runner(  # type: ignore[no-untyped-def]
    device: str,
    graphs: bool,
    dtype: str,
    weights_from: torch.nn.Module | None,
    disable_pdl: bool = False,
):
    runner = small_runner("tiny", device, dtype, graphs, capture=False, disable_pdl=disable_pdl)
    if weights_from is not None:
        # Dummy weights come from the device's own RNG: CUDA and CPU draw different ones.
        runner.model.load_state_dict(weights_from.state_dict())
    runner.capture_cuda_graphs()
    if device == "cuda":
        assert (runner.cuda_graphs is not None) == graphs
        assert (runner.piecewise is not None) == graphs
    return runner


def _logits_trace(runner) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Three requests of different prompt lengths, prefilled together, then 12 steps: decodes,
    except step 8, where request 1 computes a chunk of 3 tokens (a mixed step)."""
    gen = seeded(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 1, 17)]
    tables = [
        [3, 7, 1, 12, 40, 41, 42, 43],
        [20, 21, 22, 23, 24, 25],
        [5, 0, 9, 30, 31, 32, 33, 34],
    ]
    seqs = [SeqPlan(p, 0, t, GREEDY) for p, t in zip(prompts, tables, strict=True)]
    trace = []
    logits, _ = runner.run_plan(StepPlan(step=0, per_rank=[seqs]))
    trace.append(logits.float().cpu())
    last = logits.argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    for step in range(1, 13):
        # Request 1 sits out step 5, so that batch sizes 2 and 3 (padded to 4) both replay.
        active = [i for i in range(3) if not (step == 5 and i == 1)]
        ids = {
            i: [last[i]] + ([(7 * step) % 256, 31] if step == 8 and i == 1 else []) for i in active
        }
        plan = [SeqPlan(ids[i], lens[i], tables[i], GREEDY, step) for i in active]
        logits, _ = runner.run_plan(StepPlan(step=step, per_rank=[plan]))
        trace.append(logits.float().cpu())
        for row, i in enumerate(active):
            last[i] = int(logits[row].argmax())
            lens[i] += len(ids[i])
    if getattr(runner, "piecewise", None) is not None:
        assert runner.piecewise.replays == 2  # the prefill and the mixed step
    return trace


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_kernels_match_cpu_float32(graphs: bool) -> None:
    cpu = _runner("cpu", False, "float32", None)
    ref = _logits_trace(cpu)
    got = _logits_trace(_runner("cuda", graphs, "float32", cpu.model))
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_route_skew_runs_through_the_graphs_and_matches_cpu_float32() -> None:
    """Fault injection's route skew, set after the graphs were captured: every step still
    replays (decode graphs, piecewise prefill and mixed steps), and the logits are those of
    the CPU engine under the same skew, not those without it."""
    from safeserve.engine.plan import Faults

    cpu = _runner("cpu", False, "float32", None)
    plain = _logits_trace(cpu)
    cpu.apply_faults(Faults(route_skew_expert=3))
    ref = _logits_trace(cpu)
    cuda = _runner("cuda", True, "float32", cpu.model)
    cuda.apply_faults(Faults(route_skew_expert=3))
    got = _logits_trace(cuda)  # asserts the two piecewise replays
    assert cuda.cuda_graphs.replays == 11  # every decode step (step 8 is the mixed one)
    assert max((a - b).abs().max().item() for a, b in zip(ref, plain, strict=True)) > 1e-2
    for a, b in zip(got, ref, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    cuda.apply_faults(Faults())  # cleared: back to the unskewed logits, still replayed
    cuda.piecewise.replays = 0
    for a, b in zip(_logits_trace(cuda), plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert cuda.cuda_graphs.replays == 22


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_eager_bfloat16() -> None:
    eager_runner = _runner("cuda", False, "bfloat16", None)
    eager = _logits_trace(eager_runner)
    graph = _logits_trace(_runner("cuda", True, "bfloat16", eager_runner.model))
    for a, b in zip(graph, eager, strict=True):
        assert not a.isnan().any()
        rel = ((a - b).norm() / b.norm()).item()
        assert rel <= 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_greedy_tokens_match_cpu_float32() -> None:
    """`execute` samples from the argmax the decode graph computes: the same tokens as on CPU."""
    cpu = _runner("cpu", False, "float32", None)
    cuda = _runner("cuda", True, "float32", cpu.model)
    gen = seeded(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 11)]
    tables = [[4, 9, 2, 11, 30, 31, 32], [13, 0, 6, 20, 21, 22, 23]]
    outs = []
    for runner in (cpu, cuda):
        seqs = [SeqPlan(p, 0, t, GREEDY) for p, t in zip(prompts, tables, strict=True)]
        last = runner.execute(StepPlan(step=0, per_rank=[seqs]))
        tokens = [list(last)]
        for step in range(1, 10):
            plan = [
                SeqPlan([last[i]], len(prompts[i]) + step - 1, tables[i], GREEDY, step)
                for i in range(2)
            ]
            last = runner.execute(StepPlan(step=step, per_rank=[plan]))
            tokens.append(list(last))
        outs.append(tokens)
    assert outs[0] == outs[1]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs a Hopper or newer GPU",
)
@pytest.mark.parametrize("graphs", [False, True])
def test_dependent_launches_match_ordinary_launches_bfloat16(graphs: bool) -> None:
    """Every Triton kernel launched as a programmatic dependent (the default on Hopper) gives
    bit-identical logits to ordinary launches (`--disable-pdl`): prefill (sorted MoE plan,
    align) and decode (pair plan, router, attention), eager and as CUDA graphs. A kernel that
    read its input before waiting for the kernel that writes it would differ."""
    from safeserve.kernels import common

    try:
        plain_runner = _runner("cuda", graphs, "bfloat16", None, disable_pdl=True)
        assert not common.pdl_supported(plain_runner.device)
        plain = _logits_trace(plain_runner)
        dependent_runner = _runner("cuda", graphs, "bfloat16", plain_runner.model)
        assert common.pdl_supported(dependent_runner.device)
        dependent = _logits_trace(dependent_runner)
    finally:
        common.set_pdl(True)
    for a, b in zip(dependent, plain, strict=True):
        assert not a.isnan().any()
        assert torch.equal(a, b)


def _triton_variants() -> dict[str, set]:
    """Kernel variants Triton holds in this process (compiled, or loaded from its disk cache),
    per kernel of safeserve.kernels: the keys of its in-memory cache."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import safeserve.kernels

    out: dict[str, set] = {}
    for info in pkgutil.iter_modules(safeserve.kernels.__path__):
        module = importlib.import_module(f"safeserve.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction):
                keys = {str(k) for caches in obj.device_caches.values() for k in caches[0]}
                out[f"{info.name}.{name}"] = keys
    return out


def test_warm_up_builds_every_kernel_variant_later_requests_use() -> None:
    from safeserve.engine.engine import Engine
    from safeserve.engine.warm_up import warm_up_sizes

    args = ServerArgs(
        device="cuda",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_batched_tokens=512,
        max_running_requests=8,
        cuda_graph_max_bs=8,
        num_kv_blocks=1024,
        block_size=4,
    )
    engine = Engine(args)
    engine.warm_up()
    assert engine.step_id == 2 * len(warm_up_sizes(512, compiles=True))  # prefill + decode each
    assert not engine.has_work() and engine.scheduler.num_blocks_used == 0
    built = _triton_variants()
    assert sum(map(len, built.values())) > 0
    # Lengths the warm-up did not use, together: mixed prefill + decode steps of many sizes,
    # and a prompt longer than one step (chunked).
    # ignore_eos: every request runs its 6 tokens whatever the random model answers, so the
    # steps (and their sizes) do not depend on the drawn prompts
    gen = seeded(3)
    greedy6 = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 47, 100, 300, 511, 700)):
        prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
        engine.add_request(str(i), prompt, greedy6)
    steps = engine.step_id
    while engine.has_work():
        engine.step()
    assert engine.step_id - steps >= 8
    after = _triton_variants()
    new = {name: keys - built.get(name, set()) for name, keys in after.items()}
    report = [
        f"{name}: new {sorted(keys)}; built at warm-up {sorted(built.get(name, set()))}"
        for name, keys in new.items()
        if keys
    ]
    assert not report, "\n".join(report)  # none built while serving
