# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU stand-ins for CUDA streams and events cover every stream and event
call the package makes (R55).

The tests and the demo (examples/run_demo.sh) run the workers' side-stream
copy on CPU through one set of stand-ins, `cpu_cuda_streams` (the
`cuda_stream_stubs` fixture). The calls are not listed here: they are read
from the package's source, so a call added to the package without its
stand-in fails here rather than in the demo.
"""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit import kv_checksum_reference as ref
from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    CpuEvent,
    CpuStream,
    cpu_cuda_streams,
)
from tests.v1.kv_connector.unit.test_kv_checksum import (
    REQ,
    blocks,
    hexes,
    send,
    truth_worker,
)

pytestmark = pytest.mark.cpu

PACKAGE = (
    Path(__file__).resolve().parents[4] / "vllm/distributed/kv_transfer/kv_checksum"
)
DEVICE_MODULES = {"cuda": torch.cuda, "accelerator": torch.accelerator}
# Device calls of the package that a worker whose device is the CPU never
# makes, so the stand-ins leave them alone; the test makes each raise and
# runs a CPU worker's step to prove it.
CUDA_ONLY = {
    "torch.accelerator.current_device_index": "the side copy on a CUDA device",
    "torch.accelerator.current_stream": "the side copy on a CUDA device",
    "torch.accelerator.set_stream": "the side copy on a CUDA device",
    "torch.accelerator.set_device_index": "the side copy on a CUDA device",
}


def package_trees() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in PACKAGE.rglob("*.py")]


def device_calls(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    """Every `torch.cuda.<name>` and `torch.accelerator.<name>` in the source."""
    found = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "torch"
                and node.value.attr in DEVICE_MODULES
            ):
                found.add(f"torch.{node.value.attr}.{node.attr}")
    return found


def other_imports(trees: list[tuple[Path, ast.Module]]) -> list[str]:
    """Imports that would hide a device call from `device_calls`
    (`from torch.cuda import ...`, `import torch.cuda as ...`)."""
    hidden = []
    for path, tree in trees:
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.asname or a.name != "torch"]
            hidden += [
                f"{path.name}: {n}"
                for n in names
                if n.startswith(("torch.cuda", "torch.accelerator"))
            ]
    return hidden


def attribute_names(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    return {
        node.attr
        for _, tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
    }


def resolve(call: str) -> object:
    _, module, name = call.split(".")
    return getattr(DEVICE_MODULES[module], name)


def test_R55_stand_ins_cover_every_stream_call_of_the_package(
    monkeypatch: pytest.MonkeyPatch,
):
    """R55: under `cpu_cuda_streams`, every `torch.cuda` function or class the
    package names is a stand-in (or one a CPU worker never reaches, each made
    to raise here while a CPU worker sends and its side-stream copy is read
    back against the reference), and the stand-in stream and event have every
    method and attribute of torch's Stream and Event that the package's
    source names. Bug caught (issue 75): a stand-in set without
    `torch.cuda.set_stream` (the demo's own stubs), so the launcher handed
    a CPU stream to the real `set_stream`, which failed reading its
    `stream_id`: the demo crashed while the tests, under other stubs, passed.
    Also caught: a call of a CUDA-only name on a CPU worker."""
    trees = package_trees()
    assert other_imports(trees) == []
    calls = device_calls(trees)
    # The scan reads the package: the launcher's stream calls are in it.
    assert {"torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.set_stream"} <= calls
    real = {call: resolve(call) for call in calls}
    with cpu_cuda_streams(monkeypatch):
        not_stood_in = {call for call in calls if resolve(call) is real[call]}
        assert not_stood_in - set(CUDA_ONLY) == set()
        names = attribute_names(trees)
        for real_cls, stand_in in (
            (torch.cuda.streams.Stream, CpuStream),
            (torch.cuda.streams.Event, CpuEvent),
        ):
            used = {n for n in dir(real_cls) if not n.startswith("_")} & names
            assert used, real_cls  # the launcher waits, records and queries
            missing = {n for n in used if not hasattr(stand_in(), n)}
            assert missing == set(), (stand_in.__name__, missing)

        def unreachable(*args: object, **kwargs: object) -> None:
            raise AssertionError("a CUDA-only device call on a CPU worker")

        for call in CUDA_ONLY:
            _, module, name = call.split(".")
            monkeypatch.setattr(DEVICE_MODULES[module], name, unreachable)
        kv = ref.random_kv(np.random.default_rng(17), 2, 28, 2, 16)
        worker = truth_worker(kv, [2, 5])
        for _ in range(2):  # the first copy makes the side stream, later reuse it
            record = send(worker, {REQ: blocks(28, (0, 0, [2, 5]))})
            want = ref.reference_block_checksums(kv, 16)
            assert hexes(record.checksums[REQ][0].values[:, 0]) == hexes(want)
        assert worker.launcher._streams is not None
        assert isinstance(worker.launcher._streams.side, CpuStream)
