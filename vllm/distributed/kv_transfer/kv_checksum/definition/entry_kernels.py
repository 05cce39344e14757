# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The block checksum table's writes and moves, as PyTorch operations.

An entry write (R117, R118) sums a launch's output over its columns, XORs the
blocks' tags and stores the entries into the table at the block ids and, for
an offload store, into the host slots too. A move copies entries between the
table and the host slots (a load's restore, a store of blocks whose entries
exist) or gathers a pass's stored entries. Each is two to four operations
queued on the current stream, with no host sync. This module imports torch
only.
"""

import functools

import torch


class EntryKernels:
    """Entry writes and moves on one device. Every tensor is int64 and
    one-dimensional, except `sums` ([n, width])."""

    def write(
        self,
        sums: torch.Tensor,
        tags: torch.Tensor,
        ids: torch.Tensor,
        table: torch.Tensor,
        slots: torch.Tensor | None = None,
        dest: torch.Tensor | None = None,
    ) -> None:
        """Queue table[ids] = entries (and dest[slots] = entries, parallel to
        ids) on the current stream; entries = sums summed over columns XOR
        tags (R117)."""
        n, width = sums.shape
        if not n:
            return
        # One column: that column itself, XORed in place (no reduction).
        entries = sums[:, 0] if width == 1 else sums.sum(dim=1)
        entries.bitwise_xor_(tags)
        table.index_copy_(0, ids, entries)
        if slots is not None and dest is not None:
            dest.index_copy_(0, slots, entries)

    def move(
        self,
        src: torch.Tensor,
        src_idx: torch.Tensor,
        dst: torch.Tensor,
        dst_idx: torch.Tensor | None = None,
    ) -> None:
        """Queue dst[dst_idx[i]] = src[src_idx[i]] (dst[i] without dst_idx)."""
        n = src_idx.numel()
        if not n:
            return
        if dst_idx is None:
            torch.index_select(src, 0, src_idx, out=dst[:n])
        else:
            dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


@functools.cache
def entry_kernels(device: torch.device) -> EntryKernels:
    """The one `EntryKernels` of `device` the block table and the host slots
    share."""
    return EntryKernels()
