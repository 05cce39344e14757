# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the KV checksum tests.

Nothing here changes vLLM's behaviour at import time: vLLM is imported only
inside fixtures, and the test connector registers itself (a new name in
``KVConnectorFactory``) when ``kv_checksum_helpers`` is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from tests.v1.kv_connector.unit.kv_checksum_helpers import CpuStreamState


_PACKAGE = "vllm.distributed.kv_transfer.kv_checksum"
_MODULE_IMPORT = re.compile(
    r"^(?:from|import) (vllm\.distributed\.kv_transfer\.kv_checksum[\w.]*)"
    r"(?: import ([\w, ()]+))?",
    re.MULTILINE,
)
# Test files left out on a vLLM with the subsystem built in, with the module
# of the package each needs that is not there (the plugin's wiring, or a
# capability whose series commit comes later).
_NOT_NATIVE: dict[str, str] = {}


_LOCAL_IMPORT = re.compile(
    r"^from tests\.v1\.kv_connector\.unit(?:\.(\w+) import| import (\w+))",
    re.MULTILINE,
)


def _missing_module(path: Path, seen: set[Path] | None = None) -> str | None:
    """The first package module a test file (or a module of this folder it
    imports) imports at module level that this vLLM does not have; None when
    it has them all."""
    seen = set() if seen is None else seen
    if path in seen or not path.exists():
        return None
    seen.add(path)
    source = path.read_text()
    for module, names in _MODULE_IMPORT.findall(source):
        if not _exists(module):
            return module
        for name in names.strip("()").split(","):  # `from package import module`
            name = name.split(" as ")[0].strip()
            dotted = f"{module}.{name}"
            if name and not _exists(dotted) and not _is_attribute(dotted):
                return dotted
    for local in _LOCAL_IMPORT.findall(source):
        missing = _missing_module(path.with_name(f"{local[0] or local[1]}.py"), seen)
        if missing is not None:
            return missing
    return None


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent is a module, not a package
        return False


def _is_attribute(dotted: str) -> bool:
    """Whether `module.name` is an attribute of an existing module (a class
    or function imported by name) rather than a missing module."""
    module, _, name = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """On a vLLM with KV checksums built in (the in-tree series under
    `upstream/`), a test file that imports the plugin's wiring, or a module of
    a capability the series does not have yet, is not collected; they are
    listed at the end of the run. On vLLM 0.33.0 everything is collected."""
    name = collection_path.name
    if not (
        name.startswith(("test_kv_checksum", "kv_checksum_")) and name.endswith(".py")
    ):
        return None
    if importlib.util.find_spec(f"{_PACKAGE}.plugin") is not None:
        return None  # the plugin is installed: vLLM 0.33.0
    missing = _missing_module(collection_path)
    if missing is None or not name.startswith("test_"):
        return None
    _NOT_NATIVE[name] = missing
    return True


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _NOT_NATIVE:
        terminalreporter.write_sep("-", "not collected on the native subsystem")
        for name, missing in sorted(_NOT_NATIVE.items()):
            terminalreporter.write_line(f"{name}: needs {missing}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kv_checksum_capability(name): needs a capability that a vLLM with the "
        "in-tree series may not have wired yet (skipped there until it has)",
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Skip tests marked ``cuda`` when no CUDA device is available, and, on a
    vLLM with the in-tree series, tests of a capability it has not wired yet."""
    from tests.v1.kv_connector.unit.kv_checksum_helpers import (
        capability_skip_reason,
        native_capability,
    )

    no_cuda = not torch.cuda.is_available()
    for item in items:
        if no_cuda and item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        for marker in item.iter_markers("kv_checksum_capability"):
            if not native_capability(marker.args[0]):
                reason = capability_skip_reason(marker.args[0])
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def vllm_caplog(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    """caplog that also sees vLLM's loggers (which do not propagate by default)."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    caplog.set_level(logging.WARNING)
    return caplog


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder holding only the ``config.json`` of a tiny Qwen3-style model
    (4 layers, 2 KV heads, head_dim 64, bf16): no weights, no tokenizer, no
    hub access."""
    from tests.v1.kv_connector.unit.kv_checksum_helpers import write_model_dir

    return write_model_dir(Path(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture
def cuda_stream_stubs(monkeypatch: pytest.MonkeyPatch) -> Iterator[CpuStreamState]:
    """CPU stand-ins for CUDA streams and events, so code that always uses a
    side stream runs on a machine without a GPU (R55).

    Patched for the duration of the test (``monkeypatch`` undoes everything):

    * ``torch.cuda.Stream`` -> ``CpuStream`` and ``torch.cuda.Event`` ->
      ``CpuEvent``: work runs eagerly, so ``wait_stream``, ``wait_event``,
      ``record_event``, ``record``, ``wait`` and ``synchronize`` are logged
      no-ops and ``query()`` is always True;
    * ``torch.cuda.current_stream``, ``default_stream``, ``set_stream``,
      ``synchronize`` and the ``torch.cuda.stream(s)`` context manager, which
      switches the stand-in current stream;
    * the same names (``Stream``, ``Event``, ``current_stream``,
      ``default_stream``, ``set_stream``, ``stream``, ``synchronize``) on
      ``vllm.platforms.current_platform``. vLLM 0.33.0's ``Platform`` has no
      such methods: ``Platform.__getattr__`` forwards them to
      ``torch.<device_type>`` (``torch.cuda`` on CUDA, None on the
      CPU/unspecified platform), so they are set as instance attributes;
    * ``vllm.utils.torch_utils.current_stream`` and the thread-local it caches
      the current stream in, so vLLM's helper returns the stand-in too.

    Not patched: ``torch.Tensor.record_stream`` (a tensor method that rejects
    the stand-ins); code meant to run here must not need it on CPU.
    ``torch.cuda.is_available()`` stays False.

    Yields the ``CpuStreamState``: ``.current``/``.default`` streams and the
    streams/events created, each logging what it waited on or recorded.
    """
    from tests.v1.kv_connector.unit.kv_checksum_helpers import cpu_cuda_streams

    with cpu_cuda_streams(monkeypatch) as state:
        yield state
