"""Where physical experts go: DeepSeek's EPLB placement, computed from per-expert loads.

Given how many tokens each logical expert of each layer received, choose which logical expert
each of the P physical slots holds so that every GPU gets about the same work:

1. `replicate_experts`: every logical expert gets one slot; each extra slot goes to the expert
   whose load per replica is largest (a replica takes an equal share of its expert's tokens).
2. `balanced_packing`: items (heaviest first) go to the lightest pack that still has room, every
   pack taking the same number of items.
3. Hierarchical policy, when the expert groups divide over the nodes: groups are packed onto
   nodes, experts are replicated within each node, and each node's physical experts are packed
   onto its GPUs (a token's experts then stay on few nodes). Otherwise the global policy: the same
   with one group and one node.

Physical slot p lives on GPU `p // (P / num_gpus)`. Everything runs on the CPU in int64 (loads in
float64); ties go to the lowest index, so equal inputs give equal placements.
"""

from __future__ import annotations

import torch

Placement = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _as_rows(weight: torch.Tensor, what: str) -> torch.Tensor:
    """`weight` as float64 rows on the CPU ([n] becomes [1, n]); loads must be finite and >= 0."""
    if weight.dim() not in (1, 2):
        raise ValueError(f"{what} must be [n] or [rows, n], got shape {tuple(weight.shape)}")
    rows = weight.detach().to("cpu", torch.float64)
    rows = rows.unsqueeze(0) if rows.dim() == 1 else rows
    if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
        raise ValueError(f"{what} must be finite and non-negative")
    return rows


def _restore(t: torch.Tensor, was_1d: bool) -> torch.Tensor:
    return t.squeeze(0) if was_1d else t


