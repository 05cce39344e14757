# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin on a vLLM with KV checksums built in installs nothing (R146).

The in-tree patch series (upstream/) makes `enable_kv_checksum` a field of
vLLM's KVTransferConfig. Here a native config class is simulated with vLLM's
own `@config` decorator, as the series declares its fields.
"""

from __future__ import annotations

import logging
from unittest import mock

import pytest
from pydantic import Field

import vllm.config
from vllm.config.utils import config
from vllm.distributed.kv_transfer.kv_checksum import plugin, wiring


@config
class NativeKVTransferConfig:
    """KVTransferConfig as the patch series' first commit declares it (a
    validated field with a pydantic Field default)."""

    kv_connector: str | None = None
    enable_kv_checksum: bool = Field(default=False, strict=True)


@pytest.fixture
def fresh_register(monkeypatch: pytest.MonkeyPatch) -> mock.MagicMock:
    """register() as in a fresh process, with wiring.install() recorded."""
    monkeypatch.setattr(plugin, "_registered", False)
    install = mock.MagicMock()
    monkeypatch.setattr(wiring, "install", install)
    return install


def test_vllm_0_33_0_has_no_native_kv_checksums() -> None:
    """R146. Catches a detection that is always true (the released vLLM would
    get no checksums at all), e.g. one looking for a name 0.33.0 has."""
    assert not plugin._vllm_has_native_kv_checksums()


def test_native_field_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """R146. Catches a detection that reads the field's value rather than its
    presence: `getattr(KVTransferConfig, "enable_kv_checksum", False)` is the
    field's default, False."""
    monkeypatch.setattr(vllm.config, "KVTransferConfig", NativeKVTransferConfig)
    assert plugin._vllm_has_native_kv_checksums()


def test_register_installs_nothing_on_native_vllm(
    fresh_register: mock.MagicMock,
    monkeypatch: pytest.MonkeyPatch,
    vllm_caplog: pytest.LogCaptureFixture,
) -> None:
    """R146. Catches register() still installing its hooks over a vLLM that
    has the subsystem built in (two checksum implementations on one engine),
    also when that vLLM is not 0.33.0 (the version check must not run first
    and log an error for a vLLM that needs no plugin)."""
    monkeypatch.setattr(vllm.config, "KVTransferConfig", NativeKVTransferConfig)
    monkeypatch.setattr(plugin, "_installed_vllm_version", lambda: "0.34.0")
    with vllm_caplog.at_level(logging.INFO):
        plugin.register()
    fresh_register.assert_not_called()
    assert "built in" in vllm_caplog.text
    assert not [r for r in vllm_caplog.records if r.levelno >= logging.ERROR]


def test_register_installs_on_vllm_0_33_0(fresh_register: mock.MagicMock) -> None:
    """R146. Catches the native check disabling the plugin on the released
    vLLM it exists for."""
    plugin.register()
    fresh_register.assert_called_once_with()


def test_flags_read_from_native_fields() -> None:
    """R146: on a vLLM with the series the settings are KVTransferConfig fields
    (validated there, the extra-config spelling mapped onto them), and the
    subsystem reads the fields, not kv_connector_extra_config. Reference: the
    field values set by hand. Bugs caught: the flags read from the extra config
    only (every native deployment unchecked), the nested fault config's kinds
    or seed dropped, the host-fault setting (still an extra-config key of the
    offload tiers) or the external-load settings (extra-config keys until
    their series commit) lost."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_checksum.config import (
        FaultInjectionConfig,
        read_flags,
    )

    native = SimpleNamespace(
        enable_kv_checksum=True,
        kv_checksum_fail_closed=True,
        kv_checksum_max_payload_bytes=4096,
        kv_checksum_verify_prefix_hits=True,
        kv_checksum_fault_injection=SimpleNamespace(
            rate=0.5, kinds=["zero_block"], seed=7
        ),
        kv_connector_extra_config={
            "enable_kv_checksum": False,
            "kv_checksum_host_fault_injection": {"rate": 1, "kinds": ["host_bit_flip"]},
            "kv_checksum_verify_external_loads": True,
            "kv_checksum_external_entry_limit": 64,
        },
    )
    flags = read_flags(native)
    assert flags.enabled and flags.fail_closed and flags.verify_prefix_hits
    assert flags.max_payload_bytes == 4096
    assert flags.fault_injection == FaultInjectionConfig(0.5, ("zero_block",), 7)
    assert flags.host_fault_injection == FaultInjectionConfig(1.0, ("host_bit_flip",))
    assert flags.verify_external_loads and flags.external_entry_limit == 64
    native.enable_kv_checksum = False
    native.kv_checksum_fault_injection = None
    flags = read_flags(native)
    assert not flags.enabled and flags.fault_injection is None


def test_enabled_by_the_native_field_alone() -> None:
    """R146: with the settings as KVTransferConfig fields and nothing in the
    extra config, `enable_kv_checksum` alone turns checksums on, and off when
    false. Bug caught: the start-up decision looking for the flag in the
    extra config only (seen on the series' tree: every native engine ran
    unchecked, with no log line)."""
    from types import SimpleNamespace

    from tests.v1.kv_connector.unit.kv_checksum_pd import (
        CARRIER_CONNECTOR_NAME,
        register_carrier_connector,
    )
    from vllm.distributed.kv_transfer.kv_checksum.config import kv_checksum_enabled

    register_carrier_connector()
    native = SimpleNamespace(
        kv_connector=CARRIER_CONNECTOR_NAME,
        kv_connector_module_path=None,
        enable_kv_checksum=True,
        kv_checksum_fail_closed=False,
        kv_checksum_max_payload_bytes=None,
        kv_checksum_verify_prefix_hits=False,
        kv_checksum_fault_injection=None,
        kv_connector_extra_config={},
    )
    assert kv_checksum_enabled(SimpleNamespace(kv_transfer_config=native))
    native.enable_kv_checksum = False
    assert not kv_checksum_enabled(SimpleNamespace(kv_transfer_config=native))
