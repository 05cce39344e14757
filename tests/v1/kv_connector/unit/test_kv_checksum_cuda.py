# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CUDA tests of the block checksum kernels (SPEC R56-R63, R124).

On a CUDA device, the Triton kernel, the PyTorch path and the NumPy reference
of test_kv_checksum_kernels.py must agree bit for bit on every case of that
file plus larger ones: both layouts at vLLM sizes, kernel-block splits,
partial and empty blocks, large slice factors, one-head 32-token x 36-piece
blocks, a column of a wider matrix, multi-group rows, fused multi-layer
launches, Mamba-like split rows and a 24K-piece row over two chunks.

Needs only torch, Triton, NumPy and pytest (no vLLM): kernels.py and the CPU
test module are loaded by file path. On a GPU host without vLLM:

    python -m pytest -p no:cacheprovider --noconftest \\
        tests/v1/kv_connector/unit/test_kv_checksum_cuda.py

Each test's docstring names the bug it catches.
"""

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

H = 1 << 16


def load_cases() -> ModuleType:
    """test_kv_checksum_kernels.py (cases, reference, runner) by file path."""
    name = "_kv_checksum_kernel_cases"
    if name not in sys.modules:
        path = Path(__file__).with_name("test_kv_checksum_kernels.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


cases = load_cases()
kernels = cases.kernels


def random_rows(
    rng: np.random.Generator, blocks: int, count: int, block_tokens: int
) -> np.ndarray:
    """Rows over random blocks: mostly full, some partial or empty."""
    valid = rng.integers(0, block_tokens + 1, size=count)
    valid[rng.random(count) < 0.7] = block_tokens
    return cases.make_rows(
        rng.integers(0, blocks, size=count).tolist(),
        (rng.integers(0, 8192, size=count) * block_tokens).tolist(),
        valid.tolist(),
    )


def case_big_layout(device: str, layout: str, kernel_blocks: int = 1, heads: int = 8):
    """8 heads x 16 tokens x 64 pieces (bf16 K and V, head size 128); with 32
    heads a token-major token's row (2048 pieces) is longer than a tile and a
    block spans two chunks."""
    rng = np.random.default_rng(100 + kernel_blocks + heads)
    views = cases.make_views(
        rng,
        device,
        blocks=600,
        kernel_blocks=kernel_blocks,
        heads=heads,
        tokens=16,
        pieces=64,
        layout=layout,
    )
    rows = random_rows(rng, 600, 512, 16 * kernel_blocks)
    return cases.single(cases.LaunchSpec(views, [3 * H + 8], [0], rows))


def case_big_one_head_32x36(device: str):
    rng = np.random.default_rng(110)
    views = cases.make_views(rng, device, blocks=300, heads=1, tokens=32, pieces=36)
    rows = random_rows(rng, 300, 200, 32)
    return cases.single(cases.LaunchSpec(views, [61 * H], [0], rows))


def case_big_large_slice(device: str):
    """Slice factors and token positions far past 32 bits, fused layers."""
    rng = np.random.default_rng(111)
    views = cases.make_views(
        rng, device, num_layers=2, blocks=64, heads=4, tokens=16, pieces=64
    )
    rows = random_rows(rng, 64, 48, 16)
    rows[1, ::2] += 1 << 34
    slices = [2 * H * 40 + 3, (1 << 40) + 7]
    return cases.single(cases.LaunchSpec(views, slices, [0, 1], rows))


def case_fused_prompt(device: str, num_layers: int):
    """A 1K-token prompt over many layers sharing one layout: one launch."""
    rng = np.random.default_rng(112)
    views = cases.make_views(
        rng, device, num_layers=num_layers, blocks=80, heads=8, tokens=16, pieces=64
    )
    order = rng.permutation(80)[:64]
    rows = cases.make_rows(order.tolist(), [16 * i for i in range(64)], [16] * 63 + [7])
    slices = [layer * H for layer in range(num_layers)]
    return cases.single(cases.LaunchSpec(views, slices, [0] * num_layers, rows))


def case_split_rows_big(device: str, dtype: torch.dtype):
    """Mamba2-like state rows [blocks, 1, rows, 1, elements] of 2/4-byte pieces."""
    rng = np.random.default_rng(113)
    views = cases.make_views(
        rng, device, blocks=6, heads=64, tokens=1, pieces=2048, dtype=dtype, pad=40
    )
    rows = cases.make_rows([5, 0, 3], [0, 0, 0], [1, 1, 1])
    return cases.single(cases.LaunchSpec(views, [9 * H + 64], [0], rows))


def case_state_24k(device: str, dtype: torch.dtype):
    """One 24K-piece state per block: two programs per row add into one sum."""
    rng = np.random.default_rng(114)
    views = cases.make_views(
        rng, device, blocks=5, heads=1, tokens=1, pieces=24 * 1024, dtype=dtype
    )
    rows = cases.make_rows([4, 1, 2, 0], [0, 0, 0, 0], [1, 1, 0, 1])
    return cases.single(cases.LaunchSpec(views, [12 * H], [0], rows))


def case_multi_group_big(device: str):
    """Three groups: rows at even offsets of one tensor, outputs side by side."""
    rng = np.random.default_rng(115)
    attention = cases.make_views(
        rng, device, num_layers=6, blocks=100, heads=8, tokens=16, pieces=64
    )
    token_major = cases.make_views(
        rng,
        device,
        num_layers=3,
        blocks=50,
        kernel_blocks=2,
        heads=2,
        tokens=16,
        pieces=64,
        layout="token",
    )
    mla = cases.make_views(
        rng, device, num_layers=2, blocks=40, heads=1, tokens=32, pieces=36
    )
    specs = [
        cases.LaunchSpec(
            attention,
            [layer * H for layer in range(6)],
            [0, 1, 0, 1, 0, 1],
            random_rows(rng, 100, 33, 16),
            out_origin=(1, 0),
        ),
        cases.LaunchSpec(
            token_major,
            [layer * H + 8 for layer in range(3)],
            [0, 0, 0],
            random_rows(rng, 50, 17, 32),
            rows_offset=34,
            out_origin=(0, 2),
        ),
        cases.LaunchSpec(
            mla,
            [(6 + layer) * H for layer in range(2)],
            [1, 0],
            random_rows(rng, 40, 9, 32),
            rows_offset=52,
            out_origin=(2, 4),
        ),
    ]
    return cases.Case(specs, out_shape=(40, 7), rows_width=64)


def case_wide_matrix_big(device: str):
    """One column of a wider matrix, rows sliced out of a wider tensor."""
    rng = np.random.default_rng(116)
    views = cases.make_views(rng, device, blocks=128, heads=8, tokens=16, pieces=64)
    spec = cases.LaunchSpec(
        views,
        [5 * H],
        [1],
        random_rows(rng, 128, 96, 16),
        rows_offset=6,
        out_origin=(3, 3),
        out_width=2,
    )
    return cases.Case([spec], out_shape=(101, 7), rows_width=110)


BIG_CASES: dict[str, Callable[[str], Any]] = {
    "big_head_major": functools.partial(case_big_layout, layout="head"),
    "big_token_major": functools.partial(case_big_layout, layout="token"),
    "big_token_major_32_heads": functools.partial(
        case_big_layout, layout="token", heads=32
    ),
    "big_kernel_split_head_major": functools.partial(
        case_big_layout, layout="head", kernel_blocks=2
    ),
    "big_kernel_split_token_major": functools.partial(
        case_big_layout, layout="token", kernel_blocks=2
    ),
    "big_one_head_32x36": case_big_one_head_32x36,
    "big_large_slice": case_big_large_slice,
    "fused_36_layers": functools.partial(case_fused_prompt, num_layers=36),
    "split_rows_int16": functools.partial(case_split_rows_big, dtype=torch.int16),
    "split_rows_int32": functools.partial(case_split_rows_big, dtype=torch.int32),
    "state_24k_int64": functools.partial(case_state_24k, dtype=torch.int64),
    "state_24k_int16": functools.partial(case_state_24k, dtype=torch.int16),
    "multi_group_big": case_multi_group_big,
    "wide_matrix_big": case_wide_matrix_big,
}
ALL_CASES = {**cases.CASES, **BIG_CASES}


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_triton_torch_reference_agree(name: str) -> None:
    """Any difference between the Triton kernel, the PyTorch path and the
    reference on CUDA: layouts, kernel splits, partial/empty blocks, slice
    factors, tile shapes, columns, groups, fused layers, chunks (R56, R124)."""
    case = ALL_CASES[name]("cuda")
    from_triton = cases.run_case(case, "triton")
    from_torch = cases.run_case(case, "torch")
    assert np.array_equal(from_triton, from_torch), "triton != torch"
    cases.assert_matches(from_triton, case, "triton")


@pytest.mark.parametrize(
    ("vector", "token_order"),
    [(False, True), (True, False), (True, True)],
    ids=["scalar", "vector_head_order", "vector"],
)
@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_vector_full_tiles_agree(name: str, vector: bool, token_order: bool) -> None:
    """Both settings of vector_full_tiles (issue 30; on by default since
    2026-12-02c) and, with it, of token_order_tiles (memory order for dense
    token-major blocks; without vector_full_tiles it changes nothing) on CUDA:
    a full-row loop that reads a partial row's invalid tokens, lane-index
    offsets on a strided view, a memory-order tile's head, slot or piece
    misplaced, or a 16-byte alignment hint on an unaligned view (a misaligned
    128-bit load faults) (R58, R60)."""
    case = ALL_CASES[name]("cuda")
    with cases.patched(
        kernels, VECTOR_FULL_TILES=vector, TOKEN_ORDER_TILES=token_order
    ):
        from_triton = cases.run_case(case, "triton")
    cases.assert_matches(
        from_triton,
        case,
        f"triton vector_full_tiles={vector} token_order_tiles={token_order}",
    )


def test_triton_is_the_cuda_default() -> None:
    """Falling back to the slow PyTorch path on CUDA (R56)."""
    views = cases.make_views(
        np.random.default_rng(120), "cuda", blocks=2, heads=1, tokens=2, pieces=2
    )
    assert kernels.KVChecksumLaunch(views, [0], [0]).backend == "triton"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_host_sync(backend: str) -> None:
    """A hidden device-to-host sync in a launch, which would stall serving
    steps and fail VLLM_GPU_SYNC_CHECK=error (R55)."""
    case = BIG_CASES["big_head_major"]("cuda")
    spec = case.launches[0]
    launch = kernels.KVChecksumLaunch(spec.views, [0], [0], backend=backend)
    launch.warm_up()
    rows = torch.from_numpy(spec.rows).cuda()
    out = torch.zeros((rows.shape[1], 1), dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launch(rows, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def compiled_variants() -> int | None:
    """Number of compiled variants of the kernel, if this Triton exposes it."""
    caches: Any = getattr(kernels._kv_checksum_kernel, "device_caches", None)
    try:
        return sum(len(entry[0]) for entry in caches.values())
    except (AttributeError, TypeError, IndexError):
        return None


def test_warm_up_compiles_the_serving_variant() -> None:
    """A serving call compiling a new kernel variant because its rows or
    outputs have other strides or alignments than at warm-up (R52, R62)."""
    case = cases.CASES["vllm_block_token_major"]("cuda")
    spec = case.launches[0]
    launch = kernels.KVChecksumLaunch(spec.views, [7], [1])
    launch.warm_up()
    before = compiled_variants()
    if before is None:
        pytest.skip("this Triton does not expose its kernel cache")
    rows = torch.from_numpy(spec.rows).cuda()
    wide_rows = torch.zeros((3, 9), dtype=torch.int64, device="cuda")
    wide_rows[:, 3:6] = rows
    outputs = [
        torch.zeros((3, 2), dtype=torch.int64, device="cuda"),
        torch.zeros((3, 9), dtype=torch.int64, device="cuda")[:, 3:5],
        torch.zeros((3, 16), dtype=torch.int64, device="cuda")[:, 0:2],
    ]
    for out in outputs:
        for batch in (rows, wide_rows[:, 3:6]):
            launch(batch, out)
    torch.cuda.synchronize()
    assert compiled_variants() == before


def test_calls_after_warm_up_take_their_own_rows_and_outputs() -> None:
    """After warm-up, five calls with other row counts, row offsets and
    output slices each match the PyTorch path (R52, R62). Bugs: a launch
    that reuses the first call's rows, counts or strides (a value the
    kernel specialized on at warm-up); a write outside the output slice."""
    case = BIG_CASES["big_head_major"]("cuda")
    spec = case.launches[0]
    launch = kernels.KVChecksumLaunch(spec.views, [3 * H + 8], [1])
    reference = kernels.KVChecksumLaunch(spec.views, [3 * H + 8], [1], backend="torch")
    launch.warm_up()
    all_rows = torch.from_numpy(spec.rows).cuda()
    start = 0
    for count, offset, width in (
        (1, 0, 2),
        (37, 5, 2),
        (200, 1, 4),
        (3, 9, 2),
        (271, 0, 3),
    ):
        rows = torch.full((3, count + offset + 4), -7, dtype=torch.int64, device="cuda")
        rows[:, offset : offset + count] = all_rows[:, start : start + count]
        start += count
        out = torch.zeros((count + 3, width), dtype=torch.int64, device="cuda")
        expected = torch.zeros((count, 2), dtype=torch.int64, device="cuda")
        launch(rows[:, offset : offset + count], out[2 : 2 + count, width - 2 :])
        reference(all_rows[:, start - count : start], expected)
        assert torch.equal(out[2 : 2 + count, width - 2 :], expected), (count, offset)
        assert not out[:2].any() and not out[2 + count :].any()
