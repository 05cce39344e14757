# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The block checksum table's writes and moves as one small kernel each.

An entry write (R117, R118) sums a launch's output over its columns, XORs the
blocks' tags, stores the entries into the table at the block ids and, for an
offload store, into the host slots too. A move copies entries between the
table and the host slots (a load's restore, a store of blocks whose entries
exist) or gathers a pass's stored entries. In PyTorch these are two to four
operations each, and inside a serving engine each costs tens of microseconds
of host time (issue 30); here each is one launch, handed straight to the
compiled kernel's launcher after the first call (`DirectLaunch`).

Indices outside the destination or source are skipped, never written or read.
The PyTorch path (CPU, no Triton or no direct launch, or `FUSED_ENTRY_KERNELS`
off) is the reference. This module imports torch, Triton, the kernel module
and vLLM's logger only.
"""

import functools
from collections.abc import Sequence

import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (
    DIRECT_LAUNCH,
    HAS_TRITON,
    DirectLaunch,
    direct_launch_supported,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

if HAS_TRITON:
    import triton
    import triton.language as tl

# Entry writes and moves on CUDA as the kernels below (issue 30), where their
# launches go straight to the compiled kernel (the JIT's per-call work would
# cost more than the PyTorch operations); off: the PyTorch operations.
FUSED_ENTRY_KERNELS = True
# Entries per program.
ENTRY_BLOCK = 128
_INT32_MAX = (1 << 31) - 1

if HAS_TRITON:

    @triton.jit(
        do_not_specialize=[
            "sums_ptr",
            "width",
            "tags_ptr",
            "ids_ptr",
            "table_ptr",
            "table_len",
            "slots_ptr",
            "dest_ptr",
            "dest_len",
            "n",
        ]
    )
    def _write_entries_kernel(
        sums_ptr,
        width,
        tags_ptr,
        ids_ptr,
        table_ptr,
        table_len,
        slots_ptr,
        dest_ptr,
        dest_len,
        n,
        COPY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """entry[i] = (sum over c < width of sums[i, c]) ^ tags[i], mod 2^64;
        table[ids[i]] = entry[i]; with COPY, dest[slots[i]] = entry[i]."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        entry = tl.zeros([BLOCK], dtype=tl.int64)
        for c in range(width):
            entry += tl.load(sums_ptr + i * width + c, mask=live, other=0)
        entry = entry ^ tl.load(tags_ptr + i, mask=live, other=0)
        ids = tl.load(ids_ptr + i, mask=live, other=-1)
        tl.store(table_ptr + ids, entry, mask=live & (ids >= 0) & (ids < table_len))
        if COPY:
            slots = tl.load(slots_ptr + i, mask=live, other=-1)
            ok = live & (slots >= 0) & (slots < dest_len)
            tl.store(dest_ptr + slots, entry, mask=ok)

    @triton.jit(
        do_not_specialize=[
            "src_ptr",
            "src_len",
            "src_idx_ptr",
            "dst_ptr",
            "dst_len",
            "dst_idx_ptr",
            "n",
        ]
    )
    def _move_entries_kernel(
        src_ptr,
        src_len,
        src_idx_ptr,
        dst_ptr,
        dst_len,
        dst_idx_ptr,
        n,
        SCATTER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """dst[d] = src[src_idx[i]] with d = dst_idx[i] (SCATTER) or i."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        source = tl.load(src_idx_ptr + i, mask=live, other=-1)
        ok = live & (source >= 0) & (source < src_len)
        if SCATTER:  # noqa: SIM108 - a compile-time branch of the kernel
            target = tl.load(dst_idx_ptr + i, mask=live, other=-1)
        else:
            target = i
        ok = ok & (target >= 0) & (target < dst_len)
        value = tl.load(src_ptr + source, mask=ok, other=0)
        tl.store(dst_ptr + target, value, mask=ok)


class EntryKernels:
    """Entry writes and moves on one device: the kernels above on CUDA with a
    direct launch, else the PyTorch reference. `use_kernels=True` forces the
    kernels wherever Triton runs (its interpreter in tests), False forces the
    reference. Every tensor is int64 and one-dimensional, except `sums`
    ([n, width], rows contiguous)."""

    def __init__(self, device: torch.device, use_kernels: bool | None = None) -> None:
        self.forced = use_kernels is not None
        if use_kernels is None:
            use_kernels = (
                FUSED_ENTRY_KERNELS
                and HAS_TRITON
                and DIRECT_LAUNCH
                and device.type == "cuda"
                and direct_launch_supported(triton.__version__)
            )
        self.use_kernels = use_kernels
        self._direct: dict[tuple[str, bool], DirectLaunch] = {}

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
        copy = slots is not None and dest is not None
        if not n:
            return
        if not self.use_kernels:
            # One column: that column itself, XORed in place (no reduction).
            entries = sums[:, 0] if width == 1 else sums.sum(dim=1)
            entries.bitwise_xor_(tags)
            table.index_copy_(0, ids, entries)
            if copy:
                assert slots is not None and dest is not None
                dest.index_copy_(0, slots, entries)
            return
        assert sums.stride(1) == 1 and sums.stride(0) == width
        _check_flat(tags, ids, table, slots, dest)
        target = dest if dest is not None and copy else table
        args = (
            sums,
            width,
            tags,
            ids,
            table,
            table.numel(),
            slots if slots is not None and copy else ids,
            target,
            target.numel(),
            n,
        )
        self._launch("write", copy, _write_entries_kernel, args, n, COPY=copy)

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
        if not self.use_kernels:
            if dst_idx is None:
                torch.index_select(src, 0, src_idx, out=dst[:n])
            else:
                dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))
            return
        scatter = dst_idx is not None
        _check_flat(src, src_idx, dst, dst_idx)
        args = (
            src,
            src.numel(),
            src_idx,
            dst,
            dst.numel(),
            dst_idx if dst_idx is not None else src_idx,
            n,
        )
        self._launch("move", scatter, _move_entries_kernel, args, n, SCATTER=scatter)

    def warm_up(self, device: torch.device) -> None:
        """Compile and run every variant once on scratch tensors (R62: not in
        the first step that stores or loads)."""
        scratch = torch.zeros(4, dtype=torch.int64, device=device)
        index = torch.zeros(1, dtype=torch.int64, device=device)
        sums = scratch[:2].view(1, 2)
        self.write(sums, scratch[2:3], index, scratch[3:])
        self.write(sums, scratch[2:3], index, scratch[3:], index, scratch[2:])
        self.move(scratch, index, scratch[3:])
        self.move(scratch, index, scratch[3:], index)

    def _launch(
        self,
        name: str,
        variant: bool,
        kernel: object,
        args: Sequence[object],
        n: int,
        **constexprs: object,
    ) -> None:
        """One launch: the captured kernel's launcher when it has one and the
        counts fit the 32 bits it was compiled for, else the JIT (whose
        first call is captured)."""
        grid = ((n + ENTRY_BLOCK - 1) // ENTRY_BLOCK, 1, 1)
        key = (name, variant)
        direct = self._direct.get(key)
        fits = max(a for a in args if isinstance(a, int)) <= _INT32_MAX
        if direct is not None and direct.compiled is not None and fits:
            addresses = [
                a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args
            ]
            if direct.launch(grid, addresses):
                return
            if direct.compiled is None:  # the launcher raised
                self._no_direct_launch()
        constants = dict(constexprs, BLOCK=ENTRY_BLOCK)  # the JIT path only
        compiled = kernel[grid](*args, **constants)  # type: ignore[index]
        names = getattr(kernel, "arg_names", None)
        if not DIRECT_LAUNCH or names is None or not fits:
            return
        if direct is None:
            direct = self._direct[key] = DirectLaunch()
        if direct.pending:
            direct.capture(compiled, names, len(args), constants)
            if direct.compiled is None:  # no launcher to capture
                self._no_direct_launch()

    def _no_direct_launch(self) -> None:
        """Without a direct launch every call would pay the JIT's per-call
        work: later calls take the PyTorch operations (unless forced)."""
        if not self.forced:
            logger.info("KV checksums: entry writes use PyTorch operations.")
            self.use_kernels = False


@functools.cache
def entry_kernels(device: torch.device) -> EntryKernels:
    """The one `EntryKernels` of `device` the block table and the host slots
    share (one capture of each launch per process)."""
    return EntryKernels(device)


def _check_flat(*tensors: torch.Tensor | None) -> None:
    """The kernels index every one-dimensional operand by element."""
    for tensor in tensors:
        if tensor is not None:
            assert tensor.dim() == 1 and (tensor.numel() < 2 or tensor.stride(0) == 1)
