# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmarks of KV checksums (SPEC R127, R133).

Kernel mode times the fused Triton launch and the PyTorch path on CUDA for
vLLM-sized KV caches, reports the KV read rate and its ratio to torch's int64
sum over the same bytes (measured in the same run), and asserts that both paths
agree bit for bit. It needs only torch, Triton and NumPy: without vLLM,
kernels.py is loaded by file path.

    python benchmarks/kernels/benchmark_kv_checksum.py --mode kernel
    python benchmarks/kernels/benchmark_kv_checksum.py --mode all
"""

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

KERNELS_MODULE = "vllm.distributed.kv_transfer.kv_checksum.kernels"
KERNELS_PATH = (
    Path(__file__).resolve().parents[2]
    / "vllm/distributed/kv_transfer/kv_checksum/kernels.py"
)
# R133 targets, all as ratios measured in one run.
TARGET_SUM_RATE_RATIO = 0.87  # (a): read rate / torch int64 sum read rate
TARGET_FUSED_TIME_RATIO = 1.3  # (b): time / (bytes / sum read rate of (a))
TARGET_SPEEDUP = 8.0  # (c): PyTorch path time / Triton time on (a)
TARGET_LARGE_SUM_RATE_RATIO = 0.95  # (d), 537 MB: read rate / int64 sum rate
L2_FLUSH_BYTES = 256 << 20


def load_kernels() -> ModuleType:
    """The kernels module from the package, or by file path without vLLM."""
    try:
        return importlib.import_module(KERNELS_MODULE)
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "kv_checksum_kernels", KERNELS_PATH
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


@dataclass(frozen=True)
class KernelShape:
    """A step's checksum work: `blocks` full blocks of each of `layers` layers."""

    label: str
    layers: int
    blocks: int
    cache_blocks: int  # blocks allocated per layer (rows pick `blocks` of them)
    layout: str = "head"  # "head": [B, H, N, C]; "token": [B, N, H, C]
    heads: int = 8
    tokens: int = 16
    head_size: int = 128  # bf16 K and V: C = 2 * head_size * 2 bytes
    # Tokens per chunk view (a producer's send pass, R135); 0: whole blocks.
    chunk: int = 0

    @property
    def pieces(self) -> int:
        return 2 * self.head_size * 2 // 8

    @property
    def bytes_read(self) -> int:
        return self.layers * self.blocks * self.heads * self.tokens * self.pieces * 8


SHAPES = [
    KernelShape("(a) 1 layer, 2048 blocks", 1, 2048, 2048, "head"),
    KernelShape("(a) 1 layer, 2048 blocks", 1, 2048, 2048, "token"),
    KernelShape("(b) 36 layers, 1K prompt", 36, 64, 128),
    KernelShape("(c) 32 layers, 2K prompt", 32, 128, 256),
    KernelShape("(d) 1 layer, 128K prompt", 1, 8192, 8192),
    KernelShape("(e) send pass, 32-token blocks", 1, 1024, 1024, tokens=32, chunk=16),
]


def make_views(shape: KernelShape, device: torch.device) -> list[torch.Tensor]:
    """Random per-layer caches as 5-D int64 piece views [B, 1, H, N, P]."""
    views = []
    blocks, heads, tokens, pieces = (
        shape.cache_blocks,
        shape.heads,
        shape.tokens,
        shape.pieces,
    )
    for _ in range(shape.layers):
        if shape.layout == "head":
            cache = torch.empty((blocks, heads, tokens, pieces), dtype=torch.int64)
        else:
            cache = torch.empty((blocks, tokens, heads, pieces), dtype=torch.int64)
        cache = cache.to(device)
        cache.view(torch.uint8).random_()
        if shape.layout == "token":
            cache = cache.transpose(1, 2)
        views.append(cache.unsqueeze(1))
    return views


