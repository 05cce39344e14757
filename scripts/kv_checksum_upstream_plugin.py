# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""pytest plugin for running vLLM's own tests with the KV checksum plugin.

Loaded by scripts/upstream_tests.sh with ``-p kv_checksum_upstream_plugin``;
the mode comes from the environment variable KV_CHECKSUM_UPSTREAM_MODE:

- ``none``: the plugin is not loaded: its entry point is filtered out of
  ``importlib.metadata.entry_points()``, so vLLM's plugin loader never sees
  it (VLLM_PLUGINS stays unset: vLLM's test_scheduler_kv_connector_override.py
  loads a plugin of its own through that loader, which an allow-list without
  its name would refuse); at the end this module checks that the hooks were
  never installed.
- ``off``: vLLM's general plugins are loaded before the first test, as in
  every engine process, so every hook is installed; checksums stay off.
- ``on``: as ``off``, and every KVTransferConfig with a connector gets
  ``enable_kv_checksum: true`` in its kv_connector_extra_config (fail-open)
  unless the test set the flag itself: a new dict, the caller's is not
  mutated.

In every mode, unless KV_CHECKSUM_UPSTREAM_EXACT_CLEANUP=1, the
`gc.collect()` inside vLLM's `cleanup_dist_env_and_memory` (run after every
test by tests/conftest.py's `cleanup_fixture` and by `dist_init`) is skipped:
on a 2-core machine it took nearly all of the run time. Everything else of
vLLM's cleanup runs, and Python's automatic collection still frees cycles.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pytest

MODE_VARIABLE = "KV_CHECKSUM_UPSTREAM_MODE"
EXACT_CLEANUP_VARIABLE = "KV_CHECKSUM_UPSTREAM_EXACT_CLEANUP"
MODES = ("none", "off", "on")
ENABLE_KEY = "enable_kv_checksum"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "kv_checksum"


PACKAGE_VARIABLE = "KV_CHECKSUM_UPSTREAM_PACKAGE"
PACKAGE = "vllm.distributed.kv_transfer.kv_checksum"


def _use_package_copy() -> None:
    """Import the package from $KV_CHECKSUM_UPSTREAM_PACKAGE (e.g. the
    kv_checksum folder of a `git archive` of one commit) instead of the
    editable install's checkout: the editable finder's mapping is redirected
    before anything imports the package."""
    folder = os.environ.get(PACKAGE_VARIABLE)
    if not folder:
        return
    if PACKAGE in sys.modules:
        raise RuntimeError(f"{PACKAGE} was imported before {PACKAGE_VARIABLE} applied")
    finders = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("__editable___vllm_kv_checksum")
        and isinstance(getattr(m, "MAPPING", None), dict)
    ]
    if not finders:
        raise RuntimeError(f"{PACKAGE_VARIABLE} needs the editable install's finder")
    for finder in finders:
        finder.MAPPING[PACKAGE] = os.path.abspath(folder)


_use_package_copy()


def _mode() -> str:
    mode = os.environ.get(MODE_VARIABLE, "")
    if mode not in MODES:
        raise pytest.UsageError(f"{MODE_VARIABLE} must be one of {MODES}, not {mode!r}")
    return mode


def _force_checksums_on() -> None:
    from vllm.config import KVTransferConfig

    original = KVTransferConfig.__post_init__

    def __post_init__(self: KVTransferConfig) -> None:
        original(self)
        extra = self.kv_connector_extra_config
        if self.kv_connector is not None and ENABLE_KEY not in extra:
            self.kv_connector_extra_config = {**extra, ENABLE_KEY: True}

    KVTransferConfig.__post_init__ = __post_init__  # type: ignore[method-assign]


def _hide_entry_point() -> None:
    import importlib.metadata as metadata

    original = metadata.entry_points

    def entry_points(**params: object) -> metadata.EntryPoints:
        found = original(**params)  # type: ignore[arg-type]
        return metadata.EntryPoints(
            e for e in found if (e.group, e.name) != (PLUGIN_GROUP, PLUGIN_NAME)
        )

    metadata.entry_points = entry_points  # type: ignore[assignment]


# What the hooks did in this session (mode on): checksum schedulers and
# workers created, hook errors contained (R134). Written as JSON to
# $KV_CHECKSUM_UPSTREAM_STATS at the end, and shown in the terminal summary.
_stats = {"schedulers": 0, "workers": 0, "contained_errors": 0}


def _count_checksum_objects() -> None:
    from vllm.distributed.kv_transfer.kv_checksum import wiring
    from vllm.distributed.kv_transfer.kv_checksum.engine import guard
    from vllm.distributed.kv_transfer.kv_checksum.wiring import (  # noqa: F401
        scheduler,
        worker,
    )

    # Each wiring module that binds the name gets its own counting wrapper;
    # the hooks' guard (engine/guard.py) calls its own disable_after_error.
    modules = [
        module
        for name, module in list(sys.modules.items())
        if name == wiring.__name__ or name.startswith(wiring.__name__ + ".")
    ] + [guard]

    def counting(name: str, key: str) -> None:
        for module in modules:
            original = getattr(module, name, None)
            if original is None:
                continue

            def call(
                *args: object, _original: Any = original, **kwargs: object
            ) -> object:
                result = _original(*args, **kwargs)
                if result is not None or key == "contained_errors":
                    _stats[key] += 1
                return result

            setattr(module, name, call)

    counting("create_kv_checksum_scheduler", "schedulers")
    counting("_create_worker", "workers")
    counting("_disable_after_error", "contained_errors")  # wiring's own calls
    counting("disable_after_error", "contained_errors")  # the guard's


def _hooks_installed() -> bool:
    wiring = sys.modules.get("vllm.distributed.kv_transfer.kv_checksum.wiring")
    return bool(getattr(wiring, "_installed", False))


def _skip_cleanup_gc_collect() -> None:
    import gc
    import types

    from vllm.distributed import parallel_state

    parallel_state.gc = types.SimpleNamespace(  # type: ignore[assignment]
        collect=lambda *args, **kwargs: 0, unfreeze=gc.unfreeze
    )


def pytest_configure(config: pytest.Config) -> None:
    mode = _mode()
    if os.environ.get(EXACT_CLEANUP_VARIABLE) != "1":
        _skip_cleanup_gc_collect()
    if mode == "none":
        _hide_entry_point()
        return
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    if not _hooks_installed():
        raise pytest.UsageError(
            "the kv_checksum plugin did not install its hooks (is "
            "vllm-kv-checksum installed?)"
        )
    if mode == "on":
        _force_checksums_on()
        _count_checksum_objects()


def pytest_terminal_summary(terminalreporter: object) -> None:
    if _mode() != "on":
        return
    line = ", ".join(f"{k} {v}" for k, v in _stats.items())
    print(f"\nkv_checksum (checksums forced on): {line}")
    path = os.environ.get("KV_CHECKSUM_UPSTREAM_STATS")
    if path:
        with open(path, "w") as f:
            json.dump(_stats, f)


def pytest_report_header(config: pytest.Config) -> str:
    spec = importlib.util.find_spec(PACKAGE)
    where = spec.submodule_search_locations if spec else None
    return f"kv_checksum upstream mode: {_mode()}; package: {where}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _mode() == "none" and _hooks_installed():
        print("\nERROR: the kv_checksum hooks were installed in mode 'none'")
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
