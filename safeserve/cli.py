"""`safeserve serve` (and, as they land, `group`, `bench`, `chaos`, `oncall`)."""

from __future__ import annotations

import argparse
import logging
import sys

from safeserve.config import ConfigError, ServerArgs


def _serve(ns: argparse.Namespace) -> int:
    try:
        args = ServerArgs.from_cli_args(ns)
    except ConfigError as e:
        print(f"safeserve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s [frontend] %(levelname)s %(name)s: %(message)s",
    )
    import uvicorn

    from safeserve.model.config import ModelConfigError
    from safeserve.model.loader import LoadError
    from safeserve.model.tokenizer import TokenizerError
    from safeserve.server.app import build_app

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
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False
    )
    server = uvicorn.Server(config)
    server.run()
    return 1 if fatal else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safeserve", description="Fault-tolerant MoE inference server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    ServerArgs.add_cli_args(serve)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
