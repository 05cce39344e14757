# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host cost of the worker's device paths per call (issue 30).

The H200 hook timer put a store's entry save at 678 us, a finished load's
launch at 545 us and its copy back at 246 us of host CPU a call
(`benchmarks/results/h200_runs_2026-12-02.md`), mostly torch calls. This
times the three offload-tier paths of a checksum worker, and counts the aten
operators each call dispatches, and apart those that are not views: on CUDA
each of these is a kernel, a copy or an allocation. Op counts are exact on
any machine; times are this machine's.

- save: `save_block_checksums` of N blocks with their copy to host slots;
- load: a step whose offload load of N blocks finishes (`bind` +
  `post_forward`: rows, launch, stored entries, copy to host);
- restore: `HostEntryTable.restore_ids` of N blocks (a load starting);
- prefix step: the first step of a request hitting N cached blocks and
  caching 16 (R140), with the entries and checks in one upload and one
  launch (the worker since 2026-12-02g) and, in the same run, the way it ran
  before (the entries through the table's own save, then the checks); also
  timed as a pair, call by call in alternation, so host drift hits both;
- load + store step: a step that starts a load of N blocks and stores N
  others, the restore riding in the save's upload (both offload tiers after
  the forward since 2026-12-05) and, paired with it, the restore and the
  save apart (two uploads, before);
- store save, paired: the save with its copy to host slots folded into its
  entry write (`FOLD_STORE_COPIES`, since 2026-12-05e) and as a move of its
  own after it (one launch more on CUDA).

On CPU the checksum kernel is stubbed (host work only). `--cuda` runs on a
GPU with the Triton kernel and adds the host time of each kind of device
call these paths make, alone, the Triton launch alone, and a pinned upload
after many earlier pinned buffers were freed while their copies still wait
behind queued GPU work (their events pending in the caching host allocator:
in the H200 engine a restore's two-array upload took 178 us a call, outside
it about 13; `h200_runs_2026-12-02b.md`) (`gpu_runs.sh device-calls`):

    python benchmarks/host/benchmark_kv_checksum_device_calls.py --blocks 128
"""

import argparse
import contextlib
import cProfile
import gc
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.v1.kv_connector.unit.kv_checksum_device_paths import (  # noqa: E402
    OpCount,
    load_store_step_paths,
    offload_paths,
    prefix_step_paths,
    send_path,
)
from tests.v1.kv_connector.unit.test_kv_checksum_worker_cuda import (  # noqa: E402
    worker_on,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (  # noqa: E402
    KVChecksumLaunch,
)
from vllm.distributed.kv_transfer.kv_checksum.engine import block_table  # noqa: E402


def _no_kernel(launch: Any, rows: Any, out: Any) -> None:
    """The checksum launch stubbed: host work only."""


def with_fold(fn: Callable[[], Any], fold: bool) -> Callable[[], Any]:
    """`fn` with `FOLD_STORE_COPIES` set to `fold` for the call: a store's
    copy to its host slots in its entry write, or a move of its own after it
    (issue 30, 2026-12-05e). Both sides pay the same switching."""

    def call() -> Any:
        before = block_table.FOLD_STORE_COPIES
        block_table.FOLD_STORE_COPIES = fold
        try:
            return fn()
        finally:
            block_table.FOLD_STORE_COPIES = before

    return call


def _median_of_rounds(one_round: Callable[[], float], rounds: int) -> float:
    """Median over rounds of `one_round()` (collector off); on CUDA the device
    drains between rounds, never inside one."""
    per_round = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            per_round.append(one_round())
    finally:
        gc.enable()
    return statistics.median(per_round)


def _timed(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    """Median over rounds of the mean microseconds a call, back to back."""

    def one_round() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    return _median_of_rounds(one_round, rounds)


def cache_evictor(megabytes: int) -> Callable[[], None]:
    """A stand-in for the rest of an engine step between two calls: sweeps
    `megabytes` of memory and runs unrelated Python and torch code, so the
    next call starts with its code and data out of the CPU caches."""
    sweep = np.ones(megabytes << 17, dtype=np.int64)
    small = torch.ones(64)

    def evict() -> None:
        sweep[::8] += 1  # one write per 64-byte line
        junk = {i: str(i) for i in range(2000)}
        for _ in range(20):
            small.add_(1).mul_(0.5)
        del junk

    return evict


def _timed_cold(
    fn: Callable[[], Any], calls: int, rounds: int, evict: Callable[[], None]
) -> float:
    """Like `_timed`, but `evict` runs before each call, outside the timing:
    the median over rounds of the median microseconds a call."""

    def one_round() -> float:
        times = []
        for _ in range(calls):
            evict()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    return _median_of_rounds(one_round, rounds)


def _paired(
    first: Callable[[], Any],
    second: Callable[[], Any],
    calls: int,
    rounds: int,
    evict: Callable[[], None] | None = None,
) -> tuple[float, float, float]:
    """Two paths timed call by call in alternation (first, second, first,
    ...; `evict` before each call when given), so drift on the host hits both
    alike: the medians over rounds of each path's median us a call, and of
    the rounds' ratios second / first."""
    per_round: list[tuple[float, float]] = []

    def one_round() -> float:
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(2 * calls):
            fn = (first, second)[i % 2]
            if evict is not None:
                evict()
            start = time.perf_counter()
            fn()
            times[i % 2].append(time.perf_counter() - start)
        pair = (statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6)
        per_round.append(pair)
        return pair[1] / pair[0]

    ratio = _median_of_rounds(one_round, rounds)
    return (
        statistics.median(a for a, _ in per_round),
        statistics.median(b for _, b in per_round),
        ratio,
    )


