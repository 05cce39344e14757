# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Wall time of every KV checksum hook inside a running engine (issue 30).

A diagnosis tool for the GPU host, not part of the package. Installed as
`sitecustomize.py` on the engines' PYTHONPATH with KV_CHECKSUM_HOOK_TIMER_DIR
set, it replaces the wiring's `_wrap` before `install()` runs, so each hook
counts its calls, its whole time and the time of the vLLM method it wraps;
`whole - wrapped` is the package's own time in that hook. It also counts
engine steps (`EngineCore.step*`). With KV_CHECKSUM_HOOK_TIMER_DEEP=1 it
also times every method of the core classes in `DEEP` (inclusive: nested
calls count in their callers too), to tell which part of a hook costs
(KV_CHECKSUM_HOOK_TIMER_DEEP=Class,Class...: those classes only, e.g.
KVChecksumPendingRecord, whose `finalize` waits for the step's host copy);
with KV_CHECKSUM_HOOK_TIMER_HOOKS=0 it leaves the hooks alone and counts
only steps and garbage collections (a nearly untouched engine). Garbage
collections are always counted, with their time, per generation, and per
hook those its own code set off (they count in its own time). With
KV_CHECKSUM_HOOK_TIMER_CPU=1 each hook also counts its thread's CPU time
(`time.thread_time`), and in deep mode each timed core call too
(`core_cpu_us_per_call`): own wall time well above own CPU time means the
engine thread waited inside the hook (for the GIL, or off its core) rather
than worked.
With KV_CHECKSUM_HOOK_TIMER_COPIES=1 vLLM's SimpleCPUOffloadConnector batch
copies (`copy_blocks`, called by its copy thread) are timed too
("vllm:copy_blocks") and marked while in progress, and in deep mode each core
call that overlapped one is counted apart (`core_beside_copy`: the share of
calls, and microseconds a call beside a copy and alone): whether the eager
tier's device calls wait on that thread.
With KV_CHECKSUM_HOOK_TIMER_REQUESTS=1 each scheduler also counts, per
request, the engine steps (and ms) between its arrival, the step whose output
reported its KV load finished, the first step that scheduled its tokens and
the step that gave its first token (`RequestSteps`): an extra step that
checksums put before a loaded request runs shows there, on or off.
With KV_CHECKSUM_HOOK_TIMER_VLLM=1 it also times vLLM's own step parts in
`VLLM_PARTS` (inclusive, on and off alike): the scheduler's `schedule` with
the package's work inside it (its `_update_after_schedule` hook, the block
pool's instance hooks of prefix-hit verification), `allocate_slots` (those
block pool hooks alone) and the executor's model call (the worker's hooks
and the forward's host time); with CPU=1 each part's thread CPU time too, and
the rest of its wall time as off-CPU time (`vllm_off_cpu_us_per_step`: the
engine thread waiting with the GIL released, or for the GIL).
With KV_CHECKSUM_HOOK_TIMER_RUNNING=1 vLLM's `Scheduler.schedule` also notes
how many requests were running at its start (`len(self.running)`) and puts
that step, and the hooks' own time of each call, in a bucket of
`RUNNING_BUCKETS` ("0" for none): the package's cost per step at 8, 64 or 256
running requests (issue 30 item 2), under "by_running". A step counts in the
bucket current at its end (its own schedule's), a hook's call in the one
current when it returns (calls between steps: the last step's).
Each process writes its totals to
DIR/PID.json every two seconds (on a timed call, or from a daemon thread
when the process is idle), with every thread's CPU seconds so far (Linux):
the summary's "threads_cpu" names what else in an engine process burns
CPU while its engine thread waits; and with CUDA in use, the caching host
and device allocators' counters ("allocators": pinned blocks created and
their CUDA time, device allocation retries). `python kv_checksum_hook_timer.py summarize
DIR` prints per process the package's time per step and per hook, with
checksums on and off told apart by whether any hook did work of its own.
"""

import functools
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any

PACKAGE = "vllm.distributed.kv_transfer.kv_checksum"
WIRING = f"{PACKAGE}.wiring"
# (module under the package, class): methods timed in deep mode.
DEEP = (
    ("engine.worker", "KVChecksumWorker"),
    ("engine.launches", "ChecksumLauncher"),
    ("engine.block_table", "BlockChecksumTable"),
    ("engine.records", "KVChecksumPendingRecord"),
    ("engine.scheduler", "KVChecksumScheduler"),
    ("engine.consumer", "KVChecksumConsumer"),
    ("engine.producer", "KVChecksumProducer"),
    ("engine.metrics", "KVChecksumStats"),
    ("offload.offloading", "OffloadWorkerSide"),
    ("offload.offloading", "OffloadSchedulerSide"),
    ("offload.offloading", "HostEntryTable"),
    ("offload.simple_cpu_offload", "SimpleOffloadWorkerSide"),
    ("offload.simple_cpu_offload", "SimpleOffloadSchedulerSide"),
    ("offload.loads", "KVChecksumOffloadLoads"),
    ("offload.held_calls", "HeldCalls"),
    ("definition.kernels", "KVChecksumLaunch"),
    ("definition.kernels", "CompiledLaunch"),
    ("definition.entry_kernels", "EntryKernels"),
    ("wire.payload", "KVChecksumPayload"),
)
# (module under the package, name): module-level functions timed in deep mode
# where that module looks them up (a class there: its construction), keyed
# "core:module.name"; KV_CHECKSUM_HOOK_TIMER_DEEP names them by name.
DEEP_FUNCTIONS = (
    ("engine.launches", "segment_rows"),
    ("engine.launches", "upload_segments"),
    ("engine.launches", "_Layout"),
    ("engine.consumer", "select_blocks"),
    ("engine.consumer", "verify_load"),
    ("engine.producer", "select_blocks"),
    ("engine.producer", "build_producer_payload"),
    ("engine.block_table", "block_checksum_tags"),
    ("engine.block_table", "upload_segments"),
    ("offload.offloading", "host_to_device"),
    ("definition.rows", "pack_segments"),
    ("offload.simple_cpu_offload", "block_places"),
)
# (module under the package, torch function): torch calls timed with
# KV_CHECKSUM_HOOK_TIMER_DEEP=1 (a list of names leaves them alone) where
# that module makes them (its `torch` name becomes a proxy that times
# these and passes every other attribute through), keyed
# "core:module.torch.name", with the elements they allocate beside ("what an
# upload's pinned buffer costs, and how large it is"). An upload less its
# `pack_segments` (which holds the pinned zeros) is its device copy.
DEEP_TORCH = (
    ("definition.rows", "zeros"),
    ("engine.launches", "empty"),
)
# (module under the package, class, method, event attribute): in deep mode,
# whether the instance's CUDA event (a device copy the method waits for) was
# still pending when the method was called, counted without waiting
# (`query()`): a `finalize` that mostly finds its copy unfinished waits for
# the GPU, one that finds it done works ("core_pending_share").
DEEP_EVENT_WAITS = (("engine.records", "KVChecksumPendingRecord", "finalize", "event"),)
# (module, class, method): vLLM's step parts timed with ..._VLLM=1; one a
# vLLM version lacks is skipped.
VLLM_PARTS = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor", "execute_model"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor", "sample_tokens"),
)
# Running-request buckets of ..._RUNNING=1: (name, low, high or None), in
# order; an empty running list is bucket "0".
RUNNING_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("1-15", 1, 15),
    ("16-127", 16, 127),
    ("128+", 128, None),
)
_DUMP_EVERY_S = 2.0
# Threads the summary lists per process, busiest first.
TOP_THREADS = 12

_CPU = os.environ.get("KV_CHECKSUM_HOOK_TIMER_CPU") == "1"
_RUNNING = os.environ.get("KV_CHECKSUM_HOOK_TIMER_RUNNING") == "1"
_COPIES = os.environ.get("KV_CHECKSUM_HOOK_TIMER_COPIES") == "1"

_whole: dict[str, float] = defaultdict(float)
_wrapped: dict[str, float] = defaultdict(float)
# With _CPU: the same, in the engine thread's CPU seconds.
_whole_cpu: dict[str, float] = defaultdict(float)
_wrapped_cpu: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)
# Deep mode's timed torch calls (`DEEP_TORCH`): elements allocated, by key.
_elements: dict[str, int] = defaultdict(int)
# Deep mode's `DEEP_EVENT_WAITS`: calls that found their event pending, by key.
_pending: dict[str, int] = defaultdict(int)
# With _COPIES: vLLM's batch copies in progress now, and a count that moves
# at each one's start and end (written by the copy thread only); deep calls
# that overlapped one, their seconds and count by key.
_copy_active = [0]
_copy_epoch = [0]
_beside: dict[str, float] = defaultdict(float)
_beside_calls: dict[str, int] = defaultdict(int)
# Deep mode: timed `warm_up` calls in progress. Core calls inside one (a
# kernel's first, compiling call) are kept under "warm-up:" keys, apart from
# the serving calls whose cost per call the summary reports.
_warming = [0]
WARM_UP = "warm-up:"
_last_dump = [0.0]
# When this process's timing began (`activate`, or the script's load).
_started = [time.perf_counter()]
# One writer at a time; the engine thread skips its dump while the flusher
# writes. The flusher: a daemon thread per process that writes the record
# when no timed call did for `_DUMP_EVERY_S` (an engine idle after its last
# requests would otherwise leave up to that long of them unwritten).
_dump_lock = threading.Lock()
_flusher_pid = [0]
_flusher_on = [False]  # set by `activate()` (an engine), not by tests' loads
# Garbage collections per generation: count and seconds.
_gc_counts = [0, 0, 0]
_gc_seconds = [0.0, 0.0, 0.0]
_gc_start = [0.0]
# Seconds of every collection so far, and per hook those that ran inside the
# hook's call and inside the vLLM method it wraps: whole - wrapped is the
# collections the hook's own code set off, counted in its own time.
_gc_total = [0.0]
_whole_gc: dict[str, float] = defaultdict(float)
_wrapped_gc: dict[str, float] = defaultdict(float)
# With _RUNNING: the bucket and running count of the last schedule() call,
# and per bucket the hooks' own seconds, the steps, their seconds and the
# sum of their running counts.
_current_bucket = "0"
_current_running = 0
_bucket_own: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_bucket_steps: dict[str, int] = defaultdict(int)
_bucket_step_s: dict[str, float] = defaultdict(float)
_bucket_running_sum: dict[str, int] = defaultdict(int)


def _cpu_now() -> float:
    return time.thread_time() if _CPU else 0.0


def running_bucket(running: int) -> str:
    """The `RUNNING_BUCKETS` name of `running` requests ("0" for none)."""
    if running <= 0:
        return "0"
    for name, low, high in RUNNING_BUCKETS:
        if running >= low and (high is None or running <= high):
            return name
    return RUNNING_BUCKETS[-1][0]


def _track_running(scheduler_cls: type) -> None:
    """Set the current bucket from `len(self.running)` at the start of each
    `schedule()` (the requests a step starts with)."""
    schedule = scheduler_cls.schedule  # type: ignore[attr-defined]

    @functools.wraps(schedule)
    def tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _current_bucket, _current_running
        _current_running = len(self.running)
        _current_bucket = running_bucket(_current_running)
        return schedule(self, *args, **kwargs)

    scheduler_cls.schedule = tracked  # type: ignore[attr-defined]


def _by_running_record() -> dict[str, dict[str, Any]]:
    """The per-bucket totals as `_dump` writes them."""
    buckets = dict.fromkeys([*_bucket_steps, *_bucket_own])
    return {
        bucket: {
            "steps": _bucket_steps.get(bucket, 0),
            "step_s": _bucket_step_s.get(bucket, 0.0),
            "running_sum": _bucket_running_sum.get(bucket, 0),
            "own": dict(_bucket_own.get(bucket, {})),
        }
        for bucket in buckets
    }


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
        return
    generation = min(int(info.get("generation", 0)), 2)
    _gc_counts[generation] += 1
    seconds = time.perf_counter() - _gc_start[0]
    _gc_seconds[generation] += seconds
    _gc_total[0] += seconds


def _proc_stats() -> Any:
    """`benchmarks/kv_checksum_proc_stats.py` (the benchmarks' per-thread
    /proc reader): by name where gpu_runs.sh copies it beside this file's
    sitecustomize copy, else from the repository; None if neither."""
    try:
        import kv_checksum_proc_stats  # type: ignore[import-not-found]

        return kv_checksum_proc_stats
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "kv_checksum_proc_stats.py")
    spec = importlib.util.spec_from_file_location("kv_checksum_proc_stats", path)
    if spec is None or spec.loader is None or not os.path.exists(path):
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["kv_checksum_proc_stats"] = module
    return module


def thread_cpu_seconds(proc: str = "/proc", pid: int | None = None) -> dict[str, dict]:
    """Per thread of this process (Linux), keyed by thread id: its kernel
    name, its Python name (None for a thread Python did not start: CUDA's,
    NCCL's) and its CPU seconds so far (user + system); {} without /proc.
    Read with `kv_checksum_proc_stats.sample_threads` (threads gone or
    unreadable meanwhile are left out, never raised into the engine).

    Beside a hook's wall and CPU time: a thread of the engine process that
    burns CPU while the engine thread waits inside a hook (vLLM's copy
    thread, a busy polling thread) is what it waited for."""
    from pathlib import Path

    stats = _proc_stats()
    if stats is None:
        return {}
    try:
        samples = stats.sample_threads(
            [os.getpid() if pid is None else pid], Path(proc)
        )
    except (OSError, ValueError):
        return {}
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    return {
        str(tid): {
            "name": sample.thread,
            "python": python_names.get(tid),
            "cpu_s": sample.cpu_s,
        }
        for tid, sample in samples.items()
    }


# The caching allocators' counters a record keeps (PyTorch's names; those a
# version lacks are left out): pinned host blocks created with their CUDA
# time, and device allocations, frees, retries and whole-device syncs.
HOST_ALLOCATOR_KEYS = (
    "num_host_alloc",
    "num_host_free",
    "host_alloc_time.total",
    "host_free_time.total",
    "allocations.current",
    "allocated_bytes.current",
    "active_requests.current",
)
DEVICE_ALLOCATOR_KEYS = (
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
    "num_sync_all_streams",
    "num_ooms",
)


def allocator_stats() -> dict[str, dict[str, float]] | None:
    """The caching host (pinned) and device allocators' counters of this
    process's CUDA device, or None where CUDA is not in use (torch not
    imported, CUDA not initialized: never initialized here). An upload that
    costs hundreds of microseconds in an engine and 13-17 alone may be
    growing the pinned pool (`cudaHostAlloc`) or retrying device allocations
    (each retry frees the cache after a sync); these counters tell."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        host = torch.cuda.memory.host_memory_stats()
        device = torch.cuda.memory_stats()
    except Exception:  # an older torch, or no device: nothing to report
        return None
    return {
        "host": {k: host[k] for k in HOST_ALLOCATOR_KEYS if k in host},
        "device": {k: device[k] for k in DEVICE_ALLOCATOR_KEYS if k in device},
    }


class RequestSteps:
    """Steps and ms between the events of each request of one scheduler.

    Events: "add" (arrival), "load_done" (the step whose output reported its
    load finished), "scheduled" (the first step that scheduled tokens of it)
    and "first_token". When the first token comes, each interval between two
    of its events is counted (steps: a histogram; ms: a list, bounded) and the
    request is forgotten; the step counter is the number of outputs processed.
    """

    INTERVALS = (
        ("add", "first_token"),
        ("add", "load_done"),
        ("load_done", "scheduled"),
        ("scheduled", "first_token"),
    )
    MAX_MS = 2000  # ms values kept per interval (each dump writes them all)
    MAX_OPEN = 10000  # requests tracked at once (aborted ones are dropped)

    def __init__(self) -> None:
        self.step = 0
        self.open: dict[str, dict[str, tuple[int, float]]] = {}
        self.steps: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.ms: dict[str, list[float]] = defaultdict(list)

    def on_add(self, req_id: str, now: float) -> None:
        if len(self.open) >= self.MAX_OPEN:
            self.open.clear()
        self.open[req_id] = {"add": (self.step, now)}

    def on_output(
        self,
        scheduled: Any,
        finished_loads: Any,
        first_tokens: Any,
        now: float,
    ) -> None:
        """One step's output: `scheduled` maps request ids to their scheduled
        tokens; `finished_loads` and `first_tokens` are request ids."""
        step = self.step
        self.step += 1
        for req_id in finished_loads or ():
            events = self.open.get(req_id)
            if events is not None:
                events.setdefault("load_done", (step, now))
        for req_id, tokens in scheduled.items():
            events = self.open.get(req_id)
            if events is not None and tokens:
                events.setdefault("scheduled", (step, now))
        for req_id in first_tokens:
            events = self.open.pop(req_id, None)
            if events is None:
                continue
            events["first_token"] = (step, now)
            loaded = "load_done" in events
            for start, end in self.INTERVALS:
                if start in events and end in events:
                    name = f"{start}->{end}" + (" (loaded)" if loaded else "")
                    self.steps[name][events[end][0] - events[start][0]] += 1
                    if len(self.ms[name]) < self.MAX_MS:
                        self.ms[name].append(1e3 * (events[end][1] - events[start][1]))

    def record(self) -> dict:
        return {
            "steps": {k: dict(v) for k, v in self.steps.items()},
            "ms": dict(self.ms),
        }


_requests = RequestSteps()


def _trace_requests(scheduler_cls: type) -> None:
    """Feed `_requests` from the scheduler's own methods (vLLM's classes,
    whether or not checksums are on)."""
    add_request = scheduler_cls.add_request
    update_from_output = scheduler_cls.update_from_output

    @functools.wraps(add_request)
    def traced_add(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _requests.on_add(request.request_id, time.perf_counter())
        return add_request(self, request, *args, **kwargs)

    @functools.wraps(update_from_output)
    def traced_update(
        self: Any, scheduler_output: Any, model_output: Any, *args: Any, **kwargs: Any
    ) -> Any:
        result = update_from_output(
            self, scheduler_output, model_output, *args, **kwargs
        )
        kv_output = getattr(model_output, "kv_connector_output", None)
        first = [
            out.request_id
            for outputs in (result or {}).values()
            for out in outputs.outputs
            if out.new_token_ids and out.request_id in _requests.open
        ]
        _requests.on_output(
            scheduler_output.num_scheduled_tokens,
            getattr(kv_output, "finished_recving", None),
            first,
            time.perf_counter(),
        )
        return result

    scheduler_cls.add_request = traced_add
    scheduler_cls.update_from_output = traced_update


def _dump(out_dir: str) -> None:
    now = time.perf_counter()
    if now - _last_dump[0] < _DUMP_EVERY_S:
        return
    if _flusher_on[0]:
        _start_flusher(out_dir)
    if not _dump_lock.acquire(blocking=False):
        return  # the flusher (or another thread) is writing
    try:
        _write_at(out_dir, now)
    finally:
        _dump_lock.release()


def flush_if_idle(out_dir: str) -> bool:
    """The flusher's work: write the record if no dump did for
    `_DUMP_EVERY_S`; False if not due, or if the engine thread changed a
    table while it was read (the next round writes it)."""
    with _dump_lock:
        now = time.perf_counter()
        return now - _last_dump[0] >= _DUMP_EVERY_S and _write_at(out_dir, now)


def _write_at(out_dir: str, now: float) -> bool:
    """`_write`, then `now` is the last dump; with the lock held. False when a
    table changed under a timed call on another thread while it was read
    ("dictionary changed size during iteration"): never raised into the
    engine, and the next dump writes it."""
    try:
        _write(out_dir)
    except RuntimeError:
        return False
    _last_dump[0] = now
    return True


def _start_flusher(out_dir: str) -> None:
    """Start this process's flusher once (a forked child starts its own)."""
    if _flusher_pid[0] == os.getpid():
        return
    _flusher_pid[0] = os.getpid()

    def run() -> None:
        while True:
            time.sleep(_DUMP_EVERY_S)
            try:
                flush_if_idle(out_dir)
            except Exception as e:  # never into the engine; report once
                print(f"[hook-timer] flusher stopped: {e!r}", file=sys.stderr)
                return

    threading.Thread(target=run, name="kv-checksum-hook-timer", daemon=True).start()


def _write(out_dir: str) -> None:
    """This process's totals to OUT_DIR/PID.json (through a temporary file)."""
    path = os.path.join(out_dir, f"{os.getpid()}.json")
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        # Which engine of a P/D pair (the serve benchmark's launch script gives
        # each engine its own side channel port).
        "side_channel_port": os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT"),
        "whole": dict(_whole),
        "wrapped": dict(_wrapped),
        "calls": dict(_calls),
        "elements": dict(_elements),
        "pending": dict(_pending),
        "beside": dict(_beside),
        "beside_calls": dict(_beside_calls),
        "whole_cpu": dict(_whole_cpu),
        "wrapped_cpu": dict(_wrapped_cpu),
        "gc_counts": list(_gc_counts),
        "gc_seconds": list(_gc_seconds),
        "whole_gc": dict(_whole_gc),
        "wrapped_gc": dict(_wrapped_gc),
        "request_steps": _requests.record(),
        "wall_s": time.perf_counter() - _started[0],
        "threads": thread_cpu_seconds(),
        "allocators": allocator_stats(),
    }
    if _RUNNING:
        record["by_running"] = _by_running_record()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _timed_wrap(out_dir: str) -> Any:
    """A `_wrap` that times the hook and the original it calls."""

    def timed_wrap(cls: type, name: str) -> Any:
        key = f"{cls.__name__}.{name}"

        def decorator(hook: Any) -> Any:
            original = getattr(cls, name)

            @functools.wraps(original)
            def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
                # This call's wrapped time, apart from the running totals (a
                # hook may call its original more than once, or not at all).
                inner = [0.0]

                def call_original(*a: Any, **k: Any) -> Any:
                    start, cpu, gc_at = time.perf_counter(), _cpu_now(), _gc_total[0]
                    try:
                        return original(*a, **k)
                    finally:
                        elapsed = time.perf_counter() - start
                        inner[0] += elapsed
                        _wrapped[key] += elapsed
                        _wrapped_cpu[key] += _cpu_now() - cpu
                        _wrapped_gc[key] += _gc_total[0] - gc_at

                start, cpu, gc_at = time.perf_counter(), _cpu_now(), _gc_total[0]
                try:
                    return hook(call_original, self, *args, **kwargs)
                finally:
                    whole = time.perf_counter() - start
                    _whole[key] += whole
                    _whole_cpu[key] += _cpu_now() - cpu
                    _whole_gc[key] += _gc_total[0] - gc_at
                    _calls[key] += 1
                    if _RUNNING:
                        _bucket_own[_current_bucket][key] += whole - inner[0]
                    _dump(out_dir)

            timed.__kv_checksum_original__ = original  # type: ignore[attr-defined]
            setattr(cls, name, timed)
            return hook

        return decorator

    return timed_wrap


def _time_steps(out_dir: str) -> None:
    """Count engine steps and their time (both step functions of EngineCore)."""
    from vllm.v1.engine.core import EngineCore

    for name in ("step", "step_with_batch_queue"):
        original = getattr(EngineCore, name, None)
        if original is None:
            continue
        key = f"EngineCore.{name}"

        def wrapper(self: Any, *a: Any, _o: Any = original, _k: str = key, **k: Any):
            start = time.perf_counter()
            try:
                return _o(self, *a, **k)
            finally:
                elapsed = time.perf_counter() - start
                _whole[_k] += elapsed
                _calls[_k] += 1
                if _RUNNING:
                    # The bucket at the step's end: its own schedule() ran
                    # inside it.
                    _bucket_steps[_current_bucket] += 1
                    _bucket_step_s[_current_bucket] += elapsed
                    _bucket_running_sum[_current_bucket] += _current_running
                _dump(out_dir)

        setattr(EngineCore, name, wrapper)


def _time_function(owner: Any, name: str, key: str, out_dir: str) -> None:
    original = owner.__dict__[name]

    warm_up = name == "warm_up"

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), _cpu_now()
        copying, epoch = _copy_active[0], _copy_epoch[0]
        if warm_up:
            _warming[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            if warm_up:
                _warming[0] -= 1
            timed = WARM_UP + key if _warming[0] and not warm_up else key
            elapsed = time.perf_counter() - start
            _whole[timed] += elapsed
            if _CPU:
                _whole_cpu[timed] += _cpu_now() - cpu
            _calls[timed] += 1
            if copying or _copy_epoch[0] != epoch:  # a copy ran beside it
                _beside[timed] += elapsed
                _beside_calls[timed] += 1
            _dump(out_dir)

    setattr(owner, name, wrapper)


def _deep_names(setting: str) -> set[str] | None:
    """The names KV_CHECKSUM_HOOK_TIMER_DEEP lists, None for "1" (all); an
    unknown name is reported and skipped."""
    if setting.strip() == "1":
        return None
    names = {name.strip() for name in setting.split(",") if name.strip()}
    known = {c for _, c in DEEP} | {f for _, f in DEEP_FUNCTIONS}
    for name in sorted(names - known):
        print(f"[hook-timer] {name} is not in DEEP; not timed", file=sys.stderr)
    return names


def deep_classes(setting: str) -> list[tuple[str, str]]:
    """The `DEEP` entries KV_CHECKSUM_HOOK_TIMER_DEEP names: "1" for all of
    them, else a comma-separated list of class (or `DEEP_FUNCTIONS` function)
    names (e.g. "KVChecksumPendingRecord,KVChecksumConsumer": fewer wrappers,
    and a run that times one suspect alone); an unknown name is reported and
    skipped."""
    names = _deep_names(setting)
    return [(m, c) for m, c in DEEP if names is None or c in names]


def deep_functions(setting: str) -> list[tuple[str, str]]:
    """The `DEEP_FUNCTIONS` entries the same setting names ("1": all)."""
    names = _deep_names(setting)
    return [(m, f) for m, f in DEEP_FUNCTIONS if names is None or f in names]


def _package_module(module_name: str) -> Any:
    """A module under the package, None (reported) if it does not import."""
    import importlib

    try:
        return importlib.import_module(f"{PACKAGE}.{module_name}")
    except Exception as e:
        print(f"[hook-timer] {module_name} not timed: {e!r}", file=sys.stderr)
        return None


def _time_core(out_dir: str) -> None:
    """Deep mode: every plain method of the `DEEP` classes and every
    `DEEP_FUNCTIONS` function (or those named)."""
    setting = os.environ.get("KV_CHECKSUM_HOOK_TIMER_DEEP", "1")
    for module_name, class_name in deep_classes(setting):
        cls = getattr(_package_module(module_name), class_name, None)
        if cls is None:
            continue
        for name, value in list(vars(cls).items()):
            if name.startswith("__") or not callable(value) or isinstance(value, type):
                continue
            _time_function(cls, name, f"core:{class_name}.{name}", out_dir)
    for module_name, name in deep_functions(setting):
        module = _package_module(module_name)
        if module is not None and name in vars(module):
            _time_function(module, name, f"core:{module_name}.{name}", out_dir)
    for module_name, class_name, name, attribute in DEEP_EVENT_WAITS:
        cls = getattr(_package_module(module_name), class_name, None)
        if cls is not None and (setting.strip() == "1" or class_name in setting):
            _count_pending(cls, name, attribute, f"core:{class_name}.{name}")
    if setting.strip() == "1":
        for module_name, name in DEEP_TORCH:
            module = _package_module(module_name)
            if module is not None and "torch" in vars(module):
                _time_torch_call(module, name, f"core:{module_name}.torch.{name}")


def _count_pending(cls: type, name: str, attribute: str, key: str) -> None:
    """Count the calls of `cls.name` whose `attribute` (an event) was not yet
    complete when called; `query()` never waits."""
    original = cls.__dict__[name]

    @functools.wraps(original)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        event = getattr(self, attribute, None)
        if event is not None and not event.query():
            _pending[key] += 1
        return original(self, *args, **kwargs)

    setattr(cls, name, counted)


class _TimedTorch:
    """A module's `torch` with some functions timed (`DEEP_TORCH`); every
    other attribute is the real module's."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _time_torch_call(module: Any, name: str, key: str) -> None:
    """Time `module`'s calls of torch.`name` and count what they allocate."""
    proxy = module.torch
    if not isinstance(proxy, _TimedTorch):
        proxy = _TimedTorch(proxy)
        module.torch = proxy
    original = getattr(proxy._real, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), _cpu_now()
        tensor = original(*args, **kwargs)
        _whole[key] += time.perf_counter() - start
        if _CPU:
            _whole_cpu[key] += _cpu_now() - cpu
        _calls[key] += 1
        _elements[key] += tensor.numel()
        return tensor

    setattr(proxy, name, timed)


def _time_copies() -> None:
    """SimpleCPUOffloadConnector's batch copies, where its copy loop looks
    `copy_blocks` up: each timed ("vllm:copy_blocks") and marked in progress
    for the deep calls of other threads to see (`_copy_active`,
    `_copy_epoch`)."""
    from vllm.v1.simple_kv_offload import copy_backend

    original = copy_backend.copy_blocks

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        _copy_active[0] += 1
        _copy_epoch[0] += 1
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _whole["vllm:copy_blocks"] += time.perf_counter() - start
            _calls["vllm:copy_blocks"] += 1
            _copy_active[0] -= 1
            _copy_epoch[0] += 1

    copy_backend.copy_blocks = timed


def _time_vllm_parts(out_dir: str) -> None:
    """vLLM's step parts of `VLLM_PARTS`, whole (key "vllm:Class.method")."""
    import importlib

    for module_name, class_name, name in VLLM_PARTS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception as e:
            print(f"[hook-timer] {class_name} not timed: {e!r}", file=sys.stderr)
            continue
        if name in vars(cls):
            _time_function(cls, name, f"vllm:{class_name}.{name}", out_dir)


class _WiringFinder(importlib.abc.MetaPathFinder):
    """Patches the wiring module right after it runs, before `install()`."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != WIRING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        out_dir = self.out_dir
        exec_module = loader.exec_module  # type: ignore[attr-defined]

        def patched_exec(module: Any) -> None:
            exec_module(module)
            if os.environ.get("KV_CHECKSUM_HOOK_TIMER_HOOKS", "1") != "0":
                module._wrap = _timed_wrap(out_dir)
            if os.environ.get("KV_CHECKSUM_HOOK_TIMER_DEEP"):
                install = module.install

                def deep_install() -> None:
                    install()
                    _time_core(out_dir)

                module.install = deep_install
            try:
                _time_steps(out_dir)
            except Exception as e:  # the hooks' timing still works
                print(f"[hook-timer] steps not timed: {e!r}", file=sys.stderr)
            if os.environ.get("KV_CHECKSUM_HOOK_TIMER_REQUESTS") == "1":
                from vllm.v1.core.sched.scheduler import Scheduler

                # Before install(): the package's hooks wrap these, so the
                # trace sees vLLM's own calls on and off alike.
                _trace_requests(Scheduler)
            if _RUNNING:
                from vllm.v1.core.sched.scheduler import Scheduler

                # Before install(), as above: the bucket is set before the
                # package's hooks of the step run.
                _track_running(Scheduler)
            if os.environ.get("KV_CHECKSUM_HOOK_TIMER_VLLM") == "1":
                _time_vllm_parts(out_dir)
            if _COPIES:
                try:
                    _time_copies()
                except Exception as e:  # no such connector in this vLLM
                    print(f"[hook-timer] copies not timed: {e!r}", file=sys.stderr)

        loader.exec_module = patched_exec  # type: ignore[method-assign]
        return spec


def activate() -> None:
    out_dir = os.environ.get("KV_CHECKSUM_HOOK_TIMER_DIR")
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    sys.meta_path.insert(0, _WiringFinder(out_dir))
    _started[0] = time.perf_counter()
    gc.callbacks.append(_on_gc)
    _flusher_on[0] = True


def own_by_hook() -> dict[str, float]:
    """This process's hooks' own seconds so far (whole - wrapped) by hook;
    engine steps and deep-mode core methods (nested in hooks) left out."""
    return {
        key: _whole[key] - _wrapped.get(key, 0.0)
        for key in list(_whole)
        if not key.startswith(("EngineCore.", "core:", WARM_UP))
    }


def summarize(out_dir: str) -> dict:
    """Per process with engine steps: steps, ms in steps, and the package's
    own µs per step in each hook (whole - wrapped)."""
    result = {}
    for name in sorted(os.listdir(out_dir)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(out_dir, name)) as f:
            record = json.load(f)
        calls = record["calls"]
        steps = sum(v for k, v in calls.items() if k.startswith("EngineCore."))
        if not steps:
            continue
        own = {
            k: record["whole"][k] - record["wrapped"].get(k, 0.0)
            for k in record["whole"]
            if not k.startswith(("EngineCore.", "core:", "vllm:", WARM_UP))
        }
        core = {
            k[len("core:") :]: v
            for k, v in record["whole"].items()
            if k.startswith("core:")
        }
        core_cpu = {
            k[len("core:") :]: v
            for k, v in record.get("whole_cpu", {}).items()
            if k.startswith("core:")
        }
        parts = {
            k[len("vllm:") :]: v
            for k, v in record["whole"].items()
            if k.startswith("vllm:")
        }
        parts_cpu = {
            k[len("vllm:") :]: v
            for k, v in record.get("whole_cpu", {}).items()
            if k.startswith("vllm:")
        }
        # Hooks that ran once (constructors) are start-up, not step, cost.
        once = {k for k in own if calls.get(k, 0) <= 1}
        own_cpu = {
            k: v - record.get("wrapped_cpu", {}).get(k, 0.0)
            for k, v in record.get("whole_cpu", {}).items()
            if not k.startswith(("EngineCore.", "core:", "vllm:"))
        }
        own_gc = {
            k: v - record.get("wrapped_gc", {}).get(k, 0.0)
            for k, v in record.get("whole_gc", {}).items()
        }
        step_s = sum(v for k, v in record["whole"].items() if k.startswith("Engine"))
        result[str(record["pid"])] = {
            "ppid": record["ppid"],
            "side_channel_port": record.get("side_channel_port"),
            "steps": steps,
            "step_ms_mean": 1e3 * step_s / steps,
            "own_us_per_step": 1e6 * sum(own.values()) / steps,
            "own_us_per_step_without_start_up": round(
                1e6 * sum(v for k, v in own.items() if k not in once) / steps, 2
            ),
            "hooks_us_per_step": {
                k: round(1e6 * v / steps, 2)
                for k, v in sorted(own.items(), key=lambda kv: -kv[1])
            },
            "own_cpu_us_per_step": round(1e6 * sum(own_cpu.values()) / steps, 2),
            # Thread CPU time (..._CPU=1) per hook, start-up left out: set
            # beside hooks_us_per_step, wall well above CPU is waiting (the
            # GIL, or off the core), not work.
            "own_cpu_us_per_step_without_start_up": round(
                1e6 * sum(v for k, v in own_cpu.items() if k not in once) / steps, 2
            ),
            "hooks_cpu_us_per_step": {
                k: round(1e6 * v / steps, 2)
                for k, v in sorted(own_cpu.items(), key=lambda kv: -kv[1])
                if k not in once
            },
            # Collections set off by a hook's own code, in its own time
            # (start-up left out): hooks_us_per_step less these is the hook's
            # code alone.
            "hooks_gc_us_per_step": {
                k: round(1e6 * v / steps, 2)
                for k, v in sorted(own_gc.items(), key=lambda kv: -kv[1])
                if k not in once and v > 0
            },
            "gc_us_per_step": round(1e6 * sum(record.get("gc_seconds", [])) / steps, 2),
            "gc_counts": record.get("gc_counts"),
            "core_us_per_step": {
                k: round(1e6 * v / steps, 2)
                for k, v in sorted(core.items(), key=lambda kv: -kv[1])
            },
            # Per call (deep mode): what one pass, load or payload costs,
            # methods called once (warm-up, start-up) and calls inside a
            # warm-up left out.
            "core_us_per_call": _per_call(core, calls),
            # The same in the engine thread's CPU time (..._CPU=1): a call
            # whose wall time stands well above it waited (for the GIL, a
            # driver lock, or off its core) rather than worked.
            "core_cpu_us_per_call": _per_call(core_cpu, calls),
            # Timed torch allocations (`DEEP_TORCH`): elements a call.
            "core_elements_per_call": {
                k[len("core:") :]: round(v / calls[k], 1)
                for k, v in (record.get("elements") or {}).items()
                if calls.get(k)
            },
            # `DEEP_EVENT_WAITS`: the share of calls that found their device
            # copy unfinished (and so waited for the GPU).
            "core_pending_share": {
                k[len("core:") :]: round(v / calls[k], 3)
                for k, v in (record.get("pending") or {}).items()
                if calls.get(k)
            },
            # With ..._COPIES=1: per deep call that ever overlapped one of
            # vLLM's batch copies, the share of its calls that did and its
            # microseconds a call beside a copy and alone.
            "core_beside_copy": _beside_copy(
                record.get("whole", {}),
                record.get("beside") or {},
                record.get("beside_calls") or {},
                calls,
            ),
            "core_warm_up_ms": {
                k[len(WARM_UP + "core:") :]: round(1e3 * v, 2)
                for k, v in sorted(record["whole"].items(), key=lambda kv: -kv[1])
                if k.startswith(WARM_UP + "core:")
            },
            "vllm_us_per_step": {
                k: round(1e6 * v / steps, 2)
                for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
            },
            # With _CPU: the engine thread's CPU time in each part, and the
            # rest of its wall time, off the CPU: waiting with the GIL
            # released (on the GPU's results, mostly in sample_tokens) or for
            # the GIL. Another thread's Python work can only hide there.
            "vllm_cpu_us_per_step": {
                k: round(1e6 * parts_cpu[k] / steps, 2) for k in parts if k in parts_cpu
            },
            "vllm_off_cpu_us_per_step": {
                k: round(1e6 * max(parts[k] - parts_cpu[k], 0.0) / steps, 2)
                for k in parts
                if k in parts_cpu
            },
            "calls": calls,
            "request_steps": _request_summary(record.get("request_steps") or {}),
            # The allocators' counters at the last dump (`allocator_stats`).
            "allocators": record.get("allocators"),
            "threads_cpu": _threads_summary(
                record.get("threads") or {}, record.get("wall_s"), record["pid"]
            ),
        }
        if "by_running" in record:
            result[str(record["pid"])]["by_running"] = _running_summary(
                record["by_running"], calls
            )
    return result


def _threads_summary(threads: dict, wall_s: float | None, pid: int) -> list[dict]:
    """The process's busiest threads (at most `TOP_THREADS`), most CPU first:
    name, Python name, CPU seconds and CPU over the process's timed wall
    time ("share": 1.0 is one core all the time); the engine thread (the
    process id) is marked "main"."""
    rows = []
    for tid, thread in threads.items():
        share = thread["cpu_s"] / wall_s if wall_s else None
        rows.append(
            {
                "tid": int(tid),
                "main": int(tid) == pid,
                "name": thread["name"],
                "python": thread["python"],
                "cpu_s": round(thread["cpu_s"], 2),
                "share": None if share is None else round(share, 3),
            }
        )
    rows.sort(key=lambda row: -row["cpu_s"])
    return rows[:TOP_THREADS]


def _per_call(core: dict[str, float], calls: dict[str, int]) -> dict[str, float]:
    """Deep mode's microseconds a call of each timed method or function (key
    without "core:"), largest first; those called at most once left out."""
    per_call = {
        name: 1e6 * seconds / calls[f"core:{name}"]
        for name, seconds in core.items()
        if calls.get(f"core:{name}", 0) > 1
    }
    return {
        name: round(us, 1)
        for name, us in sorted(per_call.items(), key=lambda kv: -kv[1])
    }


def _beside_copy(
    whole: dict[str, float],
    beside: dict[str, float],
    beside_calls: dict[str, int],
    calls: dict[str, int],
) -> dict[str, dict[str, float | None]]:
    """Per deep call (key without "core:") that overlapped a batch copy at
    least once and ran more than once: the share of its calls that did, and
    its microseconds a call beside a copy and alone (None without such
    calls)."""
    result: dict[str, dict[str, float | None]] = {}
    for key, n_beside in sorted(beside_calls.items()):
        total = calls.get(key, 0)
        if not key.startswith("core:") or total <= 1:
            continue
        alone = total - n_beside
        alone_s = whole.get(key, 0.0) - beside.get(key, 0.0)
        result[key[len("core:") :]] = {
            "share": round(n_beside / total, 3),
            "us_beside": round(1e6 * beside.get(key, 0.0) / n_beside, 1),
            "us_alone": round(1e6 * alone_s / alone, 1) if alone else None,
        }
    return result


def _running_summary(by_running: dict, calls: dict) -> dict:
    """Per running-request bucket with steps (`RUNNING_BUCKETS` order): steps,
    mean running count, mean step ms and the hooks' own µs per step; hooks
    that ran once overall (constructors: start-up) left out, as
    `own_us_per_step_without_start_up`."""
    order = ["0", *(name for name, _, _ in RUNNING_BUCKETS)]
    names = [b for b in order if b in by_running]
    names += sorted(b for b in by_running if b not in order)
    summary = {}
    for bucket in names:
        row = by_running[bucket]
        steps = row.get("steps", 0)
        if not steps:
            continue
        own = {
            k: v
            for k, v in row.get("own", {}).items()
            if calls.get(k, 0) > 1
            and not k.startswith(("EngineCore.", "core:", "vllm:"))
        }
        summary[bucket] = {
            "steps": steps,
            "running_mean": round(row.get("running_sum", 0) / steps, 2),
            "step_ms_mean": round(1e3 * row.get("step_s", 0.0) / steps, 4),
            "own_us_per_step": round(1e6 * sum(own.values()) / steps, 2),
            "hooks_us_per_step": {
                k: round(1e6 * v / steps, 2)
                for k, v in sorted(own.items(), key=lambda kv: -kv[1])
            },
        }
    return summary


def _request_summary(record: dict) -> dict:
    """Per interval: requests, mean steps, the steps histogram, median ms."""
    summary = {}
    for name, histogram in sorted(record.get("steps", {}).items()):
        counts = {int(k): v for k, v in histogram.items()}
        n = sum(counts.values())
        ms = record.get("ms", {}).get(name, [])
        summary[name] = {
            "requests": n,
            "steps_mean": round(sum(k * v for k, v in counts.items()) / n, 3),
            "steps": dict(sorted(counts.items())),
            "ms_median": round(statistics.median_high(ms), 3) if ms else None,
        }
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "summarize":
        print(json.dumps(summarize(sys.argv[2]), indent=1))
    else:
        print(__doc__)
else:
    activate()
