# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests of the block checksum kernels (SPEC R17-R26, R56-R63).

Every case runs the PyTorch path (whole and in tiny gather chunks) and the
Triton kernel under Triton's CPU interpreter (default tiles, and tiny tiles and
chunks that force the head-tile path and multi-chunk rows), and compares them
with an independent NumPy reference of the per-row definition written here
(its piece mix, R137, is the one of kv_checksum_reference.py).

kernels.py and kv_checksum_reference.py import no vLLM, so they are loaded by
file path: this module (and
test_kv_checksum_cuda.py, which reuses its cases) runs without vLLM installed.
Run as a script (`--interpret`), it prints the Triton results of every case as
JSON; the interpreter tests run it in a subprocess with TRITON_INTERPRET=1,
which must be set before Triton is imported.

Each test's docstring names the bug it catches.
"""

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cpu

H = 1 << 16  # heads per layer in the definition: slice = layer * H + head
KERNELS_PATH = (
    Path(__file__).resolve().parents[4]
    / "vllm/distributed/kv_transfer/kv_checksum/definition/kernels.py"
)


REFERENCE_PATH = Path(__file__).resolve().parent / "kv_checksum_reference.py"


def load_by_path(name: str, path: Path) -> ModuleType:
    """A module by file path (it must not need vLLM), loaded once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_kernels() -> ModuleType:
    """kernels.py by file path, loaded once."""
    return load_by_path("_kv_checksum_kernels_under_test", KERNELS_PATH)


kernels = load_kernels()
mix64 = load_by_path("_kv_checksum_reference_for_kernels", REFERENCE_PATH).mix64


# --------------------------------------------------------------------------
# Cases: launches over strided views, rows and output regions.
# --------------------------------------------------------------------------


@dataclass
class LaunchSpec:
    """One KVChecksumLaunch, its rows and where its output matrix lies."""

    views: list[torch.Tensor]
    first_slices: list[int]
    columns: list[int]
    rows: np.ndarray  # int64 [3, R]: block id, first token, valid tokens
    rows_offset: int = 0  # column of the wide rows tensor holding row 0
    out_origin: tuple[int, int] = (0, 0)  # (row, column) of out in the wide matrix
    out_width: int | None = None  # columns of out (default max(columns) + 1)
    # Per view, the block token its slot 0 holds (chunk views, R135).
    token_offsets: list[int] | None = None

    def offsets(self) -> list[int]:
        return self.token_offsets or [0] * len(self.views)


@dataclass
class Case:
    launches: list[LaunchSpec]
    out_shape: tuple[int, int]
    rows_width: int
    # Known values of the wide matrix (definition test vectors, R26).
    expected: dict[tuple[int, int], int] = field(default_factory=dict)


def random_buffer(rng: np.random.Generator, nbytes: int, device: str) -> torch.Tensor:
    """Random bytes (int8, so every high bit occurs) on `device`."""
    data = rng.integers(-128, 128, size=nbytes, dtype=np.int8)
    return torch.from_numpy(data).to(device)


def make_views(
    rng: np.random.Generator,
    device: str,
    *,
    num_layers: int = 1,
    blocks: int,
    kernel_blocks: int = 1,
    heads: int,
    tokens: int,
    pieces: int,
    dtype: torch.dtype = torch.int64,
    layout: str = "head",
    pad: int = 0,
    offset: int = 2,
) -> list[torch.Tensor]:
    """Per-layer 5-D views [B, KB, H, T, P] over one random int8 buffer.

    Kernel blocks subdivide a block contiguously (the cache's first axis has
    B * KB kernel blocks); `layout` "head" stores a kernel block as [H, T, P],
    "token" as [T, H, P]; each kernel block is followed by `pad` unused
    pieces; layers lie one after another from piece `offset` on.
    """
    kernel_stride = heads * tokens * pieces + pad
    block_stride = kernel_blocks * kernel_stride
    if layout == "head":
        strides = (block_stride, kernel_stride, tokens * pieces, pieces, 1)
    else:
        assert layout == "token"
        strides = (block_stride, kernel_stride, pieces, heads * pieces, 1)
    layer_pieces = blocks * block_stride
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = random_buffer(
        rng, (offset + num_layers * layer_pieces) * itemsize, device
    ).view(dtype)
    shape = (blocks, kernel_blocks, heads, tokens, pieces)
    return [
        torch.as_strided(buffer, shape, strides, offset + layer * layer_pieces)
        for layer in range(num_layers)
    ]


def make_rows(blocks: list[int], first: list[int], valid: list[int]) -> np.ndarray:
    return np.array([blocks, first, valid], dtype=np.int64)


def single(spec: LaunchSpec) -> Case:
    """A case of one launch writing into a matrix of exactly its own size."""
    width = max(spec.columns) + 1
    return Case([spec], (spec.rows.shape[1], width), spec.rows.shape[1])


def case_head_major(device: str) -> Case:
    rng = np.random.default_rng(1)
    views = make_views(rng, device, blocks=7, heads=2, tokens=4, pieces=4)
    rows = make_rows([3, 0, 6, 3], [0, 4, 8, 100], [4, 4, 4, 4])
    return single(LaunchSpec(views, [0], [0], rows))


def case_token_major(device: str) -> Case:
    rng = np.random.default_rng(2)
    views = make_views(
        rng, device, blocks=7, heads=2, tokens=4, pieces=4, layout="token"
    )
    rows = make_rows([3, 0, 6, 3], [0, 4, 8, 100], [4, 4, 4, 4])
    return single(LaunchSpec(views, [1], [0], rows))


def case_kernel_blocks(device: str, layout: str) -> Case:
    rng = np.random.default_rng(3)
    views = make_views(
        rng,
        device,
        blocks=5,
        kernel_blocks=2,
        heads=2,
        tokens=2,
        pieces=4,
        layout=layout,
    )
    rows = make_rows([4, 1, 2, 0], [0, 4, 8, 12], [4, 3, 2, 1])
    return single(LaunchSpec(views, [2 * H + 1], [0], rows))


def case_kernel_blocks_head_tiles(device: str, layout: str) -> Case:
    """Kernel-block splits of 256-piece slices: the head-tile path."""
    rng = np.random.default_rng(18)
    views = make_views(
        rng,
        device,
        blocks=3,
        kernel_blocks=2,
        heads=2,
        tokens=4,
        pieces=64,
        layout=layout,
    )
    rows = make_rows([2, 0, 1], [0, 8, 16], [8, 6, 3])
    return single(LaunchSpec(views, [H + 3], [0], rows))


def case_partial_and_empty(device: str) -> Case:
    rng = np.random.default_rng(4)
    views = make_views(rng, device, blocks=6, heads=2, tokens=4, pieces=4)
    rows = make_rows([5, 2, 2, 0, 1, 3], [16, 20, 24, 0, 4, 8], [0, 1, 3, 4, 0, 2])
    return single(LaunchSpec(views, [3], [0], rows))


def case_large_first_slice(device: str) -> Case:
    rng = np.random.default_rng(5)
    views = make_views(rng, device, blocks=4, heads=3, tokens=4, pieces=2)
    rows = make_rows([1, 3, 0], [131056, 131060, 0], [4, 3, 4])
    return single(LaunchSpec(views, [2 * H * 40 + 3], [0], rows))


