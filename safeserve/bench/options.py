"""`safeserve bench`'s flags, `BenchOptions`, the serve arguments a run needs, progress lines."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from safeserve.config import ServerArgs
from safeserve.config_cli import add_server_args

PEERS = ("none", "transformers")


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Every serve flag (model, device, dtype, KV cache, ...) plus the bench's own."""
    add_server_args(parser)
    g = parser.add_argument_group("bench")
    g.add_argument(
        "--concurrency", default="1,2,4,8,16,32,64", help="Comma-separated batch sizes to run."
    )
    g.add_argument("--input-len", type=int, default=512, help="Prompt tokens per request.")
    g.add_argument("--output-len", type=int, default=128, help="Generated tokens per request.")
    g.add_argument(
        "--peer", default="none", choices=PEERS, help="Also run this implementation (same config)."
    )
    g.add_argument(
        "--peer-concurrency",
        default=None,
        help="Batch sizes for the peer (default: the first and last of --concurrency).",
    )
    g.add_argument(
        "--peer-output-len",
        type=int,
        default=None,
        help="Generated tokens per request for the peer (default: --output-len).",
    )
    g.add_argument(
        "--ceiling-gib",
        type=float,
        default=None,
        help="Size of the HBM read-ceiling test tensor (default: 4 on CUDA, 0.25 on CPU).",
    )
    g.add_argument("--json", default=None, help="Write every number to this file.")
    g.add_argument(
        "--expert-distribution-out",
        default=None,
        metavar="FILE",
        help="Write the routing of the timed decode steps (choices per MoE layer and expert) as "
        "an expert distribution file, which `safeserve plan --expert-distribution` and "
        "`--init-expert-location` read.",
    )


@dataclasses.dataclass
class BenchOptions:
    concurrency: list[int]
    input_len: int
    output_len: int
    peer: str = "none"
    peer_concurrency: list[int] | None = None
    peer_output_len: int | None = None
    ceiling_gib: float | None = None
    json_path: str | None = None
    distribution_path: str | None = None

    @staticmethod
    def from_namespace(ns: argparse.Namespace) -> BenchOptions:
        def ints(text: str) -> list[int]:
            values = [int(x) for x in text.split(",") if x.strip()]
            if not values or min(values) < 1:
                raise ValueError(f"expected positive comma-separated integers, got {text!r}")
            return values

        opts = BenchOptions(
            concurrency=ints(ns.concurrency),
            input_len=ns.input_len,
            output_len=ns.output_len,
            peer=ns.peer,
            peer_concurrency=ints(ns.peer_concurrency) if ns.peer_concurrency else None,
            peer_output_len=ns.peer_output_len,
            ceiling_gib=ns.ceiling_gib,
            json_path=ns.json,
            distribution_path=ns.expert_distribution_out,
        )
        if opts.input_len < 1 or opts.output_len < 2:
            raise ValueError("--input-len must be >= 1 and --output-len >= 2")
        return opts


def bench_server_args(args: ServerArgs, opts: BenchOptions) -> ServerArgs:
    """Room for the largest batch. The context length stays `serve`'s (--max-model-len, else the
    model's), not just input + output: a decode graph's block table is as wide as it, and the
    step is timed as the server runs it."""
    return dataclasses.replace(
        args, max_running_requests=max(args.max_running_requests, max(opts.concurrency))
    )


def check_context(args: ServerArgs, opts: BenchOptions) -> None:
    """Prompts and outputs fit the context length (ValueError, LoadError for a bad --model)."""
    from safeserve.model.checkpoint import load_model_config

    max_len = args.max_model_len or load_model_config(args.model).max_position_embeddings
    need_len = opts.input_len + opts.output_len
    if max_len < need_len:
        raise ValueError(f"--max-model-len {max_len} < input + output = {need_len}")


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
