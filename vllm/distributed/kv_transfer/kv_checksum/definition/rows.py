# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Row building: the (block id, first token, valid tokens) of every block to checksum,
and their upload to the device.

All rows of a worker call are built with vectorized NumPy into one [3, width]
int64 array; each group segment starts at an even column so every kernel slice
is 16-byte aligned like the warm-up slices (R52).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)


@dataclass(frozen=True)
class RowSegment:
    """The rows of one (pass, group): requests in order, with their row counts."""

    group_id: int
    column: int  # first column in the row array (even)
    req_ids: tuple[str, ...]
    starts: np.ndarray  # first position per request
    counts: np.ndarray  # rows per request

    @property
    def num_rows(self) -> int:
        return int(self.counts.sum())


def segment_rows(
    requests: Sequence[tuple[str, KVChecksumBlocks]], group_id: int, block_size: int
) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    """Rows of every request's blocks of one group: (req ids, starts, counts, rows).

    Per request only its entry is picked; the rows are built by whole-array
    NumPy operations, in place where they can be (a step's host cost, issue 30).
    """
    picked = [
        (req_id, entry, blocks.num_tokens)
        for req_id, blocks in requests
        if (entry := blocks.groups.get(group_id)) is not None
    ]
    # Per row: its block id, the shift from its row index to its position
    # (the request's start minus its first row) and its request's end.
    shift: np.ndarray | int
    ends: np.ndarray | int
    if len(picked) == 1:  # most passes: one request, no repeats needed
        req_id, (start, block_ids), end = picked[0]
        req_ids: tuple[str, ...] = (req_id,)
        block_rows = np.asarray(block_ids, dtype=np.int64)
        counts = np.array([len(block_rows)], dtype=np.int64)
        starts = np.array([start], dtype=np.int64)
        shift, ends = start, end
    else:
        ids = [np.asarray(entry[1], dtype=np.int64) for _, entry, _ in picked]
        req_ids = tuple(req_id for req_id, _, _ in picked)
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        starts = np.array([entry[0] for _, entry, _ in picked], dtype=np.int64)
        block_rows = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
        shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
        ends_per_request = np.array([end for _, _, end in picked], dtype=np.int64)
        ends = np.repeat(ends_per_request, counts)
    total = len(block_rows)
    rows = np.empty((3, total), dtype=np.int64)
    rows[0] = block_rows
    first = rows[1]
    first[:] = np.arange(total, dtype=np.int64)
    first += shift  # int64 arithmetic on either path
    first *= block_size
    _valid_tokens(rows, ends, block_size)
    return req_ids, starts, counts, rows


def _valid_tokens(rows: np.ndarray, ends: np.ndarray | int, block_size: int) -> None:
    """Row 2 from row 1: the tokens of each block before its request's end,
    clipped to 0..block_size, in place."""
    valid = rows[2]
    np.subtract(ends, rows[1], out=valid)
    np.maximum(valid, 0, out=valid)
    np.minimum(valid, block_size, out=valid)


def packed_width(sizes: Sequence[int]) -> int:
    """Columns of the array `pack_segments` lays out for parts and reserved
    segments of these widths (each at an even column, at least 2)."""
    return max(sum(size + (size & 1) for size in sizes), 2)


def pack_segments(
    parts: Sequence[np.ndarray],
    zeros: Callable[[tuple[int, int]], np.ndarray] = lambda shape: np.zeros(
        shape, dtype=np.int64
    ),
    reserve: Sequence[int] = (),
) -> tuple[np.ndarray, list[int]]:
    """Lay row arrays side by side, each at an even column; return the columns.

    `zeros(shape)` allocates the zeroed int64 result (padding columns are
    all-masked rows), e.g. a view of pinned memory for the device copy.
    `reserve` adds zeroed segments of those widths after the parts (their
    columns follow the parts'): device scratch that travels in the same
    upload, each segment's row 0 one contiguous, 16-byte aligned run.
    """
    columns: list[int] = []
    width = 0
    sizes = [part.shape[1] for part in parts] + list(reserve)
    for size in sizes:
        columns.append(width)
        width += size + (size & 1)
    packed = zeros((3, packed_width(sizes)))
    for column, part in zip(columns, parts):
        packed[:, column : column + part.shape[1]] = part
    return packed, columns


def upload_segments(
    parts: Sequence[np.ndarray],
    device: torch.device,
    reserve: Sequence[int] = (),
) -> tuple[torch.Tensor, list[int]]:
    """`pack_segments` straight into pinned host memory, then one non-blocking
    copy to `device` (no pageable array pinned by a copy of its own, issue
    30); on CPU the packed tensor itself. Returns it and the columns."""
    on_device = device.type != "cpu"
    host: list[torch.Tensor] = []

    def zeros(shape: tuple[int, int]) -> np.ndarray:
        host.append(torch.zeros(shape, dtype=torch.int64, pin_memory=on_device))
        return host[-1].numpy()

    _, columns = pack_segments(parts, zeros, reserve)
    packed = host[0]
    if not on_device:
        return packed, columns
    return packed.to(device, non_blocking=True), columns


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as an int64 tensor on `device`: one non-blocking copy from
    pinned host memory, queued on the current stream (no host sync, R55)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
