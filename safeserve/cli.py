"""`safeserve serve`, `node`, `keys`, `bench`, `chaos`, `oncall`, `plan` and `tokenizer`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from safeserve.chaos.cli import add_chaos_args
from safeserve.config import TINY_MODEL, ConfigError
from safeserve.config_cli import add_server_args, server_args_from
from safeserve.node.cli import add_keys_args, add_node_args
from safeserve.oncall.cli import add_oncall_args
from safeserve.plan.cli import add_plan_args, run_plan
from safeserve.wire import keys as curve_keys


def _serve(ns: argparse.Namespace) -> int:
    logging.basicConfig(
        level=ns.log_level.upper(),
        format="%(asctime)s [frontend] %(levelname)s %(name)s: %(message)s",
    )
    try:
        args = server_args_from(ns)
    except ConfigError as e:
        print(f"safeserve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from safeserve.model.checkpoint import (
        LoadError,
        check_checkpoint,
        load_model_config,
        stored_dtypes,
    )
    from safeserve.model.config import ModelConfigError
    from safeserve.model.quant import check_fp8_flags
    from safeserve.model.registry import check_layout, kv_spec
    from safeserve.model.sharding import LayoutError
    from safeserve.model.tokenizer import TokenizerError
    from safeserve.moe.eplb.location import LocationError, check_redundant

    # No torch in these (the ranks import it; reading a checkpoint's safetensors headers does
    # too): the frontend starts, and refuses bad flags, without its seconds of import.
    from safeserve.parallel.layout import Layout
    from safeserve.server.app import build_app

    # Everything that can be known wrong is refused here, before any process is spawned.
    try:
        cfg = load_model_config(args.model, args.quantization)
        check_fp8_flags(cfg.quant, args.enable_deterministic_inference)
        from_checkpoint = args.model != TINY_MODEL and args.load_format != "dummy"
        stored = stored_dtypes(args.model, cfg) if from_checkpoint else None
        for rank in range(args.tp_size):
            layout = Layout(rank, args.tp_size, args.ep_size, args.enable_dp_attention)
            check_layout(cfg, layout, stored)
        if from_checkpoint:
            check_checkpoint(args.model, cfg)
        if args.kv_cache_dtype != "auto" and kv_spec(cfg, Layout(0, args.tp_size)).v_in_k:
            raise LayoutError(
                f"--kv-cache-dtype {args.kv_cache_dtype}: {cfg.model_type} keeps a latent (MLA) "
                "cache, which has no FP8 form yet; use --kv-cache-dtype auto"
            )
        if args.enable_deterministic_inference and kv_spec(cfg, Layout(0, args.tp_size)).v_in_k:
            raise LayoutError(
                f"--enable-deterministic-inference: {cfg.model_type} keeps a latent (MLA) cache, "
                "whose attention kernels are not batch-invariant yet"
            )
        if args.enable_single_batch_overlap and not cfg.shared_intermediate_size:
            raise LayoutError(
                f"--enable-single-batch-overlap: {cfg.model_type} has no shared experts to run "
                "while the routed experts' combine is in flight"
            )
        if cfg.num_experts:
            from safeserve.model.sharding import starting_expert_map

            starting_expert_map(args, cfg, Layout(0, args.tp_size, args.ep_size))
            check_redundant(cfg.num_experts, args.ep_size, args.ep_num_redundant_experts)
        elif args.enable_eplb or args.ep_num_redundant_experts:
            raise LayoutError("--enable-eplb and --ep-num-redundant-experts need routed experts")
        if (table_error := _fused_moe_table_error()) is not None:
            print(f"safeserve: error: {table_error}", file=sys.stderr)
            return 2
        # --placement remote: the ranks run on the node agents' devices, not this host's (a
        # frontend pod holds no GPU); an agent's rank that cannot use its device fails its group.
        if args.device == "cuda" and args.placement == "local":
            import torch

            needed = 1 + max(
                args.device_index(g, r) for g in range(args.num_groups) for r in range(args.tp_size)
            )
            if torch.cuda.device_count() < needed:
                raise LayoutError(
                    f"--num-groups {args.num_groups} x --tp-size {args.tp_size} needs CUDA devices "
                    f"up to index {needed - 1}; {torch.cuda.device_count()} visible"
                )
            if args.kv_cache_dtype != "auto":
                for index in sorted({args.device_index(g, r) for g in range(args.num_groups)
                                     for r in range(args.tp_size)}):  # fmt: skip
                    if torch.cuda.get_device_capability(index) < (8, 9):
                        raise LayoutError(
                            f"--kv-cache-dtype {args.kv_cache_dtype} needs FP8 support (compute "
                            f"capability 8.9 or newer); CUDA device {index} has "
                            f"{torch.cuda.get_device_capability(index)}"
                        )
    except (ModelConfigError, LoadError, LayoutError, LocationError) as e:
        print(f"safeserve: error: {e}", file=sys.stderr)
        return 2

    if args.curve_keys_dir and args.placement == "remote":
        try:
            curve_keys.load(Path(args.curve_keys_dir), curve_keys.FRONTEND)
        except curve_keys.KeyError_ as e:
            print(f"safeserve: error: --curve-keys-dir: {e}", file=sys.stderr)
            return 2
    # A port that is taken fails here, not after every group has loaded its model.
    ports = [
        ("--port", args.host, args.port),
        ("--admin-port", args.admin_host, args.admin_port_effective),
    ]
    if args.placement == "remote":
        ports.append(("--node-port", args.node_host, args.node_port))
    for flag, host, port in ports:
        if (why := _cannot_listen(host, port)) is not None:
            print(
                f"safeserve: error: cannot listen on {host}:{port} ({flag}): {why}", file=sys.stderr
            )
            return 2

    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:
        logging.getLogger("safeserve").error("cannot serve: %s", reason)
        fatal.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        app = build_app(args, on_fatal)
    except (ModelConfigError, LoadError, TokenizerError, OSError) as e:
        print(f"safeserve: error: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=args.graceful_shutdown_s,
    )
    server = _announcing_server(config)  # type: ignore[assignment]
    server.run()
    return 1 if fatal else 0


def _bound(server: object, host: str, port: int) -> str:
    """`http://HOST:PORT` a uvicorn server listens on (the real port when asked for 0)."""
    for srv in getattr(server, "servers", None) or []:
        for sock in srv.sockets:
            port = sock.getsockname()[1]
            break
    return f"http://{host}:{port}"


def _announcing_server(config: object) -> object:
    """uvicorn's server, which logs where the API and the admin API listen once it is bound."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list | None = None) -> None:
            await super().startup(sockets)
            if not self.started:
                return
            state = self.config.app.state.safeserve
            args = state.args
            admin = _bound(state.admin_server, args.admin_host, args.admin_port_effective)
            logging.getLogger("safeserve").info(
                "serving on %s (admin API on %s)", _bound(self, args.host, args.port), admin
            )

    return Server(config)