def case_huge_first_slice(device: str) -> Case:
    rng = np.random.default_rng(6)
    views = make_views(rng, device, blocks=3, heads=2, tokens=2, pieces=2)
    rows = make_rows([2, 0], [(1 << 40) + 2, 6], [2, 1])
    # m = 2 * slice + 1 >= 2^63: factors and weights must wrap as uint64.
    return single(LaunchSpec(views, [(1 << 62) + 5], [0], rows))


def case_weight_width_boundaries(
    device: str, tokens: int, pieces: int, layout: str = "head"
) -> Case:
    """Factors m and odd weights 2j + 1 just below and just above 2^32.

    The kernel multiplies 32-bit halves when a row's factors and weights fit
    in 32 bits; the first layer and the first two rows sit at that bound,
    the rest just past it.
    """
    rng = np.random.default_rng(17)
    heads = 2
    views = make_views(
        rng,
        device,
        num_layers=2,
        blocks=4,
        heads=heads,
        tokens=tokens,
        pieces=pieces,
        layout=layout,
    )
    last_narrow = ((1 << 32) - 2 * tokens * pieces) // (2 * pieces)
    rows = make_rows(
        [3, 0, 1, 2],
        [0, last_narrow, last_narrow + 1, 1 << 33],
        [tokens, tokens, tokens - 1, tokens],
    )
    slices = [(1 << 31) - heads, (1 << 31) - heads + 1]
    return single(LaunchSpec(views, slices, [0, 1], rows))


def case_one_head_32x36(device: str) -> Case:
    rng = np.random.default_rng(7)
    views = make_views(rng, device, blocks=3, heads=1, tokens=32, pieces=36)
    rows = make_rows([2, 0, 1, 2], [0, 32, 64, 96], [32, 17, 0, 31])
    return single(LaunchSpec(views, [9], [0], rows))


def case_vllm_block(device: str, layout: str) -> Case:
    """16 tokens x 64 pieces (bf16 K and V, head size 128): the head-tile path."""
    rng = np.random.default_rng(8)
    views = make_views(
        rng, device, blocks=5, heads=2, tokens=16, pieces=64, layout=layout
    )
    rows = make_rows([4, 2, 3], [0, 32, 48], [16, 9, 0])
    return single(LaunchSpec(views, [4 * H + 2], [0], rows))


def case_vllm_block_int16(device: str) -> Case:
    """bf16 elements as int16 pieces, 16 tokens x 256 pieces (head size 128,
    K and V): head tiles over 2-byte pieces; full, partial and one-token rows."""
    rng = np.random.default_rng(23)
    views = make_views(
        rng,
        device,
        blocks=4,
        heads=2,
        tokens=16,
        pieces=256,
        dtype=torch.int16,
        offset=8,  # 16 bytes: an aligned cache
    )
    rows = make_rows([3, 0, 2, 1], [0, 16, 32, 48], [16, 15, 1, 16])
    return single(LaunchSpec(views, [H + 5], [0], rows))


def case_vllm_block_unaligned(device: str) -> Case:
    """A dense head-major cache starting 8 bytes off 16-byte alignment, with
    full rows and a row one token short of full (its last token unread)."""
    rng = np.random.default_rng(24)
    views = make_views(
        rng, device, num_layers=2, blocks=4, heads=2, tokens=16, pieces=16, offset=1
    )
    rows = make_rows([2, 3, 0], [0, 16, 32], [16, 16, 15])
    return single(LaunchSpec(views, [0, H], [0, 1], rows))


def case_narrow_pieces(device: str, dtype: torch.dtype) -> Case:
    rng = np.random.default_rng(9)
    views = make_views(
        rng, device, blocks=4, heads=2, tokens=4, pieces=6, dtype=dtype, offset=1
    )
    rows = make_rows([3, 1, 0], [0, 4, 12], [4, 4, 3])
    return single(LaunchSpec(views, [H + 1], [0], rows))


def case_split_rows(device: str, dtype: torch.dtype) -> Case:
    """Mamba-like split state rows: [blocks, 1, rows, 1, elements], t = 0."""
    rng = np.random.default_rng(10)
    views = make_views(
        rng, device, blocks=3, heads=3, tokens=1, pieces=10, dtype=dtype, pad=6
    )
    rows = make_rows([2, 0], [0, 0], [1, 1])
    return single(LaunchSpec(views, [3 * H + 7], [0], rows))


def case_padded_unaligned(device: str) -> Case:
    """Pages with padding after each kernel block and a 8-byte-aligned start."""
    rng = np.random.default_rng(11)
    views = make_views(
        rng,
        device,
        blocks=4,
        kernel_blocks=2,
        heads=2,
        tokens=2,
        pieces=3,
        layout="token",
        pad=5,
        offset=3,
    )
    rows = make_rows([3, 0, 1], [8, 0, 4], [4, 4, 3])
    return single(LaunchSpec(views, [11], [0], rows))


def case_wide_matrix_column(device: str) -> Case:
    rng = np.random.default_rng(12)
    views = make_views(rng, device, blocks=5, heads=2, tokens=4, pieces=4)
    rows = make_rows([4, 2, 0], [0, 4, 8], [4, 4, 2])
    spec = LaunchSpec(
        views, [5], [1], rows, rows_offset=2, out_origin=(1, 2), out_width=2
    )
    return Case([spec], out_shape=(5, 6), rows_width=7)


def case_fused_layers(device: str) -> Case:
    rng = np.random.default_rng(13)
    views = make_views(rng, device, num_layers=3, blocks=5, heads=2, tokens=4, pieces=4)
    rows = make_rows([1, 4, 0, 2], [0, 4, 8, 12], [4, 4, 4, 1])
    slices = [0 * H + 2, 5 * H + 2, 7 * H]
    return single(LaunchSpec(views, slices, [0, 1, 0], rows))


def case_multi_group(device: str) -> Case:
    """Two launches (groups) into column ranges of one rows tensor and matrix."""
    rng = np.random.default_rng(14)
    group_a = make_views(
        rng, device, num_layers=2, blocks=6, heads=2, tokens=4, pieces=4
    )
    group_b = make_views(
        rng,
        device,
        blocks=4,
        kernel_blocks=2,
        heads=1,
        tokens=4,
        pieces=2,
        layout="token",
    )
    spec_a = LaunchSpec(
        group_a, [0, H], [0, 1], make_rows([5, 1, 3], [0, 4, 8], [4, 4, 3])
    )
    spec_b = LaunchSpec(
        group_b,
        [2 * H],
        [0],
        make_rows([3, 0], [16, 24], [8, 5]),
        rows_offset=4,
        out_origin=(0, 2),
    )
    return Case([spec_a, spec_b], out_shape=(3, 3), rows_width=6)


def case_multi_chunk_row(device: str) -> Case:
    """A 24K-piece row (a Mamba state) spread over two 16K-piece chunks."""
    rng = np.random.default_rng(15)
    views = make_views(rng, device, blocks=3, heads=1, tokens=1, pieces=24576)
    rows = make_rows([2, 0], [0, 0], [1, 1])
    return single(LaunchSpec(views, [6 * H], [0], rows))


