# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which blocks of a request each side checksums (R64-R66).

Both sides select the blocks holding a token range per KV cache group, drop
leading null blocks (out of a sliding window) and clip sliding-window groups to
the blocks NIXL and Mooncake transfer.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.utils.math_utils import cdiv


@dataclass(frozen=True)
class SchedulerGroup:
    """What the scheduler needs of one KV cache group."""

    block_size: int
    # Blocks a sliding-window transfer keeps (0: not a sliding-window group).
    sliding_window_blocks: int = 0
    # Mamba groups: speculative scratch blocks after the running state (R67);
    # None for every other group.
    mamba_spec_blocks: int | None = None
    # False for Mamba state without TP splits, not replicated (R85).
    tp_comparable: bool = True
    # True only for full attention: vLLM holds every block of a request until
    # it frees the request, so a finishing producer need not look for freed
    # blocks (R66; issue 30: no per-block scan per finished request). False
    # (look) for every other kind, whose blocks may be freed earlier.
    holds_all_blocks: bool = False


def sliding_window_transfer_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks a transfer keeps of a sliding-window group: ceil(window / bs) + 1."""
    return cdiv(sliding_window, block_size) + 1


_IS_NULL = attrgetter("is_null")
_BLOCK_ID = attrgetter("block_id")


def _null_mask(blocks: Sequence) -> np.ndarray:
    """Which of `blocks` are vLLM's null block (freed out of a window)."""
    return np.fromiter(map(_IS_NULL, blocks), dtype=bool, count=len(blocks))


def _any_null(blocks: Sequence) -> bool:
    """Whether any of `blocks` is vLLM's null block: a scan in C that stops
    at the first one and builds no array, about twice as fast as the mask
    for the usual case of none (issue 30)."""
    return any(map(_IS_NULL, blocks))


def _group_blocks(
    blocks: Sequence, group: SchedulerGroup, begin: int, end: int
) -> tuple[int, np.ndarray] | None:
    """(start position, block ids) of the group's blocks at positions [begin, end)."""
    selected = blocks[begin:end]
    if group.sliding_window_blocks and len(selected) > group.sliding_window_blocks:
        drop = len(selected) - group.sliding_window_blocks
        selected = selected[drop:]
        begin += drop
    if not _any_null(selected):  # most requests: every block held (issue 30)
        ids = np.fromiter(map(_BLOCK_ID, selected), dtype=np.int64, count=len(selected))
        return (begin, ids) if ids.size else None
    is_null = _null_mask(selected)
    real = np.flatnonzero(~is_null)
    if real.size == 0:
        return None
    first = int(real[0])
    if real.size != len(selected) - first:
        return None  # a null block after a non-null one
    ids = np.fromiter(map(_BLOCK_ID, selected[first:]), dtype=np.int64, count=real.size)
    return begin + first, ids


def _running_state_block(
    blocks: Sequence, num_spec_blocks: int
) -> tuple[int, np.ndarray] | None:
    """(0, [running-state block]) of a Mamba group, None without one (R67).

    The non-null blocks clipped as NIXL clips them (`clip_ssm_state_blocks`:
    trailing speculative scratch slots dropped, the last one kept), at
    position 0 whatever the token range: one state per request.
    """
    real = [b.block_id for b in blocks if not b.is_null]
    kept = clip_ssm_state_blocks(real, num_spec_blocks)
    if not kept:
        return None
    return 0, np.asarray(kept, dtype=np.int64)


def first_held_position(blocks: Sequence, start: int, count: int) -> int | None:
    """The first of positions [start, start + count) after which every block
    is still held (not null), None if the last one is not.

    A sliding-window group's earliest blocks may be freed between the step
    that checksummed a prompt and the transfer (R66): a consumer cannot load
    them, so a producer must not send their checksums.
    """
    selected = blocks[start : start + count]
    if len(selected) < count:
        return None
    if not _any_null(selected):  # most requests: every block held (issue 30)
        return start
    is_null = _null_mask(selected)
    if is_null[-1]:
        return None
    return start + int(np.flatnonzero(is_null)[-1]) + 1


def select_blocks(
    request_blocks: Sequence[Sequence],
    groups: dict[int, SchedulerGroup],
    first_token: int,
    end_token: int,
) -> KVChecksumBlocks:
    """Blocks holding tokens [first_token, end_token) of every covered group."""
    selected: dict[int, tuple[int, np.ndarray]] = {}
    for group_id, group in groups.items():
        if group_id >= len(request_blocks):
            continue
        if group.mamba_spec_blocks is not None:
            state = _running_state_block(
                request_blocks[group_id], group.mamba_spec_blocks
            )
            if state is not None:
                selected[group_id] = state
            continue
        begin = first_token // group.block_size
        end = cdiv(end_token, group.block_size)
        entry = _group_blocks(request_blocks[group_id], group, begin, end)
        if entry is not None:
            selected[group_id] = entry
    return KVChecksumBlocks(num_tokens=end_token, groups=selected)
