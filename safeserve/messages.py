"""Everything the frontend and the group processes say to each other.

Messages are small dataclasses sent as pickles over ZeroMQ sockets between processes of one
deployment (never over an untrusted network).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Heartbeat phases, in the order a step goes through them.
PHASES = ("idle", "schedule", "attention", "dispatch", "experts", "combine", "sample")
# The phase of a rank moving expert weights in a rebalance (a step of its own, between model
# steps): the watchdog gives it longer before calling the group stalled.
EPLB_MOVE_PHASE = "eplb-move"

# Temperatures below this sample greedily (dividing logits by a smaller one overflows them).
GREEDY_TEMPERATURE_EPS = 1e-5

# Request-borne faults (fault injection only): "raise" makes every rank of the group raise when
# a step holds the request; "exit" makes the rank that computes it exit hard (os._exit).
REQUEST_FAULTS = ("raise", "exit")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # A continuation (a migrated request) already produced this many tokens elsewhere: seeded
    # sampling draws output i as output `output_offset + i`, so the stream goes on unchanged.
    output_offset: int = 0
    # Log-probabilities (of the model's unmodified distribution): None = none; n >= 0 = the
    # sampled token's and the n most likely tokens' of every sampled token.
    logprobs: int | None = None
    # Same for every prompt token (`echo` with `logprobs`): None = none.
    prompt_logprobs: int | None = None
    fault: str | None = None  # one of REQUEST_FAULTS (only with --enable-fault-injection)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1


# -- frontend -> group leader -----------------------------------------------------------------
@dataclass
class GenerateRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    rid: str


@dataclass
class Shutdown:
    pass


FAULT_KINDS = ("route_skew", "slow_rank", "corrupt", "clear")
# Why the frontend's router chose a group (the `reason` of safeserve:router_picks_total, which
# the chaos report reads back): a new request, a waiting one moved to a group that became READY,
# a continuation after its group failed, a canary run (GET /health/generate).
ROUTER_PICK_REASONS = ("new", "moved", "migrated", "canary")

# What two-batch overlap did with a forward step (engine/overlap.py decides; the metric
# safeserve:tbo_steps_total counts by it): ran split at a sequence boundary, ran split with one
# sequence cut across the micro-batches, or ran whole because a rank's pure decode batch is under
# --tbo-min-decode-batch, a rank has one token only, or a CUDA graph runs the step.
TBO_DECISIONS = ("split", "split_cut", "decode_below_threshold", "too_few_tokens", "cuda_graph")


@dataclass
class InjectFault:
    """Fault injection (only with --enable-fault-injection): `route_skew` sends every top-k
    choice to the experts starting at `expert`; `slow_rank` delays `rank`'s steps by `delay_s`;
    `corrupt` damages `rank`'s weights in place (a device computing wrong results; only a
    restart, which reloads them, undoes it); `clear` removes every other fault."""

    kind: str
    expert: int | None = None
    rank: int | None = None
    delay_s: float = 0.0


EPLB_OPS = ("start", "stop", "dump", "map")


@dataclass
class EplbCommand:
    """An admin request to a group's leader, answered by an `EplbReply` of the same
    `request_id` in a later `StepOutputs`: `start` (re)starts recording the routed tokens per
    logical expert (POST /admin/expert_distribution/start), `stop` stops it, `dump` returns what
    was recorded since `start`, `map` the group's current physical-to-logical map."""

    op: str
    request_id: str


# -- group -> frontend ------------------------------------------------------------------------
@dataclass
class TokenLogprob:
    """One position's log-probability: the token there, its logprob, and the most likely
    tokens with theirs (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    # --enable-deterministic-inference on CUDA: a hash of the position's whole float32 logits
    # row (16 hex digits), equal between two answers only when every logit is equal to the bit
    digest: str | None = None


@dataclass
class RequestOutput:
    rid: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # tokens generated so far, the stop token included
    # With finish_reason "error": what failed, one line (the request alone fails; the group
    # goes on serving).
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new_token_ids entry, when asked
    # When asked, once (with the request's first output): one per prompt token, the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EplbCheck:
    """One rebalance check of a group's leader (`engine/eplb.py`) and what came of it."""

    at: float  # unix time of the check
    passes: int  # forward passes whose routing it weighed (since the previous check)
    balancedness_before: float  # of those passes' routing under the placement then
    outcome: str  # "rebalanced", "in_progress" (weights still moving) or "skipped"
    reason: str  # why it was skipped, or what moves
    # of the same routing under the new placement, each token sent where the routers send it
    balancedness_predicted: float | None = None
    # measured over the passes since the move finished (None until some ran)
    balancedness_after: float | None = None
    layers_moved: int = 0
    moved_bytes: int = 0  # expert weights sent between ranks, all ranks together
    duration_s: float | None = None  # first chunk's start to last chunk's end
    longest_pause_s: float | None = None  # the longest single chunk: the longest step stall


