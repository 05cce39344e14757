# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The block table's entry writes and moves (R117, R118; issue 30) against an
independent reference (`kv_checksum_entry_cases.py`): the PyTorch path here,
the Triton kernels under Triton's interpreter in a subprocess (the interpreter
must be on before Triton is imported). The same checks run on a GPU in
test_kv_checksum_cuda.py, JIT and direct launch.

Bugs caught: the tag XORed before the columns are summed or not at all, a
column left out of the sum (width > 1), a grid one program short (rows past
the first 128 lost), the slot copy writing the table's old entry, an unmasked
index (a write past the table or the slots: device memory of another tensor),
a gather that writes at the source index instead of in order."""

from pathlib import Path

import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_entry_cases import check_entry_kernels
from tests.v1.kv_connector.unit.kv_checksum_scripts import run_interpreted

pytestmark = pytest.mark.cpu
entry_kernels = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_checksum.definition.entry_kernels"
)

ROOT = Path(__file__).resolve().parents[4]
CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.v1.kv_connector.unit.kv_checksum_entry_cases import (
    check_entry_kernels, check_out_of_range_skipped,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.entry_kernels import (
    EntryKernels,
)
import torch
kernels = EntryKernels(torch.device("cpu"), use_kernels=True)
check_entry_kernels(kernels, "cpu", seed=1)
check_out_of_range_skipped(kernels, "cpu")
print("ok")
"""


def test_R117_torch_path_matches_the_reference() -> None:
    """The reference path itself (CPU engines and CUDA with the kernels off)."""
    kernels = entry_kernels.EntryKernels(torch.device("cpu"))
    assert not kernels.use_kernels
    check_entry_kernels(kernels, "cpu")


def test_R117_triton_kernels_match_the_reference_in_the_interpreter() -> None:
    """Both kernels, every variant, under Triton's interpreter: sums over
    columns that wrap, tags, several programs, slot copies, gathers and
    scatters, and indices out of range skipped."""
    pytest.importorskip("triton")
    run_interpreted(CHECK, str(ROOT))


def test_kernels_are_the_cuda_default_and_cpu_keeps_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R142: a CUDA table takes the kernels where Triton offers the direct launch;
    a CPU table never does (its engine has no Triton device), nor a CUDA one
    on a Triton outside the direct launch's range. Bug: kernels whose every
    call goes through the JIT (its per-call binding and pointer queries cost
    more than the PyTorch operations they replace)."""
    pytest.importorskip("triton")
    cpu = entry_kernels.EntryKernels(torch.device("cpu"))
    cuda = entry_kernels.EntryKernels(torch.device("cuda", 0))
    assert not cpu.use_kernels
    assert cuda.use_kernels
    monkeypatch.setattr(entry_kernels.triton, "__version__", "2.3.0")
    assert not entry_kernels.EntryKernels(torch.device("cuda", 0)).use_kernels


def test_a_failed_capture_falls_back_to_torch_unless_forced() -> None:
    """R142: when a launch cannot be captured (or a direct launch fails), later
    calls take the PyTorch operations; kernels a caller forced (the
    interpreter tests) stay. Bug: the JIT on every later call."""
    chosen = entry_kernels.EntryKernels(torch.device("cuda", 0))
    forced = entry_kernels.EntryKernels(torch.device("cuda", 0), use_kernels=True)
    chosen._no_direct_launch()
    forced._no_direct_launch()
    assert not chosen.use_kernels
    assert forced.use_kernels


class _FakeLaunch:
    """A captured launch that records its calls, or raises."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple] = []

    def launch(self, grid: tuple, args: list) -> bool:
        self.calls.append((grid, list(args)))
        if self.fail:
            raise RuntimeError("launcher failed")
        return True


class _FakeKernel:
    """A JIT kernel: records its calls and returns a compiled stand-in."""

    arg_names = ["src", "n", "BLOCK"]

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getitem__(self, grid: tuple):
        def call(*args: object, **constants: object) -> str:
            self.calls.append((grid, args))
            return "compiled"

        return call


@pytest.mark.parametrize("forced", [False, True])
def test_entry_launch_captures_once_and_leaves_a_failing_launcher(
    monkeypatch: pytest.MonkeyPatch, forced: bool
) -> None:
    """R142 (issue 30): the first call of a variant goes through the JIT and
    is captured; later calls are direct, with tensors passed as addresses; a
    count past 32 bits takes the JIT; a launcher that raises costs its call
    nothing (the JIT runs it), is never tried again, and turns the kernels
    off unless forced. Bugs: a capture on every call, a tensor passed to the
    launcher as an object, the error raised into the step, the failing
    launcher retried every call, the kernels left on behind the JIT."""
    kernel_module = pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_checksum.definition.kernels"
    )
    launches = [_FakeLaunch(), _FakeLaunch(fail=True)]
    captured: list[tuple] = []

    def capture(compiled: object, names: list, num_args: int, constants: dict):
        captured.append((compiled, tuple(names), num_args, constants))
        return launches[len(captured) - 1]

    monkeypatch.setattr(kernel_module.CompiledLaunch, "capture", staticmethod(capture))
    monkeypatch.setattr(entry_kernels, "DIRECT_LAUNCH", True)
    # Kernels on, as the CUDA default chooses them (not forced) or forced.
    chosen = entry_kernels.EntryKernels(torch.device("cpu"), use_kernels=True)
    chosen.forced = forced
    kernel = _FakeKernel()
    src = torch.zeros(4, dtype=torch.int64)
    chosen._launch("move", False, kernel, (src, 4), 4)
    chosen._launch("move", False, kernel, (src, 4), 4)
    assert len(kernel.calls) == 1 and len(captured) == 1
    assert captured[0][1:3] == (("src", "n", "BLOCK"), 2)
    assert launches[0].calls == [((1, 1, 1), [src.data_ptr(), 4])]
    # A count the capture's 32-bit arguments cannot take: the JIT.
    chosen._launch("move", False, kernel, (src, 1 << 31), 4)
    assert len(kernel.calls) == 2 and len(launches[0].calls) == 1
    # Another variant: its own capture, whose launcher raises.
    chosen._launch("move", True, kernel, (src, 4), 4)
    chosen._launch("move", True, kernel, (src, 4), 4)
    assert len(captured) == 2 and len(kernel.calls) == 4
    assert chosen.use_kernels == forced
    chosen._launch("move", True, kernel, (src, 4), 4)
    assert len(kernel.calls) == 5 and len(captured) == 2
    assert len(launches[1].calls) == 1  # tried once, never again
