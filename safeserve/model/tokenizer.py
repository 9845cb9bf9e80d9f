"""Tokenizers: Hugging Face `tokenizer.json` files, and the built-in byte-level one of `tiny`.

Both render chat messages with a Jinja chat template (from `tokenizer_config.json` or
`chat_template.jinja`, as transformers writes them), in a sandboxed environment.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)


class TokenizerError(ValueError):
    pass


class Tokenizer(Protocol):
    eos_token_ids: list[int]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str: ...


def _raise(message: str) -> None:
    raise TokenizerError(message)


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        self.template = env.from_string(source)
        self.special = special

    def render(self, messages: list[dict[str, Any]]) -> str:
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, tools=None, **self.special
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from e


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    """A `tokenizer.json` read with the `tokenizers` library."""

    def __init__(self, model_dir: str | Path, config_eos_ids: list[int] | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"no tokenizer.json in {model_dir}")
        self._tok = RustTokenizer.from_file(str(path))
        tc_path = model_dir / "tokenizer_config.json"
        tc: dict[str, Any] = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        self.bos_token = _token_text(tc.get("bos_token"))
        self.eos_token = _token_text(tc.get("eos_token"))
        template = tc.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.exists():
            template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = (
            ChatTemplate(template, {"bos_token": self.bos_token, "eos_token": self.eos_token})
            if template
            else None
        )
        eos_ids: list[int] = list(config_eos_ids or [])
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            for i in [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or []):
                if i not in eos_ids:
                    eos_ids.append(i)
        if self.eos_token is not None:
            eos_id = self._tok.token_to_id(self.eos_token)
            if eos_id is not None and eos_id not in eos_ids:
                eos_ids.append(eos_id)
        self.eos_token_ids = eos_ids
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special = {t.content for t in self._tok.get_added_tokens_decoder().values()}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # As transformers does: the tokenizer's post-processor adds BOS etc. for plain prompts;
        # a rendered chat template already holds its special tokens. A batch of one: unlike
        # `encode`, `encode_batch` lets go of the GIL, so a long prompt encoded on a worker
        # thread leaves the server's event loop running (same ids).
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text), for logprobs."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if m := _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece byte fallback: <0xE2>
            return bytes([int(m.group(1), 16)])
        if piece in self._special or not all(c in _UNICODE_TO_BYTE for c in piece):
            return self._tok.decode([token_id], skip_special_tokens=False).encode()
        return bytes(_UNICODE_TO_BYTE[c] for c in piece)  # byte-level BPE (GPT-2, Qwen)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; use /v1/completions")
        return self.chat_template.render(messages)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


BYTE_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")

BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; three special tokens follow. Used by the tiny model."""

    SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self) -> None:
        self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIAL)}
        self.vocab_size = 256 + len(self.SPECIAL)
        self.eos_token_ids = [self.special_ids["<|endoftext|>"], self.special_ids["<|im_end|>"]]
        self.chat_template = ChatTemplate(
            BYTE_CHAT_TEMPLATE, {"bos_token": None, "eos_token": None}
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        pos = 0
        while pos < len(text):
            nxt = min(
                ((text.find(s, pos), s) for s in self.SPECIAL if text.find(s, pos) >= 0),
                default=(-1, ""),
            )
            end = nxt[0] if nxt[0] >= 0 else len(text)
            ids.extend(text[pos:end].encode("utf-8"))
            if nxt[0] < 0:
                break
            ids.append(self.special_ids[nxt[1]])
            pos = end + len(nxt[1])
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        k = token_id - 256
        return self.SPECIAL[k].encode() if k < len(self.SPECIAL) else b""

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return self.chat_template.render(messages)


def load_tokenizer(
    model: str, config_eos_ids: list[int] | None = None, allow_byte_fallback: bool = False
) -> Tokenizer:
    """`allow_byte_fallback`: a config-only directory (`--load-format dummy`) gets the byte-level
    tokenizer, so benchmarks can run from a `config.json` alone."""
    from safeserve.config import TINY_MODEL

    if model == TINY_MODEL:
        return ByteTokenizer()
    if allow_byte_fallback and not (Path(model) / "tokenizer.json").exists():
        logger.warning("no tokenizer.json in %s: using the byte-level tokenizer", model)
        return ByteTokenizer()
    return HFTokenizer(model, config_eos_ids)


# What `safeserve tokenizer` writes: the files transformers' AutoTokenizer reads.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def export_tokenizer(model: str, out: str | Path) -> list[Path]:
    """Writes `model`'s tokenizer into `out` as Hugging Face clients load it
    (`AutoTokenizer.from_pretrained(out)` encodes and decodes as the server does): `tiny`'s
    byte-level one built as a `tokenizers` file, a checkpoint's copied. Returns the files."""
    import shutil

    from safeserve.config import TINY_MODEL

    out = Path(out)
    if model != TINY_MODEL:
        src = Path(model)
        if not (src / "tokenizer.json").is_file():
            raise TokenizerError(
                f"{model}: no tokenizer.json to export (a model directory with one, or 'tiny')"
            )
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                written.append(Path(shutil.copyfile(src / name, out / name)))
        return written
    return _export_byte_tokenizer(out)


def _export_byte_tokenizer(out: Path) -> list[Path]:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    # Bytes are tokens 0..255 as GPT-2's byte-level alphabet spells them; no merges, so every
    # byte stays one token; the special tokens follow as 256.. and match before the bytes do.
    vocab = {BYTE_TO_UNICODE[b]: b for b in range(256)}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ByteTokenizer.SPECIAL
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    eos, pad = "<|im_end|>", "<|endoftext|>"
    special_map = {"eos_token": eos, "pad_token": pad, "bos_token": None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "additional_special_tokens": list(specials),
        "chat_template": BYTE_CHAT_TEMPLATE,
    }
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    tok.save(str(paths[0]))
    paths[1].write_text(json.dumps(config, indent=2) + "\n")
    special = {k: v for k, v in special_map.items() if v is not None}
    paths[2].write_text(
        json.dumps({**special, "additional_special_tokens": list(specials)}, indent=2) + "\n"
    )
    return paths