@dataclass
class EplbStatus:
    """A group's expert placement and rebalancing (GET /admin/eplb, the eplb metrics)."""

    enabled: bool
    num_logical: int
    num_physical: int  # slots per MoE layer, logical + redundant
    slots_per_rank: int
    max_replicas: int  # the most replicas any expert has in any layer now
    interval_passes: int  # --eplb-rebalance-num-iterations
    passes_since_check: int
    threshold: float
    rebalances: int = 0
    skipped: int = 0
    moved_bytes_total: int = 0
    pause_seconds_total: float = 0.0
    layers_pending: int = 0  # layers of the current rebalance still to move
    last: EplbCheck | None = None
    last_rebalance: EplbCheck | None = None  # the last check that moved experts


@dataclass
class EplbReply:
    request_id: str
    recording: bool  # whether distribution recording is on after the op
    # dump: tokens routed per logical expert per MoE layer since `start` ([L][E]), and the
    # forward passes they came from
    logical_count: list[list[int]] | None = None
    passes: int = 0
    phy2log: list[list[int]] | None = None  # map: the logical expert of each slot, per layer
    error: str | None = None  # the op could not be done (one line)


@dataclass
class EngineStats:
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    eplb: EplbStatus | None = None  # None: the group has no routed experts
    # Forward steps by two-batch-overlap decision (TBO_DECISIONS) since start; empty: TBO off.
    tbo_steps: dict[str, int] = field(default_factory=dict)


@dataclass
class StepOutputs:
    group: int
    outputs: list[RequestOutput]
    stats: EngineStats
    replies: list[EplbReply] = field(default_factory=list)  # answers to EplbCommands


@dataclass
class PrefillSizing:
    """Chunked-prefill sizing of one group (guards/prefill_sizing.py computes it)."""

    mode: str
    budget: int | None  # rows a rank may receive per round (None: admission off)
    attention_groups: int
    max_num_batched_tokens: int
    step_tokens: int  # token budget of one step, per attention group
    chunk: int  # prompt tokens of one request per step
    safe_step_tokens: int | None  # the largest step budget that needs no second round
    share: float  # share of a step's tokens the busiest rank is assumed to receive
    explicit_chunk: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.budget is None:
            return (
                f"prefill sizing: admission off; step budget {self.step_tokens} tokens, "
                f"chunk {self.chunk} per attention group"
            )
        return (
            f"prefill sizing {self.mode}: dispatch budget {self.budget} rows/rank, "
            f"{self.attention_groups} attention group(s), busiest-rank share {self.share:.2f} -> "
            f"safe step {self.safe_step_tokens} tokens per group; step budget {self.step_tokens}, "
            f"chunk {self.chunk} per group (--max-num-batched-tokens {self.max_num_batched_tokens})"
        )


@dataclass
class DispatchSizing:
    """The dispatch buffers a rank preallocated at its receive budget."""

    buffer_bytes: int
    bytes_per_recv_row: int
    attention_groups: int
    top_k: int
    local_experts: int


@dataclass
class GuardSizing:
    """The effective admission budget and prefill sizing of a group: the leader sizes prefill
    chunks from them, and GET /admin/config shows them."""

    dispatch_budget_tokens: int | None = None  # rows a rank may receive per round (None: off)
    dispatch: DispatchSizing | None = None  # None with admission off
    prefill: PrefillSizing | None = None  # set by the leader's engine


@dataclass
class GroupReady:
    group: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    guards: GuardSizing = field(default_factory=GuardSizing)


