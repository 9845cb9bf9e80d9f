"""The planner's formulas: which experts a batch reads, what a decode step reads and sends, and
how long the step takes on a calibrated GPU.

A decode step of `B` tokens reads, on each rank: its dense weights, one embedding row per token,
every local expert that at least one token chose (per MoE layer), and its sequences' KV cache.
The step's time is that read at the GPU's calibrated rate plus a fixed time per layer (launches,
tails, small operations), plus the all-to-all of dispatch and combine when experts live on
other ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

# With uniform routing a token's top-k is k distinct experts of E, each equally likely.


def _miss_own(ep_size: int, num_experts: int, top_k: int) -> float:
    """Probability that none of one token's k choices falls in a given rank's block of E/W."""
    per_rank = num_experts // ep_size
    miss = 1.0
    for i in range(top_k):
        miss *= max(0.0, (num_experts - per_rank - i) / (num_experts - i))
    return miss


def p_chosen_uniform(num_experts: int, top_k: int) -> float:
    """Probability that one token's top-k includes a given expert, under uniform routing."""
    return min(1.0, top_k / num_experts)


def selection_probs(counts: Sequence[float], top_k: int) -> list[float]:
    """Per expert, the probability that one token chooses it, from recorded token counts
    (a token counts once for each of its k choices): k x its share of the choices."""
    total = float(sum(counts))
    if total <= 0:
        raise ValueError("a recorded distribution with no tokens")
    return [min(1.0, top_k * c / total) for c in counts]


def expected_union(probs: Sequence[float], tokens: float) -> float:
    """Expected number of distinct experts that `tokens` independent tokens choose, where a
    token chooses expert e with probability probs[e]."""
    if tokens <= 0:
        return 0.0
    return sum(1.0 - (1.0 - p) ** tokens for p in probs)


def union_uniform(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts of one layer among `tokens` tokens under uniform routing:
    E * (1 - (1 - k/E)^B)."""
    return expected_union([p_chosen_uniform(num_experts, top_k)] * num_experts, tokens)


def ranks_reached(ep_size: int, num_experts: int, top_k: int) -> float:
    """Expected distinct EP ranks one token's top-k lands on (uniform routing, contiguous
    blocks of E/W experts): W * (1 - C(E - E/W, k) / C(E, k))."""
    if ep_size <= 1:
        return 1.0
    return ep_size * (1.0 - _miss_own(ep_size, num_experts, top_k))


def in_node_share(ep_size: int, gpus_per_node: int) -> float:
    """Share of a token's destination ranks inside its own node (its own GPU counted) when the
    group's EP ranks spread over nodes of `gpus_per_node`: min(G, W) / W."""
    return min(gpus_per_node, ep_size) / ep_size


def a2a_bytes(
    tokens: float, ep_size: int, num_experts: int, top_k: int, hidden: int, itemsize: int
) -> float:
    """Bytes one rank sends to other ranks in one MoE layer's dispatch (the combine sends as
    many back): each of its tokens one hidden row to each other rank its top-k reaches."""
    if ep_size <= 1:
        return 0.0
    others = ranks_reached(ep_size, num_experts, top_k) - (
        1.0 - _miss_own(ep_size, num_experts, top_k)
    )
    return tokens * others * hidden * itemsize


def a2a_seconds(
    bytes_out: float,
    ep_size: int,
    gpus_per_node: int,
    nvlink_gbs: float,
    scaleout_gbs: float,
) -> float:
    """Time of one dispatch (or combine) at link bandwidth: the share of the rows to other
    GPUs of the node over NVLink, the rest over the scale-out network."""
    if ep_size <= 1 or bytes_out <= 0:
        return 0.0
    local_others = min(gpus_per_node, ep_size) - 1  # other GPUs of the node in the group
    remote = ep_size - min(gpus_per_node, ep_size)
    others = local_others + remote
    t = 0.0
    if local_others:
        t += bytes_out * local_others / others / (nvlink_gbs * 1e9)
    if remote:
        t += bytes_out * remote / others / (scaleout_gbs * 1e9)
    return t


def predicted_step_s(
    read_bytes: float,
    num_layers: int,
    ceiling_gbs: float,
    efficiency: float,
    layer_us: float,
    comm_s: float = 0.0,
) -> float:
    """A decode step: its reads at `efficiency` x the read ceiling, a fixed time per layer, and
    its all-to-all time."""
    return read_bytes / (efficiency * ceiling_gbs * 1e9) + num_layers * layer_us * 1e-6 + comm_s


def fit_calibration(
    points: Sequence[tuple[float, float]], num_layers: int, ceiling_gbs: float
) -> tuple[float, float]:
    """(efficiency, layer_us) that fit measured decode steps `(read_bytes, step_s)` of one model
    best, by least squares on the relative error of step = a + b * bytes."""
    # minimise sum ((a + b x - y) / y)^2: weighted least squares with weights 1/y^2
    sw = swx = swy = swxx = swxy = 0.0
    for x, y in points:
        w = 1.0 / (y * y)
        sw += w
        swx += w * x
        swy += w * y
        swxx += w * x * x
        swxy += w * x * y
    det = sw * swxx - swx * swx
    if len(points) < 2 or det <= 0:
        raise ValueError("calibration needs decode steps at two or more batch sizes")
    b = (sw * swxy - swx * swy) / det
    a = (swy - b * swx) / sw
    efficiency = 1.0 / (b * ceiling_gbs * 1e9)
    return efficiency, a / num_layers * 1e6
