"""Paged-attention prefill: the Triton kernel against its torch reference (the interpreter on CPU,
the GPU in bf16/fp32), the reference against the engine's per-sequence SDPA path, and the
engine's attention metadata routing a step's chunks through the kernel on CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import paged_prefill as pp
from safeserve.kernels.common import HAS_TRITON, optin_shared_bytes, shared_memory_per_program
from safeserve.layers.paged_attention import AttentionMetadata, attend

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
_kernel_runs = pytest.mark.skipif(
    not HAS_TRITON or not (HAS_CUDA or INTERPRET),
    reason="needs Triton on a GPU or under its interpreter (TRITON_INTERPRET=1)",
)


def needs_kernel(test):  # type: ignore[no-untyped-def]
    """Runs the kernel on a GPU, or under Triton's interpreter on CPU; marked `kernel` so that
    GPU runs filtered by marker (-m "gpu or kernel") take it too."""
    return pytest.mark.kernel(_kernel_runs(test))


def _problem(q_lens, ctxs, hq, hkv, d, bs, dtype, device, seed):  # type: ignore[no-untyped-def]
    """Random caches, block tables (shuffled blocks, padded to one width) and query rows."""
    gen = seeded(seed)
    widths = [(c + bs - 1) // bs for c in ctxs]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for w in widths:
        tables.append(perm[i : i + w])
        i += w
    kc = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(device, dtype)
    vc = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(device, dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device, dtype)
    width = max(widths)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [sum(q_lens[:s]) for s in range(len(q_lens))]
    info = pp.prefill_info(starts, q_lens, ctxs)
    return q, kc, vc, bt.to(device), info.to(device), tables


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


CASES = [
    # query lengths, context lengths (>= query: earlier chunks are in the cache), Hq, Hkv, D, block
    ([5], [5], 8, 2, 64, 16),
    ([17, 3, 40], [17, 30, 95], 8, 2, 64, 16),  # chunked prefill: contexts beyond the chunk
    ([9, 2], [9, 70], 4, 4, 80, 1),  # MHA, head dim not a power of two, one token per block
    ([33, 1, 12], [33, 64, 12], 32, 4, 128, 16),  # Qwen3-30B-A3B's heads, a 1-token chunk
]


def test_reference_matches_the_engine_torch_path() -> None:
    """The oracle computes what the engine's per-sequence SDPA loop computes."""
    q_lens, ctxs = [6, 3], [6, 20]
    q, kc, vc, bt, info, tables = _problem(q_lens, ctxs, 8, 2, 16, 4, torch.float32, "cpu", 0)
    ref = pp.paged_prefill_torch(q, kc, vc, bt, info, 4, 0.3, torch.zeros_like(q))
    meta = AttentionMetadata.build(q_lens, ctxs, tables, 4, "cpu")
    assert meta.prefill is None and len(meta.seqs) == 2  # CPU keeps the torch path
    torch.testing.assert_close(attend(q, (kc, vc), meta, 0.3), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_reference(case: int, dtype: torch.dtype) -> None:
    q_lens, ctxs, hq, hkv, d, bs = CASES[case]
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter mis-computes bf16 tl.dot (checked on the GPU)")
    q, kc, vc, bt, info, _ = _problem(q_lens, ctxs, hq, hkv, d, bs, dtype, DEVICE, case)
    scale = d**-0.5
    ref = pp.paged_prefill_torch(
        q.double(), kc.double(), vc.double(), bt, info, bs, scale, torch.zeros_like(q.double())
    )
    out = torch.full_like(q, float("nan"))
    pp.paged_prefill(q, kc, vc, bt, info, max(q_lens), bs, scale, out)
    assert not out.isnan().any()  # every query row written
    assert _rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


TILE_CONFIGS = [
    {"rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"rows": 32, "block_n": 32, "num_warps": 4, "num_stages": 2},
    {"rows": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
]


@needs_kernel
@pytest.mark.parametrize("config", range(len(TILE_CONFIGS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_tile_configs_match_reference(config: int, dtype: torch.dtype) -> None:
    """Every tile shape the tuner may pick, on contexts long enough that most context tiles are
    seen whole by every row (the unmasked loop) and chunks that end mid-tile (the masked one):
    a later chunk of 70 over 300 tokens, a 1-token chunk, a first chunk of 131."""
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter mis-computes bf16 tl.dot (checked on the GPU)")
    q_lens, ctxs = [70, 1, 131], [300, 129, 131]
    q, kc, vc, bt, info, _ = _problem(q_lens, ctxs, 8, 2, 64, 16, dtype, DEVICE, 11 + config)
    ref = pp.paged_prefill_torch(
        q.double(), kc.double(), vc.double(), bt, info, 16, 0.125, torch.zeros_like(q.double())
    )
    out = torch.full_like(q, float("nan"))
    pp.paged_prefill(q, kc, vc, bt, info, 131, 16, 0.125, out, TILE_CONFIGS[config])
    assert not out.isnan().any()
    assert _rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_prefill_config_follows_the_longest_chunk_and_is_a_copy() -> None:
    for table in pp.PREFILL_CONFIGS.values():
        assert table[0][0] == 0 and [lo for lo, _ in table] == sorted({lo for lo, _ in table})
    assert pp.prefill_config(torch.device("cpu"), 4096) == pp.PREFILL_CONFIGS["default"][0][1]
    cfg = pp.prefill_config(torch.device("cpu"), 1)
    cfg["rows"] = 1
    assert pp.PREFILL_CONFIGS["default"][0][1]["rows"] != 1
    if HAS_CUDA and any(n in torch.cuda.get_device_name() for n in ("H100", "H200")):
        table = pp.PREFILL_CONFIGS["sm90"]
        for lo, want in table:
            assert pp.prefill_config(torch.device("cuda"), max(lo, 1)) == want


def test_large_tiles_only_where_hopper_shared_memory_is(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The sm90 tiles need 128 KiB of shared memory a program: an H100/H200/B200 (227 KiB) gets
    them; a GB10 or an RTX 50 (compute capability 12, 99 KiB) and an A100 (8.0) do not."""
    from types import SimpleNamespace

    for major, shared, want in ((9, 232448, True), (10, 232448, True), (12, 101376, False),
                                (8, 166912, False), (9, 0, False)):  # fmt: skip
        props = SimpleNamespace(major=major, minor=0, shared_memory_per_block_optin=shared)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, p=props: p)
        assert pp._hopper_class.__wrapped__(0) is want, (major, shared)
    # a torch whose device properties lack the opt-in size: known parts by capability
    for major, minor, want in ((9, 0, True), (10, 0, True), (12, 1, False), (12, 0, False)):
        props = SimpleNamespace(major=major, minor=minor)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, p=props: p)
        assert pp._hopper_class.__wrapped__(0) is want, (major, minor)
    # the shared memory the launchers size tiles by: reported, else known by capability
    kib = 1024
    assert optin_shared_bytes(SimpleNamespace(major=8, minor=0)) == 163 * kib  # A100
    assert optin_shared_bytes(SimpleNamespace(major=8, minor=9)) == 99 * kib  # L40S
    assert optin_shared_bytes(SimpleNamespace(major=9, minor=0)) == 227 * kib
    reported = SimpleNamespace(major=8, minor=0, shared_memory_per_block_optin=101376)
    assert optin_shared_bytes(reported) == 101376
    assert shared_memory_per_program(torch.device("cpu")) == 227 * kib  # the interpreter's


@needs_kernel
def test_prefill_kernel_leaves_other_rows_alone() -> None:
    """Rows outside the chunks (a mixed step's decode rows) keep what `out` held."""
    q, kc, vc, bt, info, _ = _problem([4], [10], 4, 2, 32, 4, torch.float32, DEVICE, 7)
    out = torch.full((6, 4, 32), 7.0, device=DEVICE)
    info[0, 1] = 1  # the chunk's rows are 1..4 of a 6-row batch
    q6 = torch.zeros(6, 4, 32, device=DEVICE)
    q6[1:5] = q
    pp.paged_prefill(q6, kc, vc, bt, info, 4, 4, 0.2, out)
    assert (out[0] == 7).all() and (out[5] == 7).all() and not (out[1:5] == 7).all()


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA device and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_prefill_step_runs_the_kernel_and_matches_the_torch_path(dtype) -> None:
    """A step of prefill chunks only (first chunks and later ones) and one with a decode row:
    on CUDA one prefill launch; the same output as the torch path."""
    for q_lens, ctxs in (([7, 64, 3], [7, 64, 40]), ([1, 20, 1], [33, 20, 5])):
        q, kc, vc, _, _, tables = _problem(q_lens, ctxs, 16, 4, 128, 16, dtype, "cuda", 3)
        meta = AttentionMetadata.build(q_lens, ctxs, tables, 16, "cuda")
        ref_meta = AttentionMetadata.build(q_lens, ctxs, tables, 16, "cuda", use_kernels=False)
        assert meta.prefill is not None and not meta.seqs and ref_meta.prefill is None
        torch.testing.assert_close(meta.slot_mapping, ref_meta.slot_mapping)
        out = attend(q, (kc, vc), meta, 0.1)
        ref = attend(q, (kc, vc), ref_meta, 0.1)
        assert not out.isnan().any()
        assert _rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
