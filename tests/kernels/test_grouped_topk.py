"""Grouped top-k with the correction bias (`safeserve.kernels.grouped_topk`): the Triton kernel on
a GPU (or, on CPU, in Triton's interpreter when TRITON_INTERPRET=1) against the torch reference
`grouped_topk_torch`; the Router taking the kernel on CUDA for grouped, sigmoid, biased or
scaled routing. Inputs are drawn without near ties at the choice's boundaries (the k-th expert,
the topk_group-th group), so the chosen sets must be equal."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import pytest
import torch
from seeds import seeded

from safeserve.kernels import grouped_topk as gt
from safeserve.moe import topk as moe_topk
from safeserve.moe.topk import Router, RouterConfig, grouped_topk, skew_ids

HAS_CUDA = torch.cuda.is_available() and gt.HAS_TRITON
INTERPRET = gt.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")

# a draw is redrawn where the float64 choice is this close to a tie at a boundary
MARGIN = 1e-5


@dataclass(frozen=True)
class Routing:
    experts: int
    top_k: int
    scoring: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    bias: bool = True
    renormalize: bool = True
    scaling: float = 2.5

    def args(self) -> tuple[int, bool, str, int, int]:
        return self.top_k, self.renormalize, self.scoring, self.n_group, self.topk_group


def _boundary_gaps(logits: torch.Tensor, r: Routing, bias: torch.Tensor | None) -> torch.Tensor:
    """Per row, in float64: the smallest gap at a boundary of the choice (between the
    topk_group-th and the next group score, between the k-th and the next kept expert)."""
    x = logits.double()
    scores = x.sigmoid() if r.scoring == "sigmoid" else x.softmax(-1)
    choice = scores if bias is None else scores + bias.double()
    t, e = choice.shape
    gap = torch.full((t,), float("inf"), dtype=torch.float64)
    if r.n_group > 1 and r.topk_group < r.n_group:
        group = choice.view(t, r.n_group, -1).topk(2, -1).values.sum(-1)
        ranked = group.sort(-1, descending=True)
        gap = ranked.values[:, r.topk_group - 1] - ranked.values[:, r.topk_group]
        dropped = ranked.indices[:, r.topk_group :]
        mask = torch.zeros(t, r.n_group, dtype=torch.bool).scatter_(1, dropped, True)
        choice = choice.masked_fill(mask.repeat_interleave(e // r.n_group, 1), float("-inf"))
    ranked = choice.sort(-1, descending=True).values
    if r.top_k < ranked.shape[1]:
        gap = torch.minimum(gap, ranked[:, r.top_k - 1] - ranked[:, r.top_k])
    return gap.nan_to_num(float("inf"))  # -inf - -inf: top_k is every kept expert


def _inputs(
    tokens: int, r: Routing, dtype: torch.dtype, seed: int, bias_scale: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [tokens, E] in `dtype` and a float32 bias (or None), with no near ties."""
    gen = seeded(seed)
    bias = (torch.randn(r.experts, generator=gen) * bias_scale) if r.bias else None
    logits = torch.randn(tokens, r.experts, generator=gen).to(dtype)
    for _ in range(100):
        bad = _boundary_gaps(logits, r, bias) < MARGIN
        if not bad.any():
            return logits, bias
        logits[bad] = torch.randn(int(bad.sum()), r.experts, generator=gen).to(dtype)
    raise AssertionError("could not draw logits without near ties")


def _check(
    logits: torch.Tensor,
    r: Routing,
    bias: torch.Tensor | None,
    weights_dtype: torch.dtype,
    expert_map: torch.Tensor | None,
) -> None:
    """Ids equal as sets per token; each id's weight within 1e-5 (float32) or 1e-2."""
    w, ids = gt.fused_grouped_topk(logits, *r.args(), bias, r.scaling, weights_dtype, expert_map)
    ref_w, ref_ids = gt.grouped_topk_torch(logits, *r.args(), bias, r.scaling, torch.float32)
    want_dtype = torch.int32 if expert_map is None else expert_map.dtype
    assert ids.dtype == want_dtype and w.dtype == weights_dtype
    assert ids.shape == ref_ids.shape == w.shape == (logits.shape[0], r.top_k)
    if expert_map is not None:
        ref_ids = expert_map[ref_ids]
    assert not torch.isnan(w).any()
    got, want = ids.long().sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(got.values, want.values), (got.values.tolist(), want.values.tolist())
    tol = 1e-5 if weights_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        w.float().gather(1, got.indices),
        ref_w.gather(1, want.indices),
        rtol=tol,
        atol=tol * 1e-3,
    )


