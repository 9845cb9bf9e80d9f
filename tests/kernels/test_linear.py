"""`skinny_linear`: the split-K linear of decode-sized batches, against `F.linear`. GPU tests
skip without CUDA; the interpreter tests need Triton and ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from counters import assert_counters_zero
from seeds import seeded

from safeserve.kernels import linear as lin

HAS_CUDA = torch.cuda.is_available() and lin.HAS_TRITON
INTERPRET = lin.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")

# rows, N, K, bias, plan (None: the default plan)
CASES = [
    (1, 96, 256, False, (32, 64, 2)),  # two K slices, the counter path
    (5, 70, 200, True, (32, 64, 2)),  # N and K not multiples of the tiles, a bias
    (16, 48, 130, False, (16, 64, 3)),  # the last K slice ragged and shorter than a tile
    (3, 40, 96, True, (16, 32, 1)),  # one slice: no counter, bias in the epilogue
    (2, 64, 512, False, None),  # the default plan
    (4, 80, 300, True, (32, 128, 3)),  # one tile per program: its weight read before the wait
    (1, 33, 64, False, (16, 64, 1)),  # one tile, one slice
]


def _check(rows, n, k, bias, plan, device, dtype, tol, seed=0) -> None:
    gen = seeded(seed)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    got = lin.skinny_linear(x, w, b, plan=plan)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (rows, n) and got.dtype == dtype
    assert not got.isnan().any()
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel <= tol, rel
    again = lin.skinny_linear(x, w, b, plan=plan)
    assert torch.equal(got, again)  # the fixed-order sum: bit-identical every call
    assert_counters_zero()


@interp
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}")
def test_interpreter_skinny_linear(case) -> None:
    _check(*case, "cpu", torch.float32, 1e-5)


def test_linear_takes_the_library_path_off_the_kernel_path() -> None:
    """CPU tensors (no interpreter) and batches over the row limit use `F.linear` itself."""
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    if not INTERPRET:
        assert torch.equal(lin.linear(x, w), F.linear(x, w))
    big = torch.randn(lin.SKINNY_MAX_ROWS + 1, 8)
    assert torch.equal(lin.linear(big, w), F.linear(big, w))
    with pytest.raises(ValueError, match="at most 16 rows"):
        lin.skinny_linear(torch.randn(17, 8), w)
    with pytest.raises(ValueError, match="does not take"):
        lin.skinny_linear(x, torch.randn(5, 9))


def test_default_plan_is_one_tile_per_program() -> None:
    """The H200 sweep's best plans for the model's shapes; K always one tile per program."""
    assert lin.skinny_plan(5120, 2048, 132) == (128, 256, 8)  # q|k|v
    assert lin.skinny_plan(2048, 4096, 132) == (64, 512, 8)  # o_proj
    for n, k in ((64, 128), (96, 200), (7168, 7168), (2560, 2048)):
        for elt in (2, 4):
            block_n, block_k, split = lin.skinny_plan(n, k, 132, elt)
            assert block_k * split >= k > block_k * (split - 1)
            assert block_n * block_k * elt <= 64 << 10


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}")
def test_gpu_skinny_linear(case, dtype) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # fresh inputs every run
    _check(*case, "cuda", dtype, 1e-5 if dtype == torch.float32 else 1e-2, seed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(5120, 2048), (2048, 4096)], ids=["qkv", "o_proj"])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_gpu_linear_graph_replay_model_shapes(shape, rows) -> None:
    """The model's shapes at the default plan, captured once and replayed on new inputs."""
    n, k = shape
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    static = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    lin.skinny_linear(static, w)  # compile and allocate the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin.skinny_linear(static, w)
    for _ in range(3):
        static.copy_(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref = F.linear(static.double(), w.double())
        assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-2
        assert torch.equal(out, lin.skinny_linear(static.clone(), w))
        assert_counters_zero()


def _invariance(device, dtype, n, k, batches, monkeypatch=None) -> None:  # type: ignore[no-untyped-def]
    """Each row of `invariant_linear` equals, bit for bit, the same row computed alone (one
    row: the K slices on programs of their own) in every other batch, at other positions, over
    several row blocks (the slices summed inside each program), and with the in-program path
    forced for small batches too; and stays within 1e-2 / 1e-5 of float64."""
    gen = seeded(n + k)
    rows = torch.randn(max(batches), k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype)
    alone = torch.cat([lin.invariant_linear(rows[i : i + 1], w, b) for i in range(len(rows))])
    ref = F.linear(rows.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((alone.double() - ref).norm() / ref.norm()).item() <= tol
    for m in batches:
        order = torch.randperm(len(rows), generator=gen)[:m]  # other rows, other positions
        got = lin.invariant_linear(rows[order], w, b)
        assert torch.equal(got, alone[order]), m
    if monkeypatch is not None:
        monkeypatch.setattr(lin, "_INVARIANT_PART_BYTES", 0)
        for m in (1, 3, 20):
            assert torch.equal(lin.invariant_linear(rows[:m], w, b), alone[:m]), m
    assert_counters_zero()


@interp
def test_interpreter_invariant_linear_rows_do_not_depend_on_the_batch(monkeypatch) -> None:
    _invariance("cpu", torch.float32, 70, 600, [1, 5, 17, 64, 65, 130], monkeypatch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "shape", [(5120, 2048), (2048, 4096), (151936, 2048)], ids=["qkv", "o_proj", "lm_head"]
)
def test_gpu_invariant_linear_rows_do_not_depend_on_the_batch(shape, monkeypatch) -> None:
    _invariance("cuda", torch.bfloat16, *shape, [1, 3, 8, 16, 17, 64, 65, 100, 300], monkeypatch)


def test_invariant_linear_is_f_linear_off_the_kernel_path() -> None:
    x, w = torch.randn(20, 8), torch.randn(5, 8)
    if not INTERPRET:
        assert torch.equal(lin.invariant_linear(x, w), F.linear(x, w))
