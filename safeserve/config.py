"""Every flag of safeserve, its default and its checks, in one place.

`ServerArgs` is the single source of truth: the CLI builds its argparse parser from the dataclass
fields (their `metadata` holds help text, group and choices), and every process receives the same
validated instance.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
A2A_BACKENDS = ("none", "alltoall", "deepep")
TINY_MODEL = "tiny"


class ConfigError(ValueError):
    """An invalid flag or layout; the message is one line meant for the operator."""


def _flag(default: Any, help: str, group: str, **extra: Any) -> Any:
    meta = {"help": help, "group": group, **extra}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ServerArgs:
    # -- model ---------------------------------------------------------------------------------
    model: str = _flag(
        TINY_MODEL,
        "Model to serve: 'tiny' (built-in tiny Qwen3-MoE, no files needed) or a local Hugging Face "
        "checkpoint directory (config.json, safetensors, tokenizer.json).",
        "model",
    )
    served_model_name: str | None = _flag(
        None,
        "Model name reported by /v1/models and accepted in requests (default: --model).",
        "model",
    )
    load_format: str = _flag(
        "auto",
        "'auto' reads safetensors; 'dummy' builds the model of config.json with random weights.",
        "model",
        choices=LOAD_FORMATS,
    )
    dtype: str = _flag("float32", "Weight and activation dtype.", "model", choices=DTYPES)
    device: str = _flag("cpu", "Device the ranks run on.", "model", choices=DEVICES)
    max_model_len: int | None = _flag(
        None,
        "Context length (prompt + generated tokens); default: the model's max_position_embeddings.",
        "model",
    )
    seed: int = _flag(0, "Seed for dummy/tiny weights and for requests that give no seed.", "model")

    # -- server --------------------------------------------------------------------------------
    host: str = _flag("127.0.0.1", "Address the HTTP server binds.", "server")
    port: int = _flag(8000, "Port of the HTTP server.", "server")
    api_key: str | None = _flag(
        None, "Bearer token required on /v1/* (no key: open).", "server", env="SAFESERVE_API_KEY"
    )
    max_request_body_bytes: int = _flag(
        1 << 20, "Largest accepted request body; larger bodies get 413.", "server"
    )
    log_level: str = _flag(
        "info", "Log level.", "server", choices=("debug", "info", "warning", "error")
    )
    startup_timeout_s: float = _flag(
        600.0, "Give up (exit non-zero) if the model is not loaded and warm after this.", "server"
    )

    # -- scheduling and KV cache ---------------------------------------------------------------
    max_running_requests: int = _flag(64, "Most requests decoding at once.", "scheduler")
    max_num_batched_tokens: int = _flag(
        2048, "Token budget of one engine step (prefill chunks + decode tokens).", "scheduler"
    )
    chunked_prefill_size: int | None = _flag(
        None,
        "Most prompt tokens of one request computed in one step (default: the step budget).",
        "scheduler",
    )
    block_size: int = _flag(16, "Tokens per KV-cache block.", "scheduler")
    num_kv_blocks: int | None = _flag(
        None,
        "KV-cache blocks per rank (default: from --kv-cache-memory-gb on CPU, from free device "
        "memory and --mem-fraction-static on GPU).",
        "scheduler",
    )
    kv_cache_memory_gb: float = _flag(1.0, "KV-cache memory per rank on CPU, in GiB.", "scheduler")
    mem_fraction_static: float = _flag(
        0.85, "Share of device memory for weights + KV cache on GPU.", "scheduler"
    )

    # -- parallelism ---------------------------------------------------------------------------
    tp_size: int = _flag(1, "Tensor-parallel size of a group (ranks per group).", "parallel")
    ep_size: int = _flag(
        1, "Expert-parallel size; forced to --tp-size by all-to-all backends.", "parallel"
    )
    moe_a2a_backend: str = _flag(
        "none", "How tokens reach their experts.", "parallel", choices=A2A_BACKENDS
    )
    enable_dp_attention: bool = _flag(
        False, "Each rank runs attention for its own requests.", "parallel"
    )

    # -- health --------------------------------------------------------------------------------
    heartbeat_interval_s: float = _flag(
        0.5, "Heartbeat period of an idle rank (busy ranks beat at every phase).", "health"
    )

    def __post_init__(self) -> None:
        self.validate()

    # The checks raise ConfigError with one line; the CLI prints it and exits 2 before spawning.
    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}")
        if self.moe_a2a_backend not in A2A_BACKENDS:
            raise ConfigError(f"--moe-a2a-backend must be one of {', '.join(A2A_BACKENDS)}")
        for name in (
            "max_running_requests",
            "max_num_batched_tokens",
            "block_size",
            "tp_size",
            "ep_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ConfigError("--chunked-prefill-size must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("--num-kv-blocks must be at least 2")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len must be at least 2")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ConfigError("--mem-fraction-static must be in (0, 1]")
        if self.max_request_body_bytes < 1024:
            raise ConfigError("--max-request-body-bytes must be at least 1024")
        if self.moe_a2a_backend == "deepep":
            raise ConfigError("--moe-a2a-backend deepep is not available yet; use none or alltoall")
        self._apply_layout_rules()

    def _apply_layout_rules(self) -> None:
        """Peer semantics (REFERENCE.md section 1): an all-to-all backend spans the TP group."""
        if self.ep_size > self.tp_size:
            raise ConfigError(f"--ep-size {self.ep_size} cannot exceed --tp-size {self.tp_size}")
        if self.moe_a2a_backend != "none" and self.ep_size != self.tp_size:
            logger.info(
                "The expert parallel size is adjusted to the tensor parallel size: ep_size %d -> %d "
                "(--moe-a2a-backend %s spans the whole TP group)",
                self.ep_size,
                self.tp_size,
                self.moe_a2a_backend,
            )
            self.ep_size = self.tp_size
        if self.tp_size % self.ep_size:
            raise ConfigError(f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size}")
        if self.enable_dp_attention and self.tp_size < 2:
            raise ConfigError("--enable-dp-attention needs --tp-size of at least 2")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def prefill_chunk(self) -> int:
        chunk = self.chunked_prefill_size or self.max_num_batched_tokens
        return min(chunk, self.max_num_batched_tokens)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d.get("api_key"):
            d["api_key"] = "***"
        return d

    # -- argparse ------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        groups: dict[str, argparse._ArgumentGroup] = {}
        titles = {
            "model": "model",
            "server": "HTTP server",
            "scheduler": "scheduling and KV cache",
            "parallel": "parallelism",
            "health": "health",
        }
        for f in dataclasses.fields(cls):
            meta = f.metadata
            gname = meta["group"]
            if gname not in groups:
                groups[gname] = parser.add_argument_group(titles.get(gname, gname))
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
            typ = _python_type(f.type)
            g.add_argument(
                flag, type=typ, default=default, choices=meta.get("choices"), help=help_text
            )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        import os

        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = getattr(ns, f.name)
            env = f.metadata.get("env")
            if value is None and env and os.environ.get(env):
                value = os.environ[env]
            kwargs[f.name] = value
        return cls(**kwargs)


def _python_type(annotation: Any) -> type:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str
