"""Guard policy presets: a TOML file of the flags that size and time the guards.

`safeserve plan --write-policy FILE` writes one (`write_policy`); `safeserve serve --guard-policy
FILE` reads one (`read_policy`, applied by `safeserve.config_cli.server_args_from`: flags given on
the command line win). The format is TOML, one table per `ServerArgs` flag group, keys the
`ServerArgs` field names, values scalars; a value left out (None) keeps the flag's default:

    # written by safeserve plan ...
    [scheduler]
    max_running_requests = 32
    chunked_prefill_size = 512

    [guards]
    dispatch_budget_tokens = 4096
    prefill_sizing = "observed"

`POLICY_FIELDS` is the one list of the keys a preset may hold; their table is the field's group
(`metadata["group"]` in `safeserve.config`). Every refusal is a `PolicyError` with one line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from pathlib import Path
from typing import Any

from safeserve.config import ConfigError, ServerArgs

# The flags a guard policy preset may set (ServerArgs field names), in the order they are written.
POLICY_FIELDS: tuple[str, ...] = (
    # scheduler: what runs at once, the step budget, the KV cache
    "max_running_requests",
    "max_num_batched_tokens",
    "chunked_prefill_size",
    "num_kv_blocks",
    "kv_cache_memory_gb",
    "mem_fraction_static",
    # guards: dispatch admission and prefill sizing
    "dispatch_budget_tokens",
    "dispatch_memory_gb",
    "prefill_sizing",
    # health: heartbeat and watchdog
    "heartbeat_interval_s",
    "watchdog_stall_timeout",
    "watchdog_slow_factor",
    "watchdog_slow_window_s",
    "canary_interval_s",
)

_FIELDS = {f.name: f for f in dataclasses.fields(ServerArgs)}


class PolicyError(ConfigError):
    """A preset that cannot be read, written or applied; one line naming the file."""


def policy_table(name: str) -> str:
    """The table of a policy key: its ServerArgs flag group."""
    return _FIELDS[name].metadata["group"]


def policy_tables() -> dict[str, list[str]]:
    """Every table a preset may hold and its keys, in writing order."""
    tables: dict[str, list[str]] = {}
    for name in POLICY_FIELDS:
        tables.setdefault(policy_table(name), []).append(name)
    return tables


def _kind(name: str) -> type:
    """The scalar type of a field (`int | None` -> int)."""
    text = str(_FIELDS[name].type).split("|")[0].strip()
    return {"int": int, "float": float, "str": str, "bool": bool}[text]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _checked(name: str, value: Any, where: str) -> Any:
    """The value of policy key `name` as ServerArgs holds it; PolicyError for a wrong type
    (an integer is taken for a float field; a float, a string or a boolean for an integer one
    is not)."""
    kind = _kind(name)
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }[kind]
    if not ok:
        want = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[kind]
        raise PolicyError(f"{where}: {name} must be {want} ({_flag(name)}), got {value!r}")
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise PolicyError(f"{where}: {name} must be a finite number, got {value!r}")
    choices = _FIELDS[name].metadata.get("choices")
    if choices and value not in choices:
        raise PolicyError(f"{where}: {name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _validated(values: dict[str, Any], where: str) -> None:
    """ServerArgs' own checks of the preset's values (every other flag at its default); the
    message names the key at fault where one alone is refused."""
    try:
        ServerArgs(**values)
    except ConfigError as e:
        for name, value in values.items():
            try:
                ServerArgs(**{name: value})
            except ConfigError as alone:
                table = policy_table(name)
                raise PolicyError(f"{where}: [{table}] {name} = {value!r}: {alone}") from None
        raise PolicyError(f"{where}: {e}") from None


def check_policy(values: dict[str, Any], where: str = "guard policy") -> dict[str, Any]:
    """The values, type-checked and validated, None dropped; PolicyError naming `where`."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in POLICY_FIELDS:
            raise PolicyError(
                f"{where}: {name!r} is not a guard policy key; allowed: {', '.join(POLICY_FIELDS)}"
            )
        if value is not None:
            out[name] = _checked(name, value, where)
    _validated(out, where)
    return out


def read_policy(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The flags a preset sets (ServerArgs field names -> values); PolicyError (one line naming
    the file) for a missing or unreadable file, a TOML syntax error, an unknown table or key, a
    key in the wrong table, a value of the wrong type or one the flag's checks refuse."""
    where = f"guard policy {path}"
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        raise PolicyError(f"{where}: no such file") from None
    except OSError as e:
        raise PolicyError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        doc = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise PolicyError(f"{where}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{where}: invalid TOML: {e}") from None
    tables = policy_tables()
    values: dict[str, Any] = {}
    for table, body in doc.items():
        if not isinstance(body, dict):
            if table in POLICY_FIELDS:
                raise PolicyError(
                    f"{where}: {table} is outside a table; put it under [{policy_table(table)}]"
                )
            raise PolicyError(
                f"{where}: {table!r} is not a table; the tables are {', '.join(tables)}"
            )
        if table not in tables:
            raise PolicyError(
                f"{where}: unknown table [{table}]; the tables are {', '.join(tables)}"
            )
        for name, value in body.items():
            if name not in tables[table]:
                if name in POLICY_FIELDS:
                    raise PolicyError(
                        f"{where}: {name} belongs in [{policy_table(name)}], not [{table}]"
                    )
                raise PolicyError(
                    f"{where}: unknown key {name!r} in [{table}]; [{table}] takes "
                    f"{', '.join(tables[table])}"
                )
            values[name] = _checked(name, value, f"{where}: [{table}]")
    _validated(values, where)
    return values


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # always with a '.' or an exponent: read back as a float
    return _toml_string(value)


def _toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def format_policy(values: dict[str, Any], header: list[str] | tuple[str, ...] = ()) -> str:
    """The text of a preset: `header` as `#` comments, then one table per flag group (keys in
    `POLICY_FIELDS` order; None values left out). PolicyError for a value `read_policy` would
    refuse."""
    checked = check_policy(values)
    lines = [f"# {part}".rstrip() for line in header for part in str(line).splitlines() or [""]]
    for table, names in policy_tables().items():
        present = [n for n in names if n in checked]
        if not present:
            continue
        if lines:
            lines.append("")
        lines.append(f"[{table}]")
        lines.extend(f"{n} = {_toml_value(checked[n])}" for n in present)
    return "\n".join(lines) + "\n"


def write_policy(
    path: str | os.PathLike[str],
    values: dict[str, Any],
    header: list[str] | tuple[str, ...] = (),
) -> None:
    """Writes the preset `read_policy(path)` reads back as `values` (None values left out);
    `header` lines become `#` comments at the top (how the preset was made). PolicyError for a
    value it would refuse, before anything is written; the file is replaced in one step."""
    text = format_policy(values, header)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PolicyError(f"guard policy {path}: cannot write it ({e.strerror or e})") from None
