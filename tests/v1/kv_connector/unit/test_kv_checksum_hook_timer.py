# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hook timer (issue 30, R142): what it attributes to a hook is the hook's
own time, and its summary divides by the engine's steps."""

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

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


def test_collections_in_a_hooks_own_code_are_its_own(tmp_path, monkeypatch) -> None:
    """Issue 30 item 2, R142 (diagnosis): a garbage collection that starts in a
    hook's own code counts in the hook's own collection time; one inside
    the vLLM method it wraps does not (whole - wrapped), and the summary
    reports it per hook. Collections are driven through the timer's own gc
    callback on a fake clock: 3 ms in the hook, 5 ms in the wrapped method.
    Bug caught (tried): the wrapped method's collections counted as the
    hook's (8 ms)."""
    timer = load_script("kv_checksum_hook_timer_gc", SCRIPT)
    clock = [100.0]
    monkeypatch.setattr(timer.time, "perf_counter", lambda: clock[0])

    def collect(seconds: float) -> None:
        timer._on_gc("start", {"generation": 0})
        clock[0] += seconds
        timer._on_gc("stop", {"generation": 0})

    class Target:
        def step(self) -> None:
            collect(0.005)

    def hook(original: Any, self: Any) -> None:
        collect(0.003)
        original(self)

    timer._timed_wrap(str(tmp_path))(Target, "step")(hook)
    for _ in range(2):
        Target().step()
    key = "Target.step"
    assert abs(timer._whole_gc[key] - 0.016) < 1e-9
    assert abs(timer._wrapped_gc[key] - 0.010) < 1e-9
    record = {
        "pid": 41,
        "ppid": 1,
        "whole": {"EngineCore.step": 1.0, key: timer._whole[key]},
        "wrapped": {key: timer._wrapped[key]},
        "whole_gc": dict(timer._whole_gc),
        "wrapped_gc": dict(timer._wrapped_gc),
        "calls": {"EngineCore.step": 2, key: 2},
    }
    (tmp_path / "41.json").write_text(json.dumps(record))
    row = timer.summarize(str(tmp_path))["41"]
    # 6 ms of the hook's own collections over 2 steps: 3,000 us a step.
    assert row["hooks_gc_us_per_step"] == {key: 3000.0}
    assert row["hooks_us_per_step"] == {key: 3000.0}


def test_own_time_by_hook_for_the_per_hook_table() -> None:
    """R142 (diagnosis), issue 30: `own_by_hook` (the hook-time benchmark's
    --per-hook table, differenced per round) gives each hook's whole - wrapped
    and leaves engine steps and deep-mode core methods out. Bugs caught
    (tried): the wrapped vLLM time not subtracted, and core methods (nested
    in hooks) listed as hooks."""
    timer = load_script("kv_checksum_hook_timer_by_hook", SCRIPT)
    timer._whole.update(
        {
            "EngineCore.step": 2.0,
            "Scheduler.make_stats": 0.5,
            "Conn.build_connector_meta": 0.25,
            "core:KVChecksumWorker.bind": 0.125,
        }
    )
    timer._wrapped.update({"Scheduler.make_stats": 0.25})
    assert timer.own_by_hook() == {
        "Scheduler.make_stats": 0.25,
        "Conn.build_connector_meta": 0.25,
    }


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


def test_request_steps_count_each_interval_by_its_events() -> None:
    """Issue 30 item 3, R142 (diagnosis): per request, steps between arrival, the
    output reporting its load finished, its first scheduled tokens and its
    first token, loaded and not-loaded requests apart; a request is counted
    once, at its first token. Bugs caught: the step counted before the output
    is processed (every interval off by one), a later load report or a decode
    step overwriting the first, and an unloaded request counted as loaded."""
    timer = load_script("kv_checksum_hook_timer_requests", SCRIPT)
    steps = timer.RequestSteps()
    steps.on_add("loaded", 0.0)
    steps.on_add("plain", 0.0)
    # Output 0: "plain" prefills and gives its first token; "loaded" waits.
    steps.on_output({"plain": 5}, (), ["plain"], 0.001)
    steps.on_output({}, (), [], 0.002)  # output 1
    steps.on_output({}, ["loaded"], [], 0.003)  # output 2 reports its load
    steps.on_output({"loaded": 3}, ["loaded"], [], 0.004)  # output 3: prefill
    steps.on_output({"loaded": 1}, (), ["loaded", "plain"], 0.006)  # output 4
    record = steps.record()["steps"]
    assert record == {
        "add->first_token": {0: 1},
        "scheduled->first_token": {0: 1},
        "add->first_token (loaded)": {4: 1},
        "add->load_done (loaded)": {2: 1},
        "load_done->scheduled (loaded)": {1: 1},
        "scheduled->first_token (loaded)": {1: 1},
    }
    assert steps.open == {}
    summary = timer._request_summary(steps.record())
    loaded = summary["add->first_token (loaded)"]
    assert (loaded["requests"], loaded["steps_mean"]) == (1, 4.0)
    assert abs(loaded["ms_median"] - 6.0) < 1e-9


