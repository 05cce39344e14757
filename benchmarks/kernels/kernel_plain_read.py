# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plain-read anchor of the kernel benchmark (SPEC R143).

A plain grid-stride Triton sum of int64 words (each program accumulates a
BLOCK-wide vector, then adds its total with one atomic) over a buffer of a
shape's byte count, timed over a few launch configurations; the best one is
the read rate the checksum kernel is held to. The mixed read is the same
loop doing the checksum's arithmetic on every word (SplitMix64's finalizer
and a 64-bit weight product): what the arithmetic alone costs in the plain
read's launch shape. Needs only torch and Triton.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _plain_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """out += sum of x[0:n] (int64, wrapping), grid-stride over BLOCK words."""
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    step = tl.num_programs(0) * BLOCK
    for start in range(tl.program_id(0) * BLOCK, n, step):
        offsets = start + lane
        if EVEN:
            acc += tl.load(x_ptr + offsets)
        else:
            acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0)
    tl.atomic_add(out_ptr, tl.sum(acc, axis=0), sem="relaxed")


@triton.jit
def _mixed_terms(x, offsets, m):
    """mix(x) * m * (2 * offset + 1) (uint64, wrapping): the checksum's
    arithmetic on one tile of words, the weight a 32 x 32 -> 64-bit product
    as in the checksum kernel's narrow loop."""
    z = x.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    odd = (offsets * 2 + 1).to(tl.uint32).to(tl.uint64)
    return z * (m * odd)


@triton.jit
def _mixed_sum_kernel(
    x_ptr, out_ptr, n, slice_weight, BLOCK: tl.constexpr, EVEN: tl.constexpr
):
    """out += sum of mix(x[i]) * slice_weight * (2i + 1) (uint64, wrapping),
    grid-stride over BLOCK words like _plain_sum_kernel."""
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    step = tl.num_programs(0) * BLOCK
    m = slice_weight.to(tl.uint32).to(tl.uint64)
    for start in range(tl.program_id(0) * BLOCK, n, step):
        offsets = start + lane
        if EVEN:
            x = tl.load(x_ptr + offsets)
        else:
            x = tl.load(x_ptr + offsets, mask=offsets < n, other=0)
        acc += _mixed_terms(x, offsets, m)
    total = tl.sum(acc, axis=0).to(tl.int64, bitcast=True)
    tl.atomic_add(out_ptr, total, sem="relaxed")


@triton.jit
def _chunked_sum_kernel(
    x_ptr,
    order_ptr,
    out_ptr,
    n,
    slice_weight,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    MIXED: tl.constexpr,
    PERMUTED: tl.constexpr,
):
    """The plain sum (with MIXED the mixed one) of x[0:n], one program per
    CHUNK words walked in BLOCK-word tiles: the checksum kernel's launch shape
    (a program per 64 KB block of a layer, 4 warps, 512-piece tiles) without
    its rows, table or weights layout. PERMUTED (n a multiple of CHUNK):
    program p sums chunk order[p], as the kernel reads scattered blocks after
    a dependent load."""
    lane = tl.arange(0, BLOCK)
    if PERMUTED:
        first = tl.load(order_ptr + tl.program_id(0)) * CHUNK
    else:
        first = tl.program_id(0) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    m = slice_weight.to(tl.uint32).to(tl.uint64)
    for start in range(0, CHUNK, BLOCK):
        offsets = first + start + lane
        if EVEN:
            x = tl.load(x_ptr + offsets)
        else:
            x = tl.load(x_ptr + offsets, mask=offsets < n, other=0)
        if MIXED:
            acc += _mixed_terms(x, offsets, m)
        else:
            acc += x.to(tl.uint64, bitcast=True)
    total = tl.sum(acc, axis=0).to(tl.int64, bitcast=True)
    tl.atomic_add(out_ptr, total, sem="relaxed")


@dataclass(frozen=True)
class PlainConfig:
    """One launch configuration of the plain sum."""

    programs_per_sm: int
    block: int
    num_warps: int

    @property
    def label(self) -> str:
        return f"{self.programs_per_sm}xSM/B{self.block}/w{self.num_warps}"


# The slice weight of the mixed read (odd, below 2^32).
MIXED_WEIGHT = 2 * 12345 + 1

PLAIN_CONFIGS = [
    PlainConfig(k, block, warps)
    for k in (1, 2, 4, 8)
    for block in (1024, 2048, 4096)
    for warps in (4, 8)
]


@dataclass
class PlainResult:
    """Best plain-read time of one buffer and which configuration reached it."""

    ms: float
    config: str
    checked: bool  # the best configuration's sum equals torch's int64 sum
    tried: int
    errors: list[str]


def programs(words: torch.Tensor, config: PlainConfig) -> int:
    """Programs of a grid-stride launch over `words`: programs_per_sm per SM
    (CPU: one SM), no more than there are BLOCK-word tiles."""
    sms = 1
    if words.device.type == "cuda":
        sms = torch.cuda.get_device_properties(words.device).multi_processor_count
    tiles = triton.cdiv(words.numel(), config.block)
    return max(1, min(config.programs_per_sm * sms, tiles))


def plain_sum(words: torch.Tensor, out: torch.Tensor, config: PlainConfig) -> None:
    """Add the wrapping int64 sum of `words` (1-D, contiguous) into out[0]."""
    n = words.numel()
    _plain_sum_kernel[(programs(words, config),)](
        words,
        out,
        n,
        BLOCK=config.block,
        EVEN=n % config.block == 0,
        num_warps=config.num_warps,
    )


