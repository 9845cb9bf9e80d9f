"""Mixtral and Qwen2-MoE in every parallel layout against transformers, on real gloo process
groups: every layout's logits (chunked prefill, then decode) within 1e-4 of transformers'.

One set of four spawned processes runs every (family, layout) group in turn, each with its own
rendezvous (`layouts._rank_main`, the ranks beyond a layout's size wait it out): spawning and
importing torch once instead of for every group is most of this file's time on a small host.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch
from checkpoints_families import write_mixtral_checkpoint, write_qwen2_moe_checkpoint
from layouts import LAYOUTS, _rank_main
from serving import free_port
from transformers import AutoModelForCausalLM

from safeserve.spawn import spawn_ranks

FAMILIES = {"mixtral": write_mixtral_checkpoint, "qwen2_moe": write_qwen2_moe_checkpoint}
CHUNKS = [5, 6, 1, 1, 3, 1, 1, 1, 1]  # chunked prefill, then decode steps


class _Tagged:
    """The rank's queue, each message tagged with the group run it belongs to."""

    def __init__(self, queue: mp.Queue, key: tuple[str, str]) -> None:
        self.queue, self.key = queue, key

    def put(self, item: tuple) -> None:
        self.queue.put((self.key, item))


def _every_group_rank(rank: int, runs: list[tuple], seqs: list[list[int]], queue: mp.Queue) -> None:
    # One thread a rank (as the server's ranks have on a small host): four ranks of two OpenMP
    # threads each on two cores spend most of their time in each other's barriers.
    torch.set_num_threads(1)
    for key, model, layout, init in runs:
        if rank < layout[0]:
            tagged = _Tagged(queue, key)
            try:
                _rank_main("cpu", model, layout, rank, init, seqs, CHUNKS, None, tagged)
            except Exception:  # that group's failure; the next runs go on
                tagged.put(("error", rank, traceback.format_exc()))


def _ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):
    """{(family, layout): ({(seq, position): logits row}, error or None)}, the sequences and
    transformers' logits by family."""
    gen = torch.Generator().manual_seed(5)
    # Three sequences of different lengths: with 4 attention ranks one rank has none.
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    ckpts, ref = {}, {}
    for family, write in FAMILIES.items():
        ckpts[family] = write(tmp_path_factory.mktemp(family), seed=2)
        hf = AutoModelForCausalLM.from_pretrained(ckpts[family], dtype=torch.float32).eval()
        with torch.no_grad():
            ref[family] = {i: hf(torch.tensor([s])).logits[0] for i, s in enumerate(seqs)}
    keys = [(f, name) for f in FAMILIES for name in sorted(LAYOUTS)]
    ports = _ports(len(keys) + 1)
    runs = [
        (key, str(ckpts[key[0]]), LAYOUTS[key[1]], f"tcp://127.0.0.1:{port}")
        for key, port in zip(keys, ports[1:], strict=True)
    ]
    out: dict = {key: ({}, None) for key in keys}
    pending = sum(LAYOUTS[name][0] for _, name in keys)  # one "done" (or error) per rank
    world = max(tp for tp, *_ in LAYOUTS.values())
    with spawn_ranks(
        world, _every_group_rank, lambda r, init, q: (r, runs, seqs, q), port=ports[0]
    ) as ranks:
        while pending:
            key, (a, b, c) = ranks.get(timeout=180)
            if a == "error":
                out[key] = (out[key][0], f"rank {b} failed:\n{c}")
            if a == "splits":  # steps run as two micro-batches (two-batch overlap only)
                continue
            if a in ("error", "done"):
                pending -= 1
                continue
            out[key][0][(a, b)] = torch.tensor(c)
    return out, seqs, ref


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layout_logits_match_transformers(results, family: str, name: str) -> None:
    out, seqs, ref = results
    got, error = out[(family, name)]
    assert error is None, error
    expected_rows = sum(
        len(
            {
                min(sum(CHUNKS[: k + 1]), len(s)) - 1
                for k in range(len(CHUNKS))
                if sum(CHUNKS[:k]) < len(s)
            }
        )
        for s in seqs
    )
    assert len(got) == expected_rows
    for (i, pos), row in got.items():
        torch.testing.assert_close(
            row,
            ref[family][i][pos],
            atol=1e-4,
            rtol=0,
            msg=lambda m, i=i, pos=pos: f"seq {i} pos {pos}: {m}",
        )