@pytest.mark.usefixtures("cuda_stream_stubs")
def test_request_steps_trace_a_real_scheduler_alike_on_and_off(
    model_dir: str, monkeypatch: Any
) -> None:
    """Issue 30 item 3, R142 (diagnosis): traced on vLLM's real Scheduler with
    OffloadingConnector loads (CPU simulation), the tracer sees every load
    and counts the same steps with checksums on (fail-closed) as off. Bugs
    caught: the trace reading the wrong output field (no loaded requests),
    or wrapping methods the engine does not call (nothing counted)."""
    from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
        OffloadSimEngine,
        run_shared_prefixes,
    )
    from tests.v1.kv_connector.unit.test_kv_checksum_offload_connectors import (
        offload_side,
    )
    from vllm.distributed.kv_transfer.kv_checksum import plugin
    from vllm.v1.core.sched.scheduler import Scheduler

    timer = load_script("kv_checksum_hook_timer_real", SCRIPT)
    # The hooks first (once per process): the methods restored after the test
    # are then the hooked ones. Installed inside the test, on top of the
    # tracer, they were undone by the restore while the plugin stayed marked
    # installed, and later tests in the process ran vLLM without its hooks.
    plugin.register()
    monkeypatch.setattr(Scheduler, "add_request", Scheduler.add_request)
    monkeypatch.setattr(Scheduler, "update_from_output", Scheduler.update_from_output)
    timer._trace_requests(Scheduler)
    counted = {}
    for enabled in (False, True):
        timer._requests = timer.RequestSteps()
        side = offload_side(enabled=enabled, fail_closed=enabled)
        engine = OffloadSimEngine(model_dir, side, f"trace-{enabled}")
        run_shared_prefixes(engine, 14)
        counted[enabled] = timer._requests.record()["steps"]
    loaded = counted[False].get("load_done->scheduled (loaded)", {})
    assert sum(loaded.values()) >= 6
    assert sum(counted[False]["add->first_token"].values()) >= 1
    assert counted[True] == counted[False]


def _summary_row(
    timer, tmp_path, pid: int, whole: dict, wrapped: dict, calls: dict, **extra
) -> dict:
    """`summarize`'s row of one engine record: 100 steps of 1 s in all, a
    constructor (`ActiveKVConnector.__init__`, 0.5 s, one call) and the given
    hook totals (`extra`: further record fields, e.g. the CPU times)."""
    record = {
        "pid": pid,
        "ppid": 1,
        "whole": {"EngineCore.step": 1.0, "ActiveKVConnector.__init__": 0.5, **whole},
        "wrapped": wrapped,
        "calls": {"EngineCore.step": 100, "ActiveKVConnector.__init__": 1, **calls},
        **extra,
    }
    (tmp_path / f"{pid}.json").write_text(json.dumps(record))
    return timer.summarize(str(tmp_path))[str(pid)]


def test_summary_keeps_start_up_and_vllm_parts_apart(tmp_path) -> None:
    """R142 (diagnosis), issue 30: a hook that ran once (a constructor) is
    start-up cost, left out of the per-step figure beside the total, and
    vLLM's own step parts (`vllm:` keys, inclusive) are reported apart from
    the package's hooks. Bugs caught (tried): the constructor's seconds
    spread over the steps as if each step paid them (the 2026-12-02f run's
    300 us "per step"), and vLLM's `schedule` counted as the package's own
    time."""
    timer = load_script("kv_checksum_hook_timer_parts", SCRIPT)
    row = _summary_row(
        timer,
        tmp_path,
        21,
        whole={"Scheduler.update_from_output": 0.004, "vllm:Scheduler.schedule": 0.02},
        wrapped={"Scheduler.update_from_output": 0.002},
        calls={"Scheduler.update_from_output": 100, "vllm:Scheduler.schedule": 100},
    )
    assert abs(row["own_us_per_step"] - 5020.0) < 1e-6
    assert row["own_us_per_step_without_start_up"] == 20.0
    assert row["vllm_us_per_step"] == {"Scheduler.schedule": 200.0}
    assert "vllm:Scheduler.schedule" not in row["hooks_us_per_step"]


def test_summary_gives_each_hooks_cpu_time_without_start_up(tmp_path) -> None:
    """Issue 30 item 2, R142 (diagnosis): thread CPU time per hook and per step,
    start-up (hooks run once) left out, beside the wall figures, so a hook
    whose wall time is well above its CPU time shows as waiting. Bug caught
    (2026-12-04 run): a constructor's CPU seconds in the per-step CPU total
    made it exceed the per-step wall figure (1,586 against 573 us)."""
    timer = load_script("kv_checksum_hook_timer_cpu", SCRIPT)
    row = _summary_row(
        timer,
        tmp_path,
        31,
        whole={"OffloadingConnector.build_connector_meta": 0.016},
        wrapped={"OffloadingConnector.build_connector_meta": 0.001},
        calls={"OffloadingConnector.build_connector_meta": 100},
        whole_cpu={
            "ActiveKVConnector.__init__": 0.4,
            "OffloadingConnector.build_connector_meta": 0.005,
        },
        wrapped_cpu={"OffloadingConnector.build_connector_meta": 0.001},
    )
    # own wall: (0.016 - 0.001) s / 100 steps = 150 us; own CPU (0.005 -
    # 0.001) s / 100 = 40 us; the constructor's 0.4 s is start-up.
    assert row["own_us_per_step_without_start_up"] == 150.0
    assert row["own_cpu_us_per_step_without_start_up"] == 40.0
    assert row["hooks_cpu_us_per_step"] == {
        "OffloadingConnector.build_connector_meta": 40.0
    }
    assert abs(row["own_cpu_us_per_step"] - 4040.0) < 1e-6


