"""What comes in through the front door, checked before the protocol models see it: the media
type of a body, JSON nesting, constants that JSON does not have (`NaN`, `Infinity`), and strings
that are not Unicode text (a lone UTF-16 surrogate such as `"\\ud800"`, which no tokenizer can
encode). Each is one 4xx in the OpenAI error shape, never a 500.
"""

from __future__ import annotations

import json
import re
from typing import Any

from safeserve.server.errors import APIError, bad_request

# Deepest nesting of arrays and objects a request body may have. The deepest real request
# (chat content parts, tool schemas) is far shallower; the limit is checked on the raw bytes,
# without recursion, before the JSON parser (which recurses) sees the body.
MAX_JSON_DEPTH = 64

JSON_MEDIA_TYPE = "application/json"

# A JSON string (escapes included) and the bracket bytes outside strings.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKET = re.compile(rb"[\[\]{}]")


def check_content_type(value: str | None) -> None:
    """415 unless the body is declared `application/json` (parameters such as `charset` pass)."""
    media = (value or "").split(";", 1)[0].strip().lower()
    if media != JSON_MEDIA_TYPE:
        got = f"got {value!r}" if value else "none was sent"
        raise APIError(
            415,
            f"Content-Type must be {JSON_MEDIA_TYPE} ({got})",
            "unsupported_media_type",
            "Content-Type",
        )


def json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a JSON text's arrays and objects, counted up to `limit + 1`."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', raw)):
        if m.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        else:
            depth -= 1
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (JSON has no NaN or Infinity)")


def decode_json(raw: bytes) -> Any:
    """A request body as JSON, or one 400: malformed, too deep, a NaN or Infinity, a string
    that is not Unicode text."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise bad_request(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError as e:  # not reached below the depth limit; kept as a backstop
        raise bad_request("the JSON body is nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a NaN, a 5,000-digit number
        raise bad_request(f"malformed JSON body: {e}") from e
    check_text(body)
    return body


def user_path(parts: list[str | int]) -> str:
    """`["messages", 0, "content"]` -> `messages[0].content`."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def check_text(node: Any, path: list[str | int] | None = None) -> None:
    """400 naming the field when a string (key or value) cannot be encoded as UTF-8."""
    path = path or []
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError as e:
            where = user_path(path) or "body"
            raise bad_request(
                f"{where}: not valid Unicode text (a lone surrogate "
                f"{node[e.start]!r} at character {e.start})",
                user_path(path) or None,
            ) from None
    elif isinstance(node, dict):
        for k, v in node.items():
            check_text(k, path)
            check_text(v, [*path, k])
    elif isinstance(node, list):
        for i, v in enumerate(node):
            check_text(v, [*path, i])
