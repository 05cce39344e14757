# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block checksum kernels: one fused Triton launch per layout, and a PyTorch path.

For a row (block id, first token f of the block in the request, valid token
count v) and a layer view ``[blocks, kernel_blocks, heads, tokens, pieces]``
that starts `o` tokens into the block (o = 0 except for the chunk views of a
producer's send pass, R135), a launch adds into ``out[row, column]``, mod 2^64::

    sum over kb, h, t, p with tt = kb * tokens + t < v - o of
        mix(x[block, kb, h, t, p]) * (2 * (first_slice + h) + 1) * (2 * j + 1),
    j = (f + o + tt) * pieces + p

where x is the piece read as an unsigned integer and mix is SplitMix64's
finalizer (definition v2, R137; SPEC sections 4 and 8).

This module imports only torch, the standard library and, optionally, Triton
(no vLLM), so it can be tested and benchmarked standalone on any CUDA host.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the installation
    HAS_TRITON = False

# Piece width in bits of each supported view dtype; narrower pieces are
# zero-extended to 64 bits (R21, R23).
PIECE_BITS: dict[torch.dtype, int] = {torch.int64: 64, torch.int32: 32, torch.int16: 16}

# Pieces of one block that one Triton program covers (R57): an attention
# block is one program, a multi-megabyte Mamba row spreads over many SMs.
CHUNK_PIECES = 16384
# Largest tile of pieces a program loads per loop iteration (R58).
MAX_TILE_PIECES = 1024
# Warps per program, at most one per WARP_PIECES pieces of a tile. With the
# vector loop below, 4 warps took 0.94-0.98 of 8 warps' time on every
# head-major shape of two H200 runs (token-major 1.01; benchmark --variants,
# h200_kernel_variants_2026-12-02b/-02c); without it 8 warps were faster.
NUM_WARPS = 4
WARP_PIECES = 128
# Full rows load without masks, dense views by lane index with 16-byte
# alignment hints (128-bit loads); on since two H200 variant runs agreed
# (issue 30, R143; benchmark --variants).
VECTOR_FULL_TILES = True
# With VECTOR_FULL_TILES, blocks stored token-major ([kernel block, token,
# head, piece], FlashAttention's NHD layout) are walked in memory order, so
# their tiles are contiguous too (DENSE == 3; issue 30 item 1). On an H200
# the previous loop took 5.3 % longer on token-major blocks and head-major ones
# did not change (benchmark --variants, "vector 4w head order";
# h200_kernel_variants_8f9458e_2026-12-02d).
TOKEN_ORDER_TILES = True
# Upper bound of the data one gather of the PyTorch path materializes, counted
# as widened int64 pieces (R63). Read at call time so tests can shrink it.
GATHER_CHUNK_BYTES = 64 << 20

_U64 = 1 << 64

# SplitMix64's finalizer multipliers (R137).
MIX_MUL1 = 0xBF58476D1CE4E5B9
MIX_MUL2 = 0x94D049BB133111EB


@dataclass(frozen=True)
class LaunchConfig:
    """Launch shape of the Triton kernel; any value gives the same sums.

    `chunk_pieces` is the work item (pieces of one block per item, a multiple
    of the tile), `vector_full_tiles` gives rows whose slots are all valid a
    loop without masks (dense views: lane-index offsets and 16-byte-aligned
    tiles, so 128-bit loads), and with it `token_order_tiles` walks blocks
    stored contiguously token-major in memory order (contiguous tiles there
    too).
    """

    max_tile: int
    chunk_pieces: int
    num_warps: int
    warp_pieces: int
    vector_full_tiles: bool = False
    token_order_tiles: bool = True

    def __post_init__(self) -> None:
        for name in ("max_tile", "chunk_pieces", "num_warps", "warp_pieces"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")


def default_config() -> LaunchConfig:
    """The tuned launch shape, read from the module constants at call time."""
    return LaunchConfig(
        max_tile=MAX_TILE_PIECES,
        chunk_pieces=CHUNK_PIECES,
        num_warps=NUM_WARPS,
        warp_pieces=WARP_PIECES,
        vector_full_tiles=VECTOR_FULL_TILES,
        token_order_tiles=TOKEN_ORDER_TILES,
    )


def _wrap_int64(value: int) -> int:
    """`value` mod 2^64 as a signed int64 (the stored form of a uint64)."""
    value %= _U64
    return value - _U64 if value >= 1 << 63 else value


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def mix_int64(pieces: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 pieces read as uint64, in wrapping int64.

    Right shifts of int64 are arithmetic, so each is masked to its logical
    result; products wrap mod 2^64 like uint64 ones (R137).
    """
    z = pieces ^ ((pieces >> 30) & ((1 << 34) - 1))
    z = z * _wrap_int64(MIX_MUL1)
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _wrap_int64(MIX_MUL2)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


if HAS_TRITON:

    @triton.jit
    def _as_piece_pointer(addr, PIECE_BITS: tl.constexpr, ALIGNED: tl.constexpr):
        """Cast an absolute int64 address from the layer table to a piece pointer."""
        if PIECE_BITS == 64:
            ptr = addr.to(tl.pointer_type(tl.int64))
        elif PIECE_BITS == 32:
            ptr = addr.to(tl.pointer_type(tl.int32))
        else:
            ptr = addr.to(tl.pointer_type(tl.int16))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def _widen(x, PIECE_BITS: tl.constexpr):
        """Loaded pieces as uint64, narrow ones zero-extended (never sign-extended)."""
        if PIECE_BITS == 64:
            wide = x.to(tl.uint64, bitcast=True)
        elif PIECE_BITS == 32:
            wide = x.to(tl.uint32, bitcast=True).to(tl.uint64)
        else:
            wide = x.to(tl.uint16, bitcast=True).to(tl.uint64)
        return wide

    @triton.jit
    def _mix(z):
        """SplitMix64's finalizer on uint64 pieces (R137); mix(0) = 0, so masked
        lanes loaded as 0 still add nothing."""
        z = z ^ (z >> 30)
        z = z * 0xBF58476D1CE4E5B9
        z = z ^ (z >> 27)
        z = z * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _below_2_32(value, span: tl.constexpr):
        """Whether value, ..., value + span (uint64, no wrap-around) are < 2^32."""
        return ((value >> 32) == 0) & (((value + span) >> 32) == 0)

    @triton.jit
    def _u32_to_u64(value):
        """A value known to be below 2^32 as a zero-extended uint64.

        The explicit 32-bit round trip lets the compiler use one 32 x 32 -> 64
        multiply-add instead of a 64 x 64 multiply.
        """
        return value.to(tl.uint32).to(tl.uint64)

    @triton.jit
    def _head_tiles_sum(
        work,
        strides,
        HEADS: tl.constexpr,
        TOKENS: tl.constexpr,
        PIECES: tl.constexpr,
        PIECE_BITS: tl.constexpr,
        TILE: tl.constexpr,
        NARROW: tl.constexpr,
        LANE32: tl.constexpr,
        FULL: tl.constexpr,
        DENSE: tl.constexpr,
        TILE_ALIGNED: tl.constexpr,
    ):
        """Sum of a chunk whose tiles each lie in one (kernel block, head).

        A tile is whole tokens (TILE a multiple of PIECES) or part of one token
        (PIECES a multiple of TILE), so per-lane offsets, token numbers and
        weight increments are loop-invariant vectors and the rest are scalars
        of the tile: 2j + 1 = (c0 + 2 * first_j) + 2 * lane. With NARROW it is
        below 2^32, so the weight is one 32 x 32 -> 64-bit product; with LANE32
        the lane offsets are int32, so each address is one wide add.

        Fast path (LaunchConfig.vector_full_tiles): FULL (every slot of the row
        valid) loads without a mask; DENSE >= 1 (pieces of a tile contiguous)
        makes the lane offsets the lane index, DENSE == 2 (the whole block
        contiguous in [kernel block, head, token, piece] order) the tile offset
        the tile's start; TILE_ALIGNED (checked on the host) marks each tile
        16-byte aligned. Together they allow 128-bit loads; the pieces read and
        their weights are the same, so is the sum.
        """
        base, block_offset, valid, m0, c0, chunk_start, num_tiles = work
        kernel_block_stride, head_stride, token_stride, piece_stride = strides
        SLICE_PIECES: tl.constexpr = TOKENS * PIECES
        lane = tl.arange(0, TILE)
        lane_token = lane // PIECES
        if DENSE >= 1:
            lane_offset = lane
        elif LANE32:
            lane_offset = lane_token * token_stride + (lane % PIECES) * piece_stride
        else:
            lane_offset = (
                lane_token.to(tl.int64) * token_stride
                + (lane % PIECES).to(tl.int64) * piece_stride
            )
        lane_weight = lane * 2
        acc = tl.zeros([TILE], dtype=tl.uint64)
        for tile in range(num_tiles):
            start = chunk_start + tile * TILE
            slice_index = start // SLICE_PIECES
            head = slice_index % HEADS
            kernel_block = slice_index // HEADS
            token = (start % SLICE_PIECES) // PIECES
            slot = kernel_block * TOKENS + token
            if DENSE == 2:
                tile_offset = block_offset + start
            else:
                tile_offset = (
                    block_offset
                    + kernel_block.to(tl.int64) * kernel_block_stride
                    + head.to(tl.int64) * head_stride
                    + token.to(tl.int64) * token_stride
                )
            first_j = slot * PIECES
            if PIECES > TILE:
                # Part of one token: the tile starts inside it, TILE-aligned.
                piece = tl.multiple_of(start % PIECES, TILE)
                if DENSE != 2:
                    tile_offset += piece.to(tl.int64) * piece_stride
                first_j += piece
            tile_ptr = base + tile_offset
            if TILE_ALIGNED:
                tile_ptr = tl.multiple_of(tile_ptr, 16)
            if FULL:
                x = tl.load(tile_ptr + lane_offset)
            else:
                x = tl.load(
                    tile_ptr + lane_offset,
                    mask=lane_token < valid - slot,
                    other=0,
                )
            m = m0 + head.to(tl.uint64) * 2
            odd = c0 + first_j.to(tl.uint64) * 2
            if NARROW:
                odd_lane = odd.to(tl.uint32) + lane_weight.to(tl.uint32)
                weight = _u32_to_u64(m) * _u32_to_u64(odd_lane)
            else:
                weight = m * odd + m * _u32_to_u64(lane_weight)
            acc += _mix(_widen(x, PIECE_BITS)) * weight
        return tl.sum(acc, axis=0)

    @triton.jit
    def _token_tiles_sum(
        work,
        HEADS: tl.constexpr,
        PIECES: tl.constexpr,
        PIECE_BITS: tl.constexpr,
        TILE: tl.constexpr,
        NARROW: tl.constexpr,
        FULL: tl.constexpr,
        TILE_ALIGNED: tl.constexpr,
    ):
        """Sum of a chunk of a block stored contiguously token-major (DENSE == 3).

        The chunk is memory-order pieces [chunk_start, chunk_start + num_tiles
        * TILE) of the block, [kernel block, token, head, piece]: a tile is
        TILE contiguous pieces (lane offset = lane index, tile offset = its
        start, so 128-bit loads) and a lane's slot, head and piece come from
        its memory index i: slot = i // ROW, head = (i // PIECES) % HEADS,
        piece = i % PIECES with ROW = HEADS * PIECES. The host takes this loop
        only when ROW and PIECES are powers of two, PIECES <= TILE and TILE
        divides the block, so each is a loop-invariant lane vector plus a tile
        scalar (the tile's slot; its head when TILE < ROW) and no lane lies
        past the block. Same pieces and weights as the other loops, so the
        same sum.
        """
        base, block_offset, valid, m0, c0, chunk_start, num_tiles = work
        ROW: tl.constexpr = HEADS * PIECES
        lane = tl.arange(0, TILE)
        lane_slot = lane // ROW
        # m = m0 + 2 * head and 2j + 1 = c0 + 2 * (slot * PIECES + piece).
        lane_m = ((lane // PIECES) % HEADS) * 2
        lane_odd = (lane_slot * PIECES + lane % PIECES) * 2
        acc = tl.zeros([TILE], dtype=tl.uint64)
        for tile in range(num_tiles):
            start = chunk_start + tile * TILE
            tile_slot = start // ROW
            tile_ptr = base + block_offset + start
            if TILE_ALIGNED:
                tile_ptr = tl.multiple_of(tile_ptr, 16)
            if FULL:
                x = tl.load(tile_ptr + lane)
            else:
                x = tl.load(
                    tile_ptr + lane, mask=lane_slot < valid - tile_slot, other=0
                )
            m = m0
            if TILE < ROW:
                # The tile lies inside one token's row, from head tile_head on.
                m += ((start % ROW) // PIECES).to(tl.uint64) * 2
            odd = c0 + (tile_slot * PIECES).to(tl.uint64) * 2
            if NARROW:
                weight = _u32_to_u64(m.to(tl.uint32) + lane_m.to(tl.uint32)) * (
                    _u32_to_u64(odd.to(tl.uint32) + lane_odd.to(tl.uint32))
                )
            else:
                weight = (m + lane_m.to(tl.uint64)) * (odd + lane_odd.to(tl.uint64))
            acc += _mix(_widen(x, PIECE_BITS)) * weight
        return tl.sum(acc, axis=0)

    @triton.jit
    def _flat_tiles_sum(
        work,
        strides,
        HEADS: tl.constexpr,
        TOKENS: tl.constexpr,
        PIECES: tl.constexpr,
        PIECE_BITS: tl.constexpr,
        TILE: tl.constexpr,
        NARROW: tl.constexpr,
        KERNEL_BLOCKS: tl.constexpr,
        FULL: tl.constexpr,
    ):
        """Sum of a chunk of any block shape: each lane decodes its own piece.

        FULL (every slot of the row valid) drops the mask when TILE divides the
        block, so that no lane lies past it.
        """
        base, block_offset, valid, m0, c0, chunk_start, num_tiles = work
        kernel_block_stride, head_stride, token_stride, piece_stride = strides
        SLICE_PIECES: tl.constexpr = TOKENS * PIECES
        lane = tl.arange(0, TILE)
        limit = valid * PIECES
        acc = tl.zeros([TILE], dtype=tl.uint64)
        for tile in range(num_tiles):
            index = chunk_start + tile * TILE + lane
            slice_index = index // SLICE_PIECES
            in_slice = index % SLICE_PIECES
            head = slice_index % HEADS
            kernel_block = slice_index // HEADS
            # j - first_token * PIECES: (kernel_block * TOKENS + t) * PIECES + p.
            local = kernel_block * SLICE_PIECES + in_slice
            offset = (
                block_offset
                + kernel_block.to(tl.int64) * kernel_block_stride
                + head.to(tl.int64) * head_stride
                + (in_slice // PIECES).to(tl.int64) * token_stride
                + (in_slice % PIECES).to(tl.int64) * piece_stride
            )
            # Lanes past the block decode to kernel_block >= KERNEL_BLOCKS, so
            # local >= limit masks them too.
            if FULL and (KERNEL_BLOCKS * HEADS * SLICE_PIECES) % TILE == 0:
                x = tl.load(base + offset)
            else:
                x = tl.load(base + offset, mask=local < limit, other=0)
            m = m0 + head.to(tl.uint64) * 2
            odd = c0 + local.to(tl.uint64) * 2
            weight = _u32_to_u64(m) * _u32_to_u64(odd) if NARROW else m * odd
            acc += _mix(_widen(x, PIECE_BITS)) * weight
        return tl.sum(acc, axis=0)

    @triton.jit
    def _tiles_sum(
        work,
        strides,
        KERNEL_BLOCKS: tl.constexpr,
        HEADS: tl.constexpr,
        TOKENS: tl.constexpr,
        PIECES: tl.constexpr,
        PIECE_BITS: tl.constexpr,
        TILE: tl.constexpr,
        HEAD_TILES: tl.constexpr,
        NARROW: tl.constexpr,
        LANE32: tl.constexpr,
        FULL: tl.constexpr,
        DENSE: tl.constexpr,
        TILE_ALIGNED: tl.constexpr,
    ):
        """One program's uint64 sum, by the loop its block shape and layout
        allow: memory order for a dense token-major block (DENSE == 3, only
        with VECTOR), else head tiles (HEAD_TILES), else one piece per lane."""
        if DENSE == 3:
            total = _token_tiles_sum(
                work,
                HEADS,
                PIECES,
                PIECE_BITS,
                TILE,
                NARROW,
                FULL,
                TILE_ALIGNED,
            )
        elif HEAD_TILES:
            total = _head_tiles_sum(
                work,
                strides,
                HEADS,
                TOKENS,
                PIECES,
                PIECE_BITS,
                TILE,
                NARROW,
                LANE32,
                FULL,
                DENSE,
                TILE_ALIGNED,
            )
        else:
            total = _flat_tiles_sum(
                work,
                strides,
                HEADS,
                TOKENS,
                PIECES,
                PIECE_BITS,
                TILE,
                NARROW,
                KERNEL_BLOCKS,
                FULL,
            )
        return total

    @triton.jit
    def _chunk_sum(
        work,
        strides,
        KERNEL_BLOCKS: tl.constexpr,
        HEADS: tl.constexpr,
        TOKENS: tl.constexpr,
        PIECES: tl.constexpr,
        PIECE_BITS: tl.constexpr,
        TILE: tl.constexpr,
        HEAD_TILES: tl.constexpr,
        NARROW: tl.constexpr,
        LANE32: tl.constexpr,
        VECTOR: tl.constexpr,
        DENSE: tl.constexpr,
        TILE_ALIGNED: tl.constexpr,
    ):
        """One program's uint64 sum. With VECTOR a row whose slots are all
        valid (every row but a request's last, in practice) takes a copy of the
        loop without masks; the others keep the masked loop."""
        if VECTOR:
            valid = work[2]
            if valid == KERNEL_BLOCKS * TOKENS:
                total = _tiles_sum(
                    work,
                    strides,
                    KERNEL_BLOCKS,
                    HEADS,
                    TOKENS,
                    PIECES,
                    PIECE_BITS,
                    TILE,
                    HEAD_TILES,
                    NARROW,
                    LANE32,
                    True,
                    DENSE,
                    TILE_ALIGNED,
                )
            else:
                total = _tiles_sum(
                    work,
                    strides,
                    KERNEL_BLOCKS,
                    HEADS,
                    TOKENS,
                    PIECES,
                    PIECE_BITS,
                    TILE,
                    HEAD_TILES,
                    NARROW,
                    LANE32,
                    False,
                    DENSE,
                    TILE_ALIGNED,
                )
        else:
            total = _tiles_sum(
                work,
                strides,
                KERNEL_BLOCKS,
                HEADS,
                TOKENS,
                PIECES,
                PIECE_BITS,
                TILE,
                HEAD_TILES,
                NARROW,
                LANE32,
                False,
                DENSE,
                TILE_ALIGNED,
            )
        return total

    @triton.jit
    def _add_item_checksum(
        table_ptr,
        row_ptr,
        rows_field_stride,
        out_row_ptr,
        out_col_stride,
        chunk,
        layer,
        block_stride,
        strides,
        KERNEL_BLOCKS: tl.constexpr,
        HEADS: tl.constexpr,
        TOKENS: tl.constexpr,
        PIECES: tl.constexpr,
        PIECE_BITS: tl.constexpr,
        CHUNK: tl.constexpr,
        TILE: tl.constexpr,
        HEAD_TILES: tl.constexpr,
        ALIGNED: tl.constexpr,
        LANE32: tl.constexpr,
        VECTOR: tl.constexpr,
        DENSE: tl.constexpr,
        TILE_ALIGNED: tl.constexpr,
    ):
        """Add one work item's sum (a chunk of one row's block of one layer) into
        out[row, column] with one atomic; rows with no valid slot add nothing.

        A row whose weights all fit 32 bits takes the narrow weight loop, the
        others the 64-bit one; both give the same sum mod 2^64.
        """
        SLOT_PIECES: tl.constexpr = KERNEL_BLOCKS * TOKENS * PIECES
        BLOCK_PIECES: tl.constexpr = SLOT_PIECES * HEADS
        token_offset = tl.load(table_ptr + layer * 4 + 3)
        valid = tl.load(row_ptr + 2 * rows_field_stride) - token_offset
        if valid > 0:
            block = tl.load(row_ptr)
            first_token = tl.load(row_ptr + rows_field_stride) + token_offset
            addr = tl.load(table_ptr + layer * 4)
            first_slice = tl.load(table_ptr + layer * 4 + 1)
            column = tl.load(table_ptr + layer * 4 + 2)
            base = _as_piece_pointer(addr, PIECE_BITS, ALIGNED)
            block_offset = block * block_stride
            slot_tokens = tl.minimum(valid, KERNEL_BLOCKS * TOKENS).to(tl.int32)
            # m = 2 * (first_slice + h) + 1 = m0 + 2h and, with the piece's
            # local index lj = (kernel_block * TOKENS + t) * PIECES + p,
            # 2j + 1 = c0 + 2lj.
            m0 = first_slice.to(tl.uint64, bitcast=True) * 2 + 1
            c0 = first_token.to(tl.uint64, bitcast=True) * (2 * PIECES) + 1
            chunk_start = chunk * CHUNK
            chunk_end = tl.minimum(chunk_start + CHUNK, BLOCK_PIECES)
            num_tiles = tl.cdiv(chunk_end - chunk_start, TILE)
            work = (base, block_offset, slot_tokens, m0, c0, chunk_start, num_tiles)
            # Every factor and odd weight of the row below 2^32 (always, in
            # practice): 32 x 32 -> 64-bit weight products suffice.
            narrow = _below_2_32(m0, 2 * (HEADS - 1)) & _below_2_32(
                c0, 2 * (SLOT_PIECES - 1)
            )
            if narrow:
                total = _chunk_sum(
                    work,
                    strides,
                    KERNEL_BLOCKS,
                    HEADS,
                    TOKENS,
                    PIECES,
                    PIECE_BITS,
                    TILE,
                    HEAD_TILES,
                    True,
                    LANE32,
                    VECTOR,
                    DENSE,
                    TILE_ALIGNED,
                )
            else:
                total = _chunk_sum(
                    work,
                    strides,
                    KERNEL_BLOCKS,
                    HEADS,
                    TOKENS,
                    PIECES,
                    PIECE_BITS,
                    TILE,
                    HEAD_TILES,
                    False,
                    LANE32,
                    VECTOR,
                    DENSE,
                    TILE_ALIGNED,
                )
            tl.atomic_add(
                out_row_ptr + column * out_col_stride,
                total.to(tl.int64, bitcast=True),
                sem="relaxed",
            )

    @triton.jit(
        do_not_specialize=[
            "rows_ptr",
            "rows_field_stride",
            "rows_row_stride",
            "out_ptr",
            "out_row_stride",
            "out_col_stride",
            "num_rows",
            "num_layers",
        ]
    )
    def _kv_checksum_kernel(
        table_ptr,
        rows_ptr,
        rows_field_stride,
        rows_row_stride,
        out_ptr,
        out_row_stride,
        out_col_stride,
        num_rows,
        num_layers,
        block_stride,
        kernel_block_stride,
        head_stride,
        token_stride,
        piece_stride,
        KERNEL_BLOCKS: tl.constexpr,
        HEADS: tl.constexpr,
        TOKENS: tl.constexpr,
        PIECES: tl.constexpr,
        PIECE_BITS: tl.constexpr,
        CHUNK: tl.constexpr,
        TILE: tl.constexpr,
        HEAD_TILES: tl.constexpr,
        ALIGNED: tl.constexpr,
        LANE32: tl.constexpr,
        VECTOR: tl.constexpr,
        DENSE: tl.constexpr,
        TILE_ALIGNED: tl.constexpr,
    ):
        """Add the checksums of block rows into their output columns, all layers.

        A work item (r, c, l) reads row r of `rows` (block id, first token of
        the block in the request, valid token count) and entry l of the layer
        table (absolute data address, first slice, output column, token offset
        of the view in the block: non-zero only for a send pass's chunk views,
        R135). It walks pieces [c * CHUNK, (c + 1) * CHUNK) of the block in the
        flat order [kernel block, head, token, piece], TILE pieces per
        iteration, addressing them through the view strides, so head-major,
        token-major and kernel-split layouts need no copy; a block stored
        contiguously token-major (DENSE == 3) is walked in its memory order
        [kernel block, token, head, piece] instead, so its tiles are
        contiguous (the items then split the block differently; they still
        cover each piece once, so the sum is the same). It computes each
        weight m * (2j + 1) in place, mixes each piece (R137), masks slots at
        or past the valid count, accumulates in uint64 (wrap-around is the mod
        2^64) and adds its sum to out[r, column] with one atomic, so items may
        finish in any order.

        Grid (rows, chunks, layers): one program per item.

        Rows, outputs, their strides and counts are not specialized (nor are
        slices and columns, read from the table), so the variant compiled at
        warm-up serves every call of a launch.
        """
        strides = (kernel_block_stride, head_stride, token_stride, piece_stride)
        row = tl.program_id(0).to(tl.int64)
        _add_item_checksum(
            table_ptr,
            rows_ptr + row * rows_row_stride,
            rows_field_stride,
            out_ptr + row * out_row_stride,
            out_col_stride,
            tl.program_id(1),
            tl.program_id(2),
            block_stride,
            strides,
            KERNEL_BLOCKS,
            HEADS,
            TOKENS,
            PIECES,
            PIECE_BITS,
            CHUNK,
            TILE,
            HEAD_TILES,
            ALIGNED,
            LANE32,
            VECTOR,
            DENSE,
            TILE_ALIGNED,
        )


class KVChecksumLaunch:
    """One fused launch: every layer view sharing one layout (R61).

    Construct once at start-up from the layer views (strided int64, int32 or
    int16 views over the KV cache, never copied); each call adds the checksums
    of a batch of block rows into an output matrix. The Triton backend reads a
    device table of (data address, first slice, output column, token offset)
    per layer built here, so one launch serves all layers; the PyTorch backend
    is the reference and the CPU path (R56). `backend` says which one runs;
    `config` (default: `default_config()`) shapes the Triton launch.
    A view with token offset o covers the block's tokens from o on (a chunk
    view of a send pass, R135): its weights count from the block's first token
    plus o and its valid count is the row's minus o.
    """

    def __init__(
        self,
        views: Sequence[torch.Tensor],
        first_slices: Sequence[int],
        columns: Sequence[int],
        backend: str | None = None,
        token_offsets: Sequence[int] | None = None,
        config: LaunchConfig | None = None,
    ) -> None:
        _check_views(views)
        if token_offsets is None:
            token_offsets = [0] * len(views)
        if not len(views) == len(first_slices) == len(columns) == len(token_offsets):
            raise ValueError(
                "views, first_slices, columns and token_offsets differ in length"
            )
        if min(columns) < 0 or min(token_offsets) < 0:
            raise ValueError("output columns and token offsets must be non-negative")
        self.views = list(views)
        self.first_slices = [int(s) for s in first_slices]
        self.columns = [int(c) for c in columns]
        self.token_offsets = [int(o) for o in token_offsets]
        self.device = views[0].device
        kernel_blocks, heads, tokens, pieces = (int(d) for d in views[0].shape[1:])
        self.shape = (kernel_blocks, heads, tokens, pieces)
        self.piece_bits = PIECE_BITS[views[0].dtype]
        self.backend = _pick_backend(backend, self.device)
        self.config = config or default_config()
        if self.backend == "triton":
            self._init_triton()
        else:
            self._init_torch()

    def __call__(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Add each row's checksum of every layer into out[row, column] (R53).

        `rows` is int64 [3, R] (block id, first token, valid tokens) and `out`
        int64 [R, C], both on the views' device; either may be a slice of a
        wider tensor. Sums wrap mod 2^64. R == 0 does nothing.
        """
        if rows.shape[1] == 0:
            return
        if self.backend == "triton":
            self._call_triton(rows, out)
        else:
            self._call_torch(rows, out)

    def warm_up(self) -> None:
        """Run the launch once on an all-masked row so Triton compiles now (R62)."""
        rows = torch.zeros((3, 1), dtype=torch.int64, device=self.device)
        out = torch.zeros(
            (1, max(self.columns) + 1), dtype=torch.int64, device=self.device
        )
        self(rows, out)

    # Triton backend.

    def _init_triton(self) -> None:
        """Build the layer table and the compile-time constants of the launch."""
        kernel_blocks, heads, tokens, pieces = self.shape
        config = self.config
        tile, head_tiles = pick_tile(self.shape, config.max_tile, config.chunk_pieces)
        self._strides = tuple(self.views[0].stride())
        token_tile = self._token_order_tile()
        if token_tile:
            # The memory-order loop replaces both others (DENSE == 3).
            tile, head_tiles = token_tile, False
        self._table = torch.tensor(
            [
                [view.data_ptr(), _wrap_int64(first_slice), column, offset]
                for view, first_slice, column, offset in zip(
                    self.views, self.first_slices, self.columns, self.token_offsets
                )
            ],
            dtype=torch.int64,
            device=self.device,
        )
        self._num_chunks = math.ceil(math.prod(self.shape) / config.chunk_pieces)
        # A tile's largest lane offset fits int32: one wide add per address.
        token_stride, piece_stride = self._strides[3], self._strides[4]
        lane_span = (tile - 1) // pieces * abs(token_stride) + (
            min(tile, pieces) - 1
        ) * abs(piece_stride)
        self._constants = dict(
            KERNEL_BLOCKS=kernel_blocks,
            HEADS=heads,
            TOKENS=tokens,
            PIECES=pieces,
            PIECE_BITS=self.piece_bits,
            CHUNK=config.chunk_pieces,
            TILE=tile,
            HEAD_TILES=head_tiles,
            ALIGNED=all(view.data_ptr() % 16 == 0 for view in self.views),
            LANE32=lane_span < 1 << 31,
            **self._vector_constants(tile, head_tiles, token_tile > 0),
            num_warps=max(1, min(config.num_warps, tile // config.warp_pieces)),
        )

    def _token_order_tile(self) -> int:
        """The tile of the memory-order loop (DENSE == 3), 0 if not taken.

        Taken with `vector_full_tiles` and `token_order_tiles` when the view's
        block is contiguous in [kernel block, token, head, piece] order but
        not in head-major order (blocks dense head-major, or with one head or
        one token where both orders agree, keep their loops), and
        `pick_token_tile` finds a tile for its shape. It does not depend on
        HEAD_TILES (which is then False: no head tiles run). A send pass's
        chunk view (R135) of a dense token-major block qualifies: its tokens
        are one contiguous run of the block.
        """
        config = self.config
        if not (config.vector_full_tiles and config.token_order_tiles):
            return 0
        if not _block_dense(self.shape, self._strides, (0, 2, 1, 3)) or _block_dense(
            self.shape, self._strides, (0, 1, 2, 3)
        ):
            return 0
        return pick_token_tile(self.shape, config.max_tile, config.chunk_pieces)

    def _vector_constants(
        self, tile: int, head_tiles: bool, token_order: bool
    ) -> dict[str, object]:
        """VECTOR, DENSE and TILE_ALIGNED of `vector_full_tiles` (all off without it).

        DENSE: 1 if a head tile's pieces are contiguous (lane offset = lane
        index), 2 if the whole block is, in [kernel block, head, token, piece]
        order (tile offset = its start), 3 with `token_order` (the block is
        contiguous in [kernel block, token, head, piece] order and walked in
        it; tile offset = its start, lane offset = lane index). TILE_ALIGNED:
        every tile of a dense loop starts 16 bytes aligned (every view, every
        stride that moves a tile and the tile itself in whole 16 bytes; in
        memory order only blocks and whole tiles move it).
        """
        if not self.config.vector_full_tiles:
            return dict(VECTOR=False, DENSE=0, TILE_ALIGNED=False)
        strides = self._strides
        pieces, token_stride, piece_stride = self.shape[3], strides[3], strides[4]
        dense = 0
        if token_order:
            dense = 3
        elif head_tiles and (pieces == 1 or piece_stride == 1):
            if tile <= pieces or token_stride == pieces:
                dense = 1
            if _block_dense(self.shape, strides, (0, 1, 2, 3)):
                dense = 2
        item = self.piece_bits // 8
        if token_order:
            # In memory order only blocks (and whole tiles) move a tile.
            moving = [strides[0]]
        else:
            # Strides between tiles: of blocks, kernel blocks, heads and tokens
            # (pieces move a tile by multiples of the tile).
            moving = [strides[0]] + [
                stride for size, stride in zip(self.shape[:3], strides[1:4]) if size > 1
            ]
        aligned = (
            dense > 0
            and all(view.data_ptr() % 16 == 0 for view in self.views)
            and all(stride * item % 16 == 0 for stride in moving)
            and tile * item % 16 == 0
        )
        return dict(VECTOR=True, DENSE=dense, TILE_ALIGNED=aligned)

    def _call_triton(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        num_rows, num_layers = rows.shape[1], len(self.views)
        grid = (num_rows, self._num_chunks, num_layers)
        _kv_checksum_kernel[grid](
            self._table,
            rows,
            rows.stride(0),
            rows.stride(1),
            out,
            out.stride(0),
            out.stride(1),
            num_rows,
            num_layers,
            *self._strides,
            **self._constants,
        )

    # PyTorch backend.

    def _init_torch(self) -> None:
        """Precompute per-layer weights of a block at the request start (R63).

        w[kb, h, t, p] = m_h * (2 * (tt * P + p) + 1) with m folded in; a block
        at first token f adds f * sum(x * 2 * P * m_h) on top (block-start term).
        """
        kernel_blocks, heads, tokens, pieces = self.shape
        device = self.device
        slots = torch.arange(kernel_blocks * tokens, dtype=torch.int64, device=device)
        local = slots.view(kernel_blocks, 1, tokens, 1) * pieces + torch.arange(
            pieces, dtype=torch.int64, device=device
        )
        self._slots = slots.view(1, kernel_blocks, 1, tokens, 1)
        self._weights: list[torch.Tensor] = []
        self._start_factors: list[torch.Tensor] = []
        for first_slice in self.first_slices:
            factors = torch.tensor(
                [_wrap_int64(2 * (first_slice + h) + 1) for h in range(heads)],
                dtype=torch.int64,
                device=device,
            )
            self._weights.append(factors.view(1, heads, 1, 1) * (2 * local + 1))
            self._start_factors.append(factors * (2 * pieces))

    def _call_torch(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Gather rows in bounded chunks and reduce them, layer by layer."""
        num_rows = rows.shape[1]
        block_bytes = 8 * math.prod(self.shape)
        chunk_rows = max(1, GATHER_CHUNK_BYTES // block_bytes)
        for start in range(0, num_rows, chunk_rows):
            chunk = rows[:, start : start + chunk_rows]
            for layer in range(len(self.views)):
                offset = self.token_offsets[layer]
                valid = self._slots < (chunk[2] - offset).reshape(-1, 1, 1, 1, 1)
                sums = self._layer_sums(layer, chunk[0], chunk[1] + offset, valid)
                out[start : start + chunk.shape[1], self.columns[layer]] += sums

    def _layer_sums(
        self,
        layer: int,
        blocks: torch.Tensor,
        first_tokens: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """One layer's checksums of gathered blocks, as wrapping int64 [rows]."""
        pieces = self.views[layer].index_select(0, blocks).to(torch.int64)
        if self.piece_bits < 64:
            pieces &= (1 << self.piece_bits) - 1
        pieces = mix_int64(torch.where(valid, pieces, 0))
        at_start = (pieces * self._weights[layer]).sum(dim=(1, 2, 3, 4))
        per_head = pieces.sum(dim=(1, 3, 4))
        start_term = (per_head * self._start_factors[layer]).sum(dim=1)
        return at_start + first_tokens * start_term


def pick_tile(
    shape: Sequence[int], max_tile: int | None = None, chunk: int | None = None
) -> tuple[int, bool]:
    """The Triton tile (pieces per iteration) and whether it uses head tiles.

    Head tiles (a power of two dividing tokens * pieces, holding whole tokens
    or lying inside one) make offsets and weights loop-invariant vectors plus
    tile scalars and allow vector loads; used unless they would be smaller
    than min(tile, 256) pieces. Otherwise each lane decodes its own piece.
    `max_tile` and `chunk` default to MAX_TILE_PIECES and CHUNK_PIECES. A
    dense token-major block may take `pick_token_tile`'s tile instead.
    """
    kernel_blocks, heads, tokens, pieces = shape
    slice_pieces = tokens * pieces
    tile = min(
        MAX_TILE_PIECES if max_tile is None else max_tile,
        CHUNK_PIECES if chunk is None else chunk,
        _next_power_of_2(kernel_blocks * heads * slice_pieces),
    )
    head_tile = min(tile, slice_pieces & -slice_pieces)
    if head_tile >= min(tile, 256) and (
        head_tile % pieces == 0 or pieces % head_tile == 0
    ):
        return head_tile, True
    return tile, False


def pick_token_tile(
    shape: Sequence[int], max_tile: int | None = None, chunk: int | None = None
) -> int:
    """The tile of the memory-order loop over a token-major block, 0 if none.

    With ROW = heads * pieces, ROW and pieces powers of two, the tile is the
    largest power of two dividing the block's pieces, at most `max_tile` and
    `chunk` (defaults as in `pick_tile`); it must hold at least one head's
    pieces of a token (tile >= pieces) and, like head tiles, at least
    min(tile of `pick_tile`'s flat loop, 256) pieces, else the other loops
    run.
    """
    kernel_blocks, heads, tokens, pieces = shape
    row = heads * pieces
    if row & (row - 1) or pieces & (pieces - 1):
        return 0
    block_pieces = kernel_blocks * tokens * row
    cap = min(
        MAX_TILE_PIECES if max_tile is None else max_tile,
        CHUNK_PIECES if chunk is None else chunk,
        _next_power_of_2(block_pieces),
    )
    tile = min(cap, block_pieces & -block_pieces)
    if tile < pieces or tile < min(cap, 256):
        return 0
    return tile


def _block_dense(
    shape: Sequence[int], strides: Sequence[int], order: Sequence[int]
) -> bool:
    """Whether a view's block ([kernel block, head, token, piece] sizes
    `shape`, view strides `strides` with the block stride first) is
    contiguous when walked in `order` (axes of the block, outermost first)."""
    inner = 1
    for axis in reversed(order):
        size, stride = shape[axis], strides[axis + 1]
        if size != 1 and stride != inner:
            return False
        inner *= size
    return True


def _check_views(views: Sequence[torch.Tensor]) -> None:
    """Views of one launch must share dtype, device, shape and strides (R61)."""
    if not views:
        raise ValueError("a launch needs at least one view")
    first = views[0]
    if first.dim() != 5:
        raise ValueError(f"views must be 5-D, got shape {tuple(first.shape)}")
    if first.dtype not in PIECE_BITS:
        raise ValueError(f"unsupported piece dtype {first.dtype}")
    if math.prod(first.shape[1:]) >= 1 << 31:
        raise ValueError("a block must have fewer than 2^31 pieces")
    for view in views[1:]:
        if (view.dtype, view.device, view.shape, view.stride()) != (
            first.dtype,
            first.device,
            first.shape,
            first.stride(),
        ):
            raise ValueError("views of one launch must share one layout")


def _pick_backend(backend: str | None, device: torch.device) -> str:
    """Triton when the views are on CUDA and Triton imports, else PyTorch (R56)."""
    if backend is None:
        return "triton" if HAS_TRITON and device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"unknown backend {backend!r}")
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError("the triton backend needs Triton")
    return backend