@dataclass
class DispatchStats:
    """A rank's dispatch admission numbers, since start."""

    budget_tokens: int  # rows it may receive in one round
    recv_tokens_peak: int  # most rows it received in one round
    rounds_total: int  # rounds run (one per dispatch when nothing had to be cut)
    cut_total: int  # dispatches that needed more than one round
    buffer_bytes: int  # preallocated
    buffer_peak_bytes: int  # most of it ever in use


@dataclass
class RankStats:
    """What a rank's heartbeat carries besides (step, phase); the defaults are "not known"
    (before a rank's first heartbeat, or off CUDA for the memory fields)."""

    own_step_s: float = 0.0  # the last step's time outside collectives
    device: str | None = None  # e.g. "cuda:1" or "cpu"
    memory_bytes: int | None = None  # device memory allocated (CUDA only)
    memory_peak_bytes: int | None = None  # peak while serving (CUDA only)
    memory_startup_peak_bytes: int | None = None  # peak of start-up (CUDA only, once serving)
    cuda_graph_replays: int | None = None  # None without decode CUDA graphs
    piecewise_graph_replays: int | None = None  # None without piecewise CUDA graphs
    # Mean expert-load balancedness per window (passes), when the rank dispatches and has run one
    balancedness: dict[int, float] = field(default_factory=dict)
    dispatch: DispatchStats | None = None  # None with admission off


@dataclass
class GroupFatal:
    """A rank could not start or hit an unrecoverable error; `message` is one line."""

    group: int
    rank: int
    message: str


@dataclass
class Heartbeat:
    """Sent by a thread of every rank each heartbeat interval, whatever its main thread does:
    a rank blocked in a collective still beats (its phase does not move), a stopped or dead one
    does not."""

    group: int
    rank: int
    pid: int
    step: int
    phase: str
    time: float  # time.time() on the rank when sent
    phase_since: float = 0.0  # time.time() when the rank entered `phase`
    stats: RankStats = field(default_factory=RankStats)


# -- node agents (`safeserve node`, --placement remote) --------------------------------------
# These, and the group messages above, cross hosts: they travel in the typed encoding of
# `safeserve.wire` (never pickled), over CurveZMQ.


@dataclass
class NodeHello:
    """An agent's first message on each connection: who it is and what it has. `agent_id` is
    new at every start of the agent (a restarted agent is a new incarnation of its node)."""

    node_id: str
    agent_id: str
    host: str  # the address its ranks rendezvous on (torch.distributed's TCP store)
    devices: list[int]
    pid: int
    # Its place in a set of agents that groups span (`safeserve node --node-set --node-rank
    # --nnodes`, the frontend's --nnodes): None where not given.
    node_set: str | None = None
    node_rank: int | None = None
    nnodes: int | None = None
    dist_init_addr: str | None = None  # HOST:PORT, the rendezvous of groups led here


@dataclass
class NodeBeat:
    """An agent's heartbeat: the group incarnations whose ranks it runs (group, incarnation);
    `sent`: the agent's monotonic clock when it sent the beat (the lease echoes it)."""

    node_id: str
    sent: float
    groups: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class NodeLease:
    """The frontend's answer to a beat: the agent's groups may go on generating until `seconds`
    after the beat was sent (`beat_sent`, the agent's clock): never past the frontend's own
    deadline, which counts from when the beat arrived. An agent whose lease lapses stops its
    ranks."""

    seconds: float
    beat_sent: float


@dataclass
class SpawnRanks:
    """Start ranks `ranks` of a group incarnation on the agent's devices `devices` (one per
    rank; -1: CPU). `init_method` None: the agent hosts rank 0 and picks the rendezvous
    address (its answer, `RanksSpawned`, names it for the other agents). `args`: the group's
    flags (`ServerArgs.to_dict()`)."""

    group: int
    incarnation: int
    ranks: list[int]
    devices: list[int]
    init_method: str | None
    args: dict[str, object]


@dataclass
class RanksSpawned:
    group: int
    incarnation: int
    ranks: list[int]
    pids: list[int]
    init_method: str


@dataclass
class StopRanks:
    """Stop a group incarnation's ranks on this agent: in order (a `Shutdown` reached its
    leader) within `grace_s`, then killed."""

    group: int
    incarnation: int
    grace_s: float = 0.0


@dataclass
class RankExited:
    """A rank process of the agent ended: its exit code (negative: the signal's number)."""

    group: int
    incarnation: int
    rank: int
    pid: int
    exitcode: int | None