class CopyThread:
    """A background thread that copies `megabytes` of KV blocks (`layers`
    layers of `blocks` blocks) to pinned host memory in a loop and waits for
    each batch: the work of vLLM's SimpleCPUOffloadConnector copy thread,
    through vLLM's own `cuMemcpyBatchAsync` path (`copy_blocks`, one driver
    call a batch from Python, the GIL released inside) where vLLM is
    importable on CUDA, else one torch copy a block (and on CPU, host copies
    for the tests). Does it make the engine thread's device calls dearer
    (2026-12-04e: 2-3 times the NIXL engines' cost a call)?"""

    def __init__(
        self, device: torch.device, megabytes: int, blocks: int = 64, layers: int = 4
    ) -> None:
        words = max(1, (megabytes << 17) // (blocks * layers))
        on_cuda = device.type == "cuda"
        shape = (layers, blocks, words)
        self.source = torch.ones(shape, dtype=torch.int64, device=device)
        self.host = torch.empty(shape, dtype=torch.int64, pin_memory=on_cuda)
        self.stream = torch.cuda.Stream() if on_cuda else None
        self.batches = 0
        self.how = "torch copies"
        self.error: str | None = None
        self._batch_copy: Callable[[], None] | None = None
        if on_cuda:
            self._batch_copy = self._vllm_batch_copy()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _vllm_batch_copy(self) -> Callable[[], None] | None:
        """vLLM's batch copy of every block of every layer, or None."""
        try:
            from vllm.v1.simple_kv_offload import cuda_mem_ops

            params = cuda_mem_ops.build_params(
                {f"layer{i}": t for i, t in enumerate(self.source)},
                {f"layer{i}": t for i, t in enumerate(self.host)},
                self.stream,
                cuda_mem_ops.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            )
        except Exception as e:  # noqa: BLE001 - any failure: torch copies
            print(f"<!-- copy thread: vLLM's batch copy unavailable: {e!r} -->")
            return None
        ids = list(range(self.source.shape[1]))
        self.how = "vLLM's cuMemcpyBatchAsync"
        return lambda: cuda_mem_ops.copy_blocks(ids, ids, params)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        try:
            self._copy_until_stopped()
        except Exception as e:  # noqa: BLE001 - kept for the report
            self.error = repr(e)

    def _copy_until_stopped(self) -> None:
        if self.stream is not None:
            # A new thread has no current CUDA context for the driver call
            # (vLLM's copy loop sets the device first too; without it the
            # batch copy failed with err=1 on the H200, 2026-12-04f).
            torch.cuda.set_device(self.source.device)
        while not self._stop.is_set():
            if self.stream is None:
                self.host.copy_(self.source)
            else:
                with torch.cuda.stream(self.stream):
                    if self._batch_copy is not None:
                        self._batch_copy()
                    else:
                        for layer in range(len(self.source)):
                            for i in range(self.source.shape[1]):
                                self.host[layer, i].copy_(
                                    self.source[layer, i], non_blocking=True
                                )
                    event = torch.cuda.Event()
                    event.record(self.stream)
                event.synchronize()
            self.batches += 1


def with_and_without(
    fn: Callable[[], Any], calls: int, rounds: int, thread: Any
) -> tuple[float, float]:
    """Mean us a call of `fn` without and with `thread` running, the two in
    alternation round by round (drift hits both): the medians over rounds."""
    alone: list[float] = []
    beside: list[float] = []
    for _ in range(rounds):
        alone.append(_timed(fn, calls, 1))
        thread.start()
        try:
            beside.append(_timed(fn, calls, 1))
        finally:
            thread.stop()
    return statistics.median(alone), statistics.median(beside)


@contextlib.contextmanager
def cpu_setting(kernel: bool) -> Iterator[None]:
    """On CPU: the tests' stand-ins for CUDA streams and, unless `kernel`,
    the checksum kernel stubbed."""
    import pytest

    from tests.v1.kv_connector.unit.kv_checksum_helpers import cpu_cuda_streams

    with pytest.MonkeyPatch.context() as patch, cpu_cuda_streams(patch):
        if not kernel:
            patch.setattr(KVChecksumLaunch, "__call__", _no_kernel)
        yield


def primitives(device: torch.device) -> dict[str, Callable[[], Any]]:
    """One of each kind of device call the three paths make, alone."""
    rows = np.arange(3 * 256, dtype=np.int64).reshape(3, 256)
    pinned = torch.zeros((3, 256), dtype=torch.int64, pin_memory=True)
    table = torch.zeros(4096, dtype=torch.int64, device=device)
    index = torch.arange(128, dtype=torch.int64, device=device)
    source = torch.ones(128, dtype=torch.int64, device=device)
    side = torch.cuda.Stream()

    def side_copy() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host = torch.empty(128, dtype=torch.int64, pin_memory=True)
            host.copy_(source, non_blocking=True)
            torch.cuda.Event().record(side)

    return {
        "torch.zeros pinned (3 x 256)": lambda: torch.zeros(
            (3, 256), dtype=torch.int64, pin_memory=True
        ),
        "from_numpy(...).pin_memory()": lambda: torch.from_numpy(rows).pin_memory(),
        "pinned.to(cuda, non_blocking=True)": lambda: pinned.to(
            device, non_blocking=True
        ),
        "torch.zeros on the device": lambda: torch.zeros(
            (128, 1), dtype=torch.int64, device=device
        ),
        "index_copy_": lambda: table.index_copy_(0, index, source),
        "index_select": lambda: table.index_select(0, index),
        "torch.cat of two": lambda: torch.cat([source, source]),
        "side-stream copy to a pinned buffer + event": side_copy,
    }


def triton_launches(worker: Any) -> dict[str, Callable[[], Any]]:
    """The checksum kernel's launch alone (the first group's offload-load
    plan), for 1 and 128 rows of zeros (all-masked rows: host cost only)."""
    plan = next(iter(worker.groups.values())).load
    launch = plan.launches[0]
    device = worker.topology.device
    calls = {}
    for n in (1, 128):
        rows = torch.zeros((3, n), dtype=torch.int64, device=device)
        out = torch.zeros((n, plan.width), dtype=torch.int64, device=device)
        calls[f"Triton launch, {n} rows"] = lambda rows=rows, out=out: launch(rows, out)
    return calls


def busy_upload_us(device: torch.device, outstanding: int, calls: int) -> float:
    """Mean us of one small pinned upload (pin_memory + non-blocking copy)
    after `outstanding` earlier pinned buffers were copied and freed while
    their copies wait behind a long GPU sleep: the caching host allocator
    holds one pending event per freed buffer (it records events at free, so
    buffers still referenced hold none). Each timed upload adds one more."""
    rows = np.arange(2 * 128, dtype=np.int64).reshape(2, 128)
    per_round = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # about 0.1 s of cycles: copies stay queued
        for _ in range(outstanding):
            host = torch.zeros(256, dtype=torch.int64, pin_memory=True)
            host.to(device, non_blocking=True)
            del host  # freed with its copy queued: an event pending
        start = time.perf_counter()
        for _ in range(calls):
            torch.from_numpy(rows).pin_memory().to(device, non_blocking=True)
        per_round.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_round)


