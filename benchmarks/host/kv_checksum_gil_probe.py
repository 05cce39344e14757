# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How much host work a second thread hides from a running engine (issue 30).

A diagnosis tool for the GPU host, not part of the package. Before moving the
stores' host work off the engine thread, this measures what such a move can
gain under CPython's GIL: after each executed engine step
(`Scheduler.update_from_output`) it adds KV_CHECKSUM_GIL_PROBE_US (default
200) microseconds of pure-Python work, either on the engine thread
(KV_CHECKSUM_GIL_PROBE=inline) or handed to one daemon thread
(KV_CHECKSUM_GIL_PROBE=thread), which runs it in slices of
KV_CHECKSUM_GIL_PROBE_SLICE_US (default 10) and lets go of the GIL between
slices, as the package's torch calls do. Unset, it does nothing. Compared
against an engine without the probe in the same run, inline shows what the
work costs on the engine thread, thread what of it a second thread hides.

Installed as the engines' `sitecustomize.py` (`scripts/gpu_runs.sh
gil-probe`); the driver's `--mode-env` sets the mode for one slot only.
"""

import importlib.abc
import importlib.machinery
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SCHEDULER = "vllm.v1.core.sched.scheduler"
# The thread's queue at most this deep: beyond, a step's work is skipped and
# counted (a probe that falls behind is reported, not hidden).
MAX_BACKLOG = 8
REPORT_EVERY = 1000


def spin(us: float) -> None:
    """Pure-Python work for `us` microseconds, the GIL held throughout."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class ProbeThread:
    """One daemon thread that runs each submitted step's work in slices."""

    def __init__(
        self,
        work_us: float,
        slice_us: float,
        work: Callable[[float], None] = spin,
        release: Callable[[float], None] = time.sleep,
    ) -> None:
        self.work_us, self.slice_us = work_us, slice_us
        self.work, self.release = work, release
        self.pending: queue.SimpleQueue[float] = queue.SimpleQueue()
        self.done = 0
        self.skipped = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="gil-probe")
        self.thread.start()

    def submit(self) -> None:
        """One step's work, unless the thread is `MAX_BACKLOG` steps behind."""
        if self.pending.qsize() >= MAX_BACKLOG:
            self.skipped += 1
            return
        self.pending.put(self.work_us)

    def _run(self) -> None:
        while True:
            left = self.pending.get()
            while left > 0:
                piece = min(left, self.slice_us)
                self.work(piece)
                self.release(0)  # the GIL goes, as around a torch call
                left -= piece
            self.done += 1


class Probe:
    """The step callback: the work inline, or submitted to the thread."""

    def __init__(
        self,
        mode: str,
        work_us: float,
        slice_us: float,
        work: Callable[[float], None] = spin,
    ) -> None:
        if mode not in ("inline", "thread"):
            raise ValueError(f"KV_CHECKSUM_GIL_PROBE={mode!r}: inline or thread")
        self.mode, self.work_us, self.slice_us = mode, work_us, slice_us
        self.work = work
        self.thread: ProbeThread | None = None  # started at the first step
        self.steps = 0

    def after_step(self) -> None:
        self.steps += 1
        if self.mode == "inline":
            self.work(self.work_us)
        else:
            if self.thread is None:
                self.thread = ProbeThread(self.work_us, self.slice_us, self.work)
            self.thread.submit()
        if self.steps % REPORT_EVERY == 0:
            print(f"[gil-probe] {self.report()}", file=sys.stderr, flush=True)

    def report(self) -> str:
        text = f"mode {self.mode}, {self.work_us:g} us a step, {self.steps} steps"
        if self.thread is not None:
            text += f", thread done {self.thread.done}, skipped {self.thread.skipped}"
        return text


def wrap_update(scheduler_cls: type, probe: Probe) -> None:
    """`probe.after_step` after each `update_from_output` (one per step run)."""
    original = scheduler_cls.update_from_output  # type: ignore[attr-defined]

    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            probe.after_step()

    scheduler_cls.update_from_output = update_from_output  # type: ignore[attr-defined]


class _SchedulerFinder(importlib.abc.MetaPathFinder):
    """Wraps the Scheduler right after its module runs."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != SCHEDULER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module  # type: ignore[attr-defined]
        probe = self.probe

        def patched_exec(module: Any) -> None:
            exec_module(module)
            wrap_update(module.Scheduler, probe)
            print(f"[gil-probe] on: {probe.report()}", file=sys.stderr, flush=True)

        spec.loader.exec_module = patched_exec  # type: ignore[method-assign]
        return spec


def activate() -> None:
    mode = os.environ.get("KV_CHECKSUM_GIL_PROBE")
    if not mode:
        return
    work_us = float(os.environ.get("KV_CHECKSUM_GIL_PROBE_US", "200"))
    slice_us = float(os.environ.get("KV_CHECKSUM_GIL_PROBE_SLICE_US", "10"))
    sys.meta_path.insert(0, _SchedulerFinder(Probe(mode, work_us, slice_us)))


if __name__ == "__main__":
    print(__doc__)
else:
    activate()