# (experts, top_k, n_group, topk_group): no groups, groups of a power of two, groups of 9
# experts (72 in 8 groups: each padded to 16 columns), 18 (72 in 4)
SHAPES = [
    (8, 2, 1, 1),
    (8, 2, 4, 2),
    (64, 6, 1, 1),
    (64, 6, 4, 2),
    (64, 6, 8, 4),
    (72, 6, 1, 1),
    (72, 6, 4, 2),
    (72, 6, 8, 4),
]


def _shape_id(s: tuple[int, int, int, int]) -> str:
    return f"E{s[0]}-k{s[1]}-g{s[2]}-{s[3]}"


# ---------------------------------------------------------------------------------------------
# CPU: the entry point's torch path, the config checks, the Router's CPU path
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRET, reason="the interpreter takes the kernel path")
def test_entry_point_runs_the_reference_where_kernels_do_not_apply() -> None:
    r = Routing(72, 6, n_group=8, topk_group=4)
    logits, bias = _inputs(9, r, torch.float32, 1)
    emap = torch.randperm(72, generator=seeded(2))
    skew = torch.full((1,), -1, dtype=torch.int64)
    w, ids = gt.fused_grouped_topk(logits, *r.args(), bias, 2.5, torch.bfloat16, emap, skew)
    ref_w, ref_ids = gt.grouped_topk_torch(logits, *r.args(), bias, 2.5, torch.bfloat16)
    assert torch.equal(w, ref_w) and torch.equal(ids, emap[ref_ids])
    skew.fill_(70)
    _, skewed = gt.fused_grouped_topk(logits, *r.args(), bias, 2.5, torch.float32, emap, skew)
    assert torch.equal(skewed, emap[skew_ids(ref_ids, skew, 72)])
    _, plain = gt.fused_grouped_topk(logits, *r.args(), bias)
    assert plain.dtype == torch.int32 and torch.equal(plain.long(), ref_ids)


def test_moe_grouped_topk_is_the_reference() -> None:
    """The routers' CPU path (`moe.topk.grouped_topk`, config in a RouterConfig) is the
    kernel's oracle."""
    cfg = RouterConfig(6, True, "sigmoid", 8, 4, True, 2.5, True)
    logits, bias = _inputs(5, Routing(64, 6, n_group=8, topk_group=4), torch.float32, 3)
    got = grouped_topk(logits, cfg, bias, torch.float32)
    want = gt.grouped_topk_torch(logits, 6, True, "sigmoid", 8, 4, bias, 2.5)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "experts,top_k,n_group,topk_group,match",
    [
        (72, 6, 5, 2, "does not divide"),
        (8, 2, 8, 4, "best two"),
        (64, 6, 8, 9, "topk_group"),
        (64, 17, 8, 2, "kept groups"),
        (8, 9, 1, 1, "top_k"),
    ],
)
def test_grouping_that_cannot_route_is_refused(experts, top_k, n_group, topk_group, match) -> None:
    with pytest.raises(ValueError, match=match):
        gt.fused_grouped_topk(torch.randn(2, experts), top_k, True, "sigmoid", n_group, topk_group)


def test_unknown_scoring_is_refused() -> None:
    with pytest.raises(ValueError, match="scoring"):
        gt.fused_grouped_topk(torch.randn(2, 8), 2, True, "relu")


# ---------------------------------------------------------------------------------------------
# Triton interpreter on CPU (TRITON_INTERPRET=1): small shapes
# ---------------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_interpreter_grouped_topk(shape, scoring: str) -> None:
    experts, top_k, n_group, topk_group = shape
    emap = torch.randperm(experts, generator=seeded(experts))
    seed = 0
    for tokens in (1, 3, 17):
        for bias in (True, False):
            for renormalize in (True, False):
                seed += 1
                r = Routing(experts, top_k, scoring, n_group, topk_group, bias, renormalize)
                logits, b = _inputs(tokens, r, torch.float32, seed)
                _check(logits, r, b, torch.float32, emap if seed % 2 else None)


@interp
@pytest.mark.parametrize("shape", [(64, 6, 8, 4), (72, 6, 8, 4), (64, 6, 1, 1)], ids=_shape_id)
def test_interpreter_grouped_topk_bf16(shape) -> None:
    """bf16 logits (many exact duplicates: redrawn where they tie at a boundary), bf16 weights."""
    r = Routing(*shape[:2], n_group=shape[2], topk_group=shape[3])
    emap = torch.randperm(r.experts, generator=seeded(5))
    for tokens, bias in ((1, True), (17, True), (17, False)):
        logits, b = _inputs(tokens, replace(r, bias=bias), torch.bfloat16, tokens)
        _check(logits, replace(r, bias=bias), b, torch.bfloat16, emap)


