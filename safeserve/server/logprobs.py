"""Log-probabilities as the OpenAI API spells them: the legacy completions object
(`tokens`, `token_logprobs`, `top_logprobs` as `{token: logprob}`, `text_offset`, with `echo`
the prompt's entries first, the first one null) and chat's `{"content": [{token, logprob, bytes,
top_logprobs}]}`.

With `--enable-deterministic-inference` on CUDA each position also carries a digest of its
whole logits row (`logits_digests` beside `tokens`; `logits_digest` in a chat entry): two
answers with equal digests had equal logits, to the bit.

A token's text is its decoded bytes; a token that is not valid UTF-8 on its own (one byte of a
multi-byte character) is spelt `bytes:\\xNN...`, as OpenAI and vLLM do, so that two such tokens
never share a key of a `top_logprobs` dict.
"""

from __future__ import annotations

import math
from typing import Any

from safeserve.messages import TokenLogprob
from safeserve.model.tokenizer import Tokenizer

# What a logprob of -inf (a token of probability 0) or NaN is written as: JSON has neither, and
# an answer must stay valid JSON (vLLM writes the same number).
FLOOR_LOGPROB = -9999.0
# With --enable-deterministic-inference on CUDA, each position's logits digest (16 hex digits of
# a hash of its whole float32 logits row; null for the prompt's first token): completions'
# `logprobs` get a list beside `tokens`, chat's content entries one key each. Equal digests are
# equal logits, to the bit.
DIGESTS = "logits_digests"
DIGEST = "logits_digest"


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


def token_text(tok: Tokenizer, token_id: int) -> str:
    raw = tok.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class CompletionLogprobs:
    """The legacy `choice.logprobs` of a completion, built a stream chunk at a time
    (`text_offset` goes on from the text already sent)."""

    def __init__(self, tok: Tokenizer, top_n: int, offset: int = 0) -> None:
        self.tok = tok
        self.top_n = top_n
        self.offset = offset

    def entries(self, token_ids: list[int], logprobs: list[TokenLogprob | None] | None) -> dict:
        """One entry per token; `logprobs` None (or an entry None: the prompt's first token)
        gives null logprobs there."""
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        digests: list[str | None] = []
        for i, tid in enumerate(token_ids):
            lp = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            text = token_text(self.tok, tid)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(self.tok.decode([tid]))
            digests.append(None if lp is None else lp.digest)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite(lp.logprob))
            top: dict[str, float] = {}
            # The sampled token is always there (lm-eval's greedy check compares it with the
            # dict's maximum), with the n most likely; a text two tokens share keeps the larger.
            for t, v in [*lp.top[: self.top_n], (lp.token_id, lp.logprob)]:
                key = token_text(self.tok, t)
                top[key] = max(finite(v), top.get(key, FLOOR_LOGPROB))
            out["top_logprobs"].append(top)
        if any(d is not None for d in digests):
            out[DIGESTS] = digests
        return out


def merge_completion_logprobs(parts: list[dict]) -> dict:
    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for p in parts:
        for k in merged:
            merged[k].extend(p[k])
    if any(DIGESTS in p for p in parts):
        merged[DIGESTS] = [d for p in parts for d in p.get(DIGESTS, [None] * len(p["tokens"]))]
    return merged


def chat_logprobs(
    tok: Tokenizer, top_n: int, token_ids: list[int], logprobs: list[TokenLogprob] | None
) -> dict:
    """Chat's `choice.logprobs` (or a chunk's) for these tokens."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tok.token_bytes(token_id)
        text = token_text(tok, token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(raw)}

    content = []
    for i, tid in enumerate(token_ids):
        if logprobs is None or i >= len(logprobs):
            break
        lp = logprobs[i]
        entry = one(tid, lp.logprob)
        entry["top_logprobs"] = [one(t, v) for t, v in lp.top[:top_n]]
        if lp.digest is not None:
            entry[DIGEST] = lp.digest
        content.append(entry)
    return {"content": content, "refusal": None}
