# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the KV checksum tests.

Nothing here changes vLLM's behaviour at import time: vLLM is imported only
inside fixtures, and the test connector registers itself (a new name in
``KVConnectorFactory``) when ``kv_checksum_helpers`` is imported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from tests.v1.kv_connector.unit.kv_checksum_helpers import CpuStreamState


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Skip tests marked ``cuda`` when no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


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
