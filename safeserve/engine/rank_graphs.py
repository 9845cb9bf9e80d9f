"""A rank's CUDA graphs: decode steps (engine/cuda_graph.py), then prefill and mixed steps as
piecewise graphs (engine/piecewise_graph.py), each kind on every rank of the group or on none.

A rank replaying a graph while a peer runs the same step eagerly would pair different
collectives, so a capture that fails on any rank leaves that kind off on all of them (the group
serves those steps eagerly).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from safeserve.engine.cuda_graph import DecodeCudaGraphs
from safeserve.engine.piecewise_graph import PiecewiseCudaGraphs
from safeserve.model.loader import DTYPES
from safeserve.model.sharding import head_split

logger = logging.getLogger(__name__)


def graphs_possible(runner: Any) -> bool:
    """Whether a `ModelRunner`'s steps can be CUDA graphs: CUDA, not disabled, and attention
    kernels for its cache. Every layout: the `alltoall` backend dispatches captured steps as
    `none` does (moe/dispatch/alltoall.py), and with attention data-parallel every rank replays
    the largest rank's bucket."""
    return (
        runner.device.type == "cuda"
        and not runner.args.disable_cuda_graph
        and runner.attention_kernels
    )


def capture(runner: Any) -> tuple[DecodeCudaGraphs | None, PiecewiseCudaGraphs | None]:
    """The decode graphs and the piecewise graphs of a `ModelRunner` (None: not captured)."""
    if not graphs_possible(runner):
        return None, None
    args, layout = runner.args, runner.layout
    decode: DecodeCudaGraphs | None = DecodeCudaGraphs(
        runner.model,
        runner.kv.layers,
        min(args.cuda_graph_max_bs, args.max_running_requests),
        runner.max_model_len,
        args.block_size,
        runner.device,
        dispatcher=runner.dispatcher,
        # the leader samples with tensor-parallel attention, every rank with data-parallel
        logits=layout.rank == 0 or layout.dp_attention,
        ranks=layout.tp_size,
        replicated=not layout.dp_attention,
    )
    assert decode is not None
    if not _on_every_rank("decode", decode.capture, runner.agree_min):
        decode = None
    max_tokens = min(args.cuda_graph_max_tokens, args.max_num_batched_tokens)
    if max_tokens < 1:
        return decode, None
    # Decode graphs first: `safeserve bench`'s routing probe tells the kinds apart by that order.
    runner.cuda_graphs = decode
    piecewise: PiecewiseCudaGraphs | None = PiecewiseCudaGraphs(
        runner.model,
        runner.kv.layers,
        max_tokens,
        head_split(runner.config, layout).num_heads,
        runner.kv_spec.k_dim,
        runner.kv_spec.v_dim,
        DTYPES[args.dtype],
        runner.device,
        dispatcher=runner.dispatcher,
        ranks=layout.tp_size,
        replicated=not layout.dp_attention,
    )
    assert piecewise is not None
    if not _on_every_rank("piecewise", piecewise.capture, runner.agree_min):
        piecewise = None
    return decode, piecewise


def _on_every_rank(what: str, capture: Callable[[], None], agree_min: Callable[[int], int]) -> bool:
    """Runs a capture; False (on every rank) when it failed on any rank."""
    error = ""
    try:
        capture()
    except RuntimeError as e:  # a forward that cannot be captured still serves, eagerly
        error = str(e) or type(e).__name__
    if agree_min(0 if error else 1) == 0:
        logger.warning(
            "%s CUDA graph capture failed%s, running those steps eagerly%s",
            what,
            " on a peer rank" if not error else "",
            f": {error}" if error else "",
        )
        return False
    return True