def make_rows(shape: KernelShape, device: torch.device) -> torch.Tensor:
    """One request's prompt: distinct random blocks at consecutive positions."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randperm(shape.cache_blocks, generator=generator)[: shape.blocks]
    first = torch.arange(shape.blocks) * shape.tokens
    valid = torch.full((shape.blocks,), shape.tokens)
    return torch.stack([blocks, first, valid]).to(device)


def time_ms(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    """Median CUDA-event time of `fn` after warm-up, L2 flushed before each run."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_shape(
    kernels: ModuleType, shape: KernelShape, iters: int, flush: torch.Tensor
) -> dict[str, float]:
    """Triton and PyTorch path times, equality and the int64 sum baseline."""
    device = flush.device
    views = make_views(shape, device)
    rows = make_rows(shape, device)
    first_slices = [layer * (1 << 16) for layer in range(shape.layers)]
    columns = [0] * shape.layers
    offsets = [0] * shape.layers
    if shape.chunk:
        # Chunk views of each layer, chunk i into column i (R135).
        count = shape.tokens // shape.chunk
        views = [
            view[:, :, :, i * shape.chunk : (i + 1) * shape.chunk]
            for view in views
            for i in range(count)
        ]
        first_slices = [s for s in first_slices for _ in range(count)]
        columns = list(range(count)) * shape.layers
        offsets = [i * shape.chunk for i in range(count)] * shape.layers
    launches = {
        backend: kernels.KVChecksumLaunch(
            views, first_slices, columns, backend, token_offsets=offsets
        )
        for backend in ("triton", "torch")
    }
    outs = {}
    for backend, launch in launches.items():
        launch.warm_up()
        outs[backend] = torch.zeros(
            (shape.blocks, max(columns) + 1), dtype=torch.int64, device=device
        )
        launch(rows, outs[backend])
    assert torch.equal(outs["triton"], outs["torch"]), f"{shape}: paths differ"
    out = outs["triton"]
    baseline = torch.empty(shape.bytes_read // 8, dtype=torch.int64, device=device)
    baseline.view(torch.uint8).random_()
    return {
        "triton_ms": time_ms(lambda: launches["triton"](rows, out), iters, flush),
        "torch_ms": time_ms(lambda: launches["torch"](rows, out), iters, flush),
        "sum_ms": time_ms(baseline.sum, iters, flush),
    }


def run_kernel_benchmarks(
    iters: int = 50, num_warps: int | None = None, max_tile: int | None = None
) -> bool:
    """Print the kernel table (markdown) and the R133 targets; True if all met.

    `num_warps` / `max_tile` override the kernel module's NUM_WARPS /
    MAX_TILE_PIECES, for tuning.
    """
    if not torch.cuda.is_available():
        print("kernel benchmarks need a CUDA device")
        return False
    kernels = load_kernels()
    if num_warps is not None:
        vars(kernels)["NUM_WARPS"] = num_warps
    if max_tile is not None:
        vars(kernels)["MAX_TILE_PIECES"] = max_tile
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    print(
        f"device: {torch.cuda.get_device_name()}, median of {iters} iterations, "
        f"NUM_WARPS={kernels.NUM_WARPS}, MAX_TILE_PIECES={kernels.MAX_TILE_PIECES}"
    )
    print()
    print(
        "| shape | layout | MB read | Triton ms | TB/s | int64 sum TB/s "
        "| ratio to sum | PyTorch path ms | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for shape in SHAPES:
        times = bench_shape(kernels, shape, iters, flush)
        rate = shape.bytes_read / times["triton_ms"] / 1e9
        sum_rate = shape.bytes_read / times["sum_ms"] / 1e9
        speedup = times["torch_ms"] / times["triton_ms"]
        results.append((shape, times))
        print(
            f"| {shape.label} | {shape.layout}-major | {shape.bytes_read / 1e6:.0f} "
            f"| {times['triton_ms']:.4f} | {rate:.2f} | {sum_rate:.2f} "
            f"| {rate / sum_rate:.3f} | {times['torch_ms']:.3f} | {speedup:.1f}x |"
        )
    return report_targets(results)


def run_sweep(iters: int) -> None:
    """Tuning table: (a) and (d) read rates over launch configurations.

    Each row overrides NUM_WARPS, WARP_PIECES and MAX_TILE_PIECES, rebuilds
    the launches and reports both shapes against the same run's int64 sum.
    """
    kernels = load_kernels()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    shapes = [SHAPES[0], next(s for s in SHAPES if s.label.startswith("(d)"))]
    print("| NUM_WARPS | WARP_PIECES | MAX_TILE | (a) / int64 sum | (d) / int64 sum |")
    print("|---|---|---|---|---|")
    defaults = {n: vars(kernels)[n] for n in ("NUM_WARPS", "WARP_PIECES")}
    defaults["MAX_TILE_PIECES"] = kernels.MAX_TILE_PIECES
    for num_warps, warp_pieces, max_tile in (
        (4, 256, 1024),
        (8, 128, 1024),
        (8, 256, 2048),
        (4, 128, 512),
        (16, 128, 2048),
        (2, 256, 512),
    ):
        vars(kernels).update(
            NUM_WARPS=num_warps, WARP_PIECES=warp_pieces, MAX_TILE_PIECES=max_tile
        )
        ratios = []
        for shape in shapes:
            times = bench_shape(kernels, shape, iters, flush)
            ratios.append(times["sum_ms"] / times["triton_ms"])
        print(
            f"| {num_warps} | {warp_pieces} | {max_tile} "
            f"| {ratios[0]:.3f} | {ratios[1]:.3f} |"
        )
    vars(kernels).update(defaults)


def report_targets(results: list[tuple[KernelShape, dict[str, float]]]) -> bool:
    """R133 (a)-(c) from the measured times; every path was bit-identical."""
    a_shape, a_times = results[0]  # (a), head-major
    b_shape, b_times = next(item for item in results if item[0].label.startswith("(b)"))
    d_times = next(item for item in results if item[0].label.startswith("(d)"))[1]
    sum_rate = a_shape.bytes_read / a_times["sum_ms"]  # bytes per ms
    checks = [
        (
            "(a) read rate / int64 sum read rate",
            a_times["sum_ms"] / a_times["triton_ms"],
            f">= {TARGET_SUM_RATE_RATIO}",
            a_times["sum_ms"] / a_times["triton_ms"] >= TARGET_SUM_RATE_RATIO,
        ),
        (
            "(b) time / (bytes / int64 sum read rate of (a))",
            b_times["triton_ms"] / (b_shape.bytes_read / sum_rate),
            f"<= {TARGET_FUSED_TIME_RATIO}",
            b_times["triton_ms"] / (b_shape.bytes_read / sum_rate)
            <= TARGET_FUSED_TIME_RATIO,
        ),
        (
            "(d) 537 MB: read rate / int64 sum read rate",
            d_times["sum_ms"] / d_times["triton_ms"],
            f">= {TARGET_LARGE_SUM_RATE_RATIO}",
            d_times["sum_ms"] / d_times["triton_ms"] >= TARGET_LARGE_SUM_RATE_RATIO,
        ),
        (
            "(c) speedup over the PyTorch path on (a)",
            a_times["torch_ms"] / a_times["triton_ms"],
            f">= {TARGET_SPEEDUP}",
            a_times["torch_ms"] / a_times["triton_ms"] >= TARGET_SPEEDUP,
        ),
    ]
    print()
    print("| R133 target | measured | required | met |")
    print("|---|---|---|---|")
    for name, value, required, met in checks:
        print(f"| {name} | {value:.3f} | {required} | {'yes' if met else 'NO'} |")
    print()
    print("Triton and PyTorch paths: bit-identical on every shape.")
    return all(met for *_, met in checks)


def run_host_benchmarks() -> bool:
    """Host-side benchmarks against the R133 host targets (needs vLLM).

    Row building, verification of a 128K-token load and the payload round
    trip, each timed in this run; returns whether every target was met.
    """
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, f"{here}/{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    rows = load("host_rows_bench").bench_rows()
    verify_us = load("host_verification_bench").bench_verification()
    encode_us, decode_us, raw, b64 = load("host_payload_bench").bench_payload()
    print("\n| host operation | us | target |\n|---|---|---|")
    for label, us in rows:
        target = "<= 150" if "8192" in label else ""
        print(f"| rows: {label} | {us:.0f} | {target} |")
    print(f"| verify 128K-token load, 8 workers | {verify_us:.0f} | <= 1000 |")
    print(
        f"| payload encode + decode ({raw} B raw, {b64} B base64) | "
        f"{encode_us + decode_us:.0f} | <= 500 |"
    )
    rows_8192 = [us for label, us in rows if "8192" in label]
    return (
        all(us <= 150 for us in rows_8192)
        and verify_us <= 1000
        and encode_us + decode_us <= 500
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["kernel", "host", "all"], default="all")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--num-warps", type=int, help="override NUM_WARPS")
    parser.add_argument("--max-tile", type=int, help="override MAX_TILE_PIECES")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a performance target is missed"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also print the launch tuning table"
    )
    args = parser.parse_args()
    met = True
    if args.sweep:
        run_sweep(args.iters)
    if args.mode in ("kernel", "all"):
        met &= run_kernel_benchmarks(args.iters, args.num_warps, args.max_tile)
    if args.mode in ("host", "all"):
        met &= run_host_benchmarks()
    if args.check and not met:
        sys.exit(1)


if __name__ == "__main__":
    main()
