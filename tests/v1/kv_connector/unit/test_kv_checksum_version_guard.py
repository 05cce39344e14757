# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV checksums on a vLLM the package does not support (R144, R7).

The plugin registers before any configuration exists; on another vLLM it
installs only its version guard. A fresh interpreter, told by the plugin's
version probe that vLLM is 0.34.0 and loading the plugin as every vLLM
process does, builds real VllmConfigs, Schedulers (their connector through
vLLM's factory) and vLLM's Prometheus stat logger, and checks: a fail-closed
configuration asking for checksums is refused with one error naming both
versions; fail-open starts with exactly one error line, nothing of the
package's wiring installed and no vllm:kv_checksum_* series among vLLM's own.
In-process tests cover the command-line fallback and the series an absence
alert keys on with the supported vLLM.
"""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from tests.v1.kv_connector.unit.kv_checksum_pd import (
    CARRIER_CONNECTOR_NAME,
    register_carrier_connector,
)
from vllm.distributed.kv_transfer.kv_checksum import plugin, version
from vllm.distributed.kv_transfer.kv_checksum.wiring import version_guard

pytestmark = pytest.mark.cpu

REPO_ROOT = Path(__file__).resolve().parents[4]
CHECKSUM_LOGGER = "vllm.distributed.kv_transfer.kv_checksum"
# The series an alert for "this instance should check KV but exports no
# checksum metric" keys on: one per engine, present (0) from the start.
ABSENCE_SERIES = "vllm:kv_checksum_tracked_requests"

UNSUPPORTED_SCRIPT = textwrap.dedent(
    """
    import logging

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    def errors():
        return [r.getMessage() for r in records if r.levelno >= logging.ERROR]

    from vllm.distributed.kv_transfer.kv_checksum import plugin, wiring

    plugin._installed_vllm_version = lambda: "0.34.0"  # another vLLM
    logging.getLogger("vllm").addHandler(Collect())

    from prometheus_client import REGISTRY

    from tests.v1.kv_connector.unit.kv_checksum_helpers import (
        make_kv_cache_config,
        make_scheduler,
        make_vllm_config,
        write_model_dir,
    )
    from vllm.distributed.kv_transfer.kv_checksum.version import (
        UnsupportedVLLMError,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.outputs import KVConnectorOutput

    model_dir = write_model_dir("MODEL_DIR")
    OPEN = {"enable_kv_checksum": True}
    CLOSED = {"enable_kv_checksum": True, "kv_checksum_fail_closed": True}

    def config(extra):
        return make_vllm_config(model_dir, kv_connector="NixlConnector",
                                extra_config=extra)

    def engine(vllm_config):
        # What EngineCore builds: a Scheduler, its connector from vLLM's
        # KVConnectorFactory.
        return make_scheduler(vllm_config, make_kv_cache_config(vllm_config))

    # Built before vLLM loaded the plugin (e.g. a VllmConfig made by hand).
    early_closed = config(CLOSED)

    import vllm.plugins
    vllm.plugins.load_general_plugins()  # as every vLLM process does
    assert not wiring._installed
    assert not hasattr(Scheduler.__init__, "__kv_checksum_original__")
    assert not hasattr(KVConnectorOutput, "kv_checksums")
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING
                and r.name.startswith("vllm.distributed.kv_transfer.kv_checksum")]
    assert len(warnings) == 1 and "0.34.0" in warnings[0], warnings
    assert errors() == [], errors()

    # No checksums asked for: the engine starts, nothing logged.
    engine(config({}))
    assert errors() == [], errors()

    # Fail-closed: the config is refused with one error naming both versions.
    try:
        config(CLOSED)
    except UnsupportedVLLMError as e:
        assert "0.33.0" in str(e) and "0.34.0" in str(e), e
        print("REFUSED-CONFIG")
    # ... also when the config was made before the plugin was loaded: the
    # engine's connector is refused.
    try:
        engine(early_closed)
    except UnsupportedVLLMError as e:
        assert "0.33.0" in str(e) and "0.34.0" in str(e), e
        print("REFUSED-ENGINE")
    assert errors() == [], errors()

    # Fail-open: exactly one error line, the engine runs without any hook.
    vllm_config = config(OPEN)
    scheduler = engine(vllm_config)
    assert not hasattr(scheduler, "kv_checksum_scheduler")
    assert len(errors()) == 1, errors()
    assert "0.33.0" in errors()[0] and "0.34.0" in errors()[0], errors()
    # vLLM's own metrics, and not one vllm:kv_checksum_* series.
    PrometheusStatLogger(vllm_config)
    names = {m.name for m in REGISTRY.collect()}
    assert "vllm:num_requests_running" in names, sorted(names)
    assert not any(n.startswith("vllm:kv_checksum") for n in names), names
    print("FAIL-OPEN-OK")
    """
)


def run_unsupported_script(tmp_path: Path) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["VLLM_PLUGINS"] = "kv_checksum"
    script = UNSUPPORTED_SCRIPT.replace("MODEL_DIR", str(tmp_path / "model"))
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=str(REPO_ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


def test_R144_unsupported_vllm_refuses_fail_closed_and_flags_fail_open(
    tmp_path: Path,
) -> None:
    """R144, R7 on a fresh interpreter whose plugin sees vLLM 0.34.0 (see the
    module docstring). Bugs caught: the plugin only logging on another vLLM
    (issue 75: a fail-closed engine starts and serves every load unchecked);
    a guard on VllmConfig alone (a config made before the plugin loaded
    starts its engine unchecked, fail-closed); the fail-open error logged at
    each config and connector (more than one line) or never; any 0.33.0 hook
    or checksum metric installed on the other vLLM."""
    out = run_unsupported_script(tmp_path)
    for marker in ("REFUSED-CONFIG", "REFUSED-ENGINE", "FAIL-OPEN-OK"):
        assert marker in out, out[-6000:]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["vllm", "serve", "m", "--kv-transfer-config",
          '{"kv_connector_extra_config": {"enable_kv_checksum": true, '
          '"kv_checksum_fail_closed": true}}'], True),
        (["vllm", "serve", "--kv-transfer-config.kv_connector_extra_config."
          "kv_checksum_fail_closed=true"], True),
        (["vllm", "serve", "--kv-transfer-config.kv_connector_extra_config."
          "kv_checksum_fail_closed", "True"], True),
        (["vllm", "serve", "--kv-transfer-config",
          '{"kv_connector_extra_config": {"kv_checksum_fail_closed": false}}'],
         False),
        (["vllm", "serve", "m"], False),
    ],
)  # fmt: skip
def test_R144_fail_closed_on_the_command_line(argv: list[str], expected: bool) -> None:
    """R144's last resort: the fail-closed flag set to true on a command line,
    in JSON or as a dotted argument. Bugs caught: missing the dotted forms
    (`=true`, a separate `True`), and taking "false" for true."""
    assert version.fail_closed_on_command_line(argv) is expected


@pytest.fixture
def unsupported_without_guard(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """register() on "vLLM 0.34.0" where no guard hook can be installed;
    returns the versions the guard was asked to install for."""
    asked: list[str] = []

    def no_guard(found: str) -> bool:
        asked.append(found)
        return False

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_installed_vllm_version", lambda: "0.34.0")
    monkeypatch.setattr(version_guard, "install_version_guard", no_guard)
    return asked


def test_R144_no_guard_point_refuses_fail_closed_command_line(
    monkeypatch: pytest.MonkeyPatch, unsupported_without_guard: list[str]
) -> None:
    """R144: if neither guard hook exists on the other vLLM, a command line
    asking for fail-closed makes `register()` raise (vLLM's plugin loader lets
    it through, so the process does not start). Bug caught: register()
    swallowing its own refusal with its catch-all (fail-closed serves
    unchecked)."""
    argv = ["vllm", "serve", '{"kv_checksum_fail_closed": true}']
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(version.UnsupportedVLLMError, match="0.34.0"):
        plugin.register()
    assert unsupported_without_guard == ["0.34.0"]


def test_R144_no_guard_point_logs_one_error(
    monkeypatch: pytest.MonkeyPatch,
    unsupported_without_guard: list[str],
    vllm_caplog: pytest.LogCaptureFixture,
) -> None:
    """R144: without a guard hook and without fail-closed on the command line,
    `register()` starts the process with one error saying checksums cannot be
    enforced. Bug caught: a silent (warning-level) start."""
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m"])
    plugin.register()
    errors = [
        r
        for r in vllm_caplog.records
        if r.name.startswith(CHECKSUM_LOGGER) and r.levelno >= logging.ERROR
    ]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "0.33.0" in errors[0].getMessage()


def test_R144_requested_flags() -> None:
    """R8 on any vLLM: fail-closed alone asks for nothing, a non-boolean flag
    is an error, a config without the extra dict asks for nothing. Bug
    caught: refusing an engine that set only kv_checksum_fail_closed."""

    class Config:
        def __init__(self, extra: object) -> None:
            self.kv_connector_extra_config = extra

    guard = version.UnsupportedVersionGuard("0.34.0")
    guard.check(Config({"kv_checksum_fail_closed": True}))
    guard.check(Config(None))
    guard.check(None)
    with pytest.raises(ValueError, match="enable_kv_checksum"):
        guard.check(Config({"enable_kv_checksum": "yes"}))
    with pytest.raises(version.UnsupportedVLLMError):
        guard.check(
            Config({"enable_kv_checksum": True, "kv_checksum_fail_closed": True})
        )


def test_R144_absence_series_present_from_start(model_dir: str) -> None:
    """R144, R141 on the supported vLLM: an engine with checksums on exports
    `vllm:kv_checksum_tracked_requests` (0) for its engine as soon as vLLM's
    Prometheus logger exists, before any request: the series an alert on
    "should check KV, exports no checksum metric" keys on. Bug caught: a
    series that appears only after the first verdict (the absence alert
    would fire on every healthy idle engine)."""
    from tests.v1.kv_connector.unit.kv_checksum_helpers import make_vllm_config
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    plugin.register()
    register_carrier_connector()
    vllm_config = make_vllm_config(
        model_dir,
        kv_connector=CARRIER_CONNECTOR_NAME,
        extra_config={"enable_kv_checksum": True},
    )
    unregister_vllm_metrics()
    try:
        logger = PrometheusStatLogger(vllm_config)
        model_name, engine = logger.per_engine_labelvalues[0]
        value = REGISTRY.get_sample_value(
            ABSENCE_SERIES, {"model_name": str(model_name), "engine": str(engine)}
        )
        assert value == 0.0
    finally:
        unregister_vllm_metrics()
