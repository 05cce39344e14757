# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GIL probe (issue 30, R142's cost measured): what a second thread can
hide of host work a step, the diagnosis before moving the stores' host work
off the engine thread."""

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

ROOT = Path(__file__).resolve().parents[4]
probe_module = load_script(
    "kv_checksum_gil_probe", ROOT / "benchmarks/host/kv_checksum_gil_probe.py"
)


def test_inline_work_runs_on_the_engine_thread_each_step() -> None:
    """R142: inline mode does the step's whole work in the calling (engine)
    thread, once per step. Bug caught: inline work handed to a thread (then
    the baseline of the comparison hides its own cost)."""
    calls: list[tuple[int, float]] = []
    probe = probe_module.Probe(
        "inline", 200.0, 10.0, work=lambda us: calls.append((threading.get_ident(), us))
    )
    probe.after_step()
    probe.after_step()
    assert calls == [(threading.get_ident(), 200.0)] * 2
    assert probe.thread is None and "2 steps" in probe.report()


def test_thread_work_runs_elsewhere_in_slices_that_let_go_of_the_gil() -> None:
    """R142: thread mode hands each step's work to one other thread, which
    runs it in slices that add up to the step's work, each followed by a GIL
    release. Bugs caught: the work done on the engine thread too, a slice
    lost or counted twice, or slices run without a release between them (the
    engine thread then waits out the switch interval)."""
    events: list[Any] = []
    finished = threading.Event()

    def work(us: float) -> None:
        events.append(("work", threading.get_ident(), us))

    def release(seconds: float) -> None:
        events.append(("release", seconds))
        if sum(e[2] for e in events if e[0] == "work") >= 2 * 25.0:
            finished.set()

    thread = probe_module.ProbeThread(25.0, 10.0, work, release)
    thread.submit()
    thread.submit()
    assert finished.wait(timeout=60)
    worked = [e for e in events if e[0] == "work"]
    assert [e[2] for e in worked] == [10.0, 10.0, 5.0] * 2
    assert {e[1] for e in worked} == {thread.thread.ident} != {threading.get_ident()}
    kinds = [e[0] for e in events]
    assert kinds == ["work", "release"] * 6


def test_a_thread_behind_by_the_backlog_skips_and_counts_steps() -> None:
    """R142: while the thread is `MAX_BACKLOG` steps behind, further steps'
    work is skipped and counted, not queued without bound. Bug caught: an
    unbounded queue (the probe then reports work it never did)."""
    gate = threading.Event()
    started = threading.Event()

    def work(us: float) -> None:
        started.set()
        gate.wait(timeout=60)

    thread = probe_module.ProbeThread(10.0, 10.0, work, lambda s: None)
    thread.submit()
    assert started.wait(timeout=60)  # the first step is taken off the queue
    for _ in range(probe_module.MAX_BACKLOG + 3):
        thread.submit()
    assert thread.skipped == 3
    gate.set()


def test_the_wrapped_update_returns_its_result_and_counts_failed_steps() -> None:
    """R142 (diagnosis): the wrapper keeps `update_from_output`'s result and
    exception and counts the step either way; vLLM 0.33.0's Scheduler has
    the method it wraps. Bugs caught: a renamed target (the probe then
    silently absent), a failed step left without its work."""
    from vllm.v1.core.sched.scheduler import Scheduler

    assert callable(Scheduler.update_from_output)
    done: list[float] = []

    class Stand:
        def update_from_output(self, value: Any) -> Any:
            if value is None:
                raise ValueError("bad step")
            return value

    probe = probe_module.Probe("inline", 5.0, 5.0, work=done.append)
    probe_module.wrap_update(Stand, probe)
    assert Stand().update_from_output(7) == 7
    with pytest.raises(ValueError):
        Stand().update_from_output(None)
    assert done == [5.0, 5.0] and probe.steps == 2


def test_an_unknown_mode_is_refused() -> None:
    """R142 (diagnosis): a mode other than inline or thread is refused, not
    read as one of them. Bug caught: a misspelt mode run as thread mode (the
    record then names a comparison that did not run)."""
    with pytest.raises(ValueError, match="inline or thread"):
        probe_module.Probe("threads", 200.0, 10.0)
