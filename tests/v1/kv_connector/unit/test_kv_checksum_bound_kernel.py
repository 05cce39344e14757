# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The checksum kernel launched through its compiled variant (`BoundKernel`,
issue 30, SPEC R142 host cost and R62 warm-up), on CPU with a stand-in for
the compiled kernel and Triton's driver: what it passes, when it yields to
Triton's JIT launcher, and warm-up's fallback. test_kv_checksum_cuda.py runs
the bound launch on a GPU against the reference.

Each test's docstring names the bug it catches.
"""

import inspect
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.test_kv_checksum_kernels import kernels, make_views

pytestmark = pytest.mark.cpu

triton = pytest.importorskip("triton")
if not kernels.HAS_KNOBS:
    pytest.skip("this Triton has no knobs (older than 3.4)", allow_module_level=True)

HEADER = ("function", "metadata")


class FakeCompiled:
    """What `kernel[grid](...)` returns, with a launcher that records calls
    (or raises `error`)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.error = error
        self.function, self.packed_metadata = HEADER

    def run(self, *args: Any) -> None:
        if self.error is not None:
            raise self.error
        self.calls.append(args)


class FakeJit:
    """`_kv_checksum_kernel` in its place: counts JIT launches, returns `compiled`."""

    def __init__(self, compiled: Any) -> None:
        self.arg_names = kernels._kv_checksum_kernel.arg_names
        self.compiled = compiled
        self.launches = 0

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **constants: Any) -> Any:
            self.launches += 1
            return self.compiled

        return launch


@pytest.fixture
def device_zero(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Triton's driver replaced: current device `current.device` (0), stream 77."""
    current = SimpleNamespace(device=0)
    active = SimpleNamespace(
        get_current_device=lambda: current.device,
        get_current_stream=lambda device: 77,
    )
    monkeypatch.setattr(kernels, "driver", SimpleNamespace(active=active))
    return current


def cpu_triton_launch(**config: Any) -> Any:
    """A Triton-backend launch over CPU views (its launch is never run here)."""
    views = make_views(
        np.random.default_rng(142), "cpu", blocks=3, heads=2, tokens=4, pieces=8
    )
    base = kernels.default_config()
    return kernels.KVChecksumLaunch(
        views,
        [0],
        [0],
        backend="triton",
        config=kernels.LaunchConfig(**{**vars(base), **config}),
    )


def rows_and_out() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((3, 2), dtype=torch.int64), torch.zeros(
        (2, 1), dtype=torch.int64
    )


def test_bound_launch_passes_every_parameter_in_signature_order(
    device_zero: SimpleNamespace,
) -> None:
    """Constants passed in the launch's dict order, launch options such as
    num_warps passed as kernel arguments, a constant dropped, or the runtime
    arguments shifted: the launcher reads its arguments by position, so each
    would launch the kernel with wrong strides or constants. The expected
    order is the kernel function's own signature (R142)."""
    launch = cpu_triton_launch()
    grid, args = launch._triton_args(*rows_and_out())
    compiled = FakeCompiled()
    bound = kernels.BoundKernel.bind(
        kernels._kv_checksum_kernel, compiled, len(args), launch._constants
    )
    assert bound is not None
    assert bound(grid, args)
    params = list(inspect.signature(kernels._kv_checksum_kernel.fn).parameters)
    constants = [launch._constants[name] for name in params[len(args) :]]
    expected = (*grid, 77, *HEADER, None, None, None, *args, *constants)
    assert len(compiled.calls) == 1
    sent = compiled.calls[0]
    assert len(sent) == len(expected)
    # Tensors compare by identity, the rest by value.
    assert all(a is b or a == b for a, b in zip(sent, expected))
    assert len(params) == len(args) + len(constants)
    assert "num_warps" not in params


def test_bound_launch_yields_to_hooks_and_other_devices(
    device_zero: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct launch while a profiler's launch hook is set (the hook would
    miss the kernel, or get no metadata) or while another device is current
    (the variant's function handle belongs to device 0's context): both must
    leave the launch to Triton's JIT."""
    launch = cpu_triton_launch()
    grid, args = launch._triton_args(*rows_and_out())
    compiled = FakeCompiled()
    bound = kernels.BoundKernel.bind(
        kernels._kv_checksum_kernel, compiled, len(args), launch._constants
    )
    assert bound is not None
    monkeypatch.setattr(kernels.knobs.runtime, "launch_enter_hook", lambda m: None)
    assert not bound(grid, args)
    monkeypatch.setattr(kernels.knobs.runtime, "launch_enter_hook", None)
    device_zero.device = 1
    assert not bound(grid, args)
    assert compiled.calls == []


def test_bind_refuses_what_it_cannot_launch(device_zero: SimpleNamespace) -> None:
    """Binding what the interpreter returns (no compiled variant) or a launch
    whose constants lack one of the kernel's parameters: the launcher would
    fail, or take a missing constant's place from the next one."""
    launch = cpu_triton_launch()
    _, args = launch._triton_args(*rows_and_out())
    jit = kernels._kv_checksum_kernel
    assert kernels.BoundKernel.bind(jit, None, len(args), launch._constants) is None
    constants = dict(launch._constants)
    del constants["DENSE"]
    assert kernels.BoundKernel.bind(jit, FakeCompiled(), len(args), constants) is None


def test_warm_up_binds_then_skips_the_jit(
    device_zero: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-up not binding, or a bound launch still going through
    `kernel[grid]` (the per-call cost it exists to remove; issue 30): after
    warm-up, calls reach the compiled variant's launcher and never the JIT."""
    compiled = FakeCompiled()
    jit = FakeJit(compiled)
    monkeypatch.setattr(kernels, "_kv_checksum_kernel", jit)
    launch = cpu_triton_launch()
    launch.warm_up()
    assert launch.bound is not None and launch.bind_error is None
    assert (jit.launches, len(compiled.calls)) == (1, 1)  # compile, then trial
    rows, out = rows_and_out()
    launch(rows, out)
    launch(rows, out)
    assert (jit.launches, len(compiled.calls)) == (1, 3)
    assert compiled.calls[-1][9] is launch._table  # after grid, stream, header


def test_warm_up_keeps_the_jit_when_the_trial_launch_raises(
    device_zero: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Triton whose launcher takes other arguments (it raises on the trial
    launch): keeping the bound launch would raise into vLLM's step; warm-up
    must fall back to the JIT and say why. With `bound_launch` off it never
    binds (the benchmarks' comparison)."""
    jit = FakeJit(FakeCompiled(TypeError("launcher takes 19 arguments")))
    monkeypatch.setattr(kernels, "_kv_checksum_kernel", jit)
    launch = cpu_triton_launch()
    launch.warm_up()
    assert launch.bound is None
    assert "launcher takes 19 arguments" in (launch.bind_error or "")
    launch(*rows_and_out())
    assert jit.launches == 2

    jit = FakeJit(FakeCompiled())
    monkeypatch.setattr(kernels, "_kv_checksum_kernel", jit)
    unbound = cpu_triton_launch(bound_launch=False)
    unbound.warm_up()
    unbound(*rows_and_out())
    assert unbound.bound is None and jit.launches == 2
    assert jit.compiled.calls == []