@interp
def test_interpreter_grouped_topk_bias_below_zero() -> None:
    """Every score + bias below 0: a dropped group's experts (-inf) still never win, and the
    weights stay the unbiased scores."""
    r = Routing(72, 8, n_group=8, topk_group=3)
    logits, bias = _inputs(17, r, torch.float32, 7)
    bias = bias - 3.0
    assert (logits.sigmoid() + bias).max() < 0
    _check(logits, r, bias, torch.float32, None)


@interp
def test_interpreter_grouped_topk_takes_every_kept_expert() -> None:
    """top_k equal to the kept groups' experts: exactly those, whatever their order."""
    r = Routing(8, 4, n_group=4, topk_group=2)
    logits, bias = _inputs(17, r, torch.float32, 8)
    _check(logits, r, bias, torch.float32, None)


@interp
def test_interpreter_grouped_topk_strided_and_empty() -> None:
    r = Routing(64, 6, n_group=8, topk_group=4)
    wide, bias = _inputs(5, replace(r, experts=128), torch.float32, 9)
    _check(wide[:, :64], r, bias[:64], torch.float32, None)  # rows 128 apart
    w, ids = gt.fused_grouped_topk(torch.empty(0, 64), *r.args(), bias[:64], 2.5)
    assert w.shape == ids.shape == (0, 6)


def _non_finite_check(device: str) -> None:
    """Rows of NaN or infinite logits: k distinct experts in range (never an id twice, which
    would overrun the dispatch buffers), NaN weights where the row is NaN; the other rows
    route as the reference does."""
    for r in (Routing(72, 6, n_group=8, topk_group=4), Routing(64, 6, "softmax")):
        logits, bias = _inputs(6, r, torch.float32, 19)
        logits[1] = float("nan")
        logits[2, 5] = float("nan")
        logits[3] = float("inf")
        logits[4, :9] = float("-inf")
        bias = bias.to(device) if bias is not None else None
        w, ids = gt.fused_grouped_topk(logits.to(device), *r.args(), bias, 2.5)
        w, ids = w.cpu(), ids.cpu()
        for row in ids.tolist():
            assert len(set(row)) == r.top_k and all(0 <= i < r.experts for i in row), row
        assert torch.isnan(w[1]).all()
        _check(logits[[0, 4, 5]].to(device), r, bias, torch.float32, None)


@interp
def test_interpreter_grouped_topk_non_finite_logits() -> None:
    _non_finite_check("cpu")


def _skew_check(device: str, dtype: torch.dtype) -> None:
    """The route skew (a device tensor): ids become map[(e + slot) % E]; weights unchanged;
    -1 changes nothing."""
    r = Routing(72, 6, n_group=8, topk_group=4)
    logits, bias = _inputs(17, r, dtype, 10)
    logits, bias = logits.to(device), bias.to(device)
    emap = torch.randperm(72, generator=seeded(11)).to(device)
    skew = torch.full((1,), -1, dtype=torch.int64, device=device)
    args = (logits, *r.args(), bias, 2.5, dtype, emap)
    plain = gt.fused_grouped_topk(*args)
    off = gt.fused_grouped_topk(*args, skew)
    assert all(torch.equal(a, b) for a, b in zip(off, plain, strict=True))
    for e in (0, 69):  # the second wraps around the last expert
        skew.fill_(e)
        w, ids = gt.fused_grouped_topk(*args, skew)
        want = emap[(e + torch.arange(6, device=device)) % 72].expand(17, 6)
        assert torch.equal(ids, want) and torch.equal(w, plain[0])


@interp
def test_interpreter_grouped_topk_skew() -> None:
    _skew_check("cpu", torch.float32)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

# DeepSeek-V3 (float32 logits, as its gate), Moonlight, 72 experts in groups of 9, softmax
# without groups but with float32 logits and a scaling factor
GPU_ROUTINGS = {
    "deepseek_v3": Routing(256, 8, "sigmoid", 8, 4),
    "deepseek_v3_not_renormalized": Routing(256, 8, "sigmoid", 8, 4, renormalize=False),
    "moonlight": Routing(64, 6, "sigmoid", 1, 1),
    "groups_of_9": Routing(72, 6, "softmax", 8, 3),
    "softmax_scaled": Routing(128, 8, "softmax", 1, 1, bias=False),
    "unbiased_groups": Routing(256, 8, "sigmoid", 8, 4, bias=False),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 333, 4096])
