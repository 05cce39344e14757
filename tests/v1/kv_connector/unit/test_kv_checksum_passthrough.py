# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Class-level hooks on vLLM's connectors pass through without checksum state.

The NIXL push, Mooncake, OffloadingConnector and SimpleCPUOffloadConnector
hooks wrap methods of vLLM's classes for every instance; only instances the
plugin attached checksum state to (checksums on) may behave differently (R16:
checksums off is plain vLLM).
Each wrapper is called on an instance without that state and must end exactly
as vLLM's original does on an identical instance: same result or same
exception, same attributes set.
"""

import asyncio
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import pytest

from vllm.distributed.kv_transfer.kv_checksum import wiring

MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker",
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
)


def _wrapped_methods() -> Iterator[tuple[type, str]]:
    wiring.install()
    for name in MODULES:
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            for attr, value in vars(cls).items():
                if hasattr(value, "__kv_checksum_original__"):
                    yield cls, attr


WRAPPED = sorted(_wrapped_methods(), key=lambda m: (m[0].__name__, m[1]))


def _bare(cls: type) -> Any:
    """An instance that skipped __init__, and whose __del__ (Mooncake's calls
    shutdown) does nothing."""
    quiet = type(cls.__name__, (cls,), {"__del__": lambda self: None})
    return quiet.__new__(quiet)


def _outcome(function: Any, cls: type, args: list[Any]) -> tuple[Any, ...]:
    """(result kind, exception type and text, attributes set) of one call."""
    instance = _bare(cls)
    try:
        result = function(instance, *args)
        if inspect.iscoroutine(result):
            result.close()
            kind: Any = "coroutine"
        else:
            kind = result is None or type(result).__name__
        error: tuple[Any, ...] = ()
    except Exception as e:
        kind, error = "raised", (type(e), str(e))
    return kind, error, sorted(vars(instance))


def test_every_connector_hook_found() -> None:
    """R16: the list is not empty by accident: the 17 class-level hooks of NIXL
    push (4), Mooncake (5), the OffloadingConnector (5) and the
    SimpleCPUOffloadConnector (3) are all found."""
    names = {f"{cls.__name__}.{attr}" for cls, attr in WRAPPED}
    assert "NixlPushConnectorWorker.get_transfer_results" in names
    assert "MooncakeConnectorWorker.process_pulling_result" in names
    assert "OffloadingConnector.wait_for_save" in names
    assert "SimpleCPUOffloadConnector.build_connector_meta" in names
    assert len(WRAPPED) >= 17


@pytest.mark.parametrize(
    ("cls", "attr"), WRAPPED, ids=[f"{c.__name__}.{a}" for c, a in WRAPPED]
)
def test_hook_without_checksum_state_is_vllms_method_r16(cls: type, attr: str) -> None:
    """Bug this fails: a wrapper that touches the instance (reads a connector
    field, sets a checksum attribute) before checking for its checksum state,
    so a checksums-off engine no longer runs vLLM's own method alone."""
    wrapper = vars(cls)[attr]
    original = wrapper.__kv_checksum_original__
    params = list(inspect.signature(original).parameters.values())[1:]
    args = [object() for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert _outcome(wrapper, cls, args) == _outcome(original, cls, args)


def test_async_hooks_return_coroutines() -> None:
    """R16: a wrapped coroutine function stays one for vLLM's event loop."""
    for cls, attr in WRAPPED:
        original = vars(cls)[attr].__kv_checksum_original__
        if asyncio.iscoroutinefunction(original):
            result = vars(cls)[attr](_bare(cls), object(), object(), object())
            assert inspect.iscoroutine(result)
            result.close()
