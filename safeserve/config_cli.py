"""The command line of `ServerArgs` (`safeserve.config`): an argparse group per flag group,
built from the dataclass fields (their help, group, choices and environment variable), and the
validated instance back from the parsed namespace; and the check of a command's output file."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from safeserve.config import ServerArgs

_TITLES = {
    "model": "model",
    "server": "HTTP server",
    "scheduler": "scheduling and KV cache",
    "parallel": "parallelism",
    "performance": "performance",
    "guards": "guards",
    "health": "health and watchdog",
    "admin": "admin API",
}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Every ServerArgs field as a `--flag`, in its group, with its default in the help."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(ServerArgs):
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
            g.add_argument(flag, action="store_true", default=default, help=help_text)
            continue
        g.add_argument(
            flag,
            type=_python_type(f.type),
            default=default,
            choices=meta.get("choices"),
            help=help_text,
        )


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    """The ServerArgs of a parsed namespace; a flag left unset takes its environment variable."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ServerArgs):
        value = getattr(ns, f.name)
        env = f.metadata.get("env")
        if value is None and env and os.environ.get(env):
            value = os.environ[env]
        kwargs[f.name] = value
    return ServerArgs(**kwargs)


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
