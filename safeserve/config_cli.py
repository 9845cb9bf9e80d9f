"""The command line of `ServerArgs` (`safeserve.config`): an argparse group per flag group,
built from the dataclass fields (their help, group, choices and environment variable), and the
validated instance back from the parsed namespace (a `--guard-policy` preset filling the flags
not given); and the check of a command's output file."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from safeserve.config import ConfigError, ServerArgs
from safeserve.policy import read_policy

logger = logging.getLogger(__name__)

# The namespace attribute naming the ServerArgs fields given on the command line.
EXPLICIT = "_explicit_server_args"


def _mark(namespace: argparse.Namespace, dest: str) -> None:
    explicit = set(getattr(namespace, EXPLICIT, ()))
    explicit.add(dest)
    setattr(namespace, EXPLICIT, explicit)


class _Store(argparse._StoreAction):
    """`store`, remembering that the flag was given (even at its default value)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _mark(namespace, self.dest)


class _StoreTrue(argparse._StoreTrueAction):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _mark(namespace, self.dest)


_TITLES = {
    "model": "model",
    "server": "HTTP server",
    "scheduler": "scheduling and KV cache",
    "parallel": "parallelism",
    "eplb": "expert-parallel load balancing (EPLB)",
    "overlap": "two-batch and single-batch overlap",
    "nodes": "node agents (groups on other hosts)",
    "performance": "performance",
    "guards": "guards",
    "health": "health and watchdog",
    "admin": "admin API",
}


def add_server_args(parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
    """Every ServerArgs field (or those named in `only`) as a `--flag`, in its group, with its
    default in the help."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(ServerArgs):
        if only is not None and f.name not in only:
            continue
        meta = f.metadata
        gname = meta["group"]
        if gname not in groups:
            groups[gname] = parser.add_argument_group(_TITLES.get(gname, gname))
        g = groups[gname]
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = meta["help"]
        if default is not None and not isinstance(default, bool):
            help_text += f" (default: {default})"
        if meta.get("env"):
            help_text += f" Also read from ${meta['env']}."
        if f.type in ("bool", bool):
            g.add_argument(flag, action=_StoreTrue, default=default, help=help_text)
            continue
        g.add_argument(
            flag,
            action=_Store,
            type=_python_type(f.type),
            default=default,
            choices=meta.get("choices"),
            help=help_text,
        )


def explicit_flags(ns: argparse.Namespace) -> set[str]:
    """The ServerArgs fields given on the command line: those the parser saw (at any value,
    the default included), and any whose value differs from its default (a namespace not made
    by `add_server_args`' parser)."""
    given = set(getattr(ns, EXPLICIT, ()))
    for f in dataclasses.fields(ServerArgs):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if getattr(ns, f.name, default) != default:
            given.add(f.name)
    return given


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    """The ServerArgs of a parsed namespace. A flag left unset takes its value from the
    `--guard-policy` preset, if it sets one, else its environment variable, else its default;
    a flag given on the command line always wins. ConfigError (one line) for a bad preset or
    flag. With a preset, logs one INFO line: what it set, and what flags overrode."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ServerArgs):
        value = getattr(ns, f.name)
        env = f.metadata.get("env")
        if value is None and env and os.environ.get(env):
            value = os.environ[env]
        kwargs[f.name] = value
    path = kwargs.get("guard_policy")
    if not path:
        return ServerArgs(**kwargs)
    preset = read_policy(path)
    given = explicit_flags(ns)
    applied = {k: v for k, v in preset.items() if k not in given}
    overridden = {k: v for k, v in preset.items() if k in given}
    kwargs.update(applied)
    try:
        args = ServerArgs(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{e} (with --guard-policy {path})") from None
    logger.info("%s", policy_line(path, applied, overridden, kwargs))
    return args


def policy_line(
    path: str, applied: dict[str, Any], overridden: dict[str, Any], final: dict[str, Any]
) -> str:
    """The INFO line of an applied preset."""
    line = f"guard policy {path} set " + (
        ", ".join(f"{k}={v!r}" for k, v in applied.items()) if applied else "nothing"
    )
    if overridden:
        line += "; flags given overrode " + ", ".join(
            f"{k} (preset {v!r}, flag {final[k]!r})" for k, v in overridden.items()
        )
    return line


def _python_type(annotation: Any) -> type:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def check_output_file(path: str | os.PathLike[str] | None, flag: str) -> None:
    """ValueError unless the file a command writes at its end (`flag`) can be written: checked
    before the work, not after it. Its missing folders are made."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create its folder ({e.strerror})") from None
    writable = os.access(target.parent, os.W_OK)
    if not writable or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")
