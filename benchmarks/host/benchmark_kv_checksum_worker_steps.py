# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker-side host time of SimpleCPUOffloadConnector steps through vLLM's
real hooks, on CPU (issue 30).

vLLM's ActiveKVConnector over its SimpleCPUOffloadConnector (worker role,
SimpleCPUOffloadWorker and DmaCopyBackend, whose copy queue no thread drains:
no CUDA here), built as Model Runner V2 builds it, with checksums on and
off. A step is what Model Runner V2 calls around the forward: pre_forward,
finish_forward (where loads start after the forward), post_forward. Kinds:

- idle: nothing loaded or stored (most decode steps);
- store: N blocks stored, the suffixes of four requests (their entries
  written and copied to host slots);
- load + store: N blocks loaded (their entries restored) and N stored.

Engines, timed in alternation in every round: checksums off; on; and, where
this tree changed a path, the path as it was, in the same process
(`--variants`, each as until 2026-12-05e):
- `copy-apart`: a store's copy to its host slots made as a move of its own
  after the entry write (`FOLD_STORE_COPIES` off, as before `fold_copy`);
- `runs-counted`: each store also counts its runs, as the truth test in
  `SimpleOffloadWorkerSide._save` (`runs or []`) did while `FullBlocks` had
  no `__bool__` and answered with `len`;
- `stacked-indices`: a move's (block ids, slots, 0) built with `np.stack`
  and a cast, as `move_indices` did;
- `numpy-groups`: the stored blocks' groups found with NumPy calls, as
  `_groups_in_order` did;
- `by-place`: the stored blocks sorted by position, as `store_runs` sorted
  them (a store's copy then no longer lines up with its entry write, and
  `fold_copy` matches them block by block).

The checksum kernel is stubbed (host work only: on a GPU host each launch and
upload costs more, `benchmark_kv_checksum_device_calls.py --cuda`); CUDA
streams are the tests' stand-ins. Figures: median over rounds of the mean
us a step.

    python benchmarks/host/benchmark_kv_checksum_worker_steps.py --blocks 16
