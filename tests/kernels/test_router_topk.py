"""`router_topk`: the router GEMM and the top-k softmax in one launch (decode-sized batches),
against `F.linear` + the torch top-k reference. GPU tests skip without CUDA; the interpreter
tests need Triton and ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from counters import assert_counters_zero
from seeds import seeded

from safeserve.kernels import common
from safeserve.kernels import router_topk as rt
from safeserve.kernels import topk_softmax as tk
from safeserve.moe.topk import skew_ids

HAS_CUDA = torch.cuda.is_available() and tk.HAS_TRITON
INTERPRET = tk.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")

# tokens, experts, hidden, top_k, renormalize, with an expert map
CASES = [
    (1, 128, 256, 8, True, False),  # a decode token: 8 programs share the experts
    (13, 60, 96, 4, False, True),  # E and H not multiples of the tiles, a map
    (5, 8, 64, 2, True, False),  # E <= 16: one program per token block, no counter
    (16, 130, 200, 6, False, True),
    (3, 20, 600, 4, True, True),  # 3 programs along the hidden size, the last one partial
    (2, 8, 520, 2, False, False),  # one program along the experts, 3 along the hidden size
    (40, 20, 64, 2, True, False),  # above the fused limit: GEMM + top-k kernel
]


def _check(
    x: torch.Tensor,
    gate: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_map: torch.Tensor | None,
    logits_tol: float,
) -> None:
    weights, ids, logits = rt.router_topk(x, gate, top_k, renormalize, x.dtype, expert_map)
    ref_logits = F.linear(x.float(), gate.float())
    assert logits.shape == ref_logits.shape and logits.dtype == x.dtype
    assert not torch.isnan(logits).any()
    rel = ((logits.float() - ref_logits).norm() / ref_logits.norm()).item()
    assert rel <= logits_tol, rel
    # the top-k of the logits it returned, exactly as the torch reference takes it
    ref_w, ref_ids = tk.topk_softmax_torch(logits, top_k, renormalize)
    if expert_map is not None:
        ref_ids = expert_map[ref_ids.long()]
    assert ids.shape == ref_ids.shape and weights.dtype == x.dtype
    probs = torch.softmax(logits.float(), dim=-1).cpu()
    inverse = None
    if expert_map is not None:
        inverse = torch.empty_like(expert_map)
        inverse[expert_map] = torch.arange(expert_map.numel(), device=expert_map.device)
    for row, (a, b) in enumerate(zip(ids.cpu(), ref_ids.cpu(), strict=True)):
        if set(a.tolist()) != set(b.tolist()):  # only exact ties at the k-th place may differ
            la, lb = (v if inverse is None else inverse.cpu()[v] for v in (a, b))
            got = probs[row, la.long()].sort().values
            want = probs[row, lb.long()].sort().values
            assert torch.equal(got, want), f"row {row}: {a.tolist()} vs {b.tolist()}"
    torch.testing.assert_close(
        weights.float().sort(dim=1).values.cpu(),
        ref_w.to(x.dtype).float().sort(dim=1).values.cpu(),
        rtol=0,
        atol=1e-5 if x.dtype == torch.float32 else 1e-2,
    )
    assert_counters_zero()


def _inputs(tokens, experts, hidden, with_map, dtype, device, seed):
    gen = seeded(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    gate = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    emap = torch.randperm(experts, generator=gen).to(device) if with_map else None
    return x, gate, emap


@interp
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-H{c[2]}-k{c[3]}")
def test_interpreter_router_topk(case) -> None:
    tokens, experts, hidden, top_k, renormalize, with_map = case
    x, gate, emap = _inputs(tokens, experts, hidden, with_map, torch.float32, "cpu", tokens)
    for _ in range(2):  # the counters are back to zero: a second call starts clean
        _check(x, gate, top_k, renormalize, emap, 1e-5)


def test_fused_limit_covers_the_cases() -> None:
    """The cases above exercise both paths: keep them on either side of the limit."""
    sizes = [c[0] for c in CASES]
    assert min(sizes) <= rt.ROUTER_FUSED_MAX_TOKENS < max(sizes)


def test_router_topk_rejects_mismatched_gate() -> None:
    with pytest.raises(ValueError, match="hidden size"):
        rt.router_topk(torch.randn(2, 8), torch.randn(4, 6), 2, True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-H{c[2]}-k{c[3]}")
def test_gpu_router_topk(case, dtype) -> None:
    tokens, experts, hidden, top_k, renormalize, with_map = case
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # fresh inputs every run
    x, gate, emap = _inputs(tokens, experts, hidden, with_map, dtype, "cuda", seed)
    _check(x, gate, top_k, renormalize, emap, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gpu_router_topk_graph_replay(tokens: int) -> None:
    """Captured once and replayed on new inputs: the per-block counters reset every replay."""
    x, gate, emap = _inputs(tokens, 128, 2048, True, torch.bfloat16, "cuda", 11)
    static = x.clone()
    rt.router_topk(static, gate, 8, True, torch.bfloat16, emap)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, logits = rt.router_topk(static, gate, 8, True, torch.bfloat16, emap)
    for seed in (12, 13, 14):
        static.copy_(_inputs(tokens, 128, 2048, True, torch.bfloat16, "cuda", seed)[0])
        ids.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_ids, want_logits = rt.router_topk(
            static.clone(), gate, 8, True, torch.bfloat16, emap
        )
        assert torch.equal(logits, want_logits)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
        assert_counters_zero()


@pytest.mark.gpu
@needs_cuda
def test_gpu_counters_survive_other_graphs_in_the_pool() -> None:
    """Graphs share one memory pool (the engine's decode buckets do): a graph captured first
    scribbles over pool memory that later captures may be handed. The arrival counters must
    not live there, or that graph's replays would corrupt them (seen in the engine as an
    illegal address: never-written ids)."""
    x, gate, emap = _inputs(1, 128, 2048, True, torch.bfloat16, "cuda", 21)
    want = rt.router_topk(x, gate, 8, True, torch.bfloat16, emap)  # eager: counters allocated
    scribble = torch.cuda.CUDAGraph()
    with torch.cuda.graph(scribble):
        tmp = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        tmp.fill_(0xFF)
        del tmp  # back to the pool: the next capture may get these addresses
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=scribble.pool()):
        got = rt.router_topk(x, gate, 8, True, torch.bfloat16, emap)
    for _ in range(3):
        scribble.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert_counters_zero()


@pytest.mark.gpu
@needs_cuda
def test_gpu_counters_are_never_allocated_in_a_capture() -> None:
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="outside the capture"):
        with torch.cuda.graph(graph):
            common.zeroed_counters(torch.device("cuda"), 8, "test: first use in a capture")


def _skew_check(tokens: int, experts: int, device: str, dtype: torch.dtype) -> None:
    """The kernels' route skew (a device tensor, fault injection) against `skew_ids`: ids
    replaced by the experts from the skew on, mapped; weights unchanged; -1 changes nothing."""
    x, gate, emap = _inputs(tokens, experts, 96, True, dtype, device, 5)
    skew = torch.full((1,), -1, dtype=torch.int64, device=device)
    plain = rt.router_topk(x, gate, 4, True, dtype, emap)
    off = rt.router_topk(x, gate, 4, True, dtype, emap, skew=skew)
    assert all(torch.equal(a, b) for a, b in zip(off, plain, strict=True))
    for e in (0, experts - 2):  # the second wraps around the last expert
        skew.fill_(e)
        weights, ids, logits = rt.router_topk(x, gate, 4, True, dtype, emap, skew=skew)
        want = emap[(e + torch.arange(4, device=device)) % experts].expand(tokens, 4)
        assert torch.equal(ids, want.to(ids.dtype)), (e, ids.tolist())
        assert torch.equal(weights, plain[0]) and torch.equal(logits, plain[2])
        ref = skew_ids(plain[1].new_zeros(tokens, 4), skew, experts)
        assert torch.equal(emap[ref.long()], want)


@interp
@pytest.mark.parametrize("tokens", [1, 40])  # the one-launch kernel; GEMM + top-k kernel
def test_interpreter_router_topk_skew(tokens: int) -> None:
    _skew_check(tokens, 20, "cpu", torch.float32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 40])
def test_gpu_router_topk_skew(tokens: int) -> None:
    _skew_check(tokens, 128, "cuda", torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_gpu_skew_set_after_capture_reaches_the_replay() -> None:
    """A graph captured with no skew follows the skew tensor being set and cleared."""
    x, gate, emap = _inputs(3, 128, 2048, True, torch.bfloat16, "cuda", 31)
    skew = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    want = rt.router_topk(x, gate, 8, True, torch.bfloat16, emap, skew=skew)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = rt.router_topk(x, gate, 8, True, torch.bfloat16, emap, skew=skew)
    for e in (None, 7, 125, None):
        skew.fill_(-1 if e is None else e)
        graph.replay()
        torch.cuda.synchronize()
        if e is None:
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            skewed = emap[(e + torch.arange(8, device="cuda")) % 128].expand(3, 8)
            assert torch.equal(got[1], skewed) and torch.equal(got[0], want[0])


def test_router_skew_setting_reaches_its_device_tensor() -> None:
    """`Router.skew_expert` (what the engine's fault injection sets) writes the tensor the
    kernels read, and the CPU path skews the same way as the kernels' reference."""
    from safeserve.moe.topk import Router, RouterConfig

    router = Router(32, 16, RouterConfig(4, True))
    router.weight.copy_(torch.randn(16, 32, generator=seeded(3)))
    router.logical_to_physical = torch.randperm(16, generator=seeded(4))
    x = torch.randn(5, 32)
    plain = router(x)
    router.skew_expert = 14
    assert router.skew.tolist() == [14] and router.skew_expert == 14
    skewed = router(x)
    want = router.logical_to_physical[skew_ids(plain.topk_ids, router.skew, 16)]
    assert torch.equal(skewed.topk_ids, want)
    assert want[0].tolist() == router.logical_to_physical[[14, 15, 0, 1]].tolist()
    assert torch.equal(skewed.topk_weights, plain.topk_weights)
    router.skew_expert = None
    assert router.skew.tolist() == [-1] and torch.equal(router(x).topk_ids, plain.topk_ids)
