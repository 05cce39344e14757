# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hook timer (issue 30, R142): what it attributes to a hook is the hook's
own time, and its summary divides by the engine's steps."""

import json
from pathlib import Path
from typing import Any

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

SCRIPT = (
    Path(__file__).resolve().parents[4]
    / "benchmarks"
    / "host"
    / "kv_checksum_hook_timer.py"
)


def test_timed_wrap_counts_the_hook_and_the_method_it_wraps(tmp_path) -> None:
    """R142 (diagnosis): a hook installed through the timer's `_wrap` still
    calls vLLM's method and returns its result; each call counts once, and
    the wrapped method's time is inside the hook's (own time = whole -
    wrapped >= 0). Bugs caught (tried): the original timed outside the hook
    (wrapped > whole), and the hook not counted per call. With CPU time on,
    the thread's CPU time nests the same way."""
    timer = load_script("kv_checksum_hook_timer_test", SCRIPT)
    timer._CPU = True

    class Target:
        def step(self, x: int) -> int:
            return x + 1

    def hook(original: Any, self: Any, x: int) -> int:
        return original(self, x) * 10

    timer._timed_wrap(str(tmp_path))(Target, "step")(hook)
    assert Target().step(1) == 20
    assert Target().step(2) == 30
    assert Target.step.__kv_checksum_original__(Target(), 5) == 6
    key = "Target.step"
    assert timer._calls[key] == 2
    assert 0.0 <= timer._wrapped[key] <= timer._whole[key]
    assert 0.0 <= timer._wrapped_cpu[key] <= timer._whole_cpu[key]


def test_summary_gives_each_engines_own_time_per_step(tmp_path) -> None:
    """R142 (diagnosis): the summary keeps processes that ran engine steps
    (not the API server), divides each hook's whole - wrapped by the steps,
    and keeps deep-mode core methods out of the hooks' total. Bugs caught
    (tried): the wrapped vLLM time counted as the package's, and core
    methods (nested in hooks) counted twice."""
    timer = load_script("kv_checksum_hook_timer_test", SCRIPT)
    engine = {
        "pid": 11,
        "ppid": 1,
        "side_channel_port": "5710",
        "whole": {
            "EngineCore.step": 2.0,
            "Scheduler.update_from_output": 0.004,
            "core:KVChecksumWorker.bind": 0.001,
        },
        "wrapped": {"Scheduler.update_from_output": 0.003},
        "whole_cpu": {"Scheduler.update_from_output": 0.002},
        "wrapped_cpu": {"Scheduler.update_from_output": 0.0015},
        "calls": {"EngineCore.step": 100, "Scheduler.update_from_output": 100},
        "gc_counts": [5, 0, 0],
        "gc_seconds": [0.0005, 0.0, 0.0],
    }
    api_server = {"pid": 12, "ppid": 1, "whole": {}, "wrapped": {}, "calls": {}}
    (tmp_path / "11.json").write_text(json.dumps(engine))
    (tmp_path / "12.json").write_text(json.dumps(api_server))
    summary = timer.summarize(str(tmp_path))
    assert list(summary) == ["11"]
    row = summary["11"]
    assert row["steps"] == 100
    assert abs(row["step_ms_mean"] - 20.0) < 1e-9
    assert abs(row["own_us_per_step"] - 10.0) < 1e-6
    assert row["hooks_us_per_step"] == {"Scheduler.update_from_output": 10.0}
    assert row["core_us_per_step"] == {"KVChecksumWorker.bind": 10.0}
    assert row["gc_us_per_step"] == 5.0
    assert abs(row["own_cpu_us_per_step"] - 5.0) < 1e-6
    assert row["side_channel_port"] == "5710"  # a consumer of a shifted pair


def test_each_record_names_its_engines_side_channel_port(tmp_path, monkeypatch) -> None:
    """R142 (diagnosis), issue 30 (hook-timer-serve): four engines of two P/D
    pairs write records; each names its NIXL side channel port, so the
    summary tells producer from consumer. Bug caught: the port read from
    another variable (every engine unnamed), or dropped by the summary."""
    timer = load_script("kv_checksum_hook_timer_port", SCRIPT)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    timer._last_dump[0] = float("-inf")
    timer._calls["EngineCore.step"] += 1
    timer._whole["EngineCore.step"] += 0.001
    timer._dump(str(tmp_path))
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert record["side_channel_port"] == "5600"
    assert timer.summarize(str(tmp_path))[str(record["pid"])]["side_channel_port"] == (
        "5600"
    )


def test_hook_time_benchmark_times_the_real_hooks(tmp_path) -> None:
    """R142 (diagnosis): the decode-step benchmark puts the timer in place
    before the plugin installs its hooks, so both engines' hooks report own
    time (a timer installed too late reports none). Bug caught (tried): the
    step benchmark imported before the timer (every row 0.0)."""
    import subprocess
    import sys

    script = SCRIPT.parent / "benchmark_kv_checksum_hook_time.py"
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--connectors",
            "OffloadingConnector",
            "--requests",
            "4",
            "--rounds",
            "1",
            "--steps",
            "8",
            "--json",
            str(out),
        ],
        cwd=SCRIPT.parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["connector"] == "OffloadingConnector" and row["running"] == 4
    assert row["on_us"] > 0 and row["off_us"] > 0