"""

import argparse
import contextlib
import functools
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.v1.kv_connector.unit.kv_checksum_helpers import (  # noqa: E402
    cpu_cuda_streams,
    empty_scheduler_output,
    write_model_dir,
)
from tests.v1.kv_connector.unit.test_kv_checksum_held_copies import (  # noqa: E402
    build_simple_active,
    install_simple_worker,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (  # noqa: E402
    FullBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (  # noqa: E402
    KVChecksumLaunch,
)
from vllm.distributed.kv_transfer.kv_checksum.engine import (  # noqa: E402
    block_table,
    launches,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.simple_cpu_offload import (  # noqa: E402
    SimpleOffloadWorkerSide,
)

KINDS = ("idle", "store", "load + store")
VARIANTS = (
    "copy-apart",
    "runs-counted",
    "stacked-indices",
    "numpy-groups",
    "by-place",
)


def _no_kernel(launch: Any, rows: Any, out: Any) -> None:
    """The checksum launch stubbed: host work only."""


def _stacked_indices(moved: Any) -> np.ndarray:
    """`move_indices` as it was until 2026-12-05e."""
    ids, slots = moved.block_ids, moved.slots
    return np.stack([ids, slots, np.zeros_like(slots)]).astype(np.int64, copy=False)


def _numpy_groups(groups: np.ndarray, allowed: set[int]) -> tuple[list[int], bool]:
    """`_groups_in_order` as it was until 2026-12-05e."""
    if not len(groups):
        return [], True
    first = int(groups[0])
    if (groups == first).all():
        return ([first] if first in allowed else []), True
    present, index = np.unique(groups, return_index=True)
    return [g for g in present[np.argsort(index)].tolist() if g in allowed], False


def scheduler_output(kind: str, blocks: int, by_place: bool = False) -> Any:
    """vLLM's SchedulerOutput for one step of `kind`, its
    SimpleCPUOffloadMetadata as the scheduler side leaves it (the stored
    blocks attached as `attach` does, in store order): stores of GPU blocks
    1..blocks, four requests' suffixes one after the other, into CPU blocks
    0..blocks-1; loads of CPU blocks blocks..2*blocks-1 into GPU blocks
    blocks+1..2*blocks. `by_place`: the stored blocks sorted by position,
    as `store_runs` sorted them until 2026-12-05e."""
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    output = empty_scheduler_output()
    stored = list(range(1, blocks + 1)) if kind != "idle" else []
    loaded = list(range(blocks + 1, 2 * blocks + 1)) if kind == "load + store" else []
    meta = SimpleCPUOffloadMetadata(
        load_event=0 if loaded else -1,
        load_gpu_blocks=loaded,
        load_cpu_blocks=[b - 1 for b in loaded],
        load_event_to_reqs={0: ["r"]} if loaded else {},
        store_event=0 if stored else -1,
        store_gpu_blocks=stored,
        store_cpu_blocks=[b - 1 for b in stored],
    )
    if stored:
        per_request = len(stored) // 4
        positions = np.concatenate(
            [5 * r + np.arange(per_request, dtype=np.int64) for r in range(4)]
        )
        order = np.argsort(positions, kind="stable") if by_place else slice(None)
        hashes = np.empty(len(stored), dtype=object)
        hashes[:] = [bytes([b % 251 + 1]) * 32 for b in stored]
        meta.kv_checksum_store_runs = FullBlocks(
            np.zeros(len(stored), dtype=np.int64),
            positions[order],
            np.asarray(stored, dtype=np.int64)[order],
            hashes[order],
        )
    output.kv_connector_metadata = meta
    return output


class Engine:
    """One ActiveKVConnector over a SimpleCPUOffloadConnector worker."""

    def __init__(self, model_dir: str, enabled: bool, patch: Any) -> None:
        built = build_simple_active(model_dir, enabled, patch)
        self.active = built.active
        self.queue = built.backend._queue
        self.batch = SimpleNamespace(idx_mapping=None, req_ids=["r"], num_tokens=1)

    def step(self, output: Any) -> None:
        """One step as Model Runner V2 calls the connector; the copy queue
        drained (the copy thread's part)."""
        self.active.pre_forward(output, self.batch)
        self.active.finish_forward()
        self.active.post_forward(set())
        while not self.queue.empty():
            self.queue.get_nowait()


@contextlib.contextmanager
def engines(model_dir: str) -> Iterator[dict[str, Engine]]:
    """The off and on engines, in the CPU setting (stream stand-ins, the
    kernel stubbed), undone after."""
    import pytest

    with pytest.MonkeyPatch.context() as patch, cpu_cuda_streams(patch):
        patch.setattr(KVChecksumLaunch, "__call__", _no_kernel)
        install_simple_worker(patch)
        yield {
            "off": Engine(model_dir, False, patch),
            "on": Engine(model_dir, True, patch),
        }


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The path as it was before this tree's change, for `name` (inputs
    aside: `by-place` changes the step's metadata, not the code)."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        if name == "copy-apart":
            patch.setattr(block_table, "FOLD_STORE_COPIES", False)
        elif name == "runs-counted":
            real_save = SimpleOffloadWorkerSide._save

            def save(self: Any, metadata: Any, *args: Any, **kw: Any) -> None:
                runs = getattr(metadata, "kv_checksum_store_runs", None)
                if runs is not None:
                    len(runs)  # the truth test's fallback before __bool__
                real_save(self, metadata, *args, **kw)

            patch.setattr(SimpleOffloadWorkerSide, "_save", save)
        elif name == "stacked-indices":
            for module in (block_table, launches):
                patch.setattr(module, "move_indices", _stacked_indices)
        elif name == "numpy-groups":
            patch.setattr(block_table, "_groups_in_order", _numpy_groups)
        yield


def timed(fn: Callable[[], None], steps: int) -> float:
    """Mean us a call over `steps` calls, the collector off."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) / steps * 1e6
    finally:
        gc.enable()


def measure(
    model_dir: str, blocks: int, rounds: int, steps: int, variants: list[str]
) -> dict[str, dict[str, float]]:
    """Median over rounds of each engine's us a step, per kind."""
    outputs = {kind: scheduler_output(kind, blocks) for kind in KINDS}
    by_place = {kind: scheduler_output(kind, blocks, True) for kind in KINDS}
    names = ["off", "on", *variants]
    samples: dict[str, dict[str, list[float]]] = {
        kind: {name: [] for name in names} for kind in KINDS
    }
    with engines(model_dir) as built:
        for kind in KINDS:  # warm-up: every path once
            for engine in built.values():
                for _ in range(20):
                    engine.step(outputs[kind])
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for kind in KINDS:
                for name in order:
                    engine = built["off" if name == "off" else "on"]
                    given = by_place if name == "by-place" else outputs
                    step = functools.partial(engine.step, given[kind])
                    with variant(name):
                        samples[kind][name].append(timed(step, steps))
    return {
        kind: {name: statistics.median(v) for name, v in per.items()}
        for kind, per in samples.items()
    } | {
        f"{kind} spread": {name: max(v) - min(v) for name, v in per.items()}
        for kind, per in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_dir = write_model_dir(Path(tempfile.mkdtemp()))
    rows = []
    print(
        "| blocks | step | off, us | on, us | on - off |"
        + "".join(f" {v}, us | {v} - on |" for v in args.variants)
    )
    print("|---|---|---|---|---|" + "---|---|" * len(args.variants))
    for blocks in args.blocks:
        got = measure(model_dir, blocks, args.rounds, args.steps, args.variants)
        for kind in KINDS:
            med = got[kind]
            cells = "".join(
                f" {med[v]:.1f} | {med[v] - med['on']:+.1f} |" for v in args.variants
            )
            print(
                f"| {blocks} | {kind} | {med['off']:.1f} | {med['on']:.1f} | "
                f"{med['on'] - med['off']:+.1f} |" + cells
            )
            rows.append({"blocks": blocks, "step": kind, **med})
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