def profile_lines(fn: Callable[[], Any], calls: int, top: int) -> list[str]:
    """cProfile over `calls` calls of `fn`, back to back: the `top` functions
    by own time, in us a call (profiled, so inflated evenly per function
    call; the ranking, not the sum, is the result)."""
    fn()
    profiler = cProfile.Profile(time.perf_counter)
    gc.disable()
    try:
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
    finally:
        gc.enable()
    stats = pstats.Stats(profiler)
    rows = sorted(
        stats.stats.items(),  # type: ignore[attr-defined]
        key=lambda item: -item[1][2],
    )
    total = sum(entry[2] for _, entry in rows)
    lines = [f"total own time {total / calls * 1e6:.1f} us a call"]
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in rows[:top]:
        where = f"{Path(path).name}:{line}" if line else path
        lines.append(
            f"  {tottime / calls * 1e6:8.1f} us own {cumtime / calls * 1e6:8.1f} "
            f"us with callees {ncalls / calls:5.1f} calls  {name} ({where})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cuda", action="store_true", help="on the GPU")
    parser.add_argument(
        "--kernel", action="store_true", help="on CPU, keep the PyTorch kernel"
    )
    parser.add_argument(
        "--cold-mb",
        type=int,
        default=0,
        help="also time each call after sweeping this many MB and running "
        "unrelated code (caches cold, as inside an engine step)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="instead of timing, print each path's top N functions by own "
        "time under cProfile (the send pass of a P/D producer included)",
    )
    parser.add_argument(
        "--copy-thread",
        type=int,
        default=0,
        help="also time each path and device call without and with a thread "
        "copying this many MB of blocks to pinned host memory in a loop "
        "(SimpleCPUOffloadConnector's copy thread)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if args.cuda else "cpu")
    evict = cache_evictor(args.cold_mb) if args.cold_mb else None
    cold = " | us a call, caches cold | cold / hot" if evict else ""
    setting = contextlib.nullcontext() if args.cuda else cpu_setting(args.kernel)
    if args.profile:
        with setting:
            for n in args.blocks:
                worker, _ = worker_on(device, None, num_blocks=n + 1)
                save, load, restore = offload_paths(worker, n)
                send_worker, _ = worker_on(device, None, num_blocks=n + 1)
                hit_worker, _ = worker_on(device, None, num_blocks=n + 17)
                fused, _ = prefix_step_paths(hit_worker, n)
                for name, fn in (
                    ("save", save),
                    ("load", load),
                    ("restore", restore),
                    ("send", send_path(send_worker, n)),
                    ("prefix step", fused),
                ):
                    print(f"\n### {name}, {n} blocks")
                    print("\n".join(profile_lines(fn, args.calls, args.profile)))
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
        return
    print(f"| path | blocks | aten ops a call | of them not views | us a call{cold} |")
    print("|---|---|---|---|---|" + ("---|---|" if evict else ""))
    paired: list[str] = []
    with setting:
        for n in args.blocks:
            worker, _ = worker_on(device, None, num_blocks=n + 1)
            save, load, restore = offload_paths(worker, n)
            hit_worker, _ = worker_on(device, None, num_blocks=n + 17)
            fused, separate = prefix_step_paths(hit_worker, n)
            step_worker, _ = worker_on(device, None, num_blocks=2 * n + 1)
            one_upload, two_uploads = load_store_step_paths(step_worker, n)
            # The paired paths in both orders across block counts.
            prefix_paths = [
                ("prefix step: 16 cached + hits, one launch", fused),
                ("prefix step: 16 cached + hits, two launches (before)", separate),
                ("load + store step: one upload", one_upload),
                ("load + store step: restore, then save (before)", two_uploads),
            ]
            if args.blocks.index(n) % 2:
                prefix_paths.reverse()
            for name, fn in (
                ("save", save),
                ("load", load),
                ("restore", restore),
                *prefix_paths,
            ):
                fn()  # warm
                with OpCount() as count:
                    fn()
                us = _timed(fn, args.calls, args.rounds)
                ops = sum(count.ops.values())
                row = f"| {name} | {n} | {ops} | {len(count.memory_ops)} | {us:.1f} |"
                if evict is not None:
                    cold_us = _timed_cold(fn, args.calls, args.rounds, evict)
                    row += f" {cold_us:.1f} | {cold_us / us:.2f} |"
                print(row)
                if name in ("save", "load") and n == max(args.blocks):
                    print(f"<!-- {name}: {dict(sorted(count.ops.items()))} -->")
            for label, cold_evict in (("hot", None), ("cold", evict)):
                if label == "cold" and evict is None:
                    continue
                for kind, now, before in (
                    ("prefix step, hits", fused, separate),
                    ("load + store step, blocks each", one_upload, two_uploads),
                    (
                        "store save, copy folded (now) or apart (before)",
                        with_fold(save, True),
                        with_fold(save, False),
                    ),
                ):
                    one, two, ratio = _paired(
                        now, before, args.calls, args.rounds, cold_evict
                    )
                    paired.append(
                        f"| {kind} | {n} | {label} | {one:.1f} | {two:.1f} "
                        f"| {ratio:.2f} |"
                    )
        print(
            "\n| step | blocks | caches | one launch or upload (now), us | "
            "two (before), us | before / now, median of rounds |"
        )
        print("|---|---|---|---|---|---|")
        print("\n".join(paired))
        if args.cuda:
            cold_head = " us a call, caches cold |" if evict else ""
            print(f"\n| device call, alone | us a call |{cold_head}")
            print("|---|---|" + ("---|" if evict else ""))
            calls = {**primitives(device), **triton_launches(worker)}
            for name, fn in calls.items():
                fn()
                row = f"| {name} | {_timed(fn, args.calls, args.rounds):.1f} |"
                if evict is not None:
                    row += f" {_timed_cold(fn, args.calls, args.rounds, evict):.1f} |"
                print(row)
            for outstanding in (0, 64, 512):
                us = busy_upload_us(device, outstanding, args.calls)
                print(
                    f"| pinned upload, {outstanding} earlier freed copies pending "
                    f"| {us:.1f} |"
                )
        if args.copy_thread:
            copier = CopyThread(device, args.copy_thread)
            print(
                f"\n| call | us a call | with a {args.copy_thread} MB copy "
                "thread | with / without |"
            )
            print("|---|---|---|---|")
            n = args.blocks[-1]  # the paths of the last block count
            timed = {
                f"{name}, {n} blocks": fn
                for name, fn in (
                    ("save", save),
                    ("load", load),
                    ("restore", restore),
                )
            }
            if args.cuda:
                timed.update(primitives(device))
            for name, fn in timed.items():
                fn()
                alone, beside = with_and_without(fn, args.calls, args.rounds, copier)
                print(f"| {name} | {alone:.1f} | {beside:.1f} | {beside / alone:.2f} |")
            print(f"<!-- copy thread: {copier.batches} batches, {copier.how} -->")
            if copier.error is not None or copier.batches == 0:
                print(f"copy thread FAILED ({copier.error}): the with column is void")
                raise SystemExit(1)


if __name__ == "__main__":
    main()
