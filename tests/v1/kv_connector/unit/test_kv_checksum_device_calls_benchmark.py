# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The device-calls benchmark's cold-cache timing (issue 30, R142).

Inside an engine each checksum call runs after the rest of a step has pushed
its code and data out of the CPU caches; `--cold-mb` times each call after a
stand-in for that. A fake clock (no real timing) checks what is timed.
"""

from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

pytestmark = pytest.mark.cpu

SCRIPT = (
    Path(__file__).resolve().parents[4]
    / "benchmarks/host/benchmark_kv_checksum_device_calls.py"
)


def _load():
    return load_script("_device_calls_bench", SCRIPT)


def test_cold_timing_runs_the_evictor_before_each_call_outside_the_clock(
    monkeypatch,
) -> None:
    """R142: each timed call follows one eviction, and only the call is on the clock
    (the call takes 2 us, the eviction 1 s of a fake clock; one call a round
    takes 12 us, the median's outlier). Bugs caught: the eviction timed with
    the call (about 1e6 us), one eviction per round instead of per call (the
    calls after the first run warm), the mean instead of the median (3 us)."""
    bench = _load()
    clock = [0.0]
    order: list[str] = []
    durations = iter(([12e-6] + [2e-6] * 9) * 3)

    def call() -> None:
        order.append("call")
        clock[0] += next(durations, 2e-6)

    def evict() -> None:
        order.append("evict")
        clock[0] += 1.0

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    us = bench._timed_cold(call, calls=10, rounds=3, evict=evict)
    assert us == pytest.approx(2.0)
    assert order == ["evict", "call"] * 30


def test_evictor_sweeps_the_memory_it_was_given() -> None:
    """R142: the stand-in step writes one word of every 64-byte line of its buffer
    (a sweep of a fraction of it would leave the caches warm)."""
    bench = _load()
    evict = bench.cache_evictor(1)
    sweep = next(
        cell.cell_contents
        for cell in evict.__closure__ or ()
        if getattr(cell.cell_contents, "nbytes", 0) == 1 << 20
    )
    before = sweep.copy()
    evict()
    assert ((sweep - before)[::8] == 1).all()
    assert sweep.nbytes == 1 << 20


def test_paired_timing_alternates_the_two_paths(monkeypatch) -> None:
    """R142, issue 30: the prefix step's two ways are timed call by call in
    alternation, each call after its own eviction and only the call on the
    clock, so host drift during a round hits both alike (a fake clock: the
    first path takes 3 us, the second 6 us, the eviction 1 s). Bugs caught:
    the paths timed in two blocks (first, ..., first, second, ...), the
    eviction on the clock, the ratio taken first / second."""
    bench = _load()
    clock = [0.0]
    order: list[str] = []

    def path(name: str, seconds: float):
        def call() -> None:
            order.append(name)
            clock[0] += seconds

        return call

    def evict() -> None:
        order.append("evict")
        clock[0] += 1.0

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    one, two, ratio = bench._paired(
        path("one", 3e-6), path("two", 6e-6), calls=4, rounds=3, evict=evict
    )
    assert (one, two, ratio) == pytest.approx((3.0, 6.0, 2.0))
    assert order == ["evict", "one", "evict", "two"] * 12


def test_copy_thread_timing_alternates_without_and_with(monkeypatch) -> None:
    """R142, issue 30 (diagnosis): `--copy-thread` times each call without and with
    the copy thread in alternating rounds, the thread running only in the
    second half of each (a fake thread and clock: calls take 2 us alone and
    5 us beside it). Bugs caught: the thread left running into the next
    round's "without" half, the two halves swapped, one half never timed."""
    bench = _load()
    clock = [0.0]
    running = [False]
    states: list[bool] = []

    class FakeThread:
        def start(self) -> None:
            running[0] = True

        def stop(self) -> None:
            running[0] = False

    def call() -> None:
        states.append(running[0])
        clock[0] += 5e-6 if running[0] else 2e-6

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    alone, beside = bench.with_and_without(call, calls=3, rounds=4, thread=FakeThread())
    assert (alone, beside) == pytest.approx((2.0, 5.0))
    assert states == ([False] * 3 + [True] * 3) * 4
    assert not running[0]


def test_copy_thread_copies_until_stopped() -> None:
    """R142 (diagnosis): the copy thread (on CPU: host copies) copies its
    blocks in batches while started and stops when told. Bug: a thread that
    never runs (the "with" column would time nothing beside the call) or
    never stops."""
    import time

    import torch

    bench = _load()
    thread = bench.CopyThread(torch.device("cpu"), megabytes=1, blocks=4, layers=2)
    thread.start()
    while thread.batches < 3 and thread._thread.is_alive():
        time.sleep(0.001)  # a crashed thread ends the wait (then fails below)
    assert thread.batches >= 3
    thread.stop()
    done = thread.batches
    assert torch.equal(thread.host, thread.source)
    assert thread.batches == done  # stopped: no batch after stop()


def test_copy_thread_failure_is_recorded() -> None:
    """R142 (diagnosis): a copy thread whose copy fails keeps the error and
    copies no batch, so the run is reported void. Bug (2026-12-04f on the
    H200): the thread died on its first batch and the table still printed a
    "with" column timed beside no copies."""
    import torch

    bench = _load()
    thread = bench.CopyThread(torch.device("cpu"), megabytes=1, blocks=4, layers=2)

    thread.host = None  # the CPU copy then raises, as the driver call did
    thread.start()
    thread._thread.join()
    assert thread.batches == 0
    assert thread.error is not None and "NoneType" in thread.error


@pytest.mark.parametrize("fold", [True, False])
def test_the_fold_pair_runs_each_side_with_its_own_switch(fold: bool) -> None:
    """R118 (issue 30): each side of the "store save" pair runs with
    `FOLD_STORE_COPIES` as named, and the switch is back after every call,
    a raising one too. Bugs caught: the switch set once for the pair (both
    sides the same path, the ratio 1 whatever the fold costs), or left set
    after a call (every later path of the run timed with it)."""
    bench = _load()
    table = bench.block_table
    default = table.FOLD_STORE_COPIES
    seen: list[bool] = []

    def save() -> None:
        seen.append(table.FOLD_STORE_COPIES)

    bench.with_fold(save, fold)()
    assert seen == [fold]
    assert table.FOLD_STORE_COPIES is default

    def raises() -> None:
        raise RuntimeError("save failed")

    with pytest.raises(RuntimeError):
        bench.with_fold(raises, fold)()
    assert table.FOLD_STORE_COPIES is default