@pytest.mark.parametrize("name", sorted(GPU_ROUTINGS))
def test_gpu_grouped_topk(name: str, tokens: int, dtype: torch.dtype) -> None:
    r = GPU_ROUTINGS[name]
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # fresh inputs every run
    logits, bias = _inputs(tokens, r, dtype, seed)
    emap = torch.randperm(r.experts, generator=seeded(seed)).cuda()
    bias = None if bias is None else bias.cuda()
    for weights_dtype, m in ((torch.bfloat16, emap), (torch.float32, None)):
        _check(logits.cuda(), r, bias, weights_dtype, m)


@pytest.mark.gpu
@needs_cuda
def test_gpu_grouped_topk_non_finite_logits() -> None:
    _non_finite_check("cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_grouped_topk_skew() -> None:
    _skew_check("cuda", torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_gpu_grouped_topk_graph_replay(tokens: int) -> None:
    """Captured once and replayed on new logits and a skew set after the capture."""
    r = GPU_ROUTINGS["deepseek_v3"]
    logits, bias = _inputs(tokens, r, torch.float32, 12)
    static, bias = logits.cuda(), bias.cuda()
    emap = torch.randperm(256, generator=seeded(13)).cuda()
    skew = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    args = (*r.args(), bias, r.scaling, torch.bfloat16, emap, skew)
    gt.fused_grouped_topk(static, *args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = gt.fused_grouped_topk(static, *args)
    for seed, e in ((14, -1), (15, 250), (16, -1)):
        static.copy_(_inputs(tokens, r, torch.float32, seed)[0])
        skew.fill_(e)
        ids.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_ids = gt.fused_grouped_topk(static.clone(), *args)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


def _router(cfg: RouterConfig, device: str) -> Router:
    gen = seeded(17)
    router = Router(32, 64, cfg)
    router.reset_buffers("cpu")
    router.weight.copy_(torch.randn(64, 32, generator=gen))
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.copy_(torch.randn(64, generator=gen) * 0.1)
    router.logical_to_physical = torch.randperm(64, generator=gen)
    return router.to(device)


DEEPSEEK_ROUTER = RouterConfig(6, True, "sigmoid", 8, 4, True, 2.5, True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "cfg",
    [DEEPSEEK_ROUTER, RouterConfig(6, False, "sigmoid", 1, 1, True, 1.0, False)],
    ids=["deepseek_v3", "moonlight_like"],
)
def test_gpu_router_takes_the_grouped_kernel(cfg: RouterConfig, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On CUDA a grouped / sigmoid / biased / scaled router runs `fused_grouped_topk` with
    its expert map and skew, and routes as the CPU path does."""
    calls: list[dict] = []
    kernel = moe_topk.fused_grouped_topk

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(moe_topk, "fused_grouped_topk", spy)
    cpu, gpu = _router(cfg, "cpu"), _router(cfg, "cuda")
    x = torch.randn(9, 32, generator=seeded(18))
    got = gpu(x.cuda())
    assert len(calls) == 1 and calls[0]["skew"] is gpu.skew
    assert got.topk_ids.dtype == torch.int64 and got.topk_weights.dtype == x.dtype
    logits = got.router_logits.cpu()
    torch.testing.assert_close(logits, cpu(x).router_logits, rtol=1e-4, atol=1e-4)
    # the CPU path's routing of the same logits
    want_w, logical = grouped_topk(logits, cfg, cpu.e_score_correction_bias, x.dtype)
    ids, order = got.topk_ids.cpu().sort(1)
    want_ids, want_order = cpu.logical_to_physical[logical].sort(1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(
        got.topk_weights.cpu().gather(1, order), want_w.gather(1, want_order)
    )
    plain = _router(RouterConfig(6, True), "cuda")
    plain(x.cuda())
    assert len(calls) == 1  # plain softmax routing keeps its one-launch kernel


def test_router_on_cpu_takes_the_torch_path(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the kernel entry point ran on CPU")

    monkeypatch.setattr(moe_topk, "fused_grouped_topk", fail)
    router = _router(DEEPSEEK_ROUTER, "cpu")
    x = torch.randn(4, 32)
    out = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    _, logical = grouped_topk(logits, DEEPSEEK_ROUTER, router.e_score_correction_bias, x.dtype)
    assert torch.equal(out.topk_ids, router.logical_to_physical[logical])
