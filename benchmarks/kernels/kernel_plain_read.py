# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plain-read anchor of the kernel benchmark (SPEC R143).

A plain grid-stride Triton sum of int64 words (each program accumulates a
BLOCK-wide vector, then adds its total with one atomic) over a buffer of a
shape's byte count, timed over a few launch configurations; the best one is
the read rate the checksum kernel is held to. Needs only torch and Triton.
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


@dataclass(frozen=True)
class PlainConfig:
    """One launch configuration of the plain sum."""

    programs_per_sm: int
    block: int
    num_warps: int

    @property
    def label(self) -> str:
        return f"{self.programs_per_sm}xSM/B{self.block}/w{self.num_warps}"


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


def best_plain_read(
    words: torch.Tensor, time_ms: Callable[[Callable[[], object]], float]
) -> PlainResult:
    """Time every PLAIN_CONFIGS entry of the plain sum on `words`; a failing
    one is skipped; the best one's sum checked against torch's."""
    out = torch.zeros(1, dtype=torch.int64, device=words.device)
    best: tuple[float, PlainConfig] | None = None
    errors = []
    for config in PLAIN_CONFIGS:
        try:
            ms = time_ms(functools.partial(plain_sum, words, out, config))
        except Exception as exc:  # noqa: BLE001 - report and go on
            errors.append(f"{config.label}: {type(exc).__name__}: {exc}")
            continue
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        return PlainResult(float("nan"), "none", False, len(PLAIN_CONFIGS), errors)
    out.zero_()
    plain_sum(words, out, best[1])
    checked = int(out[0]) == int(words.sum())
    return PlainResult(best[0], best[1].label, checked, len(PLAIN_CONFIGS), errors)