def replicate_experts(weight: torch.Tensor, num_physical: int) -> Placement:
    """Replicates `weight[rows?, E]`'s experts into `num_physical` slots.

    Slot e < E holds expert e; each further slot goes to the expert with the largest
    load / replica count (on a tie: fewer replicas, then the lowest index, so zero loads spread
    the extra slots instead of piling them on expert 0).
    Returns (slot_to_expert[rows?, P], replica_index[rows?, P], replica_count[rows?, E]), where
    replica_index is the slot's rank among its expert's replicas (0 for the first).
    """
    rows = _as_rows(weight, "weight")
    n_rows, num_experts = rows.shape
    if num_physical < num_experts:
        raise ValueError(f"num_physical {num_physical} < {num_experts} logical experts")
    slot_to_expert = torch.arange(num_physical).repeat(n_rows, 1)
    slot_to_expert[:, num_experts:] = 0
    replica_index = torch.zeros(n_rows, num_physical, dtype=torch.int64)
    count = torch.ones(n_rows, num_experts, dtype=torch.int64)
    row = torch.arange(n_rows)
    for slot in range(num_experts, num_physical):
        per_replica = rows / count
        tied = per_replica == per_replica.max(dim=1, keepdim=True).values
        expert = torch.where(tied, count, torch.iinfo(torch.int64).max).argmin(dim=1)
        slot_to_expert[:, slot] = expert
        replica_index[:, slot] = count[row, expert]
        count[row, expert] += 1
    was_1d = weight.dim() == 1
    return (
        _restore(slot_to_expert, was_1d),
        _restore(replica_index, was_1d),
        _restore(count, was_1d),
    )


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packs the n items of each row of `weight[rows?, n]` into `num_packs` packs of n/num_packs.

    Items go heaviest first (equal weights: lower index first) into the lightest pack that is not
    full (equal loads: lower pack first). With one item per pack, item i goes to pack i (nothing
    to balance, so nothing moves). Returns (pack_index[rows?, n], rank_in_pack[rows?, n]).
    """
    rows = _as_rows(weight, "weight")
    n_rows, num_items = rows.shape
    if num_packs < 1 or num_items % num_packs:
        raise ValueError(f"{num_items} items cannot be split evenly into {num_packs} packs")
    per_pack = num_items // num_packs
    was_1d = weight.dim() == 1
    if per_pack == 1:
        pack_index = torch.arange(num_items).repeat(n_rows, 1)
        rank_in_pack = torch.zeros(n_rows, num_items, dtype=torch.int64)
        return _restore(pack_index, was_1d), _restore(rank_in_pack, was_1d)

    order = torch.sort(rows, dim=1, descending=True, stable=True).indices
    pack_load = torch.zeros(n_rows, num_packs, dtype=torch.float64)
    pack_items = torch.zeros(n_rows, num_packs, dtype=torch.int64)
    pack_index = torch.empty(n_rows, num_items, dtype=torch.int64)
    rank_in_pack = torch.empty(n_rows, num_items, dtype=torch.int64)
    row = torch.arange(n_rows)
    for j in range(num_items):
        item = order[:, j]
        pack = pack_load.masked_fill(pack_items >= per_pack, float("inf")).argmin(dim=1)
        pack_index[row, item] = pack
        rank_in_pack[row, item] = pack_items[row, pack]
        pack_items[row, pack] += 1
        pack_load[row, pack] += rows[row, item]
    return _restore(pack_index, was_1d), _restore(rank_in_pack, was_1d)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Inverse of each row's permutation."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1)).expand_as(perm))
    return inv


def _hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical_to_logical[L, P], logical_count[L, E]) of the hierarchical policy."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_physical // num_gpus

    # 1. groups -> nodes. Renumber the logical experts ("node-major" ids) so that node n's
    # experts are n*logical_per_node... in the order its groups were packed.
    group_load = weight.view(num_layers, num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    first_of_group = (group_node * groups_per_node + group_rank) * group_size
    logical_to_major = (first_of_group.unsqueeze(-1) + torch.arange(group_size)).flatten(1)
    major_to_logical = _inverse(logical_to_major)

    # 2. replicate within each node (rows = layer x node).
    major_load = weight.gather(1, major_to_logical).view(-1, logical_per_node)
    node_slot_to_major, _, major_count = replicate_experts(major_load, physical_per_node)

    # 3. each node's physical experts -> its GPUs; a replica carries an equal share of the load.
    slot_load = (major_load / major_count).gather(1, node_slot_to_major)
    gpu, rank_on_gpu = balanced_packing(slot_load, gpus_per_node)
    placed_slot = gpu * slots_per_gpu + rank_on_gpu  # where node slot s ends up in its node
    major_at_placed = node_slot_to_major.gather(1, _inverse(placed_slot))
    node_offset = (torch.arange(num_nodes) * logical_per_node).repeat(num_layers).unsqueeze(1)
    major_at_physical = (major_at_placed + node_offset).view(num_layers, num_physical)
    physical_to_logical = major_to_logical.gather(1, major_at_physical)
    logical_count = major_count.view(num_layers, num_logical).gather(1, logical_to_major)
    return physical_to_logical, logical_count


def logical_to_physical_map(physical_to_logical: torch.Tensor, num_logical: int) -> torch.Tensor:
    """[L, E, P - E + 1]: each logical expert's physical slots, ascending, -1 padded.

    The last dimension is the most replicas any expert can have, so every placement of the same
    sizes has the same shape (maps can be updated in place).
    """
    num_layers, num_physical = physical_to_logical.shape
    max_replicas = num_physical - num_logical + 1
    slots = torch.arange(num_physical).expand(num_layers, -1)
    # slots grouped by expert, ascending within each expert
    order = torch.sort(physical_to_logical * num_physical + slots, dim=1).indices
    expert = physical_to_logical.gather(1, order)
    count = torch.zeros(num_layers, num_logical, dtype=torch.int64)
    count.scatter_add_(1, physical_to_logical, torch.ones_like(physical_to_logical))
    first = count.cumsum(1) - count
    replica = slots - first.gather(1, expert)
    out = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
    out.scatter_(1, expert * max_replicas + replica, order)
    return out.view(num_layers, num_logical, max_replicas)


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Placement:
    """A placement of `weight[L, E]`'s experts (tokens per logical expert per layer).

    num_replicas: physical slots P (logical + redundant), P/num_gpus per GPU; num_groups: the
    model's expert groups (1 when it has none); num_nodes, num_gpus: the expert-parallel topology.
    Returns (physical_to_logical[L, P], logical_to_physical[L, E, P - E + 1] -1 padded,
    logical_count[L, E]), all int64 on the CPU.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_layers, num_experts], got {tuple(weight.shape)}")
    weight = _as_rows(weight, "weight")
    num_logical = weight.size(1)
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_gpus < 1 or num_gpus % num_nodes:
        raise ValueError(
            f"num_gpus {num_gpus} must be a positive multiple of num_nodes {num_nodes}"
        )
    if num_logical % num_groups:
        raise ValueError(f"{num_logical} experts cannot be split into {num_groups} groups")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas {num_replicas} < {num_logical} logical experts")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas {num_replicas} cannot be split evenly over {num_gpus} GPUs")
    if num_groups % num_nodes == 0:
        phy2log, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    return phy2log, logical_to_physical_map(phy2log, num_logical), logcnt