def mixed_sum(words: torch.Tensor, out: torch.Tensor, config: PlainConfig) -> None:
    """Add the mixed read's wrapping sum of `words` into out[0] (MIXED_WEIGHT)."""
    n = words.numel()
    _mixed_sum_kernel[(programs(words, config),)](
        words,
        out,
        n,
        MIXED_WEIGHT,
        BLOCK=config.block,
        EVEN=n % config.block == 0,
        num_warps=config.num_warps,
    )


def mixed_sum_reference(words: torch.Tensor, mix: Callable[..., torch.Tensor]) -> int:
    """The mixed read's sum by torch (int64 wrapping), `mix` the package's
    SplitMix64 finalizer on int64 pieces; the weight's 32-bit truncation
    mirrored."""
    index = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    odd = (index * 2 + 1) & 0xFFFFFFFF
    return int((mix(words) * (odd * MIXED_WEIGHT)).sum())


# The checksum kernel's launch shape at the benchmark's blocks: 8,192 words
# (64 KB) a program, 512-word tiles, 4 warps.
KERNEL_SHAPE_CHUNK = 8192
KERNEL_SHAPE_BLOCK = 512
KERNEL_SHAPE_WARPS = 4


@dataclass(frozen=True)
class ChunkedConfig:
    """One launch shape of the chunked read: words a program, tile, warps."""

    chunk: int
    block: int
    num_warps: int

    @property
    def label(self) -> str:
        return f"C{self.chunk}/B{self.block}/w{self.num_warps}"


KERNEL_SHAPE = ChunkedConfig(KERNEL_SHAPE_CHUNK, KERNEL_SHAPE_BLOCK, KERNEL_SHAPE_WARPS)

# The shape sweep (--anchor-sweep): which of the kernel's launch shape's
# parameters the mixed read loses to (words a program, tile, warps), and the
# grid-stride mixed read at the kernel's tile and warps.
CHUNKED_SWEEP = [
    ChunkedConfig(chunk, block, warps)
    for chunk in (2048, 8192, 32768)
    for block in (512, 1024)
    for warps in (4, 8)
]
# Chunked shapes also read in a random chunk order (permuted_chunked_sum).
PERMUTED_SWEEP = [ChunkedConfig(chunk, 512, 4) for chunk in (2048, 8192)]
GRID_SWEEP = [
    PlainConfig(k, block, warps)
    for k in (2, 4, 8)
    for block in (512, 1024)
    for warps in (4, 8)
]


def chunked_sum(
    words: torch.Tensor,
    out: torch.Tensor,
    mixed: bool,
    config: ChunkedConfig = KERNEL_SHAPE,
) -> None:
    """Add the plain (or mixed) sum of `words` into out[0] in a chunked launch
    shape (_chunked_sum_kernel), by default the checksum kernel's."""
    _launch_chunked(words, out, mixed, config, None)


def _launch_chunked(
    words: torch.Tensor,
    out: torch.Tensor,
    mixed: bool,
    config: ChunkedConfig,
    order: torch.Tensor | None,
) -> None:
    n = words.numel()
    grid = triton.cdiv(n, config.chunk) if order is None else order.numel()
    _chunked_sum_kernel[(grid,)](
        words,
        words if order is None else order,
        out,
        n,
        MIXED_WEIGHT,
        CHUNK=config.chunk,
        BLOCK=config.block,
        EVEN=n % config.chunk == 0,
        MIXED=mixed,
        PERMUTED=order is not None,
        num_warps=config.num_warps,
    )


def chunk_order(words: torch.Tensor, chunk: int) -> torch.Tensor:
    """A seeded random order of `words`' chunks (int64, on its device)."""
    generator = torch.Generator().manual_seed(0)
    count = words.numel() // chunk
    return torch.randperm(count, generator=generator).to(words.device)


def permuted_chunked_sum(
    words: torch.Tensor,
    out: torch.Tensor,
    mixed: bool,
    config: ChunkedConfig,
    order: torch.Tensor,
) -> None:
    """chunked_sum with chunks in `order` (chunk_order); `words` a whole
    number of chunks."""
    if words.numel() % config.chunk:
        raise ValueError(f"{words.numel()} words are not a whole number of chunks")
    _launch_chunked(words, out, mixed, config, order)


def best_plain_read(
    words: torch.Tensor, time_ms: Callable[[Callable[[], object]], float]
) -> PlainResult:
    """Time every PLAIN_CONFIGS entry of the plain sum on `words`; a failing
    one is skipped; the best one's sum checked against torch's."""
    return _best_read(words, time_ms, plain_sum, lambda: int(words.sum()))


def best_mixed_read(
    words: torch.Tensor,
    time_ms: Callable[[Callable[[], object]], float],
    expected: int,
) -> PlainResult:
    """As best_plain_read for the mixed read, checked against `expected`
    (mixed_sum_reference, computed once by the caller)."""
    return _best_read(words, time_ms, mixed_sum, lambda: expected)


def _best_read(
    words: torch.Tensor,
    time_ms: Callable[[Callable[[], object]], float],
    read: Callable[[torch.Tensor, torch.Tensor, PlainConfig], None],
    expected: Callable[[], int],
) -> PlainResult:
    out = torch.zeros(1, dtype=torch.int64, device=words.device)
    best: tuple[float, PlainConfig] | None = None
    errors = []
    for config in PLAIN_CONFIGS:
        try:
            ms = time_ms(functools.partial(read, words, out, config))
        except Exception as exc:  # noqa: BLE001 - report and go on
            errors.append(f"{config.label}: {type(exc).__name__}: {exc}")
            continue
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        return PlainResult(float("nan"), "none", False, len(PLAIN_CONFIGS), errors)
    out.zero_()
    read(words, out, best[1])
    checked = int(out[0]) == expected()
    return PlainResult(best[0], best[1].label, checked, len(PLAIN_CONFIGS), errors)