def test_summary_splits_vllm_parts_into_cpu_and_off_cpu_time(tmp_path) -> None:
    """R142 (diagnosis), issue 30: with CPU times recorded, each vLLM step part's
    engine-thread CPU time and the rest of its wall time (off the CPU: the
    window another thread's work could hide in) per step, from the record's
    whole and whole_cpu. Bugs caught (tried): the two swapped (CPU reported
    as the off-CPU time), and a part with no CPU time reported as all off
    the CPU."""
    timer = load_script("kv_checksum_hook_timer_parts_cpu", SCRIPT)
    row = _summary_row(
        timer,
        tmp_path,
        41,
        whole={
            "vllm:UniProcExecutor.sample_tokens": 0.08,
            "vllm:Scheduler.schedule": 0.02,
        },
        wrapped={},
        calls={
            "vllm:UniProcExecutor.sample_tokens": 100,
            "vllm:Scheduler.schedule": 100,
        },
        whole_cpu={"vllm:UniProcExecutor.sample_tokens": 0.03},
    )
    # sample_tokens: 800 us a step of wall, 300 of CPU, 500 off the CPU;
    # schedule has no CPU time recorded, so neither split names it.
    assert row["vllm_us_per_step"] == {
        "UniProcExecutor.sample_tokens": 800.0,
        "Scheduler.schedule": 200.0,
    }
    assert row["vllm_cpu_us_per_step"] == {"UniProcExecutor.sample_tokens": 300.0}
    assert row["vllm_off_cpu_us_per_step"] == {"UniProcExecutor.sample_tokens": 500.0}


def test_vllm_parts_are_vllm_0_33_methods_and_stay_transparent(
    tmp_path, monkeypatch
) -> None:
    """R142 (diagnosis), issue 30: every step part the timer names exists in
    vLLM 0.33.0 (a renamed method would be skipped silently and its figure
    missing) and gets wrapped; a timed part returns the method's result and
    counts each call. Bug caught (tried): a part named after a method vLLM
    does not define on that class (`Scheduler.schedule_step`)."""
    import importlib

    timer = load_script("kv_checksum_hook_timer_vllm", SCRIPT)
    classes = []
    for module_name, class_name, name in timer.VLLM_PARTS:
        cls = getattr(importlib.import_module(module_name), class_name)
        assert name in vars(cls), f"{class_name}.{name}"
        monkeypatch.setattr(cls, name, vars(cls)[name])  # restored after the test
        classes.append((cls, name, vars(cls)[name]))
    timer._time_vllm_parts(str(tmp_path))
    for cls, name, original in classes:
        assert vars(cls)[name].__wrapped__ is original

    class Part:
        def run(self, x: int) -> int:
            return x * 3

    timer._time_function(Part, "run", "vllm:Part.run", str(tmp_path))
    assert Part().run(2) == 6 and Part().run(3) == 9
    assert timer._calls["vllm:Part.run"] == 2
    assert timer._whole["vllm:Part.run"] >= 0.0


class _FakeClock:
    """`time.perf_counter` that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance_us(self, us: float) -> None:
        self.now += us * 1e-6


def test_running_buckets_get_each_steps_hook_time(tmp_path, monkeypatch) -> None:
    """Issue 30 item 2, R142 (diagnosis): with KV_CHECKSUM_HOOK_TIMER_RUNNING=1
    a step's hooks' own time goes to the bucket of the running count its own
    schedule() saw (3 -> "1-15", 70 -> "16-127", 0 -> "0"), each call counted
    as that call's whole - its own wrapped time, and the summary gives per
    bucket the steps, mean running count, mean step ms and own µs per step
    without the once-run constructor; checked against a hand computation on
    a fake clock. Bugs caught (tried): a step in the previous step's bucket (the
    bucket read at the step's start, before its schedule()), a hook's own
    time taken against the cumulative wrapped total instead of this call's
    (a second call in a step, with a different wrapped time, comes out
    wrong), and a constructor spread over one bucket's steps."""
    from vllm.v1.engine.core import EngineCore

    monkeypatch.setenv("KV_CHECKSUM_HOOK_TIMER_RUNNING", "1")
    timer = load_script("kv_checksum_hook_timer_running", SCRIPT)
    clock = _FakeClock()
    monkeypatch.setattr(timer.time, "perf_counter", clock)
    assert [timer.running_bucket(n) for n in (0, 1, 15, 16, 127, 128, 4096)] == [
        "0",
        "1-15",
        "1-15",
        "16-127",
        "16-127",
        "128+",
        "128+",
    ]

    class FakeScheduler:
        """Stands in for vLLM's Scheduler: `running` and `schedule`."""

        def __init__(self) -> None:
            self.running: list[int] = []

        def schedule(self) -> None:
            clock.advance_us(1)

        def update_from_output(self, wrapped_us: int) -> int:
            clock.advance_us(wrapped_us)
            return wrapped_us

    class Conn:
        def setup(self) -> None:
            clock.advance_us(3)

    def hook(original: Any, self: Any, own_us: int, wrapped_us: int) -> int:
        clock.advance_us(own_us)
        return original(self, wrapped_us)

    def setup_hook(original: Any, self: Any) -> None:
        clock.advance_us(500)  # start-up work: ran once
        original(self)

    scheduler = FakeScheduler()
    timer._track_running(FakeScheduler)
    timed_wrap = timer._timed_wrap(str(tmp_path))
    timed_wrap(FakeScheduler, "update_from_output")(hook)
    timed_wrap(Conn, "setup")(setup_hook)

    def fake_step(core: Any) -> None:
        clock.advance_us(core.rest_us)
        scheduler.running = list(range(core.running))
        scheduler.schedule()
        if core.setup:
            Conn().setup()
        for own_us, wrapped_us in core.calls:
            assert scheduler.update_from_output(own_us, wrapped_us) == wrapped_us

    # Restored after the test: _time_steps replaces both with its wrappers.
    monkeypatch.setattr(EngineCore, "step", fake_step)
    monkeypatch.setattr(
        EngineCore, "step_with_batch_queue", EngineCore.step_with_batch_queue
    )
    timer._time_steps(str(tmp_path))

    # (bucket expected, running, hook calls as (own us, wrapped us), other us,
    # constructor in this step)
    plan = [
        ("1-15", 3, [(2, 10)], 100, True),
        ("16-127", 70, [(7, 20), (3, 5)], 200, False),
        ("1-15", 5, [(1, 30)], 50, False),
        ("16-127", 70, [(4, 40)], 300, False),
        ("0", 0, [], 10, False),
    ]
    for _, running, calls, rest_us, setup in plan:
        EngineCore.step(
            SimpleNamespace(running=running, calls=calls, rest_us=rest_us, setup=setup)
        )

    expected: dict[str, dict[str, Any]] = {}
    for bucket, running, calls, rest_us, setup in plan:
        row = expected.setdefault(bucket, {"steps": 0, "run": 0, "us": 0, "own": 0})
        row["steps"] += 1
        row["run"] += running
        row["own"] += sum(own for own, _ in calls)
        row["us"] += rest_us + 1 + sum(o + w for o, w in calls) + 503 * setup
    assert dict(timer._bucket_steps) == {b: r["steps"] for b, r in expected.items()}
    assert timer._bucket_own["16-127"]["FakeScheduler.update_from_output"] == (
        pytest.approx(14e-6)
    )

    timer._last_dump[0] = float("-inf")
    timer._dump(str(tmp_path))
    by_running = timer.summarize(str(tmp_path))[str(os.getpid())]["by_running"]
    assert list(by_running) == ["0", "1-15", "16-127"]
    for bucket, row in expected.items():
        got = by_running[bucket]
        assert got["steps"] == row["steps"]
        assert got["running_mean"] == pytest.approx(row["run"] / row["steps"])
        assert got["step_ms_mean"] == pytest.approx(
            row["us"] / 1e3 / row["steps"], abs=1e-4
        )
        assert got["own_us_per_step"] == pytest.approx(
            row["own"] / row["steps"], abs=0.01
        )
        hooks = {"FakeScheduler.update_from_output": got["own_us_per_step"]}
        assert got["hooks_us_per_step"] == (hooks if row["own"] else {})
    # The literal figures of the plan above, for the reader.
    assert by_running["1-15"]["running_mean"] == 4.0
    assert by_running["1-15"]["own_us_per_step"] == 1.5  # (2 + 1) / 2
    assert by_running["16-127"]["own_us_per_step"] == 7.0  # (7 + 3 + 4) / 2


