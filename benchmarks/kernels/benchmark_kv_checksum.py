# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmarks of KV checksums (SPEC R127, R133, R143).

Kernel mode times the fused Triton launch and the PyTorch path on CUDA for
vLLM-sized KV caches and reports, per shape, the kernel's ratio to the best
plain grid-stride read of the same byte count (kernel_plain_read.py, R143) and
to torch's int64 sum, all timed the same way in the same run; every Triton
result is compared bit for bit with the PyTorch path. Three tables follow:
the queued timing (the GPU held ahead of the host; each launch path's host
time), the primed timing (the kernel's inputs or code in L2 first) and the
arithmetic anchor (the plain read doing the checksum's arithmetic), which
take R143's gap apart. `--sweep` then times the
launch configurations of `sweep_configs` on every shape and recommends one;
`--variants` times the default configuration and the kernel variants of
`variant_configs` side by side on every shape (interleaved rounds, the same
plain-read anchor, bit-checked); `--json` writes every result. It needs only
torch, Triton and NumPy: without vLLM, kernels.py is loaded by file path.

    python benchmarks/kernels/benchmark_kv_checksum.py --mode kernel
    python benchmarks/kernels/benchmark_kv_checksum.py --mode kernel --sweep \\
        --iters 30 --json kernel.json
    python benchmarks/kernels/benchmark_kv_checksum.py --mode kernel --variants \\
        --iters 20 --json variants.json
    python benchmarks/kernels/benchmark_kv_checksum.py --mode all
"""

import argparse
import dataclasses
import datetime
import functools
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

KERNELS_MODULE = "vllm.distributed.kv_transfer.kv_checksum.definition.kernels"
KERNELS_PATH = (
    Path(__file__).resolve().parents[2]
    / "vllm/distributed/kv_transfer/kv_checksum/definition/kernels.py"
)
# R133 targets, all as ratios measured in one run.
TARGET_SUM_RATE_RATIO = 0.87  # (a): read rate / torch int64 sum read rate
TARGET_FUSED_TIME_RATIO = 1.3  # (b): time / (bytes / sum read rate of (a))
TARGET_SPEEDUP = 8.0  # (c): PyTorch path time / Triton time on (a)
TARGET_LARGE_SUM_RATE_RATIO = 0.95  # (d), 537 MB: read rate / int64 sum rate
# R143: every shape's time / the best plain grid-stride sum's, inverted.
TARGET_PLAIN_READ_RATIO = 0.95
# Sweep: candidates may not slow shapes up to this size down by more than 2 %.
SMALL_SHAPE_BYTES = 160_000_000
SMALL_SHAPE_SLOWDOWN = 0.02
L2_FLUSH_BYTES = 256 << 20
# Spin cycles queued on the GPU after the flush in the queued timing (about
# 200 us at an H200's 1.98 GHz): the host's launch path then runs while the
# GPU is busy, so the timed window holds the kernel alone, as in an engine step
# where the launch queues behind the forward pass.
AHEAD_CYCLES = 400_000
# Where kernel mode runs (a CPU smoke run under TRITON_INTERPRET=1 patches it).
DEVICE = "cuda"


def load_sibling(name: str) -> ModuleType:
    """A module of this directory by file path."""
    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


# Rows' blocks in ascending order (--sorted-rows): how much of the kernel's
# time over the plain read is its blocks' scattered order in the cache.
SORTED_ROWS = False


def make_rows(shape: KernelShape, device: torch.device) -> torch.Tensor:
    """One request's prompt: distinct random blocks at consecutive positions
    (with SORTED_ROWS the same blocks in ascending order)."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randperm(shape.cache_blocks, generator=generator)[: shape.blocks]
    if SORTED_ROWS:
        blocks = blocks.sort().values
    first = torch.arange(shape.blocks) * shape.tokens
    valid = torch.full((shape.blocks,), shape.tokens)
    return torch.stack([blocks, first, valid]).to(device)


def time_ms(
    fn: Callable[[], object],
    iters: int,
    flush: torch.Tensor,
    ahead_cycles: int = 0,
    prime: Callable[[], object] | None = None,
) -> float:
    """Median CUDA-event time of `fn` after warm-up, L2 flushed before each run;
    with `ahead_cycles` a spin of that many GPU cycles is queued between the
    flush and the start event, so that `fn`'s host path is not timed; `prime`
    runs after the flush, outside the timed window."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        if prime is not None:
            prime()
        if ahead_cycles:
            torch.cuda._sleep(ahead_cycles)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@dataclass
class ShapeRun:
    """A shape's data, rows and PyTorch-path result, built once per run."""

    shape: KernelShape
    views: list[torch.Tensor]
    first_slices: list[int]
    columns: list[int]
    offsets: list[int]
    rows: torch.Tensor
    expected: torch.Tensor  # the PyTorch path's sums (the reference)
    words: torch.Tensor  # shape.bytes_read bytes for the plain read and sum

    def out(self) -> torch.Tensor:
        """A zeroed output matrix of the reference's shape."""
        return torch.zeros_like(self.expected)

    def launch(self, kernels: ModuleType, backend: str, config: Any = None) -> Any:
        return kernels.KVChecksumLaunch(
            self.views,
            self.first_slices,
            self.columns,
            backend,
            token_offsets=self.offsets,
            config=config,
        )


def prepare_shape(kernels: ModuleType, shape: KernelShape) -> ShapeRun:
    """Views, rows, the PyTorch path's sums and the plain-read buffer."""
    device = torch.device(DEVICE)
    views = make_views(shape, device)
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
    rows = make_rows(shape, device)
    expected = torch.zeros(
        (shape.blocks, max(columns) + 1), dtype=torch.int64, device=device
    )
    words = torch.empty(shape.bytes_read // 8, dtype=torch.int64, device=device)
    words.view(torch.uint8).random_()
    run = ShapeRun(shape, views, first_slices, columns, offsets, rows, expected, words)
    run.launch(kernels, "torch")(rows, expected)
    return run


@dataclass
class KernelTiming:
    """One configuration's time on one shape and whether its sums were right."""

    ms: float
    identical: bool


def time_kernel(
    kernels: ModuleType, run: ShapeRun, config: Any, iters: int, flush: torch.Tensor
) -> KernelTiming:
    """Build the Triton launch with `config`, check it bit for bit, time it."""
    launch = run.launch(kernels, "triton", config)
    launch.warm_up()
    out = run.out()
    launch(run.rows, out)
    identical = bool(torch.equal(out, run.expected))
    return KernelTiming(time_ms(lambda: launch(run.rows, out), iters, flush), identical)


def host_launch_us(fn: Callable[[], object], iters: int) -> float:
    """Median host time of one call of `fn` in microseconds: its launch path,
    with the device idle before each call."""
    times = []
    for _ in range(iters):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)


def shape_name(shape: KernelShape) -> str:
    """A shape's label with its layout."""
    return f"{shape.label}, {shape.layout}-major"


def config_label(config: Any) -> str:
    """A LaunchConfig in a few words."""
    mode = (
        f"persistent {config.programs_per_sm}xSM" if config.programs_per_sm else "grid"
    )
    wide = ", wide" if config.wide_weights else ""
    vector = ", vector" if getattr(config, "vector_full_tiles", False) else ""
    if vector and not getattr(config, "token_order_tiles", True):
        vector += " (head order)"
    static = ", static tiles" if getattr(config, "static_tiles", False) else ""
    static += ", early loads" if getattr(config, "early_loads", False) else ""
    return (
        f"{mode}, chunk {config.chunk_pieces}, tile {config.max_tile}, "
        f"{config.num_warps}w/{config.warp_pieces}{wide}{vector}{static}"
    )


class Report:
    """Collects every result and rewrites the JSON file after each step."""

    def __init__(self, path: str | None, meta: dict) -> None:
        self.path = path
        self.data: dict = {
            "meta": meta,
            "shapes": {},
            "sweep": [],
            "variants": {},
            "errors": [],
        }

    def error(self, where: str, exc: BaseException) -> None:
        line = f"{where}: {type(exc).__name__}: {exc}"
        print(f"ERROR {line}", flush=True)
        self.data["errors"].append(line)
        self.save()

    def save(self) -> None:
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1, default=str)


def environment() -> dict:
    """Device, versions and date of this run."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
    }


def run_kernel_benchmarks(
    iters: int = 50,
    config_overrides: dict | None = None,
    sweep: bool = False,
    json_path: str | None = None,
    budget_s: float = 170.0,
    variants: bool = False,
    rounds: int = 3,
    anchor_sweep: bool = False,
) -> bool:
    """Print the kernel table (markdown), the R133 targets and, with `sweep`,
    the tuning table; True if every R133 and R143 target was met.

    `config_overrides` replace fields of the kernel's default LaunchConfig for
    the main table. Every step reports its errors and goes on.
    """
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("kernel benchmarks need a CUDA device")
        return False
    started = time.monotonic()
    kernels = load_kernels()
    plain = load_sibling("kernel_plain_read")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    default = kernels.default_config()
    try:
        main_config = dataclasses.replace(default, **(config_overrides or {}))
    except ValueError as exc:
        print(f"ERROR bad configuration {config_overrides}: {exc}; using the default")
        main_config = default
    report = Report(json_path, environment())
    report.data["meta"].update(
        iters=iters,
        default_config=vars(default),
        main_config=vars(main_config),
        sorted_rows=SORTED_ROWS,
    )
    meta = report.data["meta"]
    print(
        f"device: {meta['device']} ({meta['sms']} SMs), torch {meta['torch']}, "
        f"CUDA {meta['cuda']}, Triton {meta['triton']}, {meta['date']}; "
        f"median of {iters} iterations, L2 flushed before each"
    )
    print(f"kernel configuration: {config_label(main_config)}")
    print()
    runs: list[ShapeRun] = []
    for shape in SHAPES:
        try:
            runs.append(prepare_shape(kernels, shape))
        except Exception as exc:  # noqa: BLE001 - report and go on
            report.error(f"prepare {shape_name(shape)}", exc)
    print(
        "| shape | layout | MB read | Triton ms | TB/s | plain read TB/s "
        "| **kernel / plain read** | int64 sum TB/s | kernel / int64 sum "
        "| PyTorch path ms | speedup | plain read config |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    met = True
    for run in runs:
        shape = run.shape
        entry: dict = {"bytes": shape.bytes_read}
        report.data["shapes"][shape_name(shape)] = entry
        try:
            anchor = plain.best_plain_read(
                run.words, lambda fn: time_ms(fn, iters, flush)
            )
            entry["plain"] = vars(anchor)
            for line in anchor.errors:
                print(f"plain read config failed on {shape_name(shape)}: {line}")
            if not anchor.checked:
                print(f"WARNING plain read sum != torch sum on {shape_name(shape)}")
            sum_ms = time_ms(run.words.sum, iters, flush)
            timing = time_kernel(kernels, run, main_config, iters, flush)
            torch_ms = time_ms(
                functools.partial(run.launch(kernels, "torch"), run.rows, run.out()),
                iters,
                flush,
            )
        except Exception as exc:  # noqa: BLE001 - report and go on
            report.error(f"main table {shape_name(shape)}", exc)
            met = False
            continue
        if not timing.identical:
            print(f"MISMATCH: Triton != PyTorch path on {shape_name(shape)}")
            met = False
        times = {
            "triton_ms": timing.ms,
            "torch_ms": torch_ms,
            "sum_ms": sum_ms,
            "plain_ms": anchor.ms,
        }
        entry.update(times, identical=timing.identical)
        results.append((shape, times))
        gb = shape.bytes_read / 1e9
        plain_ratio = anchor.ms / timing.ms
        entry["kernel_over_plain"] = plain_ratio
        met &= plain_ratio >= TARGET_PLAIN_READ_RATIO
        print(
            f"| {shape.label} | {shape.layout}-major | {shape.bytes_read / 1e6:.0f} "
            f"| {timing.ms:.4f} | {gb / timing.ms:.2f} | {gb / anchor.ms:.2f} "
            f"| **{plain_ratio:.3f}** | {gb / sum_ms:.2f} | {sum_ms / timing.ms:.3f} "
            f"| {torch_ms:.3f} | {torch_ms / timing.ms:.1f}x | {anchor.config} |",
            flush=True,
        )
        report.save()
    ratios = [
        e["kernel_over_plain"]
        for e in report.data["shapes"].values()
        if "kernel_over_plain" in e
    ]
    if ratios:
        print()
        verdict = "met" if min(ratios) >= TARGET_PLAIN_READ_RATIO else "NOT met"
        print(
            f"R143 (every shape >= {TARGET_PLAIN_READ_RATIO} of the best plain "
            f"read): min {min(ratios):.3f}, {verdict}"
        )
    try:
        met &= report_targets(results)
    except Exception as exc:  # noqa: BLE001 - report and go on
        report.error("R133 targets", exc)
        met = False
    table = TimingTable(kernels, plain, runs, main_config, iters, flush, report)
    try:
        run_queued_table(table)
    except Exception as exc:  # noqa: BLE001 - report and go on
        report.error("queued table", exc)
    try:
        run_primed_table(table)
    except Exception as exc:  # noqa: BLE001 - report and go on
        report.error("primed table", exc)
    try:
        run_arithmetic_table(table)
    except Exception as exc:  # noqa: BLE001 - report and go on
        report.error("arithmetic table", exc)
    if anchor_sweep:
        try:
            run_anchor_sweep(table)
        except Exception as exc:  # noqa: BLE001 - report and go on
            report.error("anchor sweep", exc)
    if variants:
        run_variants(kernels, runs, default, iters, rounds, flush, report)
    if sweep:
        run_sweep(kernels, runs, default, iters, flush, report, started + budget_s)
    report.save()
    print(f"\nwall time {time.monotonic() - started:.0f} s")
    return met


@dataclass
class TimingTable:
    """What the launch-latency and primed tables read: the modules, the
    shapes' data, the launch config, the timer's settings and the report."""

    kernels: ModuleType
    plain: ModuleType
    runs: list[ShapeRun]
    config: Any
    iters: int
    flush: torch.Tensor
    report: Report


def run_queued_table(t: TimingTable) -> None:
    """Launch-latency table: each launch path's host time, and kernel / plain
    read timed again with the GPU held ahead of the host (AHEAD_CYCLES), so
    that neither timed window holds a host launch path (R143's reading)."""
    print()
    print(
        f"## Queued timing: the GPU held {AHEAD_CYCLES} cycles ahead of the host "
        "before each timed launch"
    )
    print()
    print(
        "| shape | kernel host launch us | kernel host launch us, JIT "
        "| plain host launch us | kernel ms | plain read ms "
        "| **kernel / plain read, queued** | flush-only ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for run in t.runs:
        key = shape_name(run.shape)
        entry = t.report.data["shapes"].get(key, {})
        if "kernel_over_plain" not in entry:
            continue
        launch = run.launch(t.kernels, "triton", t.config)
        launch.warm_up()
        out = run.out()
        kernel_call = functools.partial(launch, run.rows, out)
        anchor = t.plain.best_plain_read(
            run.words, lambda fn: time_ms(fn, t.iters, t.flush, AHEAD_CYCLES)
        )
        kernel_ms = time_ms(kernel_call, t.iters, t.flush, AHEAD_CYCLES)
        kernel_us = host_launch_us(kernel_call, t.iters)
        # The same launch through Triton's JIT every call (direct_launch off).
        jit_launch = run.launch(
            t.kernels, "triton", dataclasses.replace(t.config, direct_launch=False)
        )
        jit_launch.warm_up()
        jit_us = host_launch_us(functools.partial(jit_launch, run.rows, out), t.iters)
        best = [c for c in t.plain.PLAIN_CONFIGS if c.label == anchor.config]
        plain_us = float("nan")
        if best:
            scratch = torch.zeros(1, dtype=torch.int64, device=run.words.device)
            plain_us = host_launch_us(
                functools.partial(t.plain.plain_sum, run.words, scratch, best[0]),
                t.iters,
            )
        ratio = anchor.ms / kernel_ms
        ratios.append(ratio)
        entry["queued"] = {
            "ahead_cycles": AHEAD_CYCLES,
            "kernel_ms": kernel_ms,
            "plain_ms": anchor.ms,
            "plain_config": anchor.config,
            "kernel_host_launch_us": kernel_us,
            "kernel_host_launch_us_jit": jit_us,
            "direct_launch": bool(getattr(t.config, "direct_launch", False)),
            "plain_host_launch_us": plain_us,
            "kernel_over_plain": ratio,
        }
        print(
            f"| {key} | {kernel_us:.1f} | {jit_us:.1f} | {plain_us:.1f} "
            f"| {kernel_ms:.4f} "
            f"| {anchor.ms:.4f} | **{ratio:.3f}** | {entry['kernel_over_plain']:.3f} |",
            flush=True,
        )
        t.report.save()
    if ratios:
        verdict = "met" if min(ratios) >= TARGET_PLAIN_READ_RATIO else "NOT met"
        t.report.data["queued_min_ratio"] = min(ratios)
        print()
        print(
            f"R143 with the GPU held ahead (every shape >= {TARGET_PLAIN_READ_RATIO} "
            f"of the best plain read, queued): min {min(ratios):.3f}, {verdict}"
        )


def primed_times(t: TimingTable, run: ShapeRun, plain_config: str) -> dict[str, Any]:
    """One shape's row of the primed table (run_primed_table)."""
    launch = run.launch(t.kernels, "triton", t.config)
    launch.warm_up()
    out = run.out()
    kernel_call = functools.partial(launch, run.rows, out)
    rows_copy = torch.empty_like(run.rows)
    table = getattr(launch, "_table", None)
    table_copy = torch.empty_like(table) if table is not None else None

    def touch_inputs() -> None:
        rows_copy.copy_(run.rows)
        if table is not None and table_copy is not None:
            table_copy.copy_(table)

    one_row = run.rows[:, :1].clone()
    one_out = torch.zeros((1, out.shape[1]), dtype=out.dtype, device=out.device)

    def touch_code() -> None:
        touch_inputs()
        launch(one_row, one_out)

    best = [c for c in t.plain.PLAIN_CONFIGS if c.label == plain_config]
    kernel_cold = time_ms(kernel_call, t.iters, t.flush, AHEAD_CYCLES)
    kernel_inputs = time_ms(kernel_call, t.iters, t.flush, AHEAD_CYCLES, touch_inputs)
    kernel_code = time_ms(kernel_call, t.iters, t.flush, AHEAD_CYCLES, touch_code)
    scratch = torch.zeros(1, dtype=torch.int64, device=run.words.device)
    plain_call: Callable[[], object] = run.words.sum
    plain_prime: Callable[[], object] | None = None
    if best:  # the anchor's configuration (a stubbed anchor has none)
        plain_call = functools.partial(t.plain.plain_sum, run.words, scratch, best[0])
        small = torch.zeros(best[0].block, dtype=torch.int64, device=run.words.device)
        plain_prime = functools.partial(t.plain.plain_sum, small, scratch, best[0])
    plain_cold = time_ms(plain_call, t.iters, t.flush, AHEAD_CYCLES)
    plain_code = time_ms(plain_call, t.iters, t.flush, AHEAD_CYCLES, plain_prime)
    return {
        "kernel_ms": {
            "cold": kernel_cold,
            "inputs": kernel_inputs,
            "code": kernel_code,
        },
        "plain_ms": {"cold": plain_cold, "code": plain_code},
        "kernel_over_plain": {
            "cold": plain_cold / kernel_cold,
            "inputs": plain_cold / kernel_inputs,
            "code": plain_code / kernel_code,
        },
    }


# Column heads of the primed and arithmetic tables (" | " between columns).
PRIMED_COLUMNS = (
    "shape | cold (queued) | **inputs warm** | **code and inputs warm** "
    "| kernel ms cold / inputs / code | plain ms cold / code"
)
ARITHMETIC_COLUMNS = (
    "shape | **mixed read** | plain, kernel's shape | mixed, kernel's shape "
    "| kernel | plain read ms | mixed config | sums checked"
)


def queued_shapes(
    t: TimingTable, title: str, columns: str
) -> Iterator[tuple[ShapeRun, str, dict[str, Any], dict[str, Any]]]:
    """Print a table's title and head, then yield each shape that has a
    queued-timing entry: (its run, label, report entry, queued entry)."""
    print()
    print(f"## {title}")
    print()
    print(f"| {columns} |")
    print("|" + "---|" * (columns.count(" | ") + 1))
    for run in t.runs:
        key = shape_name(run.shape)
        entry = t.report.data["shapes"].get(key, {})
        queued = entry.get("queued")
        if queued:
            yield run, key, entry, queued


def run_primed_table(t: TimingTable) -> None:
    """Where R143's fixed cost a launch goes: kernel / plain read again, both
    queued, with what each launch needs besides the data made L2-resident
    after the flush. "inputs warm": the kernel's rows and layer table copied
    (read) first; "code warm": a one-row launch of the same kernel (and a
    small plain read of the same configuration) first, which also warms its
    table. Neither touches the timed data beyond one block of it."""
    title = (
        "Primed timing: kernel / plain read, both queued, with the L2 holding "
        "the kernel's inputs or its code"
    )
    for run, key, entry, queued in queued_shapes(t, title, PRIMED_COLUMNS):
        entry["primed"] = primed_times(t, run, queued["plain_config"])
        ratios = entry["primed"]["kernel_over_plain"]
        kernel_ms, plain_ms = entry["primed"]["kernel_ms"], entry["primed"]["plain_ms"]
        print(
            f"| {key} | {ratios['cold']:.3f} | **{ratios['inputs']:.3f}** "
            f"| **{ratios['code']:.3f}** | {kernel_ms['cold']:.4f} / "
            f"{kernel_ms['inputs']:.4f} / {kernel_ms['code']:.4f} "
            f"| {plain_ms['cold']:.4f} / {plain_ms['code']:.4f} |",
            flush=True,
        )
        t.report.save()


def run_arithmetic_table(t: TimingTable) -> None:
    """What the checksum's arithmetic and its launch shape each cost at the
    read limit, all queued, as ratios to the best plain read: the mixed read
    (the plain read's grid-stride loop doing SplitMix64 and a weight product
    on every word, best of the same launch configurations), and the plain
    and mixed reads in the kernel's launch shape (a program per 64 KB,
    512-word tiles, 4 warps). Each sum is checked against torch's. A mixed
    read near the kernel's own ratio puts R143's gap in the arithmetic; a
    kernel-shape read near it, in the launch shape."""
    title = (
        "Arithmetic anchor: reads doing the checksum's arithmetic, or in the "
        "kernel's launch shape, over the best plain read (queued)"
    )
    for run, key, entry, queued in queued_shapes(t, title, ARITHMETIC_COLUMNS):
        entry["arithmetic"] = arithmetic_times(t, run, queued)
        row = entry["arithmetic"]
        if not row["checked"]:
            t.report.error(
                f"arithmetic {key}", ValueError("a sum differs from torch's")
            )
        print(
            f"| {key} | **{row['mixed_over_plain']:.3f}** "
            f"| {row['plain_kernel_shape_over_plain']:.3f} "
            f"| {row['mixed_kernel_shape_over_plain']:.3f} "
            f"| {queued['kernel_over_plain']:.3f} | {queued['plain_ms']:.4f} "
            f"| {row['mixed_config']} | {'yes' if row['checked'] else 'NO'} |",
            flush=True,
        )
        t.report.save()


def arithmetic_times(
    t: TimingTable, run: ShapeRun, queued: dict[str, Any]
) -> dict[str, Any]:
    """One shape's row of the arithmetic table (run_arithmetic_table)."""

    def timer(fn: Callable[[], object]) -> float:
        return time_ms(fn, t.iters, t.flush, AHEAD_CYCLES)

    expected = t.plain.mixed_sum_reference(run.words, t.kernels.mix_int64)
    mixed = t.plain.best_mixed_read(run.words, timer, expected)
    out = torch.zeros(1, dtype=torch.int64, device=run.words.device)
    shaped = {}
    for name, is_mixed in (("plain", False), ("mixed", True)):
        call = functools.partial(t.plain.chunked_sum, run.words, out, is_mixed)
        shaped[name] = timer(call)
        out.zero_()
        call()
        shaped[f"{name}_sum"] = int(out[0])
        out.zero_()
    checked = (
        mixed.checked
        and shaped["plain_sum"] == int(run.words.sum())
        and shaped["mixed_sum"] == expected
    )
    plain_ms = queued["plain_ms"]
    return {
        "mixed_ms": mixed.ms,
        "mixed_config": mixed.config,
        "mixed_over_plain": plain_ms / mixed.ms,
        "plain_kernel_shape_ms": shaped["plain"],
        "plain_kernel_shape_over_plain": plain_ms / shaped["plain"],
        "mixed_kernel_shape_ms": shaped["mixed"],
        "mixed_kernel_shape_over_plain": plain_ms / shaped["mixed"],
        "checked": checked,
    }


def sweep_reads(
    plain: ModuleType, words: torch.Tensor, out: torch.Tensor
) -> Iterator[tuple[str, Callable[[], None], bool]]:
    """The anchor sweep's reads of `words` into `out`: (name, call, whether
    its sum is the plain one rather than the mixed one). Permuted reads only
    where `words` is a whole number of their chunks."""
    for config in plain.CHUNKED_SWEEP:
        call = functools.partial(plain.chunked_sum, words, out, True, config)
        yield f"chunked {config.label}", call, False
    for config in plain.GRID_SWEEP:
        yield (
            f"grid {config.label}",
            functools.partial(plain.mixed_sum, words, out, config),
            False,
        )
    for config in plain.PERMUTED_SWEEP:
        if words.numel() % config.chunk:
            continue
        order = plain.chunk_order(words, config.chunk)
        for mixed in (False, True):
            call = functools.partial(
                plain.permuted_chunked_sum, words, out, mixed, config, order
            )
            kind = "mixed" if mixed else "plain"
            yield f"{kind} permuted {config.label}", call, not mixed


def run_anchor_sweep(t: TimingTable) -> None:
    """Which part of the kernel's launch shape the arithmetic loses to: the
    mixed read chunked (words a program, tile, warps; CHUNKED_SWEEP) and
    grid-stride (GRID_SWEEP), and the plain and mixed reads chunked in a
    random chunk order as the kernel reads scattered blocks (PERMUTED_SWEEP),
    each over the shape's best plain read, queued. A sum that differs from
    torch's is marked."""

    def timer(fn: Callable[[], object]) -> float:
        return time_ms(fn, t.iters, t.flush, AHEAD_CYCLES)

    keys = []
    columns: dict[str, dict[str, str]] = {}
    for run in t.runs:
        key = shape_name(run.shape)
        queued = t.report.data["shapes"].get(key, {}).get("queued")
        if not queued:
            continue
        keys.append(key)
        expected = {
            False: t.plain.mixed_sum_reference(run.words, t.kernels.mix_int64),
            True: int(run.words.sum()),
        }
        out = torch.zeros(1, dtype=torch.int64, device=run.words.device)
        sweep = t.report.data["shapes"][key].setdefault("anchor_sweep", {})
        for name, call, is_plain in sweep_reads(t.plain, run.words, out):
            try:
                ms = timer(call)
                out.zero_()
                call()
                ok = int(out[0]) == expected[is_plain]
            except Exception as exc:  # noqa: BLE001 - report and go on
                t.report.error(f"anchor sweep {name} on {key}", exc)
                columns.setdefault(name, {})[key] = "error"
                continue
            ratio = queued["plain_ms"] / ms
            sweep[name] = {"ms": ms, "over_plain": ratio, "checked": ok}
            columns.setdefault(name, {})[key] = f"{ratio:.3f}" + ("" if ok else " NO")
        t.report.save()
    print()
    print(
        "## Anchor sweep: the mixed read in each launch shape over the best "
        "plain read (queued; NO: sum differs)"
    )
    print()
    print("| mixed read | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for name, row in columns.items():
        print(f"| {name} | " + " | ".join(row.get(k, "") for k in keys) + " |")


# Overrides the static-tile variants share.
STATIC_2048 = {"static_tiles": True, "chunk_pieces": 2048}
STATIC_4096 = {"static_tiles": True, "chunk_pieces": 4096}
WIDE_EARLY = {"wide_weights": True, "early_loads": True}


def variant_configs() -> dict[str, dict]:
    """Kernel variants timed by --variants, as overrides of the default
    LaunchConfig; the default first (the baseline of the time ratios)."""
    return {
        "default": {},
        # The default until 2026-12-02c: no vector loop, 8 warps.
        "scalar 8w": {"vector_full_tiles": False, "num_warps": 8},
        "vector 8w": {"vector_full_tiles": True, "num_warps": 8},
        "vector 4w": {"vector_full_tiles": True, "num_warps": 4},
        # The default until token_order_tiles (issue 30 item 1): token-major
        # blocks in head order (strided tiles, no 128-bit loads); it differs
        # from "default" on the token-major shape only.
        "vector 4w head order": {
            "vector_full_tiles": True,
            "num_warps": 4,
            "token_order_tiles": False,
        },
        "vector persistent 4xSM/4096": {
            "vector_full_tiles": True,
            "num_warps": 8,
            "programs_per_sm": 4,
            "chunk_pieces": 4096,
        },
        # Smaller work items (more programs, a shorter last wave) and other
        # tile sizes, all with the 4-warp vector loop (2026-12-02).
        "vector 4w chunk 4096": {
            "vector_full_tiles": True,
            "num_warps": 4,
            "chunk_pieces": 4096,
        },
        # Compile-time tile counts (static_tiles: the tile loops unrolled and
        # several tiles' loads in flight), at the default chunk and smaller
        # ones: the anchor sweep's mixed read reached 0.96-0.97 of the plain
        # read only with a few unrolled tiles a program (2026-12-03b).
        "static tiles": {"static_tiles": True},
        "static tiles chunk 2048": dict(STATIC_2048),
        "static tiles chunk 4096": dict(STATIC_4096),
        # One copy of the loop a row kind (40 registers, as the fast read) and
        # an item's fields in one round (2026-12-03b's next trial).
        "static tiles chunk 4096 wide": {**STATIC_4096, "wide_weights": True},
        "static tiles chunk 2048 wide early": {**STATIC_2048, **WIDE_EARLY},
        "static tiles chunk 4096 wide early": {**STATIC_4096, **WIDE_EARLY},
    }


def run_variants(
    kernels: ModuleType,
    runs: list[ShapeRun],
    default: Any,
    iters: int,
    rounds: int,
    flush: torch.Tensor,
    report: Report,
) -> None:
    """Variants table: per shape, each variant's kernel / plain read and its
    time / the default's, timed in `rounds` interleaved rounds (the median of
    the rounds' medians), every variant's sums checked bit for bit against
    the PyTorch path."""
    configs = {}
    for name, overrides in variant_configs().items():
        try:
            configs[name] = dataclasses.replace(default, **overrides)
        except Exception as exc:  # noqa: BLE001 - report and go on
            report.error(f"variant {name} {overrides}", exc)
    names = list(configs)
    print()
    print(
        f"## Variants: kernel / plain read (time / default), {rounds} interleaved "
        "rounds, median of medians"
    )
    print()
    for name in names:
        print(f"- {name}: {config_label(configs[name])}")
    print()
    print("| shape | plain TB/s | " + " | ".join(names) + " | bit-identical |")
    print("|---|---|" + "---|" * (len(names) + 1))
    table = report.data["variants"]
    for run in runs:
        shape_key = shape_name(run.shape)
        anchor = report.data["shapes"].get(shape_key, {}).get("plain")
        if not anchor:
            continue
        entry: dict = {"plain_ms": anchor["ms"], "ms": {}, "identical": {}}
        table[shape_key] = entry
        launches: dict[str, Any] = {}
        for name, config in configs.items():
            try:
                launch = run.launch(kernels, "triton", config)
                launch.warm_up()
                out = run.out()
                launch(run.rows, out)
                entry["identical"][name] = bool(torch.equal(out, run.expected))
                launches[name] = (launch, out)
            except Exception as exc:  # noqa: BLE001 - report and go on
                report.error(f"variant {name} on {shape_key}", exc)
                entry["identical"][name] = False
        samples: dict[str, list[float]] = {name: [] for name in launches}
        for _ in range(rounds):
            for name, (launch, out) in launches.items():
                samples[name].append(
                    time_ms(functools.partial(launch, run.rows, out), iters, flush)
                )
        entry["ms"] = {name: statistics.median(v) for name, v in samples.items()}
        base = entry["ms"].get("default")
        cells = []
        for name in names:
            ms = entry["ms"].get(name)
            if ms is None:
                cells.append("error")
                continue
            ratio = f" ({ms / base:.3f})" if base else ""
            cells.append(f"{anchor['ms'] / ms:.3f}{ratio}")
        identical = all(entry["identical"].get(name, False) for name in names)
        for name in names:
            if not entry["identical"].get(name, False):
                print(f"MISMATCH or error: variant {name} on {shape_key}")
        gb = run.shape.bytes_read / 1e9
        print(
            f"| {run.shape.label.split(' ')[0]} {run.shape.layout}-major "
            f"| {gb / anchor['ms']:.2f} | "
            + " | ".join(cells)
            + f" | {'yes' if identical else '**NO**'} |",
            flush=True,
        )
        report.save()
    mins = {
        name: min(
            (e["plain_ms"] / e["ms"][name] for e in table.values() if name in e["ms"]),
            default=float("nan"),
        )
        for name in names
    }
    report.data["variants_min_ratio"] = mins
    print()
    print(
        "min kernel / plain read over shapes: "
        + ", ".join(f"{name} {value:.3f}" for name, value in mins.items())
    )


def sweep_configs() -> list[dict]:
    """The tuning candidates as overrides of the default LaunchConfig: the
    default first, then grid and persistent variants (work-item size, warps,
    tile, wide weights)."""
    configs: list[dict] = [
        {},
        {"wide_weights": True},
        {"chunk_pieces": 4096},
        {"chunk_pieces": 2048},
        {"num_warps": 4},
        {"max_tile": 2048, "num_warps": 16},
    ]
    for k in (1, 2, 4, 8):
        for chunk in (16384, 4096, 2048):
            configs.append({"programs_per_sm": k, "chunk_pieces": chunk})
    configs += [
        {"programs_per_sm": 2, "chunk_pieces": 4096, "num_warps": 4},
        {"programs_per_sm": 4, "chunk_pieces": 4096, "num_warps": 4},
        {"programs_per_sm": 4, "chunk_pieces": 4096, "wide_weights": True},
        {"programs_per_sm": 2, "chunk_pieces": 2048, "max_tile": 512},
    ]
    return configs


def run_sweep(
    kernels: ModuleType,
    runs: list[ShapeRun],
    default: Any,
    iters: int,
    flush: torch.Tensor,
    report: Report,
    deadline: float,
) -> None:
    """Tuning table: every candidate on every shape, as kernel / plain read.

    Each candidate is checked bit for bit against the PyTorch path on every
    shape; the recommendation maximizes the minimum ratio over shapes among
    correct candidates whose small shapes (<= SMALL_SHAPE_BYTES) are at most
    2 % slower than the default in this sweep.
    """
    runs = [
        run
        for run in runs
        if "plain" in report.data["shapes"].get(shape_name(run.shape), {})
    ]
    plain_ms = {
        shape_name(run.shape): report.data["shapes"][shape_name(run.shape)]["plain"][
            "ms"
        ]
        for run in runs
    }
    print()
    print("## Tuning sweep: kernel / plain read per shape (same run, same timer)")
    print()
    print(
        "| # | configuration | "
        + " | ".join(
            f"{run.shape.label.split(' ')[0]} {run.shape.layout[0]}" for run in runs
        )
        + " | min | worst small-shape time / default | bit-identical |"
    )
    print("|---|---|" + "---|" * (len(runs) + 3))
    default_ms: dict[str, float] = {}
    rows = report.data["sweep"]
    for index, overrides in enumerate(sweep_configs()):
        if time.monotonic() > deadline:
            print(f"(time budget reached: skipped candidates {index} and later)")
            break
        try:
            config = dataclasses.replace(default, **overrides)
        except Exception as exc:  # noqa: BLE001 - report and go on
            report.error(f"sweep #{index} {overrides}", exc)
            continue
        row: dict = {"config": vars(config), "label": config_label(config), "ms": {}}
        rows.append(row)
        identical = True
        cells = []
        for run in runs:
            name = shape_name(run.shape)
            try:
                timing = time_kernel(kernels, run, config, iters, flush)
            except Exception as exc:  # noqa: BLE001 - report and go on
                report.error(f"sweep #{index} {config_label(config)} on {name}", exc)
                cells.append("error")
                identical = False
                continue
            if not timing.identical:
                print(f"MISMATCH: sweep #{index} {config_label(config)} on {name}")
                identical = False
            row["ms"][name] = timing.ms
            cells.append(f"{plain_ms[name] / timing.ms:.3f}")
        if index == 0:
            default_ms = dict(row["ms"])
        ratios = [plain_ms[name] / ms for name, ms in row["ms"].items()]
        small = [
            row["ms"][shape_name(run.shape)] / default_ms[shape_name(run.shape)]
            for run in runs
            if run.shape.bytes_read <= SMALL_SHAPE_BYTES
            and shape_name(run.shape) in row["ms"]
            and shape_name(run.shape) in default_ms
        ]
        complete = len(row["ms"]) == len(runs)
        row.update(
            identical=identical,
            complete=complete,
            min_ratio=min(ratios) if ratios else None,
            worst_small=max(small) if small else None,
        )
        print(
            f"| {index} | {config_label(config)} | "
            + " | ".join(cells)
            + f" | {min(ratios) if ratios else float('nan'):.3f}"
            + f" | {max(small) if small else float('nan'):.3f}"
            + f" | {'yes' if identical else '**NO**'} |",
            flush=True,
        )
        report.save()
    eligible = [
        row
        for row in rows
        if row.get("identical")
        and row.get("complete")
        and row.get("worst_small") is not None
        and row["worst_small"] <= 1 + SMALL_SHAPE_SLOWDOWN
    ]
    print()
    if not eligible:
        print(
            "recommended configuration: none eligible (see errors / mismatches above)"
        )
        return
    best = max(eligible, key=lambda row: row["min_ratio"])
    report.data["recommended"] = best
    print(
        f"recommended configuration: {best['label']} (min kernel / plain read "
        f"{best['min_ratio']:.3f}, worst small-shape time / default "
        f"{best['worst_small']:.3f}); LaunchConfig{tuple(best['config'].values())}"
    )
    mismatched = [row["label"] for row in rows if not row.get("identical")]
    if mismatched:
        print(f"**NOT bit-identical or failed**: {mismatched}")
    else:
        print("Every candidate: bit-identical to the PyTorch path on every shape.")


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
    parser.add_argument("--num-warps", type=int, help="override num_warps")
    parser.add_argument("--max-tile", type=int, help="override max_tile")
    parser.add_argument("--chunk", type=int, help="override chunk_pieces")
    parser.add_argument(
        "--programs-per-sm", type=int, help="override programs_per_sm (persistent)"
    )
    parser.add_argument("--wide", action="store_true", help="wide weights only")
    parser.add_argument(
        "--vector", action="store_true", help="vector_full_tiles for the main table"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a performance target is missed"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also print the launch tuning table"
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help="also time the kernel variants (variant_configs) beside the default",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of --variants"
    )
    parser.add_argument(
        "--static-tiles",
        action="store_true",
        help="static_tiles for the main table (compile-time tile counts)",
    )
    parser.add_argument(
        "--early-loads",
        action="store_true",
        help="early_loads for the main table (an item's fields in one round)",
    )
    parser.add_argument(
        "--sorted-rows",
        action="store_true",
        help="rows' blocks in ascending order (SORTED_ROWS)",
    )
    parser.add_argument(
        "--anchor-sweep",
        action="store_true",
        help="also time the mixed read in several launch shapes (run_anchor_sweep)",
    )
    parser.add_argument("--json", help="write every kernel result to this file")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=170.0,
        help="start no sweep candidate after this many seconds of the run",
    )
    args = parser.parse_args()
    global SORTED_ROWS
    SORTED_ROWS = args.sorted_rows
    overrides = {
        name: value
        for name, value in (
            ("num_warps", args.num_warps),
            ("max_tile", args.max_tile),
            ("chunk_pieces", args.chunk),
            ("programs_per_sm", args.programs_per_sm),
        )
        if value is not None
    }
    if args.wide:
        overrides["wide_weights"] = True
    if args.vector:
        overrides["vector_full_tiles"] = True
    if args.static_tiles:
        overrides["static_tiles"] = True
    if args.early_loads:
        overrides["early_loads"] = True
    met = True
    if args.mode in ("kernel", "all"):
        met &= run_kernel_benchmarks(
            args.iters,
            overrides,
            args.sweep,
            args.json,
            args.budget_s,
            args.variants,
            args.rounds,
            args.anchor_sweep,
        )
    if args.mode in ("host", "all"):
        met &= run_host_benchmarks()
    if args.check and not met:
        sys.exit(1)


if __name__ == "__main__":
    main()