def _cannot_listen(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (as uvicorn binds: SO_REUSEADDR), or None.
    Port 0 (any free port) always can."""
    import socket

    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return str(e)
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def _fused_moe_table_error() -> str | None:
    """Why the fused-MoE table that SAFESERVE_FUSED_MOE_CONFIG names cannot be used; None when
    it can or none is named."""
    if not os.environ.get("SAFESERVE_FUSED_MOE_CONFIG"):
        return None
    from safeserve.kernels.moe_config import ConfigTableError, check_override_table

    try:
        check_override_table()
    except ConfigTableError as e:
        return str(e)
    return None


def _tokenizer(ns: argparse.Namespace) -> int:
    from safeserve.model.tokenizer import TokenizerError, export_tokenizer

    try:
        written = export_tokenizer(ns.model, ns.out)
    except (TokenizerError, OSError) as e:
        print(f"safeserve: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _chaos(ns: argparse.Namespace) -> int:
    from safeserve.chaos.cli import main as chaos_main

    return chaos_main(ns)


def _oncall(ns: argparse.Namespace) -> int:
    from safeserve.oncall.cli import main as oncall_main

    return oncall_main(ns)


def _node(ns: argparse.Namespace) -> int:
    from safeserve.node.cli import run_node

    return run_node(ns)


def _keys(ns: argparse.Namespace) -> int:
    from safeserve.node.cli import run_keys

    return run_keys(ns)


def _plan(ns: argparse.Namespace) -> int:
    return run_plan(ns)


def _bench(ns: argparse.Namespace) -> int:
    from safeserve.bench import main as bench_main

    return bench_main(ns)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safeserve", description="Fault-tolerant MoE inference server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_server_args(serve)
    serve.set_defaults(func=_serve)
    bench = sub.add_parser(
        "bench", help="offline decode benchmark: time per token against the memory floor"
    )
    if (sys.argv[1:] if argv is None else argv)[:1] == ["bench"]:
        # The bench imports torch: only when it runs, so every other command starts fast.
        from safeserve.bench import add_bench_args

        add_bench_args(bench)
    bench.set_defaults(func=_bench)
    chaos = sub.add_parser(
        "chaos", help="chaos runs: load + injected faults, and the goals they must meet"
    )
    add_chaos_args(chaos)
    chaos.set_defaults(func=_chaos)
    oncall = sub.add_parser(
        "oncall", help="on-call view of a running server: get, describe, drain, restart, runbook"
    )
    add_oncall_args(oncall)
    oncall.set_defaults(func=_oncall)
    plan = sub.add_parser(
        "plan",
        help="size a deployment (layout, KV cache, dispatch budget, TPOT) from a model's config",
    )
    add_plan_args(plan)
    plan.set_defaults(func=_plan)
    node = sub.add_parser(
        "node", help="node agent: runs the ranks a frontend (--placement remote) places here"
    )
    add_node_args(node)
    node.set_defaults(func=_node)
    keys_cmd = sub.add_parser(
        "keys", help="write a CurveZMQ key directory for the frontend and its node agents"
    )
    add_keys_args(keys_cmd)
    keys_cmd.set_defaults(func=_keys)
    tok = sub.add_parser(
        "tokenizer",
        help="write a model's tokenizer as Hugging Face files (AutoTokenizer.from_pretrained)",
    )
    tok.add_argument("model", help=f"{TINY_MODEL!r} or a checkpoint directory")
    tok.add_argument("--out", required=True, help="directory to write (made if missing)")
    tok.set_defaults(func=_tokenizer)
    return parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its nested subcommands (`oncall get ...`)."""
    out = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                out |= _options(nested)
    return out


def _flag_of_another_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """A message when `argv` gives a subcommand a flag only another subcommand has (`serve
    --node-rank`: the node agent's), instead of argparse's bare "unrecognized arguments"."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not argv or argv[0] not in sub.choices:
        return None
    own = _options(sub.choices[argv[0]])
    for a in argv[1:]:
        name = a.split("=", 1)[0]
        if not name.startswith("--") or name in own:
            continue
        others = [c for c, p in sub.choices.items() if name in _options(p)]
        if others:
            where = " and ".join(f"`safeserve {c}`" for c in others)
            return f"{name} is a flag of {where}, not of `safeserve {argv[0]}`" + (
                " (the node agent that runs a group's ranks on its host; the frontend takes "
                "--placement remote and --nnodes: docs/nodes.md)"
                if others == ["node"]
                else ""
            )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    wrong = _flag_of_another_command(parser, sys.argv[1:] if argv is None else argv)
    if wrong is not None:
        print(f"safeserve: error: {wrong}", file=sys.stderr)
        return 2
    try:
        ns = parser.parse_args(argv)  # --help prints here
    except BrokenPipeError:
        return _reader_gone()
    if ns.func is _serve:
        return ns.func(ns)  # a server's broken connections are its own business
    try:
        rc = ns.func(ns)
        sys.stdout.flush()  # a pipe closed early fails here, inside the try
        return rc
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of stdout went away (`| head`): nothing more to say, and no traceback. Points
    stdout at /dev/null so that the interpreter's own flush at exit does not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
