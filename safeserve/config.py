"""Every flag of safeserve, its default and its checks, in one place.

`ServerArgs` is the single source of truth: the CLI builds its argparse parser from the dataclass
fields (their `metadata` holds help text, group and choices; `safeserve.config_cli`), and every
process receives the same validated instance.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("fp8",)
# `fp8` is `safeserve plan`'s spelling of the same cache; it is taken as `fp8_e4m3`.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")
A2A_BACKENDS = ("none", "alltoall", "deepep")
PLACEMENTS = ("local", "remote")
TINY_MODEL = "tiny"
PREFILL_SIZINGS = ("worst", "observed")
BALANCEDNESS_REPORT_MODES = ("off", "log", "prometheus", "both")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# When a step runs as two micro-batches (engine/overlap.py implements it); --help,
# GET /admin/config and the docs show this sentence.
TBO_RULE = (
    "A step runs split only if every attention rank holding tokens can split its own batch: a "
    "pure decode batch at half its sequences, with at least --tbo-min-decode-batch sequences on "
    "each rank; a prefill or mixed batch at the sequence boundary with the most balanced token "
    "sums, or, where the smaller side would hold less than --tbo-token-distribution-threshold of "
    "the tokens, at half its tokens with one sequence split across the two halves; a rank with "
    "one token, a step a CUDA decode graph runs, and a group of one rank run whole."
)


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
    quantization: str | None = _flag(
        None,
        "'fp8': quantize a high-precision checkpoint (or dummy weights) at load to block FP8, "
        "128x128 tiles with a float32 scale each; a checkpoint already in FP8 needs no flag.",
        "model",
        choices=QUANTIZATIONS,
    )
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
    graceful_shutdown_s: float = _flag(
        5.0, "On SIGTERM/Ctrl-C, wait this long for open requests before closing them.", "server"
    )
    startup_timeout_s: float = _flag(
        600.0, "Give up (exit non-zero) if the model is not loaded and warm after this.", "server"
    )

    # -- scheduling and KV cache ---------------------------------------------------------------
    max_running_requests: int = _flag(64, "Most requests decoding at once.", "scheduler")
    max_queued_requests: int = _flag(
        0,
        "Most requests waiting for a decode slot on the READY groups together; a new request "
        "beyond them gets 503 with Retry-After (0: no limit).",
        "scheduler",
    )
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
    kv_cache_dtype: str = _flag(
        "auto",
        "'auto': the KV cache in --dtype; 'fp8_e4m3' (or 'fp8'): float8_e4m3fn, one byte per "
        "element (twice the tokens of bfloat16 in the same memory), stored with a scale of 1 "
        "per layer, values clamped to +-448. Not for latent (MLA) caches.",
        "scheduler",
        choices=KV_CACHE_DTYPES,
    )
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

    # -- overlap -------------------------------------------------------------------------------
    enable_two_batch_overlap: bool = _flag(
        False,
        "Two-batch overlap: a step's tokens run as two micro-batches, one's attention and router "
        "while the other's dispatch or combine is in flight; each micro-batch gets half the "
        "dispatch receive budget. Needs --moe-a2a-backend alltoall or --enable-dp-attention. "
        + TBO_RULE,
        "overlap",
    )
    tbo_token_distribution_threshold: float = _flag(
        0.48,
        "Prefill split: the sequence boundary with the most balanced token sums, unless its "
        "smaller side holds less than this share of the tokens; then the step is cut at half "
        "its tokens, one sequence split across the micro-batches. In (0, 0.5].",
        "overlap",
    )
    tbo_min_decode_batch: int = _flag(
        64,
        "Pure decode steps with fewer sequences than this on an attention rank run whole (a "
        "small decode batch's split costs more than it hides; the default follows peers' "
        "published measurements, ours is pending).",
        "overlap",
    )
    enable_single_batch_overlap: bool = _flag(
        False,
        "Single-batch overlap: the shared experts of a micro-batch run while its routed experts' "
        "combine is in flight (families with shared experts only).",
        "overlap",
    )

    # -- expert-parallel load balancing -------------------------------------------------------
    enable_eplb: bool = _flag(
        False,
        "Rebalance the expert placement from the recorded routing every "
        "--eplb-rebalance-num-iterations passes, moving expert weights between the group's ranks "
        "a chunk of layers per pass. Needs --ep-size equal to --tp-size, at least 2.",
        "eplb",
    )
    ep_num_redundant_experts: int = _flag(
        0,
        "Extra physical expert slots per MoE layer (over the group's EP ranks), each holding a "
        "replica of a heavily used expert; logical + redundant must divide over --ep-size.",
        "eplb",
    )
    eplb_rebalance_num_iterations: int = _flag(
        1000, "Forward passes between two rebalance checks.", "eplb"
    )
    eplb_rebalance_layers_per_chunk: int = _flag(
        1,
        "MoE layers whose expert weights move in one pass of a rebalance (the rest move in the "
        "passes that follow, so no single step carries the whole move).",
        "eplb",
    )
    eplb_min_rebalancing_utilization_threshold: float = _flag(
        1.0,
        "A rebalance check moves nothing when the balancedness of the passes since the last "
        "check is above this (in (0, 1]; 1.0: always rebalance).",
        "eplb",
    )
    init_expert_location: str = _flag(
        "trivial",
        "Starting expert placement: 'trivial' (experts in contiguous blocks per EP rank, redundant "
        "slots replicating experts 0, 1, ...), or a file: a dumped expert distribution "
        "(POST /admin/expert_distribution/dump), placed by the EPLB algorithm, or a "
        "physical-to-logical map (GET /admin/eplb/map).",
        "eplb",
    )
    expert_balancedness_report_mode: str = _flag(
        "prometheus",
        "Where the expert-load balancedness goes: off, log (one line per rebalance check and every "
        "--eplb-rebalance-num-iterations passes), prometheus (safeserve:eplb_balancedness), both.",
        "eplb",
        choices=BALANCEDNESS_REPORT_MODES,
    )

    # -- performance ---------------------------------------------------------------------------
    cuda_graph_max_bs: int = _flag(
        64,
        "Largest decode batch run as a CUDA graph (graphs are captured at start-up for batch "
        "sizes 1, 2, 4, 8, 16, ... up to this; larger batches run as piecewise graphs up to "
        "--cuda-graph-max-tokens, eagerly beyond). Every layout: inside a graph "
        "--moe-a2a-backend alltoall dispatches as none does, and with --enable-dp-attention "
        "every rank replays the bucket of the rank with the most sequences.",
        "performance",
    )
    cuda_graph_max_tokens: int = _flag(
        2048,
        "Largest prefill or mixed step (in tokens, at most --max-num-batched-tokens) run as "
        "piecewise CUDA graphs: everything but attention is captured at start-up for steps of "
        "16, 32, ..., 256 tokens, then every 128 up to 1024 and every 256 beyond, up to this; "
        "attention runs eagerly between the pieces. Larger steps run eagerly; 0 turns them off. "
        "The same groups as --cuda-graph-max-bs.",
        "performance",
    )
    disable_cuda_graph: bool = _flag(
        False,
        "Run every step eagerly, without CUDA graphs (decode and piecewise).",
        "performance",
    )
    enable_deterministic_inference: bool = _flag(
        False,
        "Batch-invariant kernels on CUDA: a request's logits do not depend on what else is in "
        "the step, on its split between prefill and decode, or on a CUDA graph's padding, and "
        "a prompt's prefill computes every token as the decode step that produced it did, so a "
        "migrated request continues exactly. Requests without a seed get one, kept across "
        "migrations. Groups of one rank; families with grouped-query attention.",
        "performance",
    )
    disable_pdl: bool = _flag(
        False,
        "Launch the Triton kernels as ordinary launches, not as programmatic dependent launches "
        "(Hopper and newer: each kernel's programs are scheduled while the kernel before it "
        "finishes, then wait for it).",
        "performance",
    )

    # -- groups --------------------------------------------------------------------------------
    num_groups: int = _flag(
        1,
        "Independent EP groups serving the model (each --tp-size ranks); the unit of failure.",
        "groups",
    )
    devices: str | None = _flag(
        None,
        "Comma-separated CUDA device ids, group after group (default: g*tp .. g*tp+tp-1).",
        "groups",
    )
    crash_loop_failures: int = _flag(
        3, "A group failing this many times within --crash-loop-window-s stays FAILED.", "groups"
    )
    crash_loop_window_s: float = _flag(300.0, "Window of the crash-loop rule.", "groups")
    restart_backoff_s: float = _flag(
        1.0, "Wait before restarting a failed group; doubles per failure in the window.", "groups"
    )
    max_request_attempts: int = _flag(
        3, "Attempts per request, the first included (migrations after a group fails).", "groups"
    )
    migration_wait_s: float = _flag(
        60.0, "How long a migrating request waits for a READY group per attempt.", "groups"
    )
    exit_on_no_groups: bool = _flag(
        False, "Exit non-zero when every group is FAILED for good (crash loop).", "groups"
    )
    quarantine_s: float = _flag(
        600.0,
        "Query of death: a request in flight on a group when it failed migrates onto a group "
        "holding no other such suspect on probation (until its first token there); if that "
        "group fails during its probation it is answered 422 request_quarantined and identical "
        "requests (same prompt and sampling) are refused at admission for this long. 0 turns "
        "the rule off (requests migrate up to --max-request-attempts).",
        "groups",
    )

    # -- guards --------------------------------------------------------------------------------
    dispatch_budget_tokens: int | None = _flag(
        None,
        "Rows a rank may receive in one dispatch round (admission); the buffers are "
        "preallocated at that size. Default: from memory left after weights and KV cache; "
        "0 turns admission off.",
        "guards",
    )
    dispatch_memory_gb: float = _flag(
        0.25, "Memory per rank for dispatch buffers on CPU, in GiB (default budget).", "guards"
    )
    prefill_sizing: str = _flag(
        "worst",
        "Step/chunk size per attention group: 'worst' fits every group's tokens on one rank; "
        "'observed' fits the measured imbalance, admission rounds as the net.",
        "guards",
        choices=PREFILL_SIZINGS,
    )
    guard_policy: str | None = _flag(
        None,
        "Guard policy preset: a TOML file of guard, scheduler and watchdog flags (as `safeserve "
        "plan --write-policy` writes; format in guards/README.md). Its values fill every flag not "
        "given on the command line (flags given win); one INFO line lists what it set.",
        "guards",
    )

    # -- health --------------------------------------------------------------------------------
    heartbeat_interval_s: float = _flag(0.25, "Period of every rank's heartbeat.", "health")
    watchdog_stall_timeout: float = _flag(
        10.0,
        "A group whose progress stopped this long is 'stalled' and fenced (killed).",
        "health",
    )
    watchdog_slow_factor: float = _flag(
        4.0, "'slow': a rank's own step time above this many times the group median.", "health"
    )
    canary_interval_s: float = _flag(
        0.0,
        "Every this many seconds each READY group answers a short fixed greedy prompt through "
        "the serving path; tokens other than its first answer's are a 'corrupt' verdict that "
        "fences the group (a GPU computing wrong results). 0: off.",
        "health",
    )
    watchdog_slow_window_s: float = _flag(
        3.0, "'slow' must hold this long (sustained) before it is reported.", "health"
    )

    # -- node agents (groups on other hosts) ---------------------------------------------------
    placement: str = _flag(
        "local",
        "'local': the frontend spawns every group's ranks on this host. 'remote': node agents "
        "(`safeserve node`) connect to --node-host:--node-port, and the frontend places each "
        "group's ranks on their devices (a group may span agents).",
        "nodes",
        choices=PLACEMENTS,
    )
    node_host: str = _flag(
        "127.0.0.1", "Address the node agents' port binds (--placement remote).", "nodes"
    )
    node_port: int = _flag(8002, "Port node agents connect to (--placement remote).", "nodes")
    curve_keys_dir: str | None = _flag(
        None,
        "Directory of CurveZMQ keys (`safeserve keys DIR` writes one): the frontend's key pair "
        "and authorized/ (the node agents' public keys). Required with --placement remote "
        "unless --insecure-nodes.",
        "nodes",
        env="SAFESERVE_CURVE_KEYS_DIR",
    )
    insecure_nodes: bool = _flag(
        False,
        "Let node agents connect without CurveZMQ keys (anyone who reaches --node-port can run "
        "ranks and read traffic; a warning says so). For trusted test networks only.",
        "nodes",
    )
    node_lease_s: float = _flag(
        3.0,
        "A node agent's lease: a node not heard from for this long is lost (its groups are "
        "fenced and their requests move on); the agent stops its ranks at the same deadline. "
        "A dropped connection is noticed within two beats.",
        "nodes",
    )
    node_wait_s: float = _flag(
        120.0,
        "How long a group start waits for node agents with free devices (--placement remote).",
        "nodes",
    )
    nnodes: int | None = _flag(
        None,
        "Each group spans exactly this many node agents, --tp-size / N ranks on each: the agents "
        "of one set (`safeserve node --node-set`, by default their --dist-init-addr) with "
        "--node-rank 0..N-1, the group's k-th block of ranks on node-rank k, so its rank 0 (the "
        "leader, and the rendezvous) is on node-rank 0. Default: each group on one agent where "
        "one has room, else spread over the agents with the most free devices; 1: always on one "
        "agent. More than 1 needs --placement remote.",
        "nodes",
    )

    # -- admin ---------------------------------------------------------------------------------
    admin_host: str = _flag(
        "127.0.0.1", "Address the admin API binds (loopback unless told otherwise).", "admin"
    )
    admin_port: int | None = _flag(None, "Port of the admin API (default: --port + 1).", "admin")
    admin_api_key: str | None = _flag(
        None,
        "Bearer token required on /admin/* (required when --admin-host is not loopback).",
        "admin",
        env="SAFESERVE_ADMIN_API_KEY",
    )
    fault_fail_start_group: int | None = _flag(
        None,
        "Fault injection: the ranks of this group fail at start-up (crash-loop tests).",
        "admin",
    )
    enable_fault_injection: bool = _flag(
        False,
        "Expose POST /admin/faults (route skew, slow rank) for tests and chaos runs.",
        "admin",
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
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
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
        if self.cuda_graph_max_bs < 1:
            raise ConfigError("--cuda-graph-max-bs must be at least 1")
        if self.max_queued_requests < 0:
            raise ConfigError("--max-queued-requests must be 0 (no limit) or positive")
        if self.cuda_graph_max_tokens < 0:
            raise ConfigError("--cuda-graph-max-tokens must be 0 (off) or positive")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ConfigError("--chunked-prefill-size must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("--num-kv-blocks must be at least 2")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len must be at least 2")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ConfigError("--mem-fraction-static must be in (0, 1]")
        for name in ("kv_cache_memory_gb", "dispatch_memory_gb", "watchdog_slow_factor"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if not self.watchdog_slow_window_s >= 0:
            raise ConfigError("--watchdog-slow-window-s must be >= 0")
        if self.enable_deterministic_inference and self.tp_size > 1:
            raise ConfigError(
                "--enable-deterministic-inference runs groups of one rank for now (--tp-size 1): "
                "the collectives' reduction order follows the message size"
            )
        if not self.canary_interval_s >= 0:
            raise ConfigError("--canary-interval-s must be >= 0 (0: off)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if not 0 <= self.admin_port_effective <= 65535:
            raise ConfigError(
                f"--admin-port must be in 0..65535, got {self.admin_port_effective} (its default "
                "is --port + 1)"
            )
        if self.admin_port_effective == self.port != 0 and self.admin_host == self.host:
            raise ConfigError("--admin-port must differ from --port")
        if self.max_request_body_bytes < 1024:
            raise ConfigError("--max-request-body-bytes must be at least 1024")
        if self.dispatch_budget_tokens is not None and self.dispatch_budget_tokens < 0:
            raise ConfigError("--dispatch-budget-tokens must be 0 (off) or positive")
        if self.prefill_sizing not in PREFILL_SIZINGS:
            raise ConfigError(f"--prefill-sizing must be one of {', '.join(PREFILL_SIZINGS)}")
        if (
            self.heartbeat_interval_s <= 0
            or self.watchdog_stall_timeout <= self.heartbeat_interval_s
        ):
            raise ConfigError("--watchdog-stall-timeout must exceed --heartbeat-interval-s (> 0)")
        self._check_nodes()
        if self.admin_host not in LOOPBACK_HOSTS and not self.admin_api_key:
            raise ConfigError("--admin-host off loopback needs --admin-api-key")
        if self.num_groups < 1 or self.max_request_attempts < 1 or self.crash_loop_failures < 1:
            raise ConfigError(
                "--num-groups, --max-request-attempts, --crash-loop-failures must be >= 1"
            )
        if self.quarantine_s < 0:
            raise ConfigError("--quarantine-s must be >= 0 (0 turns the query-of-death rule off)")
        if self.fault_fail_start_group is not None and not self.enable_fault_injection:
            raise ConfigError("--fault-fail-start-group needs --enable-fault-injection")
        if self.devices is not None:
            ids = [d for d in self.devices.split(",") if d.strip()]
            if (
                not all(d.strip().isdigit() for d in ids)
                or len(ids) != self.num_groups * self.tp_size
            ):
                raise ConfigError(
                    f"--devices needs {self.num_groups * self.tp_size} comma-separated device ids "
                    "(--num-groups x --tp-size)"
                )
        if self.moe_a2a_backend == "deepep":
            raise ConfigError("--moe-a2a-backend deepep is not available yet; use none or alltoall")
        self._apply_layout_rules()
        self._check_eplb()
        self._check_overlap()

    def _check_eplb(self) -> None:
        """The EPLB flags among themselves and against the layout (the model's sizes are checked
        where the model is known: `moe.eplb.location.check_location`)."""
        if self.expert_balancedness_report_mode not in BALANCEDNESS_REPORT_MODES:
            raise ConfigError(
                "--expert-balancedness-report-mode must be one of "
                + ", ".join(BALANCEDNESS_REPORT_MODES)
            )
        if self.ep_num_redundant_experts < 0:
            raise ConfigError("--ep-num-redundant-experts must be >= 0")
        if self.eplb_rebalance_num_iterations < 1:
            raise ConfigError("--eplb-rebalance-num-iterations must be at least 1")
        if self.eplb_rebalance_layers_per_chunk < 1:
            raise ConfigError("--eplb-rebalance-layers-per-chunk must be at least 1")
        if not 0 < self.eplb_min_rebalancing_utilization_threshold <= 1:
            raise ConfigError("--eplb-min-rebalancing-utilization-threshold must be in (0, 1]")
        if not self.init_expert_location:
            raise ConfigError("--init-expert-location must be 'trivial' or a file")
        if not self.enable_eplb:
            return
        if self.ep_size < 2:
            raise ConfigError(
                "--enable-eplb needs at least 2 expert-parallel ranks (--ep-size, or "
                "--moe-a2a-backend alltoall with --tp-size >= 2): with one there is nothing to "
                "balance"
            )
        if self.ep_size != self.tp_size:
            raise ConfigError(
                f"--enable-eplb needs --ep-size equal to --tp-size (got {self.ep_size} and "
                f"{self.tp_size}): a rebalance moves whole experts between ranks"
            )

    def _check_overlap(self) -> None:
        """The overlap flags among themselves and against the layout (a family without shared
        experts is refused single-batch overlap where the model is known: `cli.py`)."""
        if not 0 < self.tbo_token_distribution_threshold <= 0.5:
            raise ConfigError("--tbo-token-distribution-threshold must be in (0, 0.5]")
        if self.tbo_min_decode_batch < 1:
            raise ConfigError("--tbo-min-decode-batch must be at least 1")
        on = [
            flag
            for flag, enabled in (
                ("--enable-two-batch-overlap", self.enable_two_batch_overlap),
                ("--enable-single-batch-overlap", self.enable_single_batch_overlap),
            )
            if enabled
        ]
        if on and self.tp_size == 1:
            logger.info(
                "%s %s nothing with one rank (--tp-size 1): there is no dispatch or combine "
                "collective to overlap",
                " and ".join(on),
                "does" if len(on) == 1 else "do",
            )
            return
        if not self.enable_two_batch_overlap:
            return
        if self.moe_a2a_backend == "none" and not self.enable_dp_attention:
            raise ConfigError(
                "--enable-two-batch-overlap needs --moe-a2a-backend alltoall or "
                "--enable-dp-attention: with tensor-parallel attention and backend none every "
                "rank computes every token, there is nothing to overlap"
            )
        if self.dispatch_budget_tokens == 1:
            raise ConfigError(
                "--enable-two-batch-overlap needs --dispatch-budget-tokens of at least 2 (or 0: "
                "off): each micro-batch gets half the receive budget"
            )

    def _apply_layout_rules(self) -> None:
        """Peer semantics (as in the peer servers): an all-to-all backend spans the TP group."""
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

    def device_index(self, group: int, rank: int) -> int:
        """The CUDA device of a group's rank."""
        if self.devices:
            return int(self.devices.split(",")[group * self.tp_size + rank])
        return group * self.tp_size + rank

    def _check_nodes(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--placement must be one of {', '.join(PLACEMENTS)}")
        if self.nnodes is not None:
            if self.nnodes < 1:
                raise ConfigError(f"--nnodes must be at least 1, got {self.nnodes}")
            if self.nnodes > 1 and self.placement != "remote":
                raise ConfigError(
                    f"--nnodes {self.nnodes} needs --placement remote: with --placement local "
                    "every rank runs on this host (run `safeserve node` on each host instead)"
                )
            if self.tp_size % self.nnodes:
                raise ConfigError(
                    f"--tp-size {self.tp_size} does not split evenly over --nnodes {self.nnodes} "
                    "(each node agent runs --tp-size / --nnodes of a group's ranks)"
                )
        if not 0 < self.node_port <= 65535:
            raise ConfigError(f"--node-port must be in 1..65535, got {self.node_port}")
        if not self.node_lease_s > 0 or not self.node_wait_s > 0:
            raise ConfigError("--node-lease-s and --node-wait-s must be positive")
        if self.placement == "remote" and not self.curve_keys_dir and not self.insecure_nodes:
            raise ConfigError(
                "--placement remote needs --curve-keys-dir (write one with `safeserve keys DIR`), "
                "or --insecure-nodes to run without authentication"
            )
        if self.placement == "remote" and self.node_port in (self.port, self.admin_port_effective):
            raise ConfigError("--node-port must differ from --port and --admin-port")

    @property
    def admin_port_effective(self) -> int:
        return self.admin_port if self.admin_port is not None else self.port + 1

    @property
    def prefill_chunk(self) -> int:
        chunk = self.chunked_prefill_size or self.max_num_batched_tokens
        return min(chunk, self.max_num_batched_tokens)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for secret in ("api_key", "admin_api_key"):
            if d.get(secret):
                d[secret] = "***"
        return d
