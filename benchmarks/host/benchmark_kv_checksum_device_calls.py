# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host cost of the worker's device paths per call (issue 30).

The H200 hook timer put a store's entry save at 678 us, a finished load's
launch at 545 us and its copy back at 246 us of host CPU a call
(`benchmarks/results/h200_runs_2026-12-02.md`), mostly torch calls. This
times the three offload-tier paths of a checksum worker with the checksum
kernel stubbed (host work only), and counts the aten operators each call
dispatches, and apart those that are not views: on CUDA each of these is a
kernel, a copy or an allocation. Op counts are exact on any machine; times
are this machine's.

- save: `save_block_checksums` of N blocks with their copy to host slots;
- load: a step whose offload load of N blocks finishes (`bind` +
  `post_forward`: rows, launch, stored entries, copy to host);
- restore: `HostEntryTable.restore_ids` of N blocks (a load starting).

    python benchmarks/host/benchmark_kv_checksum_device_calls.py --blocks 128
"""

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.v1.kv_connector.unit.kv_checksum_helpers import (  # noqa: E402
    cpu_cuda_streams,
)
from tests.v1.kv_connector.unit.test_kv_checksum_offload import (  # noqa: E402
    offload_paths,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (  # noqa: E402
    KVChecksumLaunch,
)

# Not views by their schema, but no memory touched either.
METADATA_OPS = {"aten.lift_fresh.default", "aten.detach.default"}


class OpCount(TorchDispatchMode):
    """Counts the aten operators dispatched inside the mode, and apart those
    that touch memory (not views): on CUDA each is a kernel, a copy or an
    allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}
        self.memory_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        if not func.is_view and str(func) not in METADATA_OPS:
            self.memory_ops += 1
        return func(*args, **(kwargs or {}))


def _no_kernel(launch: Any, rows: Any, out: Any) -> None:
    """The checksum launch stubbed: host work only."""


def _timed(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    """Median over rounds of the mean microseconds a call (collector off)."""
    per_round = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_round.append((time.perf_counter() - start) / calls * 1e6)
    finally:
        gc.enable()
    return statistics.median(per_round)


def paths(num_blocks: int) -> dict[str, Callable[[], Any]]:
    """The three worker paths over one request of `num_blocks` blocks (the
    CPU test's, `offload_paths`)."""
    save, load, restore = offload_paths(num_blocks)
    return {"save": save, "load": load, "restore": restore}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kernel", action="store_true", help="keep the kernel")
    args = parser.parse_args()
    print("| path | blocks | aten ops a call | of them not views | us a call |")
    print("|---|---|---|---|---|")
    with pytest.MonkeyPatch.context() as patch, cpu_cuda_streams(patch):
        if not args.kernel:
            patch.setattr(KVChecksumLaunch, "__call__", _no_kernel)
        for n in args.blocks:
            for name, fn in paths(n).items():
                fn()  # warm
                with OpCount() as count:
                    fn()
                us = _timed(fn, args.calls, args.rounds)
                ops = sum(count.ops.values())
                print(f"| {name} | {n} | {ops} | {count.memory_ops} | {us:.1f} |")
                if name != "restore" and n == max(args.blocks):
                    print(f"<!-- {name}: {dict(sorted(count.ops.items()))} -->")


if __name__ == "__main__":
    main()