def tv4_cells(num_tokens: int = 10) -> np.ndarray:
    """TV4 truth: byte k of cell (L, h, t) = (31L + 17h + 7t + k) mod 256."""
    layer, head, token, k = np.meshgrid(
        np.arange(2), np.arange(2), np.arange(num_tokens), np.arange(16), indexing="ij"
    )
    cells = (31 * layer + 17 * head + 7 * token + k) % 256
    return cells.astype(np.uint8)  # [layers, heads, tokens, 16 bytes]


def case_tv4(device: str, kernel_blocks: int, heads: list[int]) -> Case:
    """TV4 (R26) in 4-token kernel blocks; block ids permuted, layers fused."""
    cells = tv4_cells()
    block_size = 4 * kernel_blocks
    positions = -(-10 // block_size)
    block_ids = list(range(positions))[::-1]
    rng = np.random.default_rng(16)
    views = make_views(
        rng,
        device,
        num_layers=2,
        blocks=positions,
        kernel_blocks=kernel_blocks,
        heads=len(heads),
        tokens=4,
        pieces=2,
    )
    for layer, view in enumerate(views):
        padded = np.zeros((len(heads), positions * block_size, 16), dtype=np.uint8)
        padded[:, :10] = cells[layer][heads]
        pieces = padded.view(np.int64).reshape(
            len(heads), positions, kernel_blocks, 4, 2
        )
        stored = np.empty_like(pieces.transpose(1, 2, 0, 3, 4))
        stored[block_ids] = pieces.transpose(1, 2, 0, 3, 4)
        view.copy_(torch.from_numpy(stored))
    rows = make_rows(
        block_ids,
        [p * block_size for p in range(positions)],
        [min(block_size, 10 - p * block_size) for p in range(positions)],
    )
    slices = [layer * H + heads[0] for layer in range(2)]
    return single(LaunchSpec(views, slices, [0, 0], rows))


def with_expected(case: Case, values: list[int]) -> Case:
    case.expected = {(row, 0): value for row, value in enumerate(values)}
    return case


# TV5 under definition v2 (R137), from kv_checksum_reference.split_row_checksum.
TV5_V2 = 0x5C0EC0871D4B3FC2


def case_chunk_views(device: str, layout: str) -> Case:
    """32-token blocks summed as two 16-token chunk views (R135).

    View i is the block's tokens [16 i, 16 i + 16) with token offset 16 i and
    its own output column; rows hold full, partial (valid 20: the second
    chunk has 4 tokens) and short (valid 9: the second chunk is empty) blocks.
    """
    rng = np.random.default_rng(21)
    views = make_views(
        rng, device, num_layers=2, blocks=4, heads=2, tokens=32, pieces=4, layout=layout
    )
    chunk_views = [
        view[:, :, :, 16 * i : 16 * i + 16] for view in views for i in (0, 1)
    ]
    rows = make_rows([3, 1, 0], [64, 96, 128], [32, 20, 9])
    slices = [layer * H for layer in (0, 0, 1, 1)]
    spec = LaunchSpec(chunk_views, slices, [0, 1, 0, 1], rows)
    spec.token_offsets = [0, 16, 0, 16]
    return single(spec)


def case_chunk_views_vllm(device: str) -> Case:
    """Send-pass chunk views of 32-token vLLM blocks (head size 128, K and V):
    16-token head tiles whose pieces are contiguous but whose heads are not
    (the vector path's lane-index offsets with strided tiles). Rows: full,
    second chunk partial (20), second chunk empty (16 and 9)."""
    rng = np.random.default_rng(25)
    views = make_views(rng, device, blocks=4, heads=2, tokens=32, pieces=64)
    chunk_views = [views[0][:, :, :, 16 * i : 16 * i + 16] for i in (0, 1)]
    rows = make_rows([3, 1, 0, 2], [64, 96, 128, 160], [32, 20, 16, 9])
    spec = LaunchSpec(chunk_views, [H, H], [0, 1], rows)
    spec.token_offsets = [0, 16]
    return single(spec)


def case_token_order_unaligned(device: str) -> Case:
    """A dense token-major cache 8 bytes off 16-byte alignment (memory-order
    loop without the alignment hint), two layers; rows full, one token short
    and partial. 16 pieces a head, 2 heads: tiny tiles (16) lie inside one
    token's row, from head 0 or 1 on."""
    rng = np.random.default_rng(26)
    views = make_views(
        rng,
        device,
        num_layers=2,
        blocks=4,
        heads=2,
        tokens=16,
        pieces=16,
        layout="token",
        offset=1,
    )
    rows = make_rows([2, 3, 0, 1], [0, 16, 32, 48], [16, 15, 5, 16])
    return single(LaunchSpec(views, [0, H + 2], [0, 1], rows))


def case_token_order_many_heads(device: str) -> Case:
    """32 heads x 64 pieces token-major: a token's row (2048 pieces) is longer
    than the largest tile (1024), so tiles start at head 0 or 16."""
    rng = np.random.default_rng(27)
    views = make_views(
        rng, device, blocks=3, heads=32, tokens=2, pieces=64, layout="token"
    )
    rows = make_rows([2, 0, 1], [0, 2, 4], [2, 1, 2])
    return single(LaunchSpec(views, [3 * H + 32], [0], rows))


def case_token_order_odd_tokens(device: str) -> Case:
    """3-token blocks, 4 heads x 64 pieces token-major: 768 pieces a block, so
    the memory-order tile (256) is smaller than the flat loop's (1024)."""
    rng = np.random.default_rng(28)
    views = make_views(
        rng, device, blocks=4, heads=4, tokens=3, pieces=64, layout="token"
    )
    rows = make_rows([3, 1, 0, 2], [0, 3, 6, 9], [3, 2, 3, 1])
    return single(LaunchSpec(views, [H + 4], [0], rows))


def case_ragged_items(device: str, layout: str) -> Case:
    """Blocks that are not a whole number of the small configurations'
    64-piece work items: 5 heads x 1 token x 16 pieces head-major (80 pieces:
    items of 64 and 16) and 2 heads x 3 tokens x 16 pieces token-major (96:
    64 and 32; memory order with 16-piece tiles, the flat loop by default),
    full and partial rows. Their last items hold fewer tiles than the others."""
    rng = np.random.default_rng(29 if layout == "head" else 30)
    if layout == "head":
        views = make_views(rng, device, blocks=4, heads=5, tokens=1, pieces=16)
        rows = make_rows([2, 0, 3, 1], [0, 1, 2, 3], [1, 1, 0, 1])
    else:
        views = make_views(
            rng, device, blocks=4, heads=2, tokens=3, pieces=16, layout="token"
        )
        rows = make_rows([2, 0, 3, 1], [0, 3, 6, 9], [3, 3, 1, 2])
    return single(LaunchSpec(views, [H + 2], [0], rows))


def case_token_order_int16_multi_chunk(device: str) -> Case:
    """bf16 elements as int16 pieces in vLLM's FlashAttention layout (8 heads,
    16 tokens, 256 pieces a head: K and V of head size 128): 32768 pieces a
    block, two default chunks of 8 tokens each; rows full, one token short,
    ending in the second chunk (9) and in the first (3)."""
    rng = np.random.default_rng(29)
    views = make_views(
        rng,
        device,
        blocks=4,
        heads=8,
        tokens=16,
        pieces=256,
        dtype=torch.int16,
        layout="token",
        offset=8,  # 16 bytes: an aligned cache
    )
    rows = make_rows([3, 0, 2, 1], [0, 16, 32, 48], [16, 15, 9, 3])
    return single(LaunchSpec(views, [5 * H + 8], [0], rows))


def case_token_order_int32(device: str) -> Case:
    """4-byte pieces token-major (4 heads x 4 pieces): 16-piece rows, full,
    one token short and one-token rows."""
    rng = np.random.default_rng(30)
    views = make_views(
        rng,
        device,
        blocks=4,
        heads=4,
        tokens=8,
        pieces=4,
        dtype=torch.int32,
        layout="token",
        offset=4,  # 16 bytes: an aligned cache
    )
    rows = make_rows([1, 3, 0, 2], [0, 8, 16, 24], [8, 7, 1, 8])
    return single(LaunchSpec(views, [7], [0], rows))


def case_token_order_padded_heads(device: str) -> Case:
    """K halves of a token-major cache whose heads hold K and V side by side
    ([B, T, H, 2P] seen as [B, 1, H, T, P]): heads are 2P apart, so memory
    order is not the block's order and the memory-order loop must not run."""
    rng = np.random.default_rng(31)
    views = make_views(
        rng, device, blocks=4, heads=2, tokens=8, pieces=16, layout="token"
    )
    halves = [view[..., :8] for view in views]
    rows = make_rows([3, 0, 1], [0, 8, 16], [8, 7, 8])
    return single(LaunchSpec(halves, [H], [0], rows))


def case_token_order_padded_kernel_blocks(device: str) -> Case:
    """Token-major kernel blocks with 32 unused pieces after each: the
    kernel-block stride is not tokens x heads x pieces, so memory order is not
    the block's order and the memory-order loop must not run."""
    rng = np.random.default_rng(32)
    views = make_views(
        rng,
        device,
        blocks=3,
        kernel_blocks=2,
        heads=2,
        tokens=4,
        pieces=8,
        layout="token",
        pad=32,
    )
    rows = make_rows([2, 0, 1], [0, 8, 16], [8, 7, 5])
    return single(LaunchSpec(views, [2 * H], [0], rows))


def case_tv5(device: str) -> Case:
    """TV5 (R26): bf16 elements 0xFFFF, 0x0001, 0x8000 of layer 2, row 5."""
    view = torch.tensor([-1, 1, -0x8000], dtype=torch.int16, device=device)
    view = view.view(1, 1, 1, 1, 3)
    rows = make_rows([0], [0], [1])
    return with_expected(single(LaunchSpec([view], [2 * H + 5], [0], rows)), [TV5_V2])


CASES: dict[str, Callable[[str], Case]] = {
    "head_major": case_head_major,
    "token_major": case_token_major,
    "kernel_blocks_head_major": functools.partial(case_kernel_blocks, layout="head"),
    "kernel_blocks_token_major": functools.partial(case_kernel_blocks, layout="token"),
    "kernel_blocks_head_tiles_head_major": functools.partial(
        case_kernel_blocks_head_tiles, layout="head"
    ),
    "kernel_blocks_head_tiles_token_major": functools.partial(
        case_kernel_blocks_head_tiles, layout="token"
    ),
    "partial_and_empty": case_partial_and_empty,
    "chunk_views_head_major": functools.partial(case_chunk_views, layout="head"),
    "chunk_views_token_major": functools.partial(case_chunk_views, layout="token"),
    "chunk_views_vllm": case_chunk_views_vllm,
    "large_first_slice": case_large_first_slice,
    "huge_first_slice": case_huge_first_slice,
    "weight_width_head_tiles": functools.partial(
        case_weight_width_boundaries, tokens=4, pieces=64
    ),
    "weight_width_flat": functools.partial(
        case_weight_width_boundaries, tokens=3, pieces=5
    ),
    "weight_width_token_order": functools.partial(
        case_weight_width_boundaries, tokens=8, pieces=8, layout="token"
    ),
    "one_head_32x36": case_one_head_32x36,
    "vllm_block_head_major": functools.partial(case_vllm_block, layout="head"),
    "vllm_block_token_major": functools.partial(case_vllm_block, layout="token"),
    "vllm_block_int16": case_vllm_block_int16,
    "vllm_block_unaligned": case_vllm_block_unaligned,
    "token_order_unaligned": case_token_order_unaligned,
    "token_order_many_heads": case_token_order_many_heads,
    "token_order_odd_tokens": case_token_order_odd_tokens,
    "ragged_items_head_major": functools.partial(case_ragged_items, layout="head"),
    "ragged_items_token_major": functools.partial(case_ragged_items, layout="token"),
    "token_order_int16_multi_chunk": case_token_order_int16_multi_chunk,
    "token_order_int32": case_token_order_int32,
    "token_order_padded_heads": case_token_order_padded_heads,
    "token_order_padded_kernel_blocks": case_token_order_padded_kernel_blocks,
    "int16_pieces": functools.partial(case_narrow_pieces, dtype=torch.int16),
    "int32_pieces": functools.partial(case_narrow_pieces, dtype=torch.int32),
    "split_rows_int16": functools.partial(case_split_rows, dtype=torch.int16),
    "split_rows_int32": functools.partial(case_split_rows, dtype=torch.int32),
    "padded_unaligned": case_padded_unaligned,
    "wide_matrix_column": case_wide_matrix_column,
    "fused_layers": case_fused_layers,
    "multi_group": case_multi_group,
    "multi_chunk_row": case_multi_chunk_row,
    "tv4_4_token_blocks": lambda device: with_expected(
        case_tv4(device, 1, [0, 1]),
        [0xD94843158FE0FF93, 0x978412190698D0FE, 0xABF2AD2F1BE94A85],
    ),
    "tv4_8_token_blocks": lambda device: with_expected(
        case_tv4(device, 2, [0, 1]), [0x70CC552E9679D091, 0xABF2AD2F1BE94A85]
    ),
    "tv4_tp2_rank0": lambda device: with_expected(
        case_tv4(device, 1, [0]),
        [0x527CAC8539AAEC52, 0x2E8FFE2256C827E7, 0x93835FBD798CD8F4],
    ),
    "tv4_tp2_rank1": lambda device: with_expected(
        case_tv4(device, 1, [1]),
        [0x86CB969056361341, 0x68F413F6AFD0A917, 0x186F4D71A25C7191],
    ),
    "tv5_split_row": case_tv5,
}


# --------------------------------------------------------------------------
# The independent NumPy reference and the runner.
# --------------------------------------------------------------------------


def unsigned_pieces(view: torch.Tensor) -> np.ndarray:
    """A view's pieces as uint64, narrow ones zero-extended."""
    array = view.detach().cpu().contiguous().numpy()
    unsigned = {np.int64: np.uint64, np.int32: np.uint32, np.int16: np.uint16}
    return array.view(unsigned[array.dtype.type]).astype(np.uint64)


def reference_row(x: np.ndarray, first_slice: int, first: int, valid: int) -> int:
    """One block's checksum over one layer view, straight from the definition.

    x: uint64 [KB, H, T, P]. Adds mix(x) * m * (2j + 1) over valid slots,
    with m = 2 (first_slice + h) + 1 and j = (first + kb * T + t) * P + p
    (R17-R20, R137).
    """
    u64 = np.uint64
    kernel_blocks, heads, tokens, pieces = x.shape
    with np.errstate(over="ignore"):
        slot = np.arange(kernel_blocks * tokens, dtype=u64).reshape(
            kernel_blocks, 1, tokens, 1
        )
        j = (u64(first) + slot) * u64(pieces) + np.arange(pieces, dtype=u64)
        m = u64(2) * (u64(first_slice) + np.arange(heads, dtype=u64)) + u64(1)
        weight = m.reshape(1, heads, 1, 1) * (u64(2) * j + u64(1))
        mixed = mix64(x)
        terms = np.where(slot < u64(max(valid, 0)), mixed * weight, u64(0))
        return int(np.sum(terms, dtype=u64))


def reference(case: Case) -> np.ndarray:
    """The wide output matrix as uint64, per row and layer from the definition."""
    out = [[0] * case.out_shape[1] for _ in range(case.out_shape[0])]
    for spec in case.launches:
        row0, col0 = spec.out_origin
        for view, first_slice, column, offset in zip(
            spec.views, spec.first_slices, spec.columns, spec.offsets()
        ):
            pieces = unsigned_pieces(view)
            for r, (block, first, valid) in enumerate(spec.rows.T.tolist()):
                value = reference_row(
                    pieces[block], first_slice, first + offset, valid - offset
                )
                out[row0 + r][col0 + column] = (
                    out[row0 + r][col0 + column] + value
                ) % (1 << 64)
    return np.array(out, dtype=np.uint64).reshape(case.out_shape)


def run_case(case: Case, backend: str, warm_up: bool = True) -> np.ndarray:
    """Run a case's launches on `backend`; the wide matrix as uint64."""
    device = case.launches[0].views[0].device
    wide_rows = torch.full((3, case.rows_width), -7, dtype=torch.int64, device=device)
    wide_out = torch.zeros(case.out_shape, dtype=torch.int64, device=device)
    for spec in case.launches:
        count = spec.rows.shape[1]
        wide_rows[:, spec.rows_offset : spec.rows_offset + count] = torch.from_numpy(
            spec.rows
        ).to(device)
    for spec in case.launches:
        launch = kernels.KVChecksumLaunch(
            spec.views,
            spec.first_slices,
            spec.columns,
            backend=backend,
            token_offsets=spec.token_offsets,
        )
        assert launch.backend == backend
        if warm_up:
            launch.warm_up()
        count = spec.rows.shape[1]
        row0, col0 = spec.out_origin
        width = spec.out_width or max(spec.columns) + 1
        rows = wide_rows[:, spec.rows_offset : spec.rows_offset + count]
        launch(rows, wide_out[row0 : row0 + count, col0 : col0 + width])
    return wide_out.cpu().numpy().view(np.uint64)


def assert_matches(actual: np.ndarray, case: Case, path: str) -> None:
    expected = reference(case)
    for (row, column), value in case.expected.items():
        assert int(expected[row, column]) == value, "reference != test vector"
    mismatch = [tuple(index) for index in np.argwhere(actual != expected)]
    assert not mismatch, (
        f"{path}: {len(mismatch)} wrong sums, first at {mismatch[0]}: "
        f"{int(actual[mismatch[0]]):#x} != {int(expected[mismatch[0]]):#x}"
    )


@contextlib.contextmanager
def patched(module: ModuleType, **values: int) -> Iterator[None]:
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


# Cases whose launches walk memory order (DENSE 3: dense token-major blocks)
# under the default launch, and the tile they take (test_token_order_choice).
TOKEN_ORDER_CASES = {
    "token_major": 32,
    "kernel_blocks_token_major": 32,
    "kernel_blocks_head_tiles_token_major": 1024,
    "vllm_block_token_major": 1024,
    "chunk_views_token_major": 128,
    "weight_width_token_order": 128,
    "token_order_unaligned": 512,
    "token_order_many_heads": 1024,  # less than a token's 2048 pieces
    "token_order_odd_tokens": 256,  # the largest power of two dividing 768
    "token_order_int16_multi_chunk": 1024,
    "token_order_int32": 128,
}

# Interpreter configurations: (MAX_TILE_PIECES, CHUNK_PIECES,
# VECTOR_FULL_TILES, TOKEN_ORDER_TILES). Tiny tiles and chunks make the small
# blocks of these cases take the head-tile path and span several chunks. The
# 24K-piece row, the 32K-piece int16 token-major row and the 32-head
# token-major rows would take 1536, 2048 and 256 interpreted tiles per row
# there; the default configuration covers them. The vector ones run the
# unmasked fast path of full rows (vector_full_tiles, issue 30) on every
# case: full and partial rows, dense and strided views, dense token-major
# blocks in memory order (with tiny tiles only those of at most 16 pieces a
# head). "head order" runs the vector loops that token-major blocks took
# before (token_order_tiles off) on the cases where the flag matters.
INTERPRETER_CONFIGS = {
    "interpreter": (1024, 16384, False, True),
    "interpreter_small": (16, 64, False, True),
    "interpreter_vector": (1024, 16384, True, True),
    "interpreter_small_vector": (16, 64, True, True),
    "interpreter_vector_head_order": (1024, 16384, True, False),
}
INTERPRETER_SKIPS = {
    name: {"multi_chunk_row", "token_order_int16_multi_chunk", "token_order_many_heads"}
    for name, (max_tile, *_) in INTERPRETER_CONFIGS.items()
    if max_tile < 1024
}
INTERPRETER_SKIPS["interpreter_vector_head_order"] = set(CASES) - set(TOKEN_ORDER_CASES)


@functools.cache
def interpreter_runs() -> dict[str, subprocess.Popen]:
    """Start one interpreter subprocess per configuration, all at once."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    runs = {}
    for config, (max_tile, chunk, vector, token_order) in INTERPRETER_CONFIGS.items():
        command = [sys.executable, str(Path(__file__).resolve()), "--interpret"]
        command += ["--max-tile", str(max_tile), "--chunk", str(chunk)]
        command += ["--vector"] * vector + ["--head-order"] * (not token_order)
        for name in INTERPRETER_SKIPS.get(config, ()):
            command += ["--skip", name]
        runs[config] = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    return runs


@functools.cache
def interpreter_results(config: str) -> dict[str, list[list[int]]]:
    """Every case's Triton result under TRITON_INTERPRET=1 (one subprocess)."""
    stdout, stderr = interpreter_runs()[config].communicate(timeout=900)
    assert interpreter_runs()[config].returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


def check_case(name: str, path: str) -> None:
    """Compare one case on one path with the reference."""
    case = CASES[name]("cpu")
    if path == "torch":
        actual = run_case(case, "torch")
    elif path == "torch_chunked":
        # One row per gather: chunking must not change any sum.
        with patched(kernels, GATHER_CHUNK_BYTES=1):
            actual = run_case(case, "torch")
    else:
        if name in INTERPRETER_SKIPS.get(path, ()):
            pytest.skip(f"not run by {path} (too slow, or the same as the default)")
        values = interpreter_results(path)[name]
        actual = np.array(values, dtype=np.uint64).reshape(case.out_shape)
    assert_matches(actual, case, path)


PATHS = ["torch", "torch_chunked", *INTERPRETER_CONFIGS]


# --------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_head_major(path: str) -> None:
    """Wrong weights or factors on the plain [B, H, N, C] layout (R17-R19, R58)."""
    check_case("head_major", path)


@pytest.mark.parametrize("path", PATHS)
def test_token_major(path: str) -> None:
    """Assuming head-major memory instead of using strides (R22, R60)."""
    check_case("token_major", path)


@pytest.mark.parametrize("loop", ["", "head_tiles_"])
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("path", PATHS)
def test_kernel_block_splits(path: str, layout: str, loop: str) -> None:
    """Numbering tokens per kernel block or ignoring its stride (R22, R31, R60)."""
    check_case(f"kernel_blocks_{loop}{layout}", path)


@pytest.mark.parametrize("path", PATHS)
def test_partial_and_empty_blocks(path: str) -> None:
    """Counting slots at or past the valid count, or empty rows (R20, R58)."""
    check_case("partial_and_empty", path)


@pytest.mark.parametrize("path", PATHS)
def test_large_first_slice(path: str) -> None:
    """Truncating slice numbers or token positions to 32 bits (R19, R58)."""
    check_case("large_first_slice", path)


@pytest.mark.parametrize("path", PATHS)
def test_factor_wraps_mod_2_64(path: str) -> None:
    """Signed or saturating factor arithmetic when m >= 2^63 (R18, R23)."""
    check_case("huge_first_slice", path)


@pytest.mark.parametrize("loop", ["head_tiles", "flat", "token_order"])
@pytest.mark.parametrize("path", PATHS)
def test_weight_width_boundaries(path: str, loop: str) -> None:
    """Taking the 32-bit weight shortcut one factor or token too far, in each
    loop (the memory-order one: a 32-bit tile weight wrapping, or a lane's
    head or piece added after the 32-bit truncation of a wide row) (R23, R58)."""
    check_case(f"weight_width_{loop}", path)


@pytest.mark.parametrize("path", PATHS)
def test_one_head_32x36(path: str) -> None:
    """Tiles of a block whose piece count is no power of two (R58, R124)."""
    check_case("one_head_32x36", path)


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("path", PATHS)
def test_vllm_blocks(path: str, layout: str) -> None:
    """Wrong per-tile offsets or weights in the head-tile path (R58, R60)."""
    check_case(f"vllm_block_{layout}", path)


@pytest.mark.parametrize("path", PATHS)
def test_vllm_blocks_int16_head_tiles(path: str) -> None:
    """Head tiles over 2-byte pieces (vector path: 16-byte alignment counted in
    pieces instead of bytes, or a one-token row read as full) (R21, R58)."""
    check_case("vllm_block_int16", path)


@pytest.mark.parametrize("path", PATHS)
def test_dense_unaligned_and_one_token_short(path: str) -> None:
    """A row one token short of full taking the unmasked loop (its last token
    summed), or a dense view 8 bytes off alignment read as aligned (R58, R60)."""
    check_case("vllm_block_unaligned", path)


@pytest.mark.parametrize("path", PATHS)
def test_token_order_unaligned_and_one_token_short(path: str) -> None:
    """The memory-order loop (DENSE 3) on a token-major cache 8 bytes off
    alignment: a row one token short taking the unmasked loop, a mask on the
    tile's first slot only (tile_slot < valid: with 512-piece tiles of 16
    tokens the short row's last token is summed), or tiles read as 16-byte
    aligned (R58, R60)."""
    check_case("token_order_unaligned", path)


@pytest.mark.parametrize("path", PATHS)
def test_token_order_tiles_inside_a_row(path: str) -> None:
    """Tiles shorter than a token's row (32 heads x 64 pieces, tile 1024):
    the tile's first head (tile_head) dropped from the factor m, so heads
    16-31 get the factors of heads 0-15, or a tile's slot taken as one per
    tile (R18, R58)."""
    check_case("token_order_many_heads", path)


@pytest.mark.parametrize("layout", ["head", "token"])
@pytest.mark.parametrize("path", PATHS)
def test_ragged_items(path: str, layout: str) -> None:
    """R58: blocks of 80 and 96 pieces under 64-piece work items still sum
    every piece once. Bug caught: a last item given a whole item's tile count
    (4 tiles for the 16- or 32-piece last item, its end not clipped to the
    block) reads past the block or the next head, and a sum differs."""
    check_case(f"ragged_items_{layout}_major", path)


@pytest.mark.parametrize("path", PATHS)
def test_token_order_odd_tokens(path: str) -> None:
    """A 768-piece token-major block (3 tokens): a memory-order tile that does
    not divide the block (1024) reads the next block's pieces unmasked on a
    full row, or a tile count rounded down drops the last ones (R58)."""
    check_case("token_order_odd_tokens", path)


@pytest.mark.parametrize("path", PATHS)
def test_token_order_int16_two_chunks(path: str) -> None:
    """vLLM's FlashAttention layout as 2-byte pieces over two chunks: chunks
    of memory-order tiles bounded or numbered in head order (pieces dropped
    or summed twice), a tile's slot counted from its chunk instead of the
    block, or 2-byte pieces sign-extended (R21, R57, R58)."""
    check_case("token_order_int16_multi_chunk", path)


@pytest.mark.parametrize("path", PATHS)
def test_token_order_int32_rows(path: str) -> None:
    """4-byte pieces, 4 heads x 4 pieces, 8-token tiles: a lane's head taken as
    lane // PIECES without % HEADS (lanes past a token's row get heads 4-31),
    a lane's piece or slot misplaced in 2j + 1, or one-token rows reading the
    whole tile (R21, R58)."""
    check_case("token_order_int32", path)


@pytest.mark.parametrize(
    "name", ["token_order_padded_heads", "token_order_padded_kernel_blocks"]
)
@pytest.mark.parametrize("path", PATHS)
def test_token_order_needs_memory_order(path: str, name: str) -> None:
    """Token-major views that are not contiguous in memory order (heads 2P
    apart: K halves beside V; kernel blocks followed by padding) taking the
    memory-order loop, which would read V pieces or padding as tokens (R60)."""
    check_case(name, path)


VECTOR_EXPECTED = {
    # case: (HEAD_TILES, DENSE, TILE_ALIGNED) of the vector config
    "vllm_block_head_major": (True, 2, True),
    "vllm_block_token_major": (False, 3, True),
    "vllm_block_int16": (True, 2, True),
    "vllm_block_unaligned": (True, 2, False),
    "kernel_blocks_head_tiles_head_major": (True, 2, True),
    "padded_unaligned": (False, 0, False),
    "chunk_views_vllm": (True, 1, True),
    "chunk_views_token_major": (False, 3, True),
    "token_order_unaligned": (False, 3, False),
    "token_order_int16_multi_chunk": (False, 3, True),
    "token_order_padded_heads": (False, 0, False),
    "token_order_padded_kernel_blocks": (False, 0, False),
}


def launch_constants(
    spec: LaunchSpec, base: object = None, **overrides: object
) -> dict[str, object]:
    """The Triton constants of a spec's launch under `base` (default: the
    default LaunchConfig) with `overrides`, built on CPU views."""
    base = kernels.default_config() if base is None else base
    config = kernels.LaunchConfig(**{**vars(base), **overrides})
    launch = kernels.KVChecksumLaunch(
        spec.views,
        spec.first_slices,
        spec.columns,
        backend="torch",
        token_offsets=spec.token_offsets,
        config=config,
    )
    launch._init_triton()
    return launch._constants


@pytest.mark.parametrize("name", sorted(VECTOR_EXPECTED))
def test_vector_constants(name: str) -> None:
    """The fast path's host constants (issue 30): without them the vector
    interpreter runs would pass without taking the fast path, and a 16-byte
    hint on a view 8 bytes off alignment would fault on the GPU (a misaligned
    128-bit load). Without vector_full_tiles all of them are off."""
    spec = CASES[name]("cpu").launches[0]
    for vector in (False, True):
        c = launch_constants(spec, vector_full_tiles=vector)
        got = (c["HEAD_TILES"], c["DENSE"], c["TILE_ALIGNED"])
        if vector:
            assert c["VECTOR"] and got == VECTOR_EXPECTED[name]
        else:
            assert (c["VECTOR"], c["DENSE"], c["TILE_ALIGNED"]) == (False, 0, False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_token_order_choice(name: str) -> None:
    """Which launches walk memory order (DENSE 3) and with which tile, and
    that token_order_tiles changes nothing else (R58, R143; issue 30). Bugs caught: a
    token-major case falling back to the old loops (the vector interpreter
    runs would then not test the new one), a view whose heads or kernel blocks
    are not contiguous, or a head-major one, taking it (padded_heads,
    padded_kernel_blocks), a tile that does not divide the block (odd tokens)
    or one no smaller than a token's row when that is longer than the largest
    tile (many heads), or the flag changing head-major launches or launches
    without vector_full_tiles."""
    tiles = []
    for spec in CASES[name]("cpu").launches:
        on = launch_constants(spec)
        off = launch_constants(spec, token_order_tiles=False)
        if on["DENSE"] == 3:
            tiles.append(on["TILE"])
            assert on["VECTOR"] and not on["HEAD_TILES"]
            assert off["DENSE"] != 3
        else:
            assert on == off
        scalar = launch_constants(spec, vector_full_tiles=False)
        assert scalar == launch_constants(
            spec, vector_full_tiles=False, token_order_tiles=False
        )
        assert scalar["DENSE"] == 0
    assert tiles == ([TOKEN_ORDER_CASES[name]] if name in TOKEN_ORDER_CASES else [])


def test_pick_token_tile() -> None:
    """The memory-order tile on its own (R57, R58; issue 30): heads x pieces or pieces
    not powers of two, tiles shorter than a head's pieces or than
    min(flat tile, 256), or tiles that do not divide the block must give 0
    (no memory-order loop); else the largest power of two dividing the block,
    capped by max_tile and the chunk."""
    pick = kernels.pick_token_tile
    assert pick((1, 8, 16, 64), 1024, 16384) == 1024
    assert pick((1, 8, 16, 64), 2048, 16384) == 2048
    assert pick((1, 8, 16, 64), 1024, 512) == 512
    assert pick((1, 4, 3, 64), 1024, 16384) == 256
    assert pick((2, 2, 2, 4), 1024, 16384) == 32
    assert pick((1, 2, 16, 64), 16, 64) == 0  # tile shorter than a head's pieces
    assert pick((1, 3, 16, 64), 1024, 16384) == 0  # 3 heads
    assert pick((1, 2, 16, 12), 1024, 16384) == 0  # 12 pieces
    assert pick((1, 2, 5, 8), 1024, 16384) == 0  # 80 pieces: 16 < min(128, 256)
    assert pick((1, 4, 5, 64), 1024, 16384) == 256


def test_default_launch_is_the_tuned_variant() -> None:
    """The default launch is the variant two H200 runs agreed on (issue 30,
    "vector 4w": the vector loop on 4 warps, chunks of 16384 pieces as R57
    says, tiles of up to 1024 as R58 says); a stray edit of one constant
    fails here."""
    config = kernels.default_config()
    assert config.vector_full_tiles is True
    # Memory order for dense token-major blocks (issue 30 item 1): on by
    # default, to be confirmed by the variants' "vector 4w head order".
    assert config.token_order_tiles is True
    assert (config.num_warps, config.chunk_pieces, config.max_tile) == (4, 16384, 1024)


@pytest.mark.parametrize("bits", [16, 32])
@pytest.mark.parametrize("path", PATHS)
def test_narrow_pieces_zero_extended(path: str, bits: int) -> None:
    """Sign-extending 2- or 4-byte pieces with the high bit set (R21, R23)."""
    case = CASES[f"int{bits}_pieces"]("cpu")
    high = unsigned_pieces(case.launches[0].views[0]) >= 1 << (bits - 1)
    assert high.any()
    check_case(f"int{bits}_pieces", path)


@pytest.mark.parametrize("bits", [16, 32])
@pytest.mark.parametrize("path", PATHS)
def test_split_state_rows(path: str, bits: int) -> None:
    """Mis-numbering rows or elements of padded split Mamba pages (R21, R38)."""
    check_case(f"split_rows_int{bits}", path)


@pytest.mark.parametrize("path", PATHS)
def test_padded_unaligned_pages(path: str) -> None:
    """Assuming dense or 16-byte-aligned pages (R60, R61 aligned flag)."""
    check_case("padded_unaligned", path)


@pytest.mark.parametrize("path", PATHS)
def test_column_of_wider_matrix(path: str) -> None:
    """Ignoring the row stride / offset of sliced rows and outputs (R52, R53)."""
    check_case("wide_matrix_column", path)


@pytest.mark.parametrize("path", PATHS)
def test_fused_layers(path: str) -> None:
    """Mixing up table entries of fused layers: slices or columns (R61)."""
    check_case("fused_layers", path)


@pytest.mark.parametrize("path", PATHS)
def test_multi_group_rows(path: str) -> None:
    """Launches of several groups writing outside their column ranges (R52)."""
    check_case("multi_group", path)


@pytest.mark.parametrize("path", PATHS)
def test_row_over_two_chunks(path: str) -> None:
    """Dropping or double counting pieces across program chunks (R57)."""
    check_case("multi_chunk_row", path)


@pytest.mark.parametrize(
    "name",
    ["tv4_4_token_blocks", "tv4_8_token_blocks", "tv4_tp2_rank0", "tv4_tp2_rank1"],
)
@pytest.mark.parametrize("path", PATHS)
def test_definition_vector_tv4(path: str, name: str) -> None:
    """Any deviation from the published definition vectors TV4 (R26)."""
    check_case(name, path)


@pytest.mark.parametrize("path", PATHS)
def test_definition_vector_tv5(path: str) -> None:
    """Reading bf16 state elements signed (TV5, R26)."""
    check_case("tv5_split_row", path)


@pytest.mark.parametrize(
    "name", ["chunk_views_head_major", "chunk_views_token_major", "chunk_views_vllm"]
)
@pytest.mark.parametrize("path", PATHS)
def test_chunk_views(path: str, name: str) -> None:
    """Chunk views of a send pass (R135): a token offset not added to the
    weights' first token, or not subtracted from the valid count."""
    check_case(name, path)


def test_chunk_views_add_up_to_blocks() -> None:
    """R135: the two 16-token chunk sums of a 32-token block add up to the
    block's checksum (chunk sums are what a producer sends)."""
    case = CASES["chunk_views_head_major"]("cpu")
    chunks = run_case(case, "torch")
    spec = case.launches[0]
    rng = np.random.default_rng(21)
    views = make_views(rng, "cpu", num_layers=2, blocks=4, heads=2, tokens=32, pieces=4)
    whole = Case(
        [LaunchSpec(views, [0, H], [0, 0], spec.rows)], (spec.rows.shape[1], 1), 3
    )
    with np.errstate(over="ignore"):
        assert np.array_equal(run_case(whole, "torch")[:, 0], chunks.sum(axis=1))


def _flip_high_bits(
    view: torch.Tensor, rng: np.random.Generator, lowest_bit: int, count: int
) -> None:
    """Flip one random bit >= lowest_bit in `count` distinct pieces of block 0."""
    block = view[0].reshape(-1)
    for index in rng.choice(block.numel(), size=count, replace=False):
        bit = int(rng.integers(lowest_bit, 64))
        block[int(index)] ^= torch.tensor(1 << bit if bit < 63 else -(1 << 63))


def _block0_checksum(view: torch.Tensor) -> int:
    launch = kernels.KVChecksumLaunch([view], [0], [0], backend="torch")
    out = torch.zeros((1, 1), dtype=torch.int64)
    launch(torch.tensor([[0], [0], [16]], dtype=torch.int64), out)
    return int(out.numpy().view(np.uint64)[0, 0])


def _linear_block0_checksum(view: torch.Tensor) -> int:
    """Definition v1 (no mix) of block 0, exact Python ints."""
    x = view[0, 0].numpy().view(np.uint64)  # [heads, tokens, pieces]
    heads, tokens, pieces = x.shape
    total = 0
    for h in range(heads):
        for t in range(tokens):
            for p in range(pieces):
                total += int(x[h, t, p]) * (2 * h + 1) * (2 * (t * pieces + p) + 1)
    return total % (1 << 64)


def test_v2_catches_high_bit_flips_v1_misses() -> None:
    """R137: two bit-63 flips in one block cancel under the linear v1
    definition (2^63 (w1 + w2) = 0 mod 2^64) and are caught under v2. Fails
    if the kernels' torch path drops the mix."""
    rng = np.random.default_rng(63)
    view = make_views(rng, "cpu", blocks=1, heads=2, tokens=16, pieces=4)[0]
    before = _block0_checksum(view)
    linear_before = _linear_block0_checksum(view)
    _flip_high_bits(view, rng, 63, 2)
    assert _linear_block0_checksum(view) == linear_before  # v1's blind spot
    assert _block0_checksum(view) != before


@pytest.mark.parametrize("lowest_bit", range(32, 64))
def test_v2_catches_flips_confined_to_high_bits(lowest_bit: int) -> None:
    """R137 sweep: flips confined to bits >= k (k = 32..63) in an even number
    of pieces of one block (2 to 16) are all caught. Under v1 they are caught
    only modulo 2^(64 - k); fails if the mix is dropped or reduced to a
    permutation of bits that keeps high bits high."""
    rng = np.random.default_rng(lowest_bit)
    view = make_views(rng, "cpu", blocks=1, heads=2, tokens=16, pieces=4)[0]
    for count in range(2, 17, 2):
        before = _block0_checksum(view)
        _flip_high_bits(view, rng, lowest_bit, count)
        assert _block0_checksum(view) != before, (lowest_bit, count)


def test_tv4_shards_sum_to_whole() -> None:
    """The reference's TP shards not adding up to the TP1 checksum (R22, R26)."""
    whole = reference(CASES["tv4_4_token_blocks"]("cpu"))
    shards = reference(CASES["tv4_tp2_rank0"]("cpu"))
    with np.errstate(over="ignore"):
        shards = shards + reference(CASES["tv4_tp2_rank1"]("cpu"))
    assert np.array_equal(whole, shards)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_gather_equals_whole(name: str) -> None:
    """Gather chunking changing a result (R27 chunked gathers, R63)."""
    case = CASES[name]("cpu")
    whole = run_case(case, "torch")
    for limit in (1, 3 * 8 * 16):
        with patched(kernels, GATHER_CHUNK_BYTES=limit):
            assert np.array_equal(run_case(case, "torch"), whole)


def test_no_rows_is_a_no_op() -> None:
    """A launch failing or writing on an empty batch (R == 0)."""
    case = CASES["head_major"]("cpu")
    spec = case.launches[0]
    launch = kernels.KVChecksumLaunch(spec.views, [0], [0], backend="torch")
    out = torch.full((0, 1), 5, dtype=torch.int64)
    launch(torch.zeros((3, 0), dtype=torch.int64), out)
    assert out.numel() == 0


def test_warm_up_is_all_masked() -> None:
    """Warm-up reading real data or writing outside its own output (R62)."""
    views = make_views(
        np.random.default_rng(20), "cpu", blocks=2, heads=2, tokens=4, pieces=4
    )
    before = views[0].clone()
    launch = kernels.KVChecksumLaunch(views, [0], [3], backend="torch")
    launch.warm_up()
    assert torch.equal(views[0], before)


def test_backend_choice() -> None:
    """Picking Triton for CPU views or accepting unknown backends (R56)."""
    views = make_views(
        np.random.default_rng(21), "cpu", blocks=2, heads=1, tokens=2, pieces=2
    )
    assert kernels.KVChecksumLaunch(views, [0], [0]).backend == "torch"
    with pytest.raises(ValueError):
        kernels.KVChecksumLaunch(views, [0], [0], backend="cuda")


def test_launch_config_rejects_unaligned_chunks() -> None:
    """A work item that is not a power of two (so not a multiple of the tile),
    whose head tiles would start misaligned and skip or repeat pieces (R58)."""
    base = kernels.default_config()
    for field_name in ("max_tile", "chunk_pieces", "num_warps", "warp_pieces"):
        for value in (0, 3, 96):
            with pytest.raises(ValueError):
                kernels.LaunchConfig(**{**vars(base), field_name: value})
    assert kernels.LaunchConfig(**{**vars(base), "chunk_pieces": 64}).chunk_pieces == 64


def test_mixed_layouts_rejected() -> None:
    """Fusing views of different strides into one launch (R46, R61)."""
    rng = np.random.default_rng(22)
    head = make_views(rng, "cpu", blocks=2, heads=2, tokens=2, pieces=2)
    token = make_views(
        rng, "cpu", blocks=2, heads=2, tokens=2, pieces=2, layout="token"
    )
    with pytest.raises(ValueError):
        kernels.KVChecksumLaunch(head + token, [0, 2], [0, 0])


# --------------------------------------------------------------------------
# Script mode: the Triton results of every case, under the interpreter.
# --------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--interpret", action="store_true", required=True)
    parser.add_argument("--max-tile", type=int, default=kernels.MAX_TILE_PIECES)
    parser.add_argument("--chunk", type=int, default=kernels.CHUNK_PIECES)
    parser.add_argument("--vector", action="store_true")
    parser.add_argument("--head-order", action="store_true")
    parser.add_argument("--skip", action="append", default=[])
    args = parser.parse_args()
    assert os.environ.get("TRITON_INTERPRET") == "1"
    with patched(
        kernels,
        MAX_TILE_PIECES=args.max_tile,
        CHUNK_PIECES=args.chunk,
        VECTOR_FULL_TILES=args.vector,
        TOKEN_ORDER_TILES=not args.head_order,
    ):
        results = {
            name: run_case(build("cpu"), "triton").tolist()
            for name, build in CASES.items()
            if name not in args.skip
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
