# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the checksum kernel's direct launch (SPEC R142).

After its first JIT call a KVChecksumLaunch hands later calls straight to the
compiled kernel's launcher. Triton's JIT and driver are replaced by recorders
here: the direct launch must pass the launcher exactly the arguments the JIT
would bind (every parameter of the kernel's own signature, in its order), on
the current stream, and give the call back to the JIT whenever it cannot. The
bit-for-bit results of the direct launch on a GPU are test_kv_checksum_cuda.py's.

Each test's docstring names the bug it catches.
"""

import inspect
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.test_kv_checksum_kernels import make_views

pytestmark = pytest.mark.cpu
kernels = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_checksum.definition.kernels"
)
if not kernels.HAS_TRITON_KNOBS:
    pytest.skip("this Triton has no launch knobs", allow_module_level=True)

STREAM = 0x5EED
# The real kernel's parameters, read before any test replaces the kernel.
SIGNATURE = inspect.signature(kernels._kv_checksum_kernel.fn)


class Hooks:
    """Triton's HookChain as far as the direct launch reads it."""

    def __init__(self) -> None:
        self.calls: list[object] = []


class FakeCompiled:
    """A compiled kernel whose launcher records its calls (or raises)."""

    def __init__(self) -> None:
        self.function = object()
        self.packed_metadata = ("packed",)
        self.launches: list[tuple[Any, ...]] = []
        self.fail = False

    def run(self, *call: Any) -> None:
        if self.fail:
            raise RuntimeError("launcher failed")
        self.launches.append(call)


class FakeJit:
    """The JIT: binds a call to the real kernel's signature, records it, and
    returns its one compiled kernel."""

    def __init__(self) -> None:
        self.signature = SIGNATURE
        self.arg_names = list(SIGNATURE.parameters)
        self.compiled = FakeCompiled()
        self.calls: list[tuple[tuple[int, ...], list[Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def call(*args: Any, **kwargs: Any) -> FakeCompiled:
            kwargs.pop("num_warps")
            bound = self.signature.bind(*args, **kwargs)
            self.calls.append((tuple(grid), list(bound.arguments.values())))
            return self.compiled

        return call


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    jit = FakeJit()
    device = SimpleNamespace(index=0)
    active = SimpleNamespace(
        get_current_device=lambda: device.index,
        get_current_stream=lambda index: STREAM + index,
    )
    runtime = SimpleNamespace(launch_enter_hook=Hooks(), launch_exit_hook=Hooks())
    monkeypatch.setattr(kernels, "_kv_checksum_kernel", jit)
    monkeypatch.setattr(kernels, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(kernels, "knobs", SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(kernels, "DIRECT_LAUNCH", True)
    # The H200 host's Triton, whatever this machine installs.
    monkeypatch.setattr(kernels.triton, "__version__", "3.6.0")
    return SimpleNamespace(jit=jit, device=device, runtime=runtime)


def triton_launch(layers: int = 3) -> Any:
    views = make_views(
        np.random.default_rng(7),
        "cpu",
        num_layers=layers,
        blocks=8,
        heads=2,
        tokens=4,
        pieces=8,
        layout="token",
    )
    return kernels.KVChecksumLaunch(
        views, list(range(layers)), [0] * layers, backend="triton"
    )


def call_rows(count: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sliced from a wider tensor and a column block of a wider matrix,
    so strides differ from call to call."""
    rows = torch.zeros((3, count + width + 1), dtype=torch.int64)[:, 1 : count + 1]
    out = torch.zeros((count + 2, 3 + width), dtype=torch.int64)[1 : count + 1, 1:]
    return rows, out


def expected_call(
    launch: Any, rows: torch.Tensor, out: torch.Tensor, addresses: bool = False
) -> list[Any]:
    """The kernel's parameters as the JIT binds them for this call, by name;
    with `addresses`, the three pointers as the direct launch passes them
    (their addresses: the launcher then skips a driver call per tensor)."""
    block, kernel_block, head, token, piece = launch.views[0].stride()
    pointers: tuple[Any, Any, Any] = (launch._table, rows, out)
    if addresses:
        pointers = tuple(t.data_ptr() for t in pointers)  # type: ignore[assignment]
    values = dict(
        table_ptr=pointers[0],
        rows_ptr=pointers[1],
        rows_field_stride=rows.stride(0),
        rows_row_stride=rows.stride(1),
        out_ptr=pointers[2],
        out_row_stride=out.stride(0),
        out_col_stride=out.stride(1),
        num_rows=rows.shape[1],
        num_layers=len(launch.views),
        block_stride=block,
        kernel_block_stride=kernel_block,
        head_stride=head,
        token_stride=token,
        piece_stride=piece,
    )
    values.update(
        (name, value)
        for name, value in launch._constants.items()
        if name != "num_warps"
    )
    return [values[name] for name in SIGNATURE.parameters]


def test_direct_launch_passes_what_the_jit_binds(fakes: SimpleNamespace) -> None:
    """Later calls reach the launcher, not the JIT, with the arguments the
    JIT binds (the kernel's parameters in signature order; the table, rows
    and output as their addresses, issue 30), the current device's stream
    and no launch metadata or hooks. Bugs: constexprs in another order than
    the signature's; a profiler hook passed; a per-call stride, count or
    address taken from the first call; the stream of device 0."""
    fakes.device.index = 1
    launch = triton_launch(layers=3)
    launch(*call_rows(1))
    assert len(fakes.jit.calls) == 1 and not fakes.jit.compiled.launches
    held = []  # every call's tensors alive: no address reused across calls
    for count, width in ((5, 0), (2, 3), (7, 1)):
        rows, out = call_rows(count, width)
        held.append((rows, out))
        launch(rows, out)
        assert len(fakes.jit.calls) == 1, "the JIT ran again"
        call = fakes.jit.compiled.launches[-1]
        assert call[:3] == (count, launch._num_chunks, 3)
        assert call[3] == STREAM + 1
        assert call[4] is fakes.jit.compiled.function
        assert call[5] is fakes.jit.compiled.packed_metadata
        assert call[6:9] == (None, None, None)
        want = expected_call(launch, rows, out, addresses=True)
        assert same_values(list(call[9:]), want)
        assert call[10] == rows.data_ptr() and call[13] == out.data_ptr()


def same_values(actual: list[Any], expected: list[Any]) -> bool:
    """Equal lists where tensors must be the same objects."""
    return len(actual) == len(expected) and all(
        a is e if isinstance(e, torch.Tensor) else a == e
        for a, e in zip(actual, expected)
    )


def test_the_jit_call_binds_the_same(fakes: SimpleNamespace) -> None:
    """The reference above is the JIT's own binding of a call (so the direct
    test compares with what Triton gets). Bug: a reference that drifted from
    the kernel's signature."""
    launch = triton_launch(layers=2)
    rows, out = call_rows(4, 2)
    launch(rows, out)
    assert same_values(fakes.jit.calls[0][1], expected_call(launch, rows, out))


@pytest.mark.parametrize("reason", ["hook", "device", "int32_rows", "huge_stride"])
def test_calls_the_direct_launch_cannot_take_go_to_the_jit(
    fakes: SimpleNamespace, reason: str
) -> None:
    """A profiler's launch hook, another current device than the kernel was
    loaded on, or arguments the JIT would specialize differently (int32 rows,
    a stride past 32 bits) take the JIT path, call by call. Bugs: a direct
    launch that hides launches from a profiler, launches a function of
    another device's context, or reuses a kernel compiled for other types."""
    launch = triton_launch()
    launch(*call_rows(1))
    rows, out = call_rows(3)
    if reason == "hook":
        fakes.runtime.launch_enter_hook.calls.append(print)
    elif reason == "device":
        fakes.device.index = 1
    elif reason == "int32_rows":
        rows = rows.to(torch.int32)
    else:
        rows, out = call_rows(1)
        out = torch.zeros((1, 1), dtype=torch.int64).as_strided((1, 1), (1 << 31, 1))
    launch(rows, out)
    assert len(fakes.jit.calls) == 2 and not fakes.jit.compiled.launches
    # Nothing sticks: the next plain call is direct again.
    fakes.runtime.launch_enter_hook.calls.clear()
    fakes.device.index = 0
    launch(*call_rows(2))
    assert len(fakes.jit.calls) == 2 and len(fakes.jit.compiled.launches) == 1


def test_a_failing_launcher_leaves_the_jit_for_good(fakes: SimpleNamespace) -> None:
    """A launcher that raises (another Triton's calling convention) costs the
    call nothing, and every later call takes the JIT without trying again.
    Bugs: the error raised into the engine step; the launcher retried (and
    failing) on every step."""
    launch = triton_launch()
    launch(*call_rows(1))
    fakes.jit.compiled.fail = True
    launch(*call_rows(2))
    launch(*call_rows(3))
    assert len(fakes.jit.calls) == 3 and not fakes.jit.compiled.launches
    assert launch._direct.compiled is None


def test_direct_launch_off_keeps_the_jit(
    fakes: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DIRECT_LAUNCH off: every call through the JIT (the benchmark's JIT
    column and the fallback). Bug: the flag ignored."""
    monkeypatch.setattr(kernels, "DIRECT_LAUNCH", False)
    launch = triton_launch()
    for count in (1, 2, 3):
        launch(*call_rows(count))
    assert len(fakes.jit.calls) == 3 and not fakes.jit.compiled.launches


def test_a_triton_without_a_launcher_keeps_the_jit(fakes: SimpleNamespace) -> None:
    """A JIT call returning something without a launcher (the CPU
    interpreter returns None) leaves the JIT path in place. Bug: an
    AttributeError on the second call."""
    fakes.jit.compiled = None  # type: ignore[assignment]
    launch = triton_launch()
    launch(*call_rows(1))
    launch(*call_rows(2))
    assert len(fakes.jit.calls) == 2 and launch._direct.compiled is None


@pytest.mark.parametrize(
    ("version", "direct"),
    [
        ("3.6.0", True),
        ("3.8.0", True),
        ("3.3.1", False),
        ("3.9.0", False),
        ("x", False),
    ],
)
def test_only_read_triton_versions_launch_directly(
    fakes: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, version: str, direct: bool
) -> None:
    """A Triton whose launcher convention was not read keeps the JIT (its
    launcher might take the same arguments in another meaning and not raise).
    Bug: the version gate dropped or read as a string comparison."""
    monkeypatch.setattr(kernels.triton, "__version__", version)
    launch = triton_launch()
    launch(*call_rows(1))
    launch(*call_rows(2))
    assert (launch._direct.compiled is not None) == direct
    assert len(fakes.jit.compiled.launches) == int(direct)