def test_running_buckets_stay_out_without_the_variable(tmp_path, monkeypatch) -> None:
    """Issue 30 item 2, R142 (diagnosis): without KV_CHECKSUM_HOOK_TIMER_RUNNING
    the records and the summary carry no "by_running" and hooks fill no
    bucket (the other modes' figures unchanged); and vLLM 0.33's Scheduler
    has the `schedule` and `running` the mode reads, wrapped transparently.
    Bugs caught: the mode on by default, and a tracker that drops the
    original (`__wrapped__` not vLLM's method)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.delenv("KV_CHECKSUM_HOOK_TIMER_RUNNING", raising=False)
    timer = load_script("kv_checksum_hook_timer_running_off", SCRIPT)

    class Target:
        def step(self) -> int:
            return 1

    timer._timed_wrap(str(tmp_path))(Target, "step")(
        lambda original, self: original(self)
    )
    assert Target().step() == 1 and Target().step() == 1
    timer._calls["EngineCore.step"] += 1
    timer._whole["EngineCore.step"] += 0.001
    assert not timer._bucket_own and not timer._bucket_steps
    timer._last_dump[0] = float("-inf")
    timer._dump(str(tmp_path))
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert "by_running" not in record
    assert "by_running" not in timer.summarize(str(tmp_path))[str(record["pid"])]

    original = vars(Scheduler)["schedule"]
    monkeypatch.setattr(Scheduler, "schedule", original)  # restored after
    timer._track_running(Scheduler)
    assert vars(Scheduler)["schedule"].__wrapped__ is original
    assert "self.running" in inspect.getsource(Scheduler.__init__)


def test_deep_mode_times_the_named_classes_only(capsys) -> None:
    """Issue 30, R142 (diagnosis): KV_CHECKSUM_HOOK_TIMER_DEEP=1 times every `DEEP`
    class; a list of class names times those alone, in `DEEP` order, and an
    unknown name is reported, not timed. Bugs caught: "1" read as a class
    name (nothing timed), a list timing every class, a misspelt name dropped
    silently."""
    timer = load_script("kv_checksum_hook_timer_deep", SCRIPT)
    assert timer.deep_classes("1") == list(timer.DEEP)
    picked = timer.deep_classes(" KVChecksumConsumer, KVChecksumPendingRecord,Nope")
    assert picked == [
        ("engine.records", "KVChecksumPendingRecord"),
        ("engine.consumer", "KVChecksumConsumer"),
    ]
    assert "Nope is not in DEEP" in capsys.readouterr().err


def test_every_deep_entry_names_a_class_and_function_of_the_package() -> None:
    """R142, issue 30 (diagnosis): each `DEEP` class and `DEEP_FUNCTIONS` name
    resolves in its module, since the timer skips a missing one silently.
    Bug caught: a misspelt or moved entry that leaves a suspect untimed in
    a GPU run (the run's figures then lack it, and nothing says why)."""
    import importlib
    import inspect

    timer = load_script("kv_checksum_hook_timer_entries", SCRIPT)
    for module_name, class_name in timer.DEEP:
        module = importlib.import_module(f"{timer.PACKAGE}.{module_name}")
        assert inspect.isclass(getattr(module, class_name, None)), class_name
    for module_name, name in timer.DEEP_FUNCTIONS:
        module = importlib.import_module(f"{timer.PACKAGE}.{module_name}")
        assert callable(getattr(module, name, None)), (module_name, name)


def test_deep_mode_times_named_module_functions_where_they_are_looked_up(
    tmp_path, monkeypatch
) -> None:
    """Issue 30, R142 (diagnosis): a `DEEP_FUNCTIONS` name in
    KV_CHECKSUM_HOOK_TIMER_DEEP times that function in the module that calls
    it (the launcher's `segment_rows`, imported by name there), keyed
    "core:engine.launches.segment_rows", and leaves the other functions and
    the classes alone. Bugs caught: the function wrapped in its defining
    module only (the launcher's calls go uncounted), every function timed
    for one name, a class timed for a function's name."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
        KVChecksumBlocks,
    )
    from vllm.distributed.kv_transfer.kv_checksum.engine import launches

    timer = load_script("kv_checksum_hook_timer_functions", SCRIPT)
    assert timer.deep_functions("1") == list(timer.DEEP_FUNCTIONS)
    assert timer.deep_functions("segment_rows,KVChecksumConsumer") == [
        ("engine.launches", "segment_rows")
    ]
    assert timer.deep_classes("segment_rows") == []
    for name in ("segment_rows", "upload_segments", "_Layout"):
        monkeypatch.setattr(launches, name, getattr(launches, name))  # restored
    monkeypatch.setenv("KV_CHECKSUM_HOOK_TIMER_DEEP", "segment_rows")
    timer._time_core(str(tmp_path))
    blocks = KVChecksumBlocks(num_tokens=32, groups={0: (0, np.array([3, 5]))})
    _, _, counts, rows = launches.segment_rows([("r", blocks)], 0, 16)
    assert list(counts) == [2] and rows.shape == (3, 2)
    assert dict(timer._calls) == {"core:engine.launches.segment_rows": 1}
    assert not hasattr(launches.upload_segments, "__wrapped__")


def test_deep_mode_times_a_modules_torch_allocations_and_their_size(
    tmp_path, monkeypatch
) -> None:
    """Issue 30, R142 (diagnosis): with KV_CHECKSUM_HOOK_TIMER_DEEP=1 the
    pinned zeros of an upload are timed where the rows module makes them,
    with the elements they allocate, while the module's other torch names
    stay the real ones and the upload's result is unchanged; the summary
    gives elements a call. Bugs caught: the proxy breaking an attribute the
    module reads (`torch.int64`), elements counted per call instead of
    summed, torch patched globally (every vLLM `torch.zeros` counted)."""
    import torch

    from vllm.distributed.kv_transfer.kv_checksum.definition import rows

    timer = load_script("kv_checksum_hook_timer_torch", SCRIPT)
    for module_name, name in timer.DEEP_TORCH:
        module = __import__(f"{timer.PACKAGE}.{module_name}", fromlist=["torch"])
        assert callable(getattr(module.torch, name)), (module_name, name)
    monkeypatch.setattr(rows, "torch", rows.torch)  # restored after the test
    monkeypatch.setenv("KV_CHECKSUM_HOOK_TIMER_DEEP", "1")
    timer._time_torch_call(rows, "zeros", "core:definition.rows.torch.zeros")
    parts = [np.arange(6, dtype=np.int64).reshape(3, 2)]
    for _ in range(2):
        packed, columns = rows.upload_segments(parts, torch.device("cpu"), (3,))
    assert columns == [0, 2] and packed.shape == (3, 6)
    assert packed[:, :2].tolist() == parts[0].tolist()
    assert torch.zeros is not rows.torch.zeros and rows.torch.int64 is torch.int64
    key = "core:definition.rows.torch.zeros"
    assert timer._calls[key] == 2 and timer._elements[key] == 36
    row = _summary_row(
        timer, tmp_path, 4, {key: 0.001}, {}, {key: 2}, elements={key: 36}
    )
    assert row["core_elements_per_call"] == {"definition.rows.torch.zeros": 18.0}


def test_summary_reports_deep_calls_per_call_without_start_up(tmp_path) -> None:
    """Issue 30, R142 (diagnosis): deep mode's summary gives each timed method's
    microseconds a call (its time over its own calls, not the steps), largest
    first, and leaves out what ran once (a warm-up). Bugs caught: time per
    call divided by the steps (a pass on one step in ten read as a tenth of
    its cost), a warm-up's compile reported as a call's cost."""
    timer = load_script("kv_checksum_hook_timer_per_call", SCRIPT)
    row = _summary_row(
        timer,
        tmp_path,
        9,
        {
            "core:ChecksumLauncher.launch": 0.003,
            "core:KVChecksumWorker.warm_up": 2.0,
            "core:engine.launches.segment_rows": 0.0005,
        },
        {},
        {
            "core:ChecksumLauncher.launch": 10,
            "core:KVChecksumWorker.warm_up": 1,
            "core:engine.launches.segment_rows": 10,
        },
    )
    assert row["core_us_per_call"] == {
        "ChecksumLauncher.launch": 300.0,
        "engine.launches.segment_rows": 50.0,
    }
    assert list(row["core_us_per_call"]) == [
        "ChecksumLauncher.launch",
        "engine.launches.segment_rows",
    ]


def test_deep_calls_inside_a_warm_up_are_kept_apart(tmp_path, monkeypatch) -> None:
    """Issue 30, R142 (diagnosis): a core method that a warm-up also calls
    (the entry kernels' first, compiling launches, 2026-12-04e: 739 us "a
    call" that were mostly the start-up compile) is timed per serving call
    only; its calls inside `warm_up` go to "warm-up:" keys, reported as
    start-up milliseconds and never as a hook's own time. Bugs caught: the
    compile spread over the serving calls, the warm-up keys counted as hook
    time."""
    timer = load_script("kv_checksum_hook_timer_warm_up", SCRIPT)
    now = [10.0]
    monkeypatch.setattr(timer.time, "perf_counter", lambda: now[0])

    class Kernels:
        def write(self, seconds: float) -> None:
            now[0] += seconds

        def warm_up(self) -> None:
            self.write(2.0)  # the compile

    for name in ("write", "warm_up"):
        timer._time_function(Kernels, name, f"core:Kernels.{name}", str(tmp_path))
    kernels = Kernels()
    kernels.warm_up()
    for _ in range(4):
        kernels.write(0.00005)
    timer._calls["EngineCore.step"] += 10
    timer._whole["EngineCore.step"] += 0.01
    now[0] += 10.0
    timer._dump(str(tmp_path))
    (row,) = timer.summarize(str(tmp_path)).values()
    assert row["core_us_per_call"] == {"Kernels.write": 50.0}
    assert row["core_warm_up_ms"] == {"Kernels.write": 2000.0}
    assert "warm-up:core:Kernels.write" not in row["hooks_us_per_step"]
    assert timer.own_by_hook() == {}  # steps and core calls are no hook


def _dumped_row(
    timer: Any, tmp_path: Path, wall: list[float], steps: int, step_s: float
) -> dict:
    """`steps` engine steps of `step_s` in all counted, the fake clock `wall`
    moved past the dump interval, the record written and summarized: its
    one engine's row."""
    timer._calls["EngineCore.step"] += steps
    timer._whole["EngineCore.step"] += step_s
    wall[0] += 10.0
    timer._dump(str(tmp_path))
    (row,) = timer.summarize(str(tmp_path)).values()
    return row


def test_deep_calls_count_their_cpu_time_beside_their_wall_time(
    tmp_path, monkeypatch
) -> None:
    """Issue 30, R142 (diagnosis): with KV_CHECKSUM_HOOK_TIMER_CPU=1 each deep
    call (a core method, a module function, a timed torch allocation) also
    counts the engine thread's CPU time, reported a call beside its wall time:
    a call that waits (the store's upload, 884 us a call in the eager tier at
    256 running, 2026-12-04h) shows wall time far above CPU time, one that
    works shows them alike. Without the variable no CPU time is reported.
    Bugs caught: CPU time read from the wall clock (waits reported as work),
    the CPU table keyed apart from the wall table, a torch call's CPU time
    left out."""
    import torch

    from vllm.distributed.kv_transfer.kv_checksum.definition import rows

    timer = load_script("kv_checksum_hook_timer_deep_cpu", SCRIPT)
    monkeypatch.setattr(timer, "_CPU", True)
    wall, cpu = [10.0], [1.0]
    monkeypatch.setattr(timer.time, "perf_counter", lambda: wall[0])
    monkeypatch.setattr(timer.time, "thread_time", lambda: cpu[0])

    class Table:
        def upload(self) -> None:  # waits: wall time only
            wall[0] += 0.0009

        def tags(self) -> None:  # works: wall and CPU alike
            wall[0] += 0.0003
            cpu[0] += 0.0003

    for name in ("upload", "tags"):
        timer._time_function(Table, name, f"core:Table.{name}", str(tmp_path))
    monkeypatch.setattr(rows, "torch", rows.torch)  # restored after the test
    real_zeros = torch.zeros

    def slow_zeros(*args: Any, **kwargs: Any) -> Any:
        wall[0] += 0.0002
        cpu[0] += 0.0001
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", slow_zeros)
    timer._time_torch_call(rows, "zeros", "core:definition.rows.torch.zeros")
    monkeypatch.setattr(torch, "zeros", real_zeros)
    table = Table()
    for _ in range(2):
        table.upload()
        table.tags()
        rows.upload_segments([np.zeros((3, 2), dtype=np.int64)], torch.device("cpu"))
    row = _dumped_row(timer, tmp_path, wall, steps=2, step_s=0.01)
    assert row["core_us_per_call"] == {
        "Table.upload": 900.0,
        "Table.tags": 300.0,
        "definition.rows.torch.zeros": 200.0,
    }
    assert row["core_cpu_us_per_call"] == {
        "Table.tags": 300.0,
        "definition.rows.torch.zeros": 100.0,
        "Table.upload": 0.0,
    }
    monkeypatch.setattr(timer, "_CPU", False)
    timer._whole_cpu.clear()
    table.upload()
    wall[0] += 10.0
    timer._dump(str(tmp_path))
    (row,) = timer.summarize(str(tmp_path)).values()
    assert row["core_cpu_us_per_call"] == {}


def test_deep_calls_beside_vllms_batch_copies_are_told_apart(
    tmp_path, monkeypatch
) -> None:
    """Issue 30, R142 (diagnosis): with KV_CHECKSUM_HOOK_TIMER_COPIES=1 vLLM's
    SimpleCPUOffloadConnector batch copies (`copy_blocks`, where its copy
    loop looks it up) are timed, and a deep call that overlapped one (a copy
    that started or ended during it, or was in progress when it started) is
    counted apart: the summary gives each such call's share and its
    microseconds a call beside a copy and alone. Bugs caught: only a copy in
    progress at the start looked at (a copy inside the call missed), only a
    change during the call looked at (a copy of another thread already
    running missed), the alone time taken over every call."""
    from vllm.v1.simple_kv_offload import copy_backend

    timer = load_script("kv_checksum_hook_timer_copies", SCRIPT)
    wall = [10.0]
    monkeypatch.setattr(timer.time, "perf_counter", lambda: wall[0])

    def copy_blocks(*args: Any) -> None:
        wall[0] += 0.005

    monkeypatch.setattr(copy_backend, "copy_blocks", copy_blocks)  # restored
    timer._time_copies()
    assert copy_backend.copy_blocks is not copy_blocks

    class Table:
        def upload(self, case: str) -> None:
            if case == "copy inside":  # as if the copy thread ran meanwhile
                copy_backend.copy_blocks([1], [2], None)
            wall[0] += 0.0009 if case == "copy running" else 0.0001

    timer._time_function(Table, "upload", "core:Table.upload", str(tmp_path))
    table = Table()
    for case in ("alone", "copy inside", "copy running", "alone"):
        timer._copy_active[0] = 1 if case == "copy running" else 0
        table.upload(case)
    timer._copy_active[0] = 0
    row = _dumped_row(timer, tmp_path, wall, steps=4, step_s=0.04)
    assert row["core_beside_copy"] == {
        "Table.upload": {"share": 0.5, "us_beside": 3000.0, "us_alone": 100.0}
    }
    assert row["vllm_us_per_step"] == {"copy_blocks": 1250.0}


def test_each_threads_cpu_seconds_are_read_and_summarized(tmp_path) -> None:
    """Issue 30, R142 (diagnosis): every thread of an engine process is listed
    with its kernel name, its Python name (None for threads Python did not
    start) and its CPU seconds (user + system ticks), read after the last ")"
    of its stat line by the benchmarks' /proc reader (a /proc tree written by
    its tests' helper); the summary lists the busiest first with CPU over the
    process's wall time and marks the engine thread. Bugs caught: fields
    counted from the line's start (a name with spaces or ")" shifts them),
    user time alone, the share taken over the steps' time, the main thread
    unmarked, a malformed stat line raising (into the engine's hook)."""
    from tests.v1.kv_connector.unit.test_kv_checksum_proc_stats import _task

    timer = load_script("kv_checksum_hook_timer_threads", SCRIPT)
    ticks = os.sysconf("SC_CLK_TCK")
    for tid, comm, utime, stime in (
        (700, "python3", 3 * ticks, 1 * ticks),
        (701, "copy (x) y", 9 * ticks, 1 * ticks),
        (702, "cuda-EvtHandlr", 0, 0),
    ):
        _task(tmp_path, 700, tid, comm, (utime, stime), (0, 0))
    tasks = tmp_path / "700" / "task"
    (tasks / "703").mkdir()  # ended before its stat was read
    (tasks / "704").mkdir()
    (tasks / "704" / "stat").write_text("704 (odd) S " + "x " * 20)  # skipped
    threads = timer.thread_cpu_seconds(str(tmp_path), 700)
    assert threads == {
        "700": {"name": "python3", "python": None, "cpu_s": 4.0},
        "701": {"name": "copy (x) y", "python": None, "cpu_s": 10.0},
        "702": {"name": "cuda-EvtHandlr", "python": None, "cpu_s": 0.0},
    }
    rows = timer._threads_summary(threads, 20.0, 700)
    assert [(r["tid"], r["main"], r["cpu_s"], r["share"]) for r in rows] == [
        (701, False, 10.0, 0.5),
        (700, True, 4.0, 0.2),
        (702, False, 0.0, 0.0),
    ]
    if os.path.isdir("/proc/self/task"):  # this process, read for real
        import threading

        main = threading.main_thread()
        own = timer.thread_cpu_seconds()[str(main.native_id)]
        assert own["python"] == main.name and own["cpu_s"] > 0.0


def test_deep_mode_counts_finalize_calls_that_find_their_copy_pending(
    tmp_path, monkeypatch
) -> None:
    """Issue 30, R142 (diagnosis): with deep mode on a pending record's
    `finalize` (which synchronizes on its side-stream copy's event), the
    calls whose event was not yet complete are counted without waiting, and
    the summary gives their share of the calls: the consumer's `finalize`
    rose to 1.31 of its time on 2026-12-04h with wait and work untold.
    Bugs caught: the event waited for by the count (`synchronize`), an
    already finalized record (no event) counted, the share over the steps."""
    from vllm.distributed.kv_transfer.kv_checksum.engine import records

    timer = load_script("kv_checksum_hook_timer_pending", SCRIPT)
    assert timer.DEEP_EVENT_WAITS == (
        ("engine.records", "KVChecksumPendingRecord", "finalize", "event"),
    )
    cls = records.KVChecksumPendingRecord
    monkeypatch.setattr(cls, "finalize", cls.__dict__["finalize"])  # restored

    class Event:
        def __init__(self, done: bool) -> None:
            self.done = done

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            raise AssertionError("the count must not wait")

    seen = []
    monkeypatch.setattr(cls, "finalize", lambda self: seen.append(self.event))
    monkeypatch.setenv("KV_CHECKSUM_HOOK_TIMER_DEEP", "KVChecksumPendingRecord")
    timer._time_core(str(tmp_path))
    items = [Event(False), Event(True), None, Event(False)]
    for event in items:
        cls.finalize(SimpleNamespace(event=event))  # type: ignore[arg-type]
    assert seen == items
    key = "core:KVChecksumPendingRecord.finalize"
    assert timer._pending[key] == 2 and timer._calls[key] == 4
    row = _summary_row(timer, tmp_path, 5, {key: 0.001}, {}, {key: 4}, pending={key: 2})
    assert row["core_pending_share"] == {"KVChecksumPendingRecord.finalize": 0.5}


def test_records_keep_the_caching_allocators_counters(tmp_path, monkeypatch) -> None:
    """Issue 30, R142 (diagnosis): with CUDA in use a record keeps the pinned
    host allocator's growth (blocks created, their CUDA time) and the device
    allocator's allocations, retries and syncs, the named keys only, and the
    summary passes them on; without CUDA initialized, or on a torch without
    host stats, there are none and CUDA is never initialized by asking.
    Bugs caught: CUDA initialized by the timer (`torch.cuda.init` in a
    process that had none), an older torch's missing function raising into
    the engine, every key of the device stats copied into each dump."""
    import sys

    timer = load_script("kv_checksum_hook_timer_allocators", SCRIPT)
    host = {"num_host_alloc": 7, "host_alloc_time.total": 900.0, "other": 1}
    device = {"num_alloc_retries": 2, "num_device_alloc": 40, "active.all": 3}
    calls: list[str] = []

    def cuda(initialized: bool, host_stats: Any) -> SimpleNamespace:
        def init() -> None:
            calls.append("init")

        return SimpleNamespace(
            is_initialized=lambda: initialized,
            init=init,
            memory=SimpleNamespace(host_memory_stats=host_stats),
            memory_stats=lambda: dict(device),
        )

    fake = SimpleNamespace(cuda=cuda(True, lambda: dict(host)))
    monkeypatch.setitem(sys.modules, "torch", fake)
    stats = timer.allocator_stats()
    assert stats == {
        "host": {"num_host_alloc": 7, "host_alloc_time.total": 900.0},
        "device": {"num_device_alloc": 40, "num_alloc_retries": 2},
    }
    row = _summary_row(timer, tmp_path, 6, {}, {}, {}, allocators=stats)
    assert row["allocators"] == stats

    def missing() -> dict:
        raise AttributeError("host_memory_stats")

    for cuda_now in (cuda(False, lambda: dict(host)), cuda(True, missing)):
        monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda_now))
        assert timer.allocator_stats() is None
    assert calls == []
    monkeypatch.delitem(sys.modules, "torch")
    assert timer.allocator_stats() is None


