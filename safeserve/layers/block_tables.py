"""Block tables on the device, uploaded by difference.

A decode row's block table only grows by appending while its table id stays the same
(`Request.table_id`), so each step uploads just the entries the device copy lacks:
`TableMirror` keeps the host's view of what the device holds and computes the copies;
`TableUpload` owns the device rows and the (pinned) staging buffer.
"""

from __future__ import annotations

import numpy as np
import torch


class TableMirror:
    """The decode graphs' block tables in pinned host memory, and what the device copy lacks.

    Row i of a step holds sequence i's table. Rewriting and uploading whole rows would cost
    host time and bytes in proportion to the contexts (and to `--max-model-len` for the
    upload); but between two steps a row usually holds the same sequence, whose table only
    gained an entry, if anything. So each row remembers the table id it holds (`SeqPlan.
    table_id`: under one id a table only grows) and how many of its entries the device has;
    `fill` writes only the entries past those and returns the flat ranges to upload. A row
    that changes hands, or a table without an id (-1), is written whole up to its context.
    """

    # Ranges closer than this many entries (32 KiB) go up as one copy, and more ranges than
    # MAX_COPIES as one from the first to the last: each copy is a host call and a transfer's
    # latency, worth more than sending a few KiB twice (the entries between are already right
    # on the device; they are re-sent unchanged).
    MERGE_GAP = 8192
    MAX_COPIES = 8

    def __init__(self, tables: np.ndarray, block_size: int) -> None:
        self.tables = tables  # [max_bs, width], a view of the pinned buffer
        self.block_size = block_size
        self.width = tables.shape[1]
        self._held: list[tuple[int, int]] = [(-1, 0)] * tables.shape[0]  # (table id, entries)

    def fill(
        self, ends: list[int], tables: list[list[int]], ids: list[int]
    ) -> list[tuple[int, int]]:
        """Write the rows of these tables (row i: context `ends[i]`, table `tables[i]`, table
        id `ids[i]`) that the device lacks; [lo, hi) flat ranges of the table (row-major) to
        upload, ascending and disjoint."""
        ranges: list[tuple[int, int]] = []
        width, bsz = self.width, self.block_size
        for i, (end, table, table_id) in enumerate(zip(ends, tables, ids, strict=True)):
            w = (end + bsz - 1) // bsz
            tid, held = self._held[i]
            lo = held if table_id >= 0 and tid == table_id else 0
            if lo >= w:
                continue
            self.tables[i, lo:w] = table[lo:w]
            self._held[i] = (table_id, w)
            a, b = i * width + lo, i * width + w
            if ranges and a - ranges[-1][1] <= self.MERGE_GAP:
                ranges[-1] = (ranges[-1][0], b)
            else:
                ranges.append((a, b))
        if len(ranges) > self.MAX_COPIES:
            return [(ranges[0][0], ranges[-1][1])]
        return ranges


class TableUpload:
    """Decode rows' block tables on the device, uploaded by difference (`TableMirror`): the
    decode graphs' static rows, and the rows of the steps no decode graph runs (larger decode
    batches, and the decode rows of steps mixed with prefill chunks). Rebuilding them from the
    plan's lists every step cost host time in proportion to the contexts (64 rows of 8,192
    tokens: 3 ms on a CPU core).

    `device_tables` [rows, width] is where the rows go (a graph captures views of it);
    `host` [rows * width] the staging copy (pinned where the device is a GPU)."""

    def __init__(self, device_tables: torch.Tensor, host: torch.Tensor, block_size: int) -> None:
        self.device_tables = device_tables
        self.rows, self.width = device_tables.shape
        self.host = host
        self.mirror = TableMirror(host.numpy().reshape(self.rows, self.width), block_size)
        self.uploaded = torch.cuda.Event() if device_tables.is_cuda else None

    @classmethod
    def allocate(
        cls, rows: int, max_model_len: int, block_size: int, device: torch.device
    ) -> TableUpload:
        """Rows for `rows` sequences of up to `max_model_len` tokens."""
        width = (max_model_len + block_size - 1) // block_size
        tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        host = torch.zeros(rows * width, dtype=torch.int32, pin_memory=device.type == "cuda")
        return cls(tables, host, block_size)

    def load(self, ends: list[int], tables: list[list[int]], ids: list[int]) -> torch.Tensor | None:
        """Row i: context `ends[i]`, table `tables[i]`, table id `ids[i]`. Uploads what the
        device lacks and returns the [n, width] rows (entries past a row's context are not
        meaningful), or None where they do not fit (the caller builds them as before)."""
        n, bsz = len(ends), self.mirror.block_size
        if n > self.rows or any((e + bsz - 1) // bsz > self.width for e in ends):
            return None
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the pinned rows are rewritten only once they went up
        flat = self.device_tables.view(-1)
        for lo, hi in self.mirror.fill(ends, tables, ids):
            flat[lo:hi].copy_(self.host[lo:hi], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
        return self.device_tables[:n]
