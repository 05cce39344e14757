# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vLLM wiring of KV checksums: plugin, configuration and every hook.

Everything runs on the real vLLM 0.33.0 classes on CPU: real schedulers, the
real Model Runner V2 `ActiveKVConnector`, `KVOutputAggregator`,
`MultiConnector`, `VllmConfig`. The plugin is registered once for the whole
pytest process (other test modules rely on the hooks), so no test here ever
leaves the hooks uninstalled: `hooks_removed()` puts vLLM's originals back
only for the duration of one `with` block.

One test (`test_fresh_process_plugin_lifecycle`) checks what only a fresh
interpreter can show (nothing is patched before `register()`, a wrong vLLM
version patches nothing at all); its subprocess is started when this module's
first test runs so that its vLLM import overlaps with the other tests.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal
from unittest import mock

import numpy as np
import pytest
import torch

import vllm
import vllm.plugins
from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    TEST_CONNECTOR_NAME,
    consumer_kv_transfer_params,
    iter_engine_core_outputs,
    load_failed,
    load_finished,
    make_active_connector,
    make_active_env,
    make_kv_cache_config,
    make_kv_caches,
    make_model_runner_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    producer_kv_transfer_params,
    rank0_groups,
    step,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    CARRIER_CONNECTOR_NAME,
    OFFLOAD_CONNECTOR_NAME,
    KVChecksumCarrierTestConnector,
    register_carrier_connector,
)
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_checksum import config as checksum_config
from vllm.distributed.kv_transfer.kv_checksum import plugin, wiring
from vllm.distributed.kv_transfer.kv_checksum.config import (
    ENABLE_KEY,
    FAIL_CLOSED_KEY,
    connector_declares_carrier,
    kv_checksum_enabled,
    read_flags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumBlocks,
    KVChecksumCarrier,
    KVChecksumRecord,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    KVChecksumScheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (
    KVChecksumPendingRecord,
    create_kv_checksum_worker,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import KVChecksumStatus
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    offloading as wiring_offloading,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import version_guard
from vllm.distributed.kv_transfer.kv_checksum.wiring import worker as wiring_worker
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

pytestmark = pytest.mark.cpu

REPO_ROOT = Path(__file__).resolve().parents[4]
PLUGIN_GROUP = "vllm.general_plugins"
ENTRY_POINT = "vllm.distributed.kv_transfer.kv_checksum.plugin:register"
SCRIPTED_CONNECTOR_NAME = "KVChecksumScriptedTestConnector"
CHECKSUM_LOGGER = "vllm.distributed.kv_transfer.kv_checksum"

# Every vLLM method the wiring wraps (R10 a-j, R101), as module.Class.method.
EXPECTED_HOOKS = {
    "vllm.v1.core.sched.scheduler.Scheduler.__init__",
    "vllm.v1.core.sched.scheduler.Scheduler.add_request",
    "vllm.v1.core.sched.scheduler.Scheduler._update_after_schedule",
    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
    "vllm.v1.core.sched.scheduler.Scheduler._connector_finished",
    "vllm.v1.outputs.KVConnectorOutput.is_empty",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector."
    "MultiConnector.get_transfer_results",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache",
    "vllm.v1.worker.gpu.kv_connector.ActiveKVConnector.__init__",
    "vllm.v1.worker.gpu.kv_connector.ActiveKVConnector.pre_forward",
    "vllm.v1.worker.gpu.kv_connector.ActiveKVConnector.post_forward",
    "vllm.distributed.kv_transfer.kv_connector.utils.KVOutputAggregator.aggregate",
    "vllm.config.vllm.VllmConfig._get_v1_model_runner_unsupported_features",
}


# --------------------------------------------------------------------------
# A scripted connector (scheduler and worker side) for MultiConnector children
# --------------------------------------------------------------------------


class KVChecksumScriptedTestConnector(KVChecksumCarrierTestConnector):
    """The carrier test connector with per-instance behaviour from its config.

    ``kv_connector_extra_config`` keys: ``test_carrier_recv`` /
    ``test_carrier_send`` (a `KVChecksumCarrier` value or None; default
    "kv_transfer_params"), ``test_passive`` (never matches a request, starts
    no load, returns no kv_transfer_params, like an offloading child of a
    MultiConnector). Worker side: ``scripted`` is a queue of
    `KVConnectorTransferResults` returned by ``get_transfer_results`` before
    falling back to the base class. ``sent`` records ``send_kv_checksums``.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        default = KVChecksumCarrier.KV_TRANSFER_PARAMS.value
        self.carrier_recv = _carrier(extra.get("test_carrier_recv", default))
        self.carrier_send = _carrier(extra.get("test_carrier_send", default))
        self.passive = bool(extra.get("test_passive", False))
        self.scripted: list[KVConnectorTransferResults] = []
        self.sent: dict[str, bytes] = {}

    def kv_checksum_carrier(
        self, request: Any, receiving: bool
    ) -> KVChecksumCarrier | None:
        return self.carrier_recv if receiving else self.carrier_send

    def send_kv_checksums(self, request: Any, checksums: bytes) -> None:
        self.sent[request.request_id] = checksums

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if self.passive:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if not self.passive:
            super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _finished(self, request: Any, block_ids: Any):
        if self.passive:
            return False, None
        return super()._finished(request, block_ids)

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        if self.scripted:
            return self.scripted.pop(0)
        return super().get_transfer_results(finished_req_ids)


def _carrier(value: str | None) -> KVChecksumCarrier | None:
    return None if value is None else KVChecksumCarrier(value)


def register_scripted_connector() -> None:
    if SCRIPTED_CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            SCRIPTED_CONNECTOR_NAME, __name__, SCRIPTED_CONNECTOR_NAME
        )


def transfer_results(
    finished_recving: set[str] | None = None,
    kv_checksums: dict[str, bytes] | None = None,
    failed_recving: set[str] | None = None,
) -> KVConnectorTransferResults:
    results = KVConnectorTransferResults(
        finished_recving=set(finished_recving or ()),
        failed_recving=set(failed_recving or ()),
    )
    if kv_checksums is not None:
        results.kv_checksums = kv_checksums  # type: ignore[attr-defined]
    return results


# --------------------------------------------------------------------------
# Process-wide set-up and helpers
# --------------------------------------------------------------------------

FRESH_PROCESS_SCRIPT = textwrap.dedent(
    """
    import logging
    import sys

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput

    def hooked():
        return hasattr(Scheduler.__init__, "__kv_checksum_original__")

    # Importing the package and its wiring patches nothing.
    from vllm.distributed.kv_transfer.kv_checksum import plugin, wiring

    assert not hooked(), "importing the package patched vLLM"
    assert not hasattr(KVConnectorOutput, "kv_checksums")
    logging.getLogger("vllm").addHandler(Collect())

    # A wrong vLLM version: one warning, only the version guard (R7, R144).
    real_version = plugin._installed_vllm_version
    plugin._installed_vllm_version = lambda: "0.32.0"
    plugin.register()
    assert not hooked(), "hooks installed for vLLM 0.32.0"
    assert not wiring._installed
    assert not hasattr(KVConnectorOutput, "kv_checksums")
    assert not [r for r in records if r.levelno >= logging.ERROR]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    assert "0.32.0" in warnings[0].getMessage(), warnings[0].getMessage()
    assert "0.33.0" in warnings[0].getMessage(), warnings[0].getMessage()

    # The right version, loaded the way every vLLM process loads it (R7).
    plugin._installed_vllm_version = real_version
    plugin._registered = False
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    assert hooked(), "load_general_plugins did not install the hooks"
    first = Scheduler.__init__
    plugin._registered = False
    plugin.register()
    assert Scheduler.__init__ is first
    assert not hasattr(first.__kv_checksum_original__, "__kv_checksum_original__")
    print("FRESH-PROCESS-OK")
    """
)


@pytest.fixture(scope="module")
def fresh_process() -> Iterator[subprocess.Popen]:
    """The fresh-interpreter check, started early to overlap the vLLM import."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["VLLM_PLUGINS"] = "kv_checksum"
    proc = subprocess.Popen(
        [sys.executable, "-c", FRESH_PROCESS_SCRIPT],
        cwd=str(REPO_ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module", autouse=True)
def registered(request: pytest.FixtureRequest) -> None:
    """Install the hooks once for the process; they stay installed. Starts the
    fresh-process check first when it is among the selected tests."""
    if any(
        item.name == "test_fresh_process_plugin_lifecycle"
        for item in request.session.items
    ):
        request.getfixturevalue("fresh_process")
    plugin.register()
    register_carrier_connector()
    register_scripted_connector()


def checksum_logs(
    caplog: pytest.LogCaptureFixture, level: int
) -> list[logging.LogRecord]:
    """Records of the checksum package's loggers at `level` or above."""
    return [
        r
        for r in caplog.records
        if r.name.startswith(CHECKSUM_LOGGER) and r.levelno >= level
    ]


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the once-per-process disabling warnings for this test (R16)."""
    monkeypatch.setattr(checksum_config, "_warned", set())


def _qualified(cls: type, name: str) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.{name}"


def wrapped_attributes() -> dict[str, tuple[type, str, Any]]:
    """Every class attribute of a loaded vLLM module wrapped by the wiring.

    Found by scanning the classes of every imported ``vllm.*`` module for a
    ``__kv_checksum_original__`` marker, so a hook added to the wiring later
    is found (and removed by `hooks_removed`) without editing this list.
    """
    found: dict[str, tuple[type, str, Any]] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("vllm"):
            continue
        try:
            members = list(vars(module).values())
        except TypeError:
            continue
        for cls in members:
            if not isinstance(cls, type) or cls.__module__ != module_name:
                continue
            for name, value in list(vars(cls).items()):
                try:
                    original = getattr(value, "__kv_checksum_original__", None)
                except Exception:
                    continue
                if original is not None:
                    found[_qualified(cls, name)] = (cls, name, value)
    return found


@contextlib.contextmanager
def hooks_removed() -> Iterator[dict[str, tuple[type, str, Any]]]:
    """Plain vLLM inside the block: every wrapped method is its original again.

    Only for comparisons within one test (R1); the wrappers are put back on
    exit whatever happens. Attributes the wiring added rather than wrapped
    (class defaults such as ``SchedulerOutput.kv_checksum_scheduled = None``
    and the carrier methods) stay: vLLM never reads them.
    """
    wrapped = wrapped_attributes()
    assert set(wrapped) >= EXPECTED_HOOKS
    try:
        for cls, name, wrapper in wrapped.values():
            setattr(cls, name, wrapper.__kv_checksum_original__)
        yield wrapped
    finally:
        for cls, name, wrapper in wrapped.values():
            setattr(cls, name, wrapper)


def prompt(length: int, start: int = 3) -> list[int]:
    return list(range(start, start + length))


# --------------------------------------------------------------------------
# 1. Packaging and plugin (R6, R7)
# --------------------------------------------------------------------------


def test_entry_point_points_to_register() -> None:
    """R7: the `kv_checksum` entry point of group vllm.general_plugins exists
    and loads `plugin.register`. Catches a missing or misspelled entry point
    (the hooks would then never be installed in vLLM's processes)."""
    (entry,) = [
        ep
        for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)
        if ep.name == "kv_checksum"
    ]
    assert entry.value == ENTRY_POINT
    assert entry.load() is plugin.register


def test_editable_install_layout() -> None:
    """R6: vLLM is the published package in site-packages while the checksum
    package is imported from this repository (editable install into vLLM's
    namespace). Catches a stale non-editable copy shadowing the sources."""
    assert "site-packages" in Path(vllm.__file__).parts
    from vllm.distributed.kv_transfer import kv_checksum

    package = Path(kv_checksum.__file__).resolve()
    assert package.is_relative_to(REPO_ROOT)
    assert "site-packages" not in package.parts
    assert vllm.__version__ == plugin.SUPPORTED_VLLM_VERSION


def test_load_general_plugins_installs_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """R7: vLLM's own plugin loader (what every vLLM process runs) calls
    `register()` through the entry point, and afterwards every hook of R10 is
    installed. Catches an entry point vLLM does not load and hooks missing
    because `wiring.install` failed silently (register() swallows errors)."""
    calls = []
    real_register = plugin.register

    def spy() -> None:
        calls.append(True)
        real_register()

    monkeypatch.setattr(plugin, "register", spy)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "kv_checksum")
    vllm.plugins.load_general_plugins()
    assert calls == [True]
    assert hasattr(Scheduler.__init__, "__kv_checksum_original__")
    assert set(wrapped_attributes()) >= EXPECTED_HOOKS
    # Attributes added rather than wrapped (R9, R98, R101).
    assert SchedulerOutput.kv_checksum_scheduled is None  # type: ignore[attr-defined]
    assert KVConnectorOutput.kv_checksums is None  # type: ignore[attr-defined]
    assert KVConnectorTransferResults.kv_checksums is None  # type: ignore[attr-defined]
    for name in ("kv_checksum_carrier", "send_kv_checksums"):
        assert callable(getattr(KVConnectorBase_V1, name))
        assert name in vars(MultiConnector)
    assert "kv_checksum_carrier" in vars(NixlPullConnector)


def test_register_twice_is_a_no_op() -> None:
    """R7: vLLM may call `register()` several times per process; the hooks are
    wrapped once. Also `wiring.install` itself is idempotent (plugin state
    reset). Catches double wrapping (every hook would run twice: doubled
    add_send/add_recv registrations, records concatenated twice)."""
    before = wrapped_attributes()
    plugin.register()
    plugin.register()
    saved = plugin._registered
    plugin._registered = False
    try:
        plugin.register()
    finally:
        plugin._registered = saved
    after = wrapped_attributes()
    assert after.keys() == before.keys()
    for key, (_, _, wrapper) in after.items():
        assert wrapper is before[key][2], key
        assert not hasattr(wrapper.__kv_checksum_original__, "__kv_checksum_original__")
    init = Scheduler.__init__
    assert not hasattr(init.__kv_checksum_original__, "__kv_checksum_original__")


def test_wrong_vllm_version_patches_nothing(
    monkeypatch: pytest.MonkeyPatch, vllm_caplog: pytest.LogCaptureFixture
) -> None:
    """R7, R144: on another vLLM version `register()` never calls into the
    wiring: it installs only the version guard (test_kv_checksum_version_guard
    checks what that does) and logs one warning. Catches a version check that
    runs after some patching, or one that skips the guard. (The fresh-process
    test checks the same without any hook installed beforehand.)"""
    before = wrapped_attributes()
    installs = []
    guards: list[str] = []
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(wiring, "_installed", False)
    monkeypatch.setattr(plugin, "_installed_vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(wiring, "install", lambda: installs.append(True))
    monkeypatch.setattr(
        version_guard, "install_version_guard", lambda v: not guards.append(v)
    )
    plugin.register()
    assert installs == []
    assert guards == ["0.32.0"]
    assert {k: v[2] for k, v in wrapped_attributes().items()} == {
        k: v[2] for k, v in before.items()
    }
    assert checksum_logs(vllm_caplog, logging.ERROR) == []
    warnings = checksum_logs(vllm_caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "0.32.0" in warnings[0].getMessage()
    assert plugin.SUPPORTED_VLLM_VERSION in warnings[0].getMessage()


def test_install_error_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, vllm_caplog: pytest.LogCaptureFixture
) -> None:
    """R7: `register()` never raises, so a broken wiring cannot stop vLLM
    from starting; the exception is logged with its traceback."""

    def broken_install() -> None:
        raise RuntimeError("wiring exploded")

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(wiring, "install", broken_install)
    plugin.register()  # must not raise
    errors = checksum_logs(vllm_caplog, logging.ERROR)
    assert len(errors) == 1
    assert errors[0].exc_info is not None
    assert "wiring exploded" in str(errors[0].exc_info[1])


# --------------------------------------------------------------------------
# 2. Configuration (R8, R10 j, R11-R16, R100)
# --------------------------------------------------------------------------


def transfer_config(connector: str = CARRIER_CONNECTOR_NAME, **extra: Any):
    return KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra
    )


def with_parallel(vllm_config: VllmConfig, **parallel: Any) -> SimpleNamespace:
    """`vllm_config` with some ParallelConfig values replaced (a view: the
    decision is a pure function of these fields, R11)."""
    fields = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "prefill_context_parallel_size": 1,
        "distributed_executor_backend": "mp",
    }
    fields.update(parallel)
    return SimpleNamespace(
        kv_transfer_config=vllm_config.kv_transfer_config,
        model_config=vllm_config.model_config,
        parallel_config=SimpleNamespace(**fields),
    )


def test_read_flags_from_extra_config() -> None:
    """R8: both flags come from the top level of kv_connector_extra_config,
    default false. Catches reading them from another place (KVTransferConfig
    rejects unknown fields) or swapped keys."""
    assert ENABLE_KEY == "enable_kv_checksum"
    assert FAIL_CLOSED_KEY == "kv_checksum_fail_closed"
    assert read_flags(None).enabled is False
    flags = read_flags(transfer_config())
    assert (flags.enabled, flags.fail_closed) == (False, False)
    flags = read_flags(transfer_config(enable_kv_checksum=True))
    assert (flags.enabled, flags.fail_closed) == (True, False)
    flags = read_flags(
        transfer_config(enable_kv_checksum=True, kv_checksum_fail_closed=True)
    )
    assert (flags.enabled, flags.fail_closed) == (True, True)
    flags = read_flags(transfer_config(kv_checksum_fail_closed=True))
    assert (flags.enabled, flags.fail_closed) == (False, True)
    # Only the top level counts, also for a MultiConnector (R8).
    nested = transfer_config(
        "MultiConnector",
        connectors=[_child(CARRIER_CONNECTOR_NAME, enable_kv_checksum=True)],
    )
    assert read_flags(nested).enabled is False


@pytest.mark.parametrize("key", [ENABLE_KEY, FAIL_CLOSED_KEY])
@pytest.mark.parametrize("value", ["true", 1, 0, "false"])
def test_non_boolean_flag_is_a_startup_error(key: str, value: Any) -> None:
    """R8: a non-boolean flag is an error (not truthiness: "false" or 1 would
    otherwise silently enable or disable checksums)."""
    with pytest.raises(ValueError, match=key):
        read_flags(transfer_config(**{key: value}))
    flags = {ENABLE_KEY: True, key: value}  # enabled, unless the bad one
    with pytest.raises(ValueError, match=key):
        kv_checksum_enabled(
            SimpleNamespace(kv_transfer_config=transfer_config(**flags))
        )


def test_non_boolean_flag_fails_scheduler_start(model_dir: str) -> None:
    """R8: the error surfaces when the engine starts (Scheduler construction),
    not as a silently disabled feature."""
    vllm_config = make_vllm_config(
        model_dir,
        kv_connector=CARRIER_CONNECTOR_NAME,
        extra_config={ENABLE_KEY: "yes"},
    )
    with pytest.raises(ValueError, match=ENABLE_KEY):
        make_scheduler(vllm_config, make_kv_cache_config(vllm_config))


def test_enabled_needs_transfer_config_connector_and_flag(
    model_dir: str, vllm_caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    """R11: false, silently, without KV transfer config, without connector or
    without enable_kv_checksum; fail-closed alone has no effect (R8); true with
    a carrier connector and the flag. Catches enabling on fail-closed alone
    and warnings for the ordinary off case."""
    no_transfer = make_vllm_config(model_dir, kv_connector=None)
    assert no_transfer.kv_transfer_config is None
    assert kv_checksum_enabled(no_transfer) is False
    no_connector = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector=None, kv_connector_extra_config={ENABLE_KEY: True}
        )
    )
    assert kv_checksum_enabled(no_connector) is False
    for extra in ({}, {ENABLE_KEY: False}, {FAIL_CLOSED_KEY: True}):
        config = make_vllm_config(
            model_dir, kv_connector=CARRIER_CONNECTOR_NAME, extra_config=extra
        )
        assert kv_checksum_enabled(config) is False, extra
    on = make_vllm_config(
        model_dir, kv_connector=CARRIER_CONNECTOR_NAME, extra_config={ENABLE_KEY: True}
    )
    assert kv_checksum_enabled(on) is True
    assert checksum_logs(vllm_caplog, logging.DEBUG) == []


@pytest.mark.parametrize(
    "parallel",
    [{"decode_context_parallel_size": 2}, {"prefill_context_parallel_size": 2}],
    ids=["dcp2", "pcp2"],
)
def test_context_parallel_disables_with_one_warning(
    model_dir: str,
    parallel: dict[str, int],
    vllm_caplog: pytest.LogCaptureFixture,
    fresh_warnings: None,
) -> None:
    """R13, R16: DCP or PCP > 1 disables checksums with a warning, logged once
    per process however often the decision is taken (scheduler and every
    worker ask). Catches a missing check (wrong per-rank checksums) and a
    warning per call."""
    on = make_vllm_config(
        model_dir, kv_connector=CARRIER_CONNECTOR_NAME, extra_config={ENABLE_KEY: True}
    )
    assert kv_checksum_enabled(with_parallel(on)) is True
    for _ in range(3):
        assert kv_checksum_enabled(with_parallel(on, **parallel)) is False
    warnings = checksum_logs(vllm_caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "context parallel" in warnings[0].getMessage()


class LegacyRayExecutor(Executor):
    """A Ray executor not built on MultiprocExecutor (its non-last PP stages'
    connector outputs would never reach the scheduler)."""

    uses_ray = True


class RayOnMultiproc(MultiprocExecutor):
    uses_ray = True


class PlainCustomExecutor(Executor):
    uses_ray = False


@pytest.mark.parametrize(
    ("backend", "pp_size", "enabled"),
    [
        ("ray", 2, True),
        ("mp", 2, True),
        (RayOnMultiproc, 2, True),
        (PlainCustomExecutor, 2, True),
        (LegacyRayExecutor, 1, True),
        (LegacyRayExecutor, 2, False),
        (f"{__name__}.LegacyRayExecutor", 2, False),
    ],
    ids=[
        "ray-v2",
        "mp",
        "ray-on-multiproc",
        "custom-non-ray",
        "legacy-ray-pp1",
        "legacy-ray-pp2",
        "legacy-ray-qualname",
    ],
)
def test_ray_pipeline_parallel_executor(
    model_dir: str,
    backend: Any,
    pp_size: int,
    enabled: bool,
    vllm_caplog: pytest.LogCaptureFixture,
    fresh_warnings: None,
) -> None:
    """R14: only a Ray executor not derived from MultiprocExecutor with PP > 1
    disables checksums (with a warning); 0.33.0's "ray" backend (Ray V2, a
    MultiprocExecutor) stays enabled. Catches disabling every Ray backend, or
    missing the qualname form of a custom executor."""
    on = make_vllm_config(
        model_dir, kv_connector=CARRIER_CONNECTOR_NAME, extra_config={ENABLE_KEY: True}
    )
    view = with_parallel(
        on, pipeline_parallel_size=pp_size, distributed_executor_backend=backend
    )
    assert kv_checksum_enabled(view) is enabled
    warnings = checksum_logs(vllm_caplog, logging.WARNING)
    assert len(warnings) == (0 if enabled else 1)
    if not enabled:
        assert "Ray" in warnings[0].getMessage()


def test_ray_v2_is_a_multiproc_executor() -> None:
    """R14's premise on the installed vLLM: the "ray" backend is RayExecutorV2,
    a MultiprocExecutor subclass (else the "ray" short-cut would be wrong).
    Read from the source: the module needs Ray to import."""
    spec = importlib.util.find_spec("vllm.v1.executor.ray_executor_v2")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    (ray_v2,) = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "RayExecutorV2"
    ]
    assert [ast.unparse(base) for base in ray_v2.bases] == ["MultiprocExecutor"]
    get_class = inspect.getsource(Executor.get_class)
    assert "RayExecutorV2" in get_class


def test_connector_without_carrier(
    model_dir: str, vllm_caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    """R15, R16: a connector without a carrier can verify no load: fail-open
    disables checksums with one warning; fail-closed is a startup error raised
    by the Scheduler. Catches a fail-closed engine silently running
    unverified loads."""
    open_config = make_vllm_config(
        model_dir, kv_connector=TEST_CONNECTOR_NAME, extra_config={ENABLE_KEY: True}
    )
    for _ in range(2):
        assert kv_checksum_enabled(open_config) is False
    scheduler = make_scheduler(open_config, make_kv_cache_config(open_config))
    assert scheduler.kv_checksum_scheduler is None
    warnings = checksum_logs(vllm_caplog, logging.WARNING)
    assert len(warnings) == 1
    assert TEST_CONNECTOR_NAME in warnings[0].getMessage()

    closed_config = make_vllm_config(
        model_dir,
        kv_connector=TEST_CONNECTOR_NAME,
        extra_config={ENABLE_KEY: True, FAIL_CLOSED_KEY: True},
    )
    with pytest.raises(ValueError, match="carrier"):
        kv_checksum_enabled(closed_config)
    with pytest.raises(ValueError, match="carrier"):
        make_scheduler(closed_config, make_kv_cache_config(closed_config))


def _child(connector: str, **extra: Any) -> dict[str, Any]:
    child: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both"}
    if extra:
        child["kv_connector_extra_config"] = extra
    return child


@pytest.mark.parametrize(
    ("connector", "children", "declares"),
    [
        ("NixlConnector", None, True),
        ("NixlPullConnector", None, True),
        ("NixlPushConnector", None, True),
        ("MooncakeConnector", None, True),
        ("MooncakeStoreConnector", None, False),
        (CARRIER_CONNECTOR_NAME, None, True),
        (TEST_CONNECTOR_NAME, None, False),
        ("MultiConnector", ["NixlConnector", TEST_CONNECTOR_NAME], True),
        ("MultiConnector", [TEST_CONNECTOR_NAME, CARRIER_CONNECTOR_NAME], True),
        ("MultiConnector", [TEST_CONNECTOR_NAME, "MooncakeStoreConnector"], False),
        ("MultiConnector", [], False),
        (OFFLOAD_CONNECTOR_NAME, None, True),
        ("MultiConnector", [TEST_CONNECTOR_NAME, OFFLOAD_CONNECTOR_NAME], True),
    ],
    ids=[
        "nixl",
        "nixl-pull",
        "nixl-push",
        "mooncake",
        "mooncake-store",
        "carrier-test",
        "plain-test",
        "multi-nixl",
        "multi-carrier-test",
        "multi-without-carrier",
        "multi-empty",
        "offload-test",
        "multi-offload-test",
    ],
)
def test_connector_declares_carrier(
    connector: str, children: list[str] | None, declares: bool
) -> None:
    """R15, R100, R119: a connector class can verify loads iff it overrides
    `kv_checksum_carrier` or `get_kv_checksum_sources`; a MultiConnector iff
    any configured child does.
    Catches counting the base-class default as a carrier, and a MultiConnector
    judged by its own (delegating) method."""
    extra: dict[str, Any] = {}
    if children is not None:
        extra["connectors"] = [_child(name) for name in children]
    assert connector_declares_carrier(transfer_config(connector, **extra)) is declares


def test_v1_model_runner_rejects_checksums(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R10 (j), R12: the Model Runner V1 unsupported-feature list contains
    "KV checksums" exactly when checksums are on, so V1 refuses to start with
    "Model Runner V1 does not support: KV checksums". Catches V1 engines
    silently running without checksum workers (every load unverified)."""
    on = make_vllm_config(
        model_dir, kv_connector=CARRIER_CONNECTOR_NAME, extra_config={ENABLE_KEY: True}
    )
    off = make_vllm_config(model_dir, kv_connector=CARRIER_CONNECTOR_NAME)
    assert "KV checksums" in on._get_v1_model_runner_unsupported_features()
    assert "KV checksums" not in off._get_v1_model_runner_unsupported_features()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(
        ValueError, match="Model Runner V1 does not support: KV checksums"
    ):
        make_vllm_config(
            model_dir,
            kv_connector=CARRIER_CONNECTOR_NAME,
            extra_config={ENABLE_KEY: True},
        )
    assert not make_vllm_config(
        model_dir, kv_connector=CARRIER_CONNECTOR_NAME
    ).use_v2_model_runner


# --------------------------------------------------------------------------
# 3. Hooks on the real vLLM classes (R10)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_scheduler_init_creates_checksum_scheduler(
    model_dir: str, async_scheduling: bool
) -> None:
    """R10 (a): `Scheduler.__init__` (and the AsyncScheduler's) creates the
    checksum scheduler when enabled, with one worker per TP x PP rank; None
    without the flag or without a connector. Catches a hook that never runs
    (checksums silently off) or that creates one when disabled (R1)."""
    on = make_vllm_config(
        model_dir,
        kv_connector=CARRIER_CONNECTOR_NAME,
        extra_config={ENABLE_KEY: True},
        async_scheduling=async_scheduling,
    )
    scheduler = make_scheduler(on, make_kv_cache_config(on))
    assert isinstance(scheduler, AsyncScheduler if async_scheduling else Scheduler)
    kcs = scheduler.kv_checksum_scheduler
    assert isinstance(kcs, KVChecksumScheduler)
    assert kcs.num_workers == 1 and kcs.fail_closed is False
    assert set(kcs.groups) == set(scheduler.kv_cache_config.transfer_group_ids)

    for kv_connector, extra in ((CARRIER_CONNECTOR_NAME, {}), (None, {})):
        off = make_vllm_config(
            model_dir,
            kv_connector=kv_connector,
            extra_config=extra,
            async_scheduling=async_scheduling,
        )
        assert (
            make_scheduler(off, make_kv_cache_config(off)).kv_checksum_scheduler is None
        )


def test_deferred_load_registered_when_it_starts(model_dir: str) -> None:
    """R10 (d): a load deferred by the scheduler (HiSparse's fence, here set
    by hand on an AsyncScheduler) starts in `_drain_deferred_loads` during a
    later `update_from_output`; its blocks are registered in the next step,
    the same step whose connector metadata carries the load, with the loaded
    token range. Catches loads started outside `schedule()` never checksummed
    (unverified) or registered before vLLM set num_computed_tokens."""
    vllm_config = make_vllm_config(
        model_dir,
        kv_connector=CARRIER_CONNECTOR_NAME,
        extra_config={ENABLE_KEY: True},
        async_scheduling=True,
    )
    scheduler = make_scheduler(vllm_config, make_kv_cache_config(vllm_config))
    assert scheduler.defer_block_free
    scheduler.defer_async_loads = True
    scheduler.add_request(make_request("warm", prompt(20, 500), max_tokens=4))
    first = scheduler.schedule()
    first_model = make_model_runner_output(first, scheduler=scheduler)
    tokens = prompt(45)
    scheduler.add_request(
        make_request("c", tokens, kv_transfer_params=consumer_kv_transfer_params("p"))
    )
    second = scheduler.schedule()  # "c" is admitted, its load deferred
    second_model = make_model_runner_output(second, scheduler=scheduler)
    assert "c" in scheduler.deferred_loads
    assert second.kv_checksum_scheduled is None
    assert second.kv_connector_metadata.loads == {}
    scheduler.update_from_output(first, first_model)  # drains: the load starts
    assert "c" not in scheduler.deferred_loads
    scheduler.update_from_output(second, second_model)
    third = scheduler.schedule()
    (load,) = scheduler.connector.started_loads
    assert set(third.kv_connector_metadata.loads) == {"c"}
    scheduled = third.kv_checksum_scheduled
    assert scheduled is not None and set(scheduled.reqs_to_recv) == {"c"}
    blocks = scheduled.reqs_to_recv["c"]
    assert blocks.num_tokens == len(tokens) - 1 == load.num_external_tokens
    start, ids = blocks.groups[0]
    assert start == 0
    assert list(ids) == load.block_ids[0][: len(ids)]
    assert len(ids) == -(-(len(tokens) - 1) // vllm_config.cache_config.block_size)


# ---- R1: checksums off == plain vLLM ----


def _snapshot_scheduler_output(output: SchedulerOutput) -> dict[str, Any]:
    snap: dict[str, Any] = {}
    for f in dataclasses.fields(output):
        value = getattr(output, f.name)
        if f.name == "scheduled_new_reqs":
            value = [
                (r.req_id, r.prompt_token_ids, r.block_ids, r.num_computed_tokens)
                for r in value
            ]
        snap[f.name] = copy.deepcopy(value)
    snap["kv_checksum_scheduled"] = getattr(output, "kv_checksum_scheduled", None)
    snap["instance_attributes"] = sorted(vars(output))
    return snap


ENGINE_OUTPUT_TIMING_FIELDS = {"events", "prefill_stats", "trace_headers"}


def _snapshot_engine_outputs(outputs: Any) -> list[Any]:
    snap = []
    for client, batch in sorted((outputs or {}).items()):
        entries = [
            {
                name: copy.deepcopy(getattr(out, name))
                for name in out.__struct_fields__
                if name not in ENGINE_OUTPUT_TIMING_FIELDS
            }
            for out in batch.outputs
        ]
        snap.append((client, entries, copy.deepcopy(batch.finished_requests)))
    return snap


def run_scripted_scenario(
    model_dir: str, connector: str, extra: dict[str, Any], async_scheduling: bool
) -> tuple[list[Any], Scheduler]:
    """Producers, consumers (a load finishing, a load failing, an abort while
    loading) and a local request, every SchedulerOutput and EngineCoreOutput
    recorded."""
    vllm_config = make_vllm_config(
        model_dir,
        kv_connector=connector,
        extra_config=extra,
        async_scheduling=async_scheduling,
    )
    scheduler = make_scheduler(vllm_config, make_kv_cache_config(vllm_config))
    trace: list[Any] = []

    def run(**kwargs: Any) -> None:
        output, engine_outputs = step(scheduler, **kwargs)
        trace.append(_snapshot_scheduler_output(output))
        trace.append(_snapshot_engine_outputs(engine_outputs))

    def consumer(req_id: str, length: int, start: int) -> Any:
        return make_request(
            req_id,
            prompt(length, start),
            max_tokens=3,
            kv_transfer_params=consumer_kv_transfer_params(
                f"remote-{req_id}", remote_block_ids=[[1, 2, 3]]
            ),
        )

    scheduler.add_request(
        make_request(
            "p1",
            prompt(40),
            max_tokens=1,
            kv_transfer_params=producer_kv_transfer_params(),
        )
    )
    scheduler.add_request(
        make_request(
            "p2",
            prompt(24, 300),
            max_tokens=3,
            kv_transfer_params=producer_kv_transfer_params(),
        )
    )
    scheduler.add_request(make_request("local", prompt(20, 500), max_tokens=3))
    scheduler.add_request(consumer("c-ok", 50, 600))
    scheduler.add_request(consumer("c-fail", 35, 700))
    scheduler.add_request(consumer("c-abort", 30, 800))
    run()
    scheduler.finish_requests("c-abort", RequestStatus.FINISHED_ABORTED)
    run(kv_connector_output=load_finished("c-ok"))
    run(kv_connector_output=load_failed("c-fail"))
    scheduler.add_request(consumer("c-late", 33, 900))
    run(sampled_token_ids={"local": [7]})
    scheduler.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        run()
    run(kv_connector_output=load_finished("c-late"))
    for _ in range(6):
        run()
    assert scheduler.get_num_unfinished_requests() == 0
    return trace, scheduler


@pytest.mark.parametrize(
    ("connector", "extra"),
    [
        (TEST_CONNECTOR_NAME, {}),
        (CARRIER_CONNECTOR_NAME, {}),
        (CARRIER_CONNECTOR_NAME, {ENABLE_KEY: False, FAIL_CLOSED_KEY: True}),
        (TEST_CONNECTOR_NAME, {ENABLE_KEY: True}),  # no carrier: disabled (R15)
    ],
    ids=["plain", "carrier", "carrier-fail-closed-only", "plain-enabled-no-carrier"],
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_checksums_off_is_plain_vllm(
    model_dir: str, connector: str, extra: dict[str, Any], async_scheduling: bool
) -> None:
    """R1: with checksums off the hooks change no scheduling, output or
    connector message. The same script runs through a Scheduler with the hooks
    installed and through one with every hook removed (vLLM's originals); every
    SchedulerOutput (tokens, block ids, finished ids, connector metadata) and
    every EngineCoreOutput (tokens, finish reasons, kv_transfer_params) must be
    equal, and the hooked scheduler and its connector hold exactly the
    instance attributes of the plain ones (nothing set on vLLM's objects).
    Catches a hook acting while disabled, e.g. an added "kv_checksums" key, a
    SchedulerOutput attribute or a scheduler attribute set when off."""
    hooked, scheduler = run_scripted_scenario(
        model_dir, connector, extra, async_scheduling
    )
    assert scheduler.kv_checksum_scheduler is None  # the class default
    with hooks_removed():
        plain, plain_scheduler = run_scripted_scenario(
            model_dir, connector, extra, async_scheduling
        )
    assert vars(scheduler).keys() == vars(plain_scheduler).keys()
    assert vars(scheduler.connector).keys() == vars(plain_scheduler.connector).keys()
    assert hasattr(Scheduler.__init__, "__kv_checksum_original__")
    assert len(hooked) == len(plain)
    for i, (with_hooks, without) in enumerate(zip(hooked, plain)):
        assert with_hooks == without, f"trace entry {i}"
    # The script exercised what it claims to.
    finished = {
        entry["request_id"]: entry
        for outputs in hooked[1::2]
        for _, entries, _ in outputs
        for entry in entries
        if entry.get("finish_reason") is not None
    }
    assert finished["c-fail"]["finish_reason"] == FinishReason.ERROR
    assert finished["c-ok"]["finish_reason"] == FinishReason.LENGTH
    assert finished["local"]["finish_reason"] == FinishReason.LENGTH
    assert finished["local"]["new_token_ids"] == [100]
    params = finished["p1"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert KV_TRANSFER_PARAMS_KEY not in params
    assert "c-abort" not in finished


# ---- R10 (i), (h): outputs and their aggregation ----


def test_kv_connector_output_with_only_records_is_not_empty() -> None:
    """R10 (i): a KVConnectorOutput holding only checksum records is not empty
    (else `ModelRunnerOutput.with_kv_conn_output_only` drops it on no-forward
    steps and the records are lost); without anything it is empty."""
    assert KVConnectorOutput().is_empty() is True
    output = KVConnectorOutput()
    output.kv_checksums = []  # type: ignore[attr-defined]
    assert output.is_empty() is True
    output.kv_checksums = [KVChecksumRecord(0, 0)]  # type: ignore[attr-defined]
    assert output.is_empty() is False
    kept = ModelRunnerOutput.with_kv_conn_output_only(output)
    assert kept.kv_connector_output is output
    assert KVConnectorOutput(finished_recving={"r"}).is_empty() is False


def _worker_output(*records: Any, finished_recving: set[str] | None = None):
    kv_output = KVConnectorOutput(finished_recving=finished_recving)
    if records:
        kv_output.kv_checksums = list(records)  # type: ignore[attr-defined]
    return ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, kv_connector_output=kv_output
    )


def test_aggregator_concatenates_worker_and_salvaged_records() -> None:
    """R10 (h): `KVOutputAggregator.aggregate` hands the scheduler every
    worker's records and those of outputs salvaged from failed workers
    (`ft_defer_kv_connector_outputs`), each once; vLLM's own aggregation
    (finished counts) is unchanged; a later round without records carries
    none. Catches keeping only the output rank's records (the scheduler then
    sees 1 of W workers and every load is unverified)."""
    a, b, c = (KVChecksumRecord(0, rank) for rank in range(3))
    salvaged = KVChecksumRecord(1, 0)
    aggregator = KVOutputAggregator(expected_finished_count=3)
    salvaged_output = KVConnectorOutput(finished_recving={"r"})
    salvaged_output.kv_checksums = [salvaged]  # type: ignore[attr-defined]
    aggregator.ft_defer_kv_connector_outputs([salvaged_output, None])
    result = aggregator.aggregate(
        [
            _worker_output(a, finished_recving={"r"}),
            _worker_output(b, c, finished_recving={"r"}),
            ModelRunnerOutput(req_ids=[], req_id_to_index={}),
        ]
    )
    kv_output = result.kv_connector_output
    records = kv_output.kv_checksums
    assert sorted((r.pp_rank, r.tp_rank) for r in records) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
    ]
    assert all(sum(r is x for r in records) == 1 for x in (a, b, c, salvaged))
    assert kv_output.finished_recving == {"r"}

    result = aggregator.aggregate([_worker_output(), _worker_output()])
    assert getattr(result.kv_connector_output, "kv_checksums", None) is None
    assert result.kv_connector_output.is_empty()


# ---- R10 (g): Model Runner V2's ActiveKVConnector ----


def test_initialize_kv_cache_exposes_config_for_the_call(
    model_dir: str,
) -> None:
    """R10 (g): the `GPUModelRunner.initialize_kv_cache` hook exposes the
    KVCacheConfig (which 0.33.0 does not pass to get_kv_connector) while vLLM's
    method runs, and resets it afterwards even when the method raises. The real
    method runs on a stand-in runner that records the context variable on its
    first attribute access and then aborts. Catches a config leaking into later
    connectors (another engine's layout) or never set (no checksum worker)."""
    vllm_config = make_vllm_config(model_dir)
    kv_cache_config = make_kv_cache_config(vllm_config)
    seen = []

    class Abort(Exception):
        pass

    class StandInRunner:
        def __getattr__(self, name: str) -> Any:
            seen.append(wiring._kv_cache_config.get())
            raise Abort(name)

    assert wiring._kv_cache_config.get() is None
    with pytest.raises(Abort):
        GPUModelRunner.initialize_kv_cache(StandInRunner(), kv_cache_config)
    assert seen and seen[0] is kv_cache_config
    assert wiring._kv_cache_config.get() is None


@pytest.fixture
def worker_setup(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, cuda_stream_stubs: Any
) -> Any:
    """Builds (vllm_config, kv_cache_config, caches, connector, active) for a
    single-worker engine; `enabled` selects the checksum flag."""
    rank0_groups(monkeypatch)

    def build(enabled: bool) -> SimpleNamespace:
        extra = {ENABLE_KEY: True} if enabled else {}
        return make_active_env(model_dir, SCRIPTED_CONNECTOR_NAME, extra, monkeypatch)

    return build


def _scheduled_send(req_id: str = "p") -> KVChecksumScheduled:
    blocks = KVChecksumBlocks(num_tokens=40, groups={0: (0, np.array([3, 5, 9]))})
    return KVChecksumScheduled(reqs_to_send={req_id: blocks})


def test_active_connector_records_sends_and_received_bytes(worker_setup: Any) -> None:
    """R10 (g), R55, R99: the ActiveKVConnector holds the checksum worker;
    `pre_forward` binds the step's `kv_checksum_scheduled`; `post_forward`
    passes the connector's transfer results (with their `kv_checksums`) and
    the finished ids to the worker and returns `[pending record]` in
    KVConnectorOutput.kv_checksums; pickling the pending record (as the
    worker-to-scheduler queue does) yields the host KVChecksumRecord with the
    same values a directly driven worker computes. Catches an unbound step
    (no send checksummed), received bytes dropped, records not attached, or a
    pending record that cannot cross the process boundary."""
    env = worker_setup(True)
    active = env.active
    worker = active.kv_checksum_worker
    assert worker is not None
    assert worker.topology.tp_rank == 0 and worker.topology.pp_rank == 0

    output = env.empty_output
    output.kv_checksum_scheduled = _scheduled_send()
    active.pre_forward(output)
    assert set(worker._to_send) == {"p"}
    env.connector.scripted.append(
        transfer_results(kv_checksums={"consumer-x": b"producer bytes"})
    )
    active.finish_forward()
    kv_output = active.post_forward(set())
    (pending,) = kv_output.kv_checksums
    assert isinstance(pending, KVChecksumPendingRecord)
    assert not kv_output.is_empty()
    record = pickle.loads(pickle.dumps(kv_output)).kv_checksums[0]
    assert isinstance(record, KVChecksumRecord)
    assert record.received == {"consumer-x": b"producer bytes"}
    assert set(record.checksums) == {"p"}

    direct = create_kv_checksum_worker(
        env.vllm_config,
        env.kv_cache_config,
        env.caches,
        torch.device("cpu"),
        tp_rank=0,
        pp_rank=0,
    )
    direct.bind(_scheduled_send())
    expected = direct.post_forward(None).finalize()
    got, want = record.checksums["p"][0], expected.checksums["p"][0]
    assert got.start == want.start == 0
    np.testing.assert_array_equal(got.values, want.values)
    assert got.values.shape[0] == 3

    # Next step: nothing bound, nothing received -> no record.
    next_output = copy.copy(env.empty_output)
    next_output.kv_checksum_scheduled = None
    active.pre_forward(next_output)
    assert getattr(active.post_forward(set()), "kv_checksums", None) is None


def test_active_connector_no_forward_step(worker_setup: Any) -> None:
    """R10 (g), R47: a step without forward (`no_forward`) binds the step's
    blocks too and its ModelRunnerOutput carries the records, also when the
    connector has nothing else to report. Catches sends of no-forward steps
    lost (the producer then never has every worker's report)."""
    env = worker_setup(True)
    output = env.empty_output
    output.kv_checksum_scheduled = _scheduled_send("nf")
    model_output = env.active.no_forward(output)
    (pending,) = model_output.kv_connector_output.kv_checksums
    assert set(pending.finalize().checksums) == {"nf"}


def test_active_connector_finished_load_uses_transfer_results(
    worker_setup: Any,
) -> None:
    """R10 (g), R48: a load bound in one step is checksummed in the step the
    connector's `get_transfer_results` reports it finished; one reported
    failed is dropped. Catches passing the scheduler's finished ids instead of
    the connector's finished_recving."""
    env = worker_setup(True)
    blocks = KVChecksumBlocks(num_tokens=33, groups={0: (0, np.array([4, 6, 8]))})
    output = env.empty_output
    output.kv_checksum_scheduled = KVChecksumScheduled(
        reqs_to_recv={"load-ok": blocks, "load-bad": blocks}
    )
    env.active.pre_forward(output)
    assert getattr(env.active.post_forward(set()), "kv_checksums", None) is None
    quiet = copy.copy(env.empty_output)
    quiet.kv_checksum_scheduled = None
    env.connector.scripted.append(
        transfer_results(
            finished_recving={"load-ok", "load-bad"}, failed_recving={"load-bad"}
        )
    )
    env.active.pre_forward(quiet)
    (pending,) = env.active.post_forward(set()).kv_checksums
    assert set(pending.finalize().checksums) == {"load-ok"}


def test_active_connector_with_checksums_off(worker_setup: Any) -> None:
    """R1, R10 (g): checksums off -> no checksum worker, and post_forward
    attaches no records even when the connector reports received bytes."""
    env = worker_setup(False)
    assert env.active.kv_checksum_worker is None
    output = env.empty_output
    output.kv_checksum_scheduled = _scheduled_send()
    env.active.pre_forward(output)
    env.connector.scripted.append(transfer_results(kv_checksums={"x": b"1"}))
    kv_output = env.active.post_forward(set())
    assert getattr(kv_output, "kv_checksums", None) is None


# ---- R101: MultiConnector ----


def multi_extra(*children: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"connectors": list(children), **extra}


def make_multi(model_dir: str, role: Any, *children: dict[str, Any]) -> Any:
    """A MultiConnector of `children` with checksums enabled, in `role`."""
    vllm_config = make_vllm_config(
        model_dir,
        kv_connector="MultiConnector",
        extra_config=multi_extra(*children, **{ENABLE_KEY: True}),
    )
    return MultiConnector(vllm_config, role, make_kv_cache_config(vllm_config))


SCRIPTED_CHILDREN = (
    _child(
        SCRIPTED_CONNECTOR_NAME,
        test_carrier_recv="kv_transfer_params",
        test_carrier_send=None,
        test_passive=True,
    ),
    _child(
        SCRIPTED_CONNECTOR_NAME,
        test_carrier_recv="connector",
        test_carrier_send="connector",
    ),
)


def test_multi_connector_carrier_and_sender(model_dir: str) -> None:
    """R101: a load's carrier is the one of the sub-connector chosen to load
    it (not the first with a carrier); a producer request's carrier is the
    first non-None; `send_kv_checksums` goes to that sub-connector only.
    Catches delegating loads to the first child (checksums expected in
    kv_transfer_params a CONNECTOR child never fills) or sending the bytes to
    a child that does not carry them."""
    multi = make_multi(model_dir, KVConnectorRole.SCHEDULER, *SCRIPTED_CHILDREN)
    first, second = multi._connectors
    request = make_request("r", prompt(20))
    assert multi.kv_checksum_carrier(request, True) is None  # no load chosen
    multi._requests_to_connector["r"] = 1
    assert multi.kv_checksum_carrier(request, True) is KVChecksumCarrier.CONNECTOR
    multi._requests_to_connector["r"] = 0
    assert (
        multi.kv_checksum_carrier(request, True) is KVChecksumCarrier.KV_TRANSFER_PARAMS
    )
    assert multi.kv_checksum_carrier(request, False) is KVChecksumCarrier.CONNECTOR
    multi.send_kv_checksums(request, b"payload")
    assert first.sent == {} and second.sent == {"r": b"payload"}

    # The chosen child is the one vLLM's MultiConnector picks for the load.
    consumer = make_request(
        "c", prompt(40), kv_transfer_params=consumer_kv_transfer_params("p")
    )
    assert multi.get_num_new_matched_tokens(consumer, 0) == (39, True)
    assert multi._requests_to_connector["c"] == 1
    assert multi.kv_checksum_carrier(consumer, True) is KVChecksumCarrier.CONNECTOR


def test_multi_connector_offload_methods(model_dir: str) -> None:
    """R101, R119, R121: a MultiConnector's stored-checksum sources and failure
    callback are those of the sub-connector chosen to load the request (none
    before one is chosen); the checksum worker reaches every child. Catches
    the base-class defaults answering for an offloading child."""
    register_carrier_connector()
    multi = make_multi(
        model_dir,
        KVConnectorRole.SCHEDULER,
        _child(SCRIPTED_CONNECTOR_NAME),
        _child(OFFLOAD_CONNECTOR_NAME),
    )
    first, second = multi._connectors
    request = make_request("r", prompt(20))
    assert multi.get_kv_checksum_sources(request) == set()
    multi._requests_to_connector["r"] = 1
    assert multi.get_kv_checksum_sources(request) == {"host"}
    multi.on_kv_checksum_failure(request, {0: [1]})
    assert second.failures == [("r", {0: [1]})]
    multi._requests_to_connector["r"] = 0
    assert multi.get_kv_checksum_sources(request) == set()
    worker = object()
    multi.register_kv_checksum_worker(worker)
    assert second.checksum_worker is worker


def test_multi_connector_merges_received_checksums(model_dir: str) -> None:
    """R99, R101: the worker-side MultiConnector's `get_transfer_results`
    merges its children's `kv_checksums`, the first copy winning, next to
    vLLM's own merge of finished ids; without any the result has none; the
    capture is installed once, by `register_kv_checksum_worker` (only called
    with checksums on). Catches received bytes of a second child dropped."""
    multi = make_multi(
        model_dir,
        KVConnectorRole.WORKER,
        _child(SCRIPTED_CONNECTOR_NAME),
        _child(SCRIPTED_CONNECTOR_NAME),
    )
    first, second = multi._connectors
    multi.register_kv_checksum_worker(object())
    capture = (
        vars(first)["get_transfer_results"],
        vars(second)["get_transfer_results"],
    )
    first.scripted.append(
        transfer_results({"a"}, kv_checksums={"a": b"first-a", "b": b"first-b"})
    )
    second.scripted.append(
        transfer_results({"c"}, kv_checksums={"b": b"second-b", "c": b"second-c"})
    )
    results = multi.get_transfer_results(set())
    assert results.finished_recving == {"a", "c"}
    assert results.kv_checksums == {
        "a": b"first-a",
        "b": b"first-b",
        "c": b"second-c",
    }
    results = multi.get_transfer_results(set())
    assert getattr(results, "kv_checksums", None) is None
    multi.register_kv_checksum_worker(object())  # idempotent
    assert capture == (
        vars(first)["get_transfer_results"],
        vars(second)["get_transfer_results"],
    )


# ---- Issue 20: hooks are exact pass-throughs when off, never raise when on ----


def test_multi_connector_off_leaves_mock_children_alone(model_dir: str) -> None:
    """R1, R101 (regression, issue 20): with checksums off (no checksum worker
    registered) MultiConnector.get_transfer_results is vLLM's own. Children
    that are `MagicMock(spec_set=KVConnectorBase_V1)`, as in vLLM's
    test_multi_connector.py, answer every call, and no attribute of a child
    is set or deleted. Failed before the fix (checked by reverting it): the
    hook wrapped every child and deleted the wrapper after each call, which on
    a spec_set mock deletes the mock's own attribute, so the second call
    raised AttributeError."""
    vllm_config = make_vllm_config(
        model_dir,
        kv_connector="MultiConnector",
        extra_config=multi_extra(
            _child(SCRIPTED_CONNECTOR_NAME), _child(SCRIPTED_CONNECTOR_NAME)
        ),
    )
    multi = MultiConnector(
        vllm_config, KVConnectorRole.WORKER, make_kv_cache_config(vllm_config)
    )
    children = []
    for finished in ({"a"}, {"b"}):
        child = mock.MagicMock(spec_set=KVConnectorBase_V1)
        child.get_transfer_results.return_value = transfer_results(finished)
        children.append(child)
    multi._connectors = children
    before = [dict(vars(child)) for child in children]
    for _ in range(3):
        results = multi.get_transfer_results({"x"})
        assert results.finished_recving == {"a", "b"}
        assert getattr(results, "kv_checksums", None) is None
    for child, attributes in zip(children, before):
        assert vars(child) == attributes
        assert child.get_transfer_results.call_count == 3
    assert "_kv_checksum_received" not in vars(multi)


def test_kv_connector_prom_with_a_partial_config_never_raises(
    vllm_caplog: pytest.LogCaptureFixture,
    fresh_warnings: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R11, R130, R134 (regression, issue 20): vLLM's KVConnectorProm built
    from a partial config (a namespace holding only kv_transfer_config, as in
    vLLM's test_mooncake_stats.py) with checksums on builds vLLM's metrics and
    never raises: `kv_checksum_enabled` needs nothing but the KV transfer
    config, and an error while building the checksum counters is logged once
    and leaves them out. Failed before the fix (checked by reverting it):
    `kv_checksum_enabled` read `vllm_config.parallel_config` first and the
    AttributeError escaped vLLM's constructor."""
    from vllm.distributed.kv_transfer.kv_checksum.engine.prom_metrics import (
        KVChecksumPromMetrics,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorProm,
    )

    def partial(connector: str) -> SimpleNamespace:
        return SimpleNamespace(
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector,
                kv_role="kv_producer",
                kv_connector_extra_config={ENABLE_KEY: True},
            )
        )

    labels = {"labelnames": ["model_name", "engine"]}
    engines = {0: ["model", "0"]}
    # No carrier: disabled (one warning).
    prom = KVConnectorProm(
        partial(TEST_CONNECTOR_NAME), **labels, per_engine_labelvalues=engines
    )
    assert prom.prom_metrics is None and prom.kv_checksum_metrics is None
    assert "kv_checksum_metrics" not in vars(prom)
    # A carrier: enabled without any parallel config.
    assert kv_checksum_enabled(partial(CARRIER_CONNECTOR_NAME)) is True

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(KVChecksumPromMetrics, "for_connector_prom", broken)
    vllm_caplog.clear()
    prom = KVConnectorProm(
        partial(CARRIER_CONNECTOR_NAME), **labels, per_engine_labelvalues=engines
    )
    assert prom.kv_checksum_metrics is None
    assert len(checksum_logs(vllm_caplog, logging.ERROR)) == 1


# The checksum scheduler's methods each scheduler hook calls, made to raise.
FAILING_SCHEDULER_METHODS = [
    "on_new_request",  # Scheduler.add_request
    "build_checksum_meta",  # Scheduler._update_after_schedule
    "update_from_output",  # Scheduler.update_from_output
    "request_finished",  # Scheduler._connector_finished
]


def _without_checksum_fields(trace: list[Any]) -> list[Any]:
    """A scenario trace less what checksums on may add before they fail."""
    stripped = []
    for entry in trace:
        if isinstance(entry, dict):
            entry = {
                k: v
                for k, v in entry.items()
                if k not in ("kv_checksum_scheduled", "instance_attributes")
            }
        stripped.append(entry)
    return stripped


@pytest.mark.parametrize("method", FAILING_SCHEDULER_METHODS)
def test_scheduler_hook_error_disables_checksums(
    model_dir: str,
    method: str,
    monkeypatch: pytest.MonkeyPatch,
    vllm_caplog: pytest.LogCaptureFixture,
) -> None:
    """R10 (b, c, e, f), R134 (issue 20): an exception from checksum code in a
    scheduler hook never reaches vLLM. The scenario of
    `test_checksums_off_is_plain_vllm` runs with checksums on and one
    KVChecksumScheduler method raising: the engine's outputs equal those of
    plain vLLM (hooks removed), the checksum scheduler is off afterwards, and
    exactly one error is logged. Catches an escaping exception (the engine
    would die) and a guard that also swallows or changes vLLM's own result.
    Failed before the fix (no guard: the injected error escaped)."""
    extra = {ENABLE_KEY: True}
    calls = []

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(method)
        raise RuntimeError(f"injected into {method}")

    monkeypatch.setattr(KVChecksumScheduler, method, broken)
    hooked, scheduler = run_scripted_scenario(
        model_dir, CARRIER_CONNECTOR_NAME, extra, False
    )
    assert calls == [method]
    assert scheduler.kv_checksum_scheduler is None
    errors = checksum_logs(vllm_caplog, logging.ERROR)
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].exc_info is not None
    with hooks_removed():
        plain, _ = run_scripted_scenario(
            model_dir, CARRIER_CONNECTOR_NAME, extra, False
        )
    assert _without_checksum_fields(hooked) == _without_checksum_fields(plain)


@pytest.mark.parametrize("where", ["enabled", "create"])
def test_scheduler_creation_error_leaves_checksums_off(
    model_dir: str,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    vllm_caplog: pytest.LogCaptureFixture,
) -> None:
    """R10 (a), R134 (issue 20): an error while reading the configuration
    (other than the ValueError of invalid flags) or creating the checksum
    scheduler leaves the vLLM Scheduler working with checksums off and one
    error log; invalid flags still fail the start (R8, see
    test_non_boolean_flag_fails_scheduler_start). Catches the engine failing
    to start over a checksum bug."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected")

    if where == "enabled":
        monkeypatch.setattr(wiring, "kv_checksum_enabled", broken)
    else:
        monkeypatch.setattr(KVChecksumScheduler, "create", broken)
    vllm_config = make_vllm_config(
        model_dir, kv_connector=CARRIER_CONNECTOR_NAME, extra_config={ENABLE_KEY: True}
    )
    scheduler = make_scheduler(vllm_config, make_kv_cache_config(vllm_config))
    assert scheduler.kv_checksum_scheduler is None
    assert len(checksum_logs(vllm_caplog, logging.ERROR)) == 1
    scheduler.add_request(make_request("local", prompt(20), max_tokens=2))
    for _ in range(3):
        step(scheduler)
    assert scheduler.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("where", ["create", "bind", "post_forward"])
def test_active_connector_error_disables_checksums(
    worker_setup: Any,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    vllm_caplog: pytest.LogCaptureFixture,
) -> None:
    """R10 (g), R134 (issue 20): an exception from the checksum worker (while
    it is created, in pre_forward's bind, in post_forward) never reaches Model
    Runner V2: the ActiveKVConnector is built and its pre_forward and
    post_forward return vLLM's own results, without checksum records; the
    checksum worker is off afterwards; one error is logged. The first output
    after the error carries one "checksums disabled" record for the
    scheduler, later ones nothing (issue 32). Catches a worker whose
    checksum bug kills the engine."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"injected into {where}")

    if where == "create":
        monkeypatch.setattr(wiring_worker, "create_kv_checksum_worker", broken)
    env = worker_setup(True)
    active = env.active
    if where == "create":
        assert active.kv_checksum_worker is None
    else:
        monkeypatch.setattr(active.kv_checksum_worker, where, broken)
    output = env.empty_output
    output.kv_checksum_scheduled = _scheduled_send()
    active.pre_forward(output)
    env.connector.scripted.append(
        transfer_results({"r"}, kv_checksums={"r": b"producer bytes"})
    )
    active.finish_forward()
    kv_output = active.post_forward(set())
    assert kv_output.finished_recving == {"r"}
    assert kv_output.kv_checksums == [
        KVChecksumRecord(pp_rank=0, tp_rank=0, disabled=True)
    ]
    assert active.kv_checksum_worker is None
    assert len(checksum_logs(vllm_caplog, logging.ERROR)) == 1
    # From now on a pass-through.
    active.pre_forward(output)
    later = active.post_forward(set())
    assert later is not None
    assert getattr(later, "kv_checksums", None) is None
    assert len(checksum_logs(vllm_caplog, logging.ERROR)) == 1


def test_active_connector_carries_offload_tier_off_record(
    worker_setup: Any,
) -> None:
    """R134 (issue 32): after an offload connector's worker side failed on
    this worker (its guard's `_disable_offload_worker`), the next output of
    the real ActiveKVConnector carries one "offload tier off" record (host
    source) for the scheduler, later outputs none, and the worker's own
    checksums stay on. Catches a marker never sent (the scheduler keeps
    counting the tier's loads verified on the other ranks' entries alone)
    or sent every step."""
    env = worker_setup(True)
    active = env.active
    worker = active.kv_checksum_worker
    connector = SimpleNamespace(side=SimpleNamespace(checksum_worker=worker))
    wiring_offloading._disable_offload_worker(connector, "side", "load")
    assert connector.side is None
    outputs = []
    for _ in range(2):
        active.pre_forward(env.empty_output)
        env.connector.scripted.append(transfer_results())
        active.finish_forward()
        outputs.append(active.post_forward(set()))
    assert outputs[0].kv_checksums == [
        KVChecksumRecord(pp_rank=0, tp_rank=0, disabled_sources=("host",))
    ]
    assert getattr(outputs[1], "kv_checksums", None) is None
    assert active.kv_checksum_worker is worker


def test_active_connector_off_sets_nothing(worker_setup: Any) -> None:
    """R1, R10 (g) (issue 20): with checksums off the ActiveKVConnector and its
    connector hold exactly vLLM's own instance attributes after init and a
    step (the checksum fields are class defaults). Catches a hook that sets
    or wraps anything on vLLM's objects while disabled."""
    env = worker_setup(False)
    active = env.active
    assert active.kv_checksum_worker is None
    assert not any("checksum" in name for name in vars(active))
    assert "get_transfer_results" not in vars(env.connector)
    active.pre_forward(env.empty_output)
    active.post_forward(set())
    assert not any("checksum" in name for name in vars(active))


# ---- Everything together: producer -> consumer through the real classes ----


class Engine:
    """One single-worker engine: a real Scheduler, a real ActiveKVConnector
    over CPU KV caches, the worker-to-scheduler pickle and KVOutputAggregator,
    stepped the way EngineCore and Model Runner V2 step them."""

    def __init__(
        self,
        model_dir: str,
        monkeypatch: pytest.MonkeyPatch,
        connector: str,
        extra: dict[str, Any],
        seed: int,
        policy: Literal["fail", "recompute"] = "fail",
    ) -> None:
        self.vllm_config = make_vllm_config(
            model_dir,
            kv_connector=connector,
            extra_config=extra,
            kv_load_failure_policy=policy,
        )
        self.scheduler = make_scheduler(
            self.vllm_config, make_kv_cache_config(self.vllm_config)
        )
        kv_cache_config = make_kv_cache_config(self.vllm_config, pp_rank=0)
        self.caches = make_kv_caches(kv_cache_config, seed=seed)
        self.connector = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        self.active = make_active_connector(
            self.vllm_config, kv_cache_config, self.connector, self.caches, monkeypatch
        )
        self.aggregator = KVOutputAggregator(expected_finished_count=1)
        self.final: dict[str, Any] = {}
        self.history: list[SchedulerOutput] = []

    def step(self) -> SchedulerOutput:
        scheduler = self.scheduler
        output = scheduler.schedule()
        self.history.append(output)
        model_output = make_model_runner_output(output, scheduler=scheduler)
        if output.total_num_scheduled_tokens > 0:
            self.active.pre_forward(output)
            self.active.finish_forward()
            model_output.kv_connector_output = self.active.post_forward(
                output.finished_req_ids
            )
        else:
            model_output = self.active.no_forward(output)
        # Worker -> executor (pickled message queue) -> aggregation.
        model_output = pickle.loads(pickle.dumps(model_output))
        aggregated = self.aggregator.aggregate([model_output])
        for out in iter_engine_core_outputs(
            scheduler.update_from_output(output, aggregated)
        ):
            if out.finish_reason is not None:
                self.final[out.request_id] = out
        return output

    def run(self, req_id: str, max_steps: int = 12) -> Any:
        for _ in range(max_steps):
            if req_id in self.final:
                return self.final[req_id]
            self.step()
        raise AssertionError(f"{req_id} did not finish")


def _last_child(connector: Any) -> Any:
    """The connector itself, or a MultiConnector's carrying (last) child."""
    if isinstance(connector, MultiConnector):
        return connector._connectors[-1]
    return connector


def _block_ids(ids: Any) -> list[int]:
    return list(ids[0]) if ids and isinstance(ids[0], (list, tuple)) else list(ids)


@pytest.mark.parametrize(
    ("kind", "corrupt", "fail_closed"),
    [
        ("carrier", False, False),
        ("carrier", True, True),
        ("carrier", True, False),
        ("multi", False, True),
        ("multi", True, True),
    ],
    ids=[
        "params-verified",
        "params-mismatch-fail-closed",
        "params-mismatch-fail-open",
        "multi-connector-verified",
        "multi-connector-mismatch",
    ],
)
def test_producer_to_consumer_through_the_hooks(
    model_dir: str,
    monkeypatch: pytest.MonkeyPatch,
    cuda_stream_stubs: Any,
    kind: str,
    corrupt: bool,
    fail_closed: bool,
) -> None:
    """R10 (a)-(h), R4, R73, R74, R99, R101 end to end: a producer engine
    checksums its prompt in the step that finishes it (hook c), its worker
    record crosses pickling and aggregation, the finished request's payload
    goes into kv_transfer_params (hook f; "carrier") or to the MultiConnector's
    CONNECTOR child (`send_kv_checksums`; "multi"). The consumer engine
    registers the load in the step it starts (hook d), its worker checksums the
    blocks when the connector reports the load finished (and, for "multi",
    receives the producer's bytes through the children's transfer results),
    and the scheduler verifies before the request runs (hook e): identical KV
    verifies; a flipped byte is a mismatch that fails the request under
    fail-closed (kv_load_failure_policy "fail") and is only counted fail-open.
    Catches any hook in the chain not wired to the next."""
    if kind == "carrier":
        connector, extra = SCRIPTED_CONNECTOR_NAME, {ENABLE_KEY: True}
    else:
        connector = "MultiConnector"
        extra = multi_extra(*SCRIPTED_CHILDREN, **{ENABLE_KEY: True})
    extra[FAIL_CLOSED_KEY] = fail_closed
    rank0_groups(monkeypatch)
    producer = Engine(model_dir, monkeypatch, connector, extra, seed=1)
    tokens = prompt(40)
    producer.scheduler.add_request(
        make_request(
            "p", tokens, max_tokens=1, kv_transfer_params=producer_kv_transfer_params()
        )
    )
    final = producer.run("p")
    assert final.finish_reason == FinishReason.LENGTH
    params = dict(final.kv_transfer_params)
    sent = _last_child(producer.scheduler.connector).sent
    if kind == "carrier":
        encoded = params[KV_TRANSFER_PARAMS_KEY]
        payload = KVChecksumPayload.from_base64(encoded)
        assert sent == {}
    else:
        assert KV_TRANSFER_PARAMS_KEY not in params
        payload = KVChecksumPayload.from_bytes(sent["p"])
    assert payload is not None
    assert producer.scheduler.kv_checksum_scheduler.stats.sent == 1

    consumer = Engine(model_dir, monkeypatch, connector, extra, seed=2)
    consumer.scheduler.add_request(
        make_request("c", tokens, max_tokens=2, kv_transfer_params=params)
    )
    first = consumer.step()
    assert first.kv_checksum_scheduled is not None
    assert set(first.kv_checksum_scheduled.reqs_to_recv) == {"c"}
    request = consumer.scheduler.requests["c"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = _last_child(consumer.scheduler.connector).started_loads
    source = _block_ids(params["remote_block_ids"])
    target = _block_ids(load.block_ids)
    for name, cache in consumer.caches.items():
        for src, dst in zip(source, target):
            cache[dst].copy_(producer.caches[name][src])
    if corrupt:
        first_layer = next(iter(consumer.caches.values()))
        first_layer.view(torch.uint8)[target[0], 0, 0, 5] ^= 0x20

    received = {"c": sent["p"]} if kind == "multi" else None
    _last_child(consumer.connector).scripted.append(
        transfer_results({"c"}, kv_checksums=received)
    )
    consumer.step()
    final = consumer.run("c")
    stats = consumer.scheduler.kv_checksum_scheduler.stats
    if not corrupt:
        assert stats.loads == {KVChecksumStatus.VERIFIED.value: 1}
        assert final.finish_reason == FinishReason.LENGTH
    else:
        assert stats.loads == {KVChecksumStatus.MISMATCH.value: 1}
        expected = FinishReason.ERROR if fail_closed else FinishReason.LENGTH
        assert final.finish_reason == expected


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_worker_guard_trip_leaves_fail_closed_loads_running(
    model_dir: str,
    monkeypatch: pytest.MonkeyPatch,
    cuda_stream_stubs: Any,
    vllm_caplog: pytest.LogCaptureFixture,
    policy: Literal["fail", "recompute"],
) -> None:
    """R4, R134 (issue 32): the consumer worker's checksum code raises in
    post_forward while a fail-closed load is in flight, so the real
    ActiveKVConnector guard turns that worker's checksums off. Its output
    tells the scheduler, which drops the load's check and registers no later
    load: that load and two later fault-free loads all finish normally (no
    error under policy "fail", no recomputed prompt under "recompute"), with
    no verdict; one scheduler error log and `disabled_workers` count it.
    Catches a scheduler still expecting the disabled worker's records: every
    such load ends unverified ("not all workers"), so fail-closed fails it
    (an outage of the P/D path)."""
    rank0_groups(monkeypatch)
    producer = Engine(
        model_dir, monkeypatch, SCRIPTED_CONNECTOR_NAME, {ENABLE_KEY: True}, seed=1
    )
    prompts = [prompt(40, start=3 + 100 * i) for i in range(3)]
    params = []
    for i, tokens in enumerate(prompts):
        producer.scheduler.add_request(
            make_request(
                f"p{i}",
                tokens,
                max_tokens=1,
                kv_transfer_params=producer_kv_transfer_params(),
            )
        )
        params.append(dict(producer.run(f"p{i}").kv_transfer_params))
    extra = {ENABLE_KEY: True, FAIL_CLOSED_KEY: True}
    consumer = Engine(
        model_dir, monkeypatch, SCRIPTED_CONNECTOR_NAME, extra, seed=2, policy=policy
    )
    kcs = consumer.scheduler.kv_checksum_scheduler

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected into the checksum worker's post_forward")

    monkeypatch.setattr(consumer.active.kv_checksum_worker, "post_forward", broken)
    for i, tokens in enumerate(prompts):
        req_id = f"c{i}"
        consumer.scheduler.add_request(
            make_request(req_id, tokens, max_tokens=2, kv_transfer_params=params[i])
        )
        first = consumer.step()
        registered = first.kv_checksum_scheduled is not None
        assert registered == (i == 0)  # nothing registered after the trip
        (load,) = [
            r
            for r in _last_child(consumer.scheduler.connector).started_loads
            if r.request_id == req_id
        ]
        source = _block_ids(params[i]["remote_block_ids"])
        for name, cache in consumer.caches.items():
            for src, dst in zip(source, _block_ids(load.block_ids)):
                cache[dst].copy_(producer.caches[name][src])
        _last_child(consumer.connector).scripted.append(transfer_results({req_id}))
        final = consumer.run(req_id)
        assert final.finish_reason == FinishReason.LENGTH
        computed = sum(o.num_scheduled_tokens.get(req_id, 0) for o in consumer.history)
        assert computed == len(tokens) - load.num_external_tokens + 1  # no recompute
    assert consumer.active.kv_checksum_worker is None
    assert kcs.disabled_workers == {(0, 0)}
    assert kcs.stats.disabled_workers == 1
    assert not kcs.stats.loads  # no verdict, as with checksums off
    disabled = [
        r
        for r in checksum_logs(vllm_caplog, logging.ERROR)
        if "disabled on worker" in r.getMessage()
    ]
    assert len(disabled) == 1


def test_fresh_process_plugin_lifecycle(fresh_process: subprocess.Popen) -> None:
    """R7 in a fresh interpreter (started with this module): importing the
    package patches nothing; register() on a wrong vLLM version logs one
    error and patches nothing at all; vLLM's `load_general_plugins()` then
    installs the hooks, and a second register() keeps them (no double wrap).
    Catches patching at import time and partial patching before the version
    check, which the in-process tests cannot see once hooks are installed."""
    out, _ = fresh_process.communicate(timeout=900)
    assert fresh_process.returncode == 0, out[-4000:]
    assert "FRESH-PROCESS-OK" in out


def test_R134_guard_turns_off_on_errors_and_lets_interrupts_through() -> None:
    """R134: the hooks' last-resort guard swallows an Exception and calls its
    `disable` once with the owner, attribute and place; a BaseException
    (KeyboardInterrupt, SystemExit) and a clean exit never disable. Bugs
    caught (tried): the guard swallowing BaseExceptions (an interrupt that
    cannot stop the engine), and disabling on a clean exit."""
    from vllm.distributed.kv_transfer.kv_checksum.wiring import _guard

    calls: list[tuple] = []
    owner = object()

    def disable(*args: object) -> None:
        calls.append(args)

    with _guard(owner, "kv_checksum_worker", "step", disable):
        pass
    assert calls == []
    with _guard(owner, "kv_checksum_worker", "step", disable):
        raise ValueError("checksum bug")
    assert calls == [(owner, "kv_checksum_worker", "step")]
    with (
        pytest.raises(KeyboardInterrupt),
        _guard(owner, "kv_checksum_worker", "step", disable),
    ):
        raise KeyboardInterrupt
    assert len(calls) == 1