def test_an_idle_engines_last_calls_are_written_by_the_flusher(
    tmp_path, monkeypatch
) -> None:
    """Issue 30, R142 (diagnosis): the record is written on a timed call at most every
    2 s, so the calls of an engine's last 2 s before it goes idle stayed
    unwritten (2026-12-04b: an on producer recorded 1,424 of 1,552
    requests). `flush_if_idle` (the flusher thread's work) writes them once
    2 s passed without a dump, and does nothing before. Checked on a fake
    clock, calling the flusher's work directly (no thread, no sleeping).
    Bugs caught: a flush that ignores the interval (rewrites every round),
    or one that never writes (the lost calls stay lost)."""
    timer = load_script("kv_checksum_hook_timer_flush", SCRIPT)
    now = [100.0]
    monkeypatch.setattr(timer.time, "perf_counter", lambda: now[0])
    out = str(tmp_path)

    def step() -> None:
        timer._calls["EngineCore.step"] += 1
        timer._whole["EngineCore.step"] += 0.001
        timer._dump(out)

    def written_steps() -> int:
        record = json.loads(next(tmp_path.glob("*.json")).read_text())
        return record["calls"]["EngineCore.step"]

    step()  # the first dump
    now[0] += 0.5
    step()  # within 2 s: not written
    assert written_steps() == 1
    now[0] += 1.0
    assert not timer.flush_if_idle(out)  # 1.5 s since the dump: not due
    assert written_steps() == 1
    now[0] += 1.0
    assert timer.flush_if_idle(out)
    assert written_steps() == 2
    assert not timer.flush_if_idle(out)  # just written
    assert timer._flusher_pid[0] == 0  # loaded without activate(): no thread


def test_a_dump_that_meets_a_changing_table_never_raises(tmp_path, monkeypatch) -> None:
    """Issue 30, R142 (diagnosis): a timed call on another thread can change a table
    while a dump reads it; the dump must not raise into the engine (the
    wrapper's `finally` would carry it into vLLM's call) and the next dump
    writes the record. Bugs caught: the RuntimeError let through, or the
    failed dump counted as written (then nothing is written for 2 s)."""
    timer = load_script("kv_checksum_hook_timer_race", SCRIPT)
    now = [50.0]
    monkeypatch.setattr(timer.time, "perf_counter", lambda: now[0])
    out = str(tmp_path)
    real_write = timer._write
    fail = [True]

    def write(out_dir: str) -> None:
        if fail[0]:
            raise RuntimeError("dictionary changed size during iteration")
        real_write(out_dir)

    monkeypatch.setattr(timer, "_write", write)
    timer._calls["EngineCore.step"] += 1
    timer._dump(out)  # meets the change: no exception, nothing written
    assert not list(tmp_path.glob("*.json"))
    fail[0] = False
    now[0] += 0.1  # well within 2 s of the failed attempt
    timer._dump(out)
    assert len(list(tmp_path.glob("*.json"))) == 1
