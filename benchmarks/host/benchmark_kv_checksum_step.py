# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host cost of KV checksums per engine step, on CPU (R142, issue 30 item 2).

Scheduler side: two real vLLM `Scheduler`s with the plugin's hooks, one with
checksums on and one off, over the same connector, each holding N running
requests in decode; a step is `schedule()` then `update_from_output()` with a
stand-in model output (one sampled token per request, the offload
connectors' jobs reported complete in the step). Steps run in interleaved
rounds (on, off, on, off, ...); the per-step figure is a round's time over
its steps, and on - off is the checksums' host cost per step. With
`--loads`, every step a new P/D consumer request arrives and the load started
one step earlier finishes (verified in the step; no worker records, so its
verdict is "unverified" and the figure is the scheduler's bookkeeping only).
With `--prefix` (issue 31, R140), the carrier connector with
`kv_checksum_verify_prefix_hits` on (off: no checksums): the N decoding
requests share a prefix of `--prefix-blocks` blocks (default 16: 256
tokens) and every step `--hits-per-step` new requests with that prefix and
`--hit-tail` own tokens arrive (local prefix-cache hits, checked) and finish
two steps on. The on engine's checksum worker (CPU KV caches, kernels
stubbed unless `--cpu-kernels`) runs between `schedule()` and
`update_from_output()`, so the hits verify against real entries; only the
scheduler's two calls are timed, each on its own too, and the worker's
step apart; then one hit step of the worker is replayed with and without
the CPU kernels (its host bookkeeping) and, with `--profile`, the
scheduler's calls of on and off are profiled and subtracted.
With `--offload-loads` (rows "+offload-loads"), OffloadingConnector and
SimpleCPUOffloadConnector on the tests' offload simulations
(`OffloadSimEngine`: real checksum workers, host tensors, simulated copies):
2,048-token prefixes are stored to the host tier and dropped from the GPU's
prefix cache first; then every step one new request whose prefix (128
blocks) is only in the host tier arrives and loads it back, the load
reported finished a step after the one that started it, and verified; only
schedule() and update_from_output() are timed (not the simulated workers).
These engines record vLLM's stats (log_stats, as `vllm serve` does by
default), so vLLM asks the connector for each load's hit sources itself.

Worker side: a `KVChecksumWorker` over CPU KV caches, `bind` and
`post_forward` of a decode step (nothing to checksum), as the wiring's
pre/post forward hooks call them.

Run from the repository root:
    python benchmarks/host/benchmark_kv_checksum_step.py [--requests 8 64 256]
"""

import argparse
import cProfile
import functools
import gc
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.v1.kv_connector.unit.kv_checksum_helpers import (  # noqa: E402
    cpu_cuda_streams,
    make_kv_cache_config,
    make_kv_caches,
    make_kv_connector_output,
    make_model_runner_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    write_model_dir,
)
from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (  # noqa: E402
    OffloadSimEngine,
    SimpleOffloadSimEngine,
    offload_metadata,
    run_together,
    simple_offload_metadata,
    verdicts,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (  # noqa: E402
    CARRIER_CONNECTOR_NAME,
    SideConfig,
    register_carrier_connector,
)
from vllm.distributed.kv_transfer.kv_checksum import plugin  # noqa: E402
from vllm.distributed.kv_transfer.kv_checksum.config import (  # noqa: E402
    VERIFY_PREFIX_HITS_KEY,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (  # noqa: E402
    KVChecksumLaunch,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import (  # noqa: E402
    WorkerTopology,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (  # noqa: E402
    KVChecksumWorker,
)

BLOCK_SIZE = 16
PROMPT_LEN = 32
MAX_MODEL_LEN = 2048
CARRIER_NAME = "nixl-pull-like (carrier test connector)"
CONNECTORS: dict[str, tuple[str, dict[str, Any]]] = {
    CARRIER_NAME: (CARRIER_CONNECTOR_NAME, {}),
    "OffloadingConnector": ("OffloadingConnector", {"cpu_bytes_to_use": 1 << 22}),
    "SimpleCPUOffloadConnector": (
        "SimpleCPUOffloadConnector",
        {"cpu_bytes_to_use": 1 << 22, "num_cpu_blocks": 64},
    ),
    # vLLM's NIXL push connector, scheduler side (no NIXL needed there).
    "NixlPushConnector": ("NixlPushConnector", {}),
}
REAL_LAUNCH = KVChecksumLaunch.__call__
PREFIX_NAME = "prefix hits (carrier test connector, verify_prefix_hits)"
PREFIX_BLOCKS = 16  # the shared prefix of `--prefix`, in blocks (256 tokens)


def shared_prefix(num_blocks: int = PREFIX_BLOCKS) -> list[int]:
    """The `--prefix` requests' shared prompt prefix of `num_blocks` blocks."""
    return [(11 * t) % 991 + 3 for t in range(num_blocks * BLOCK_SIZE)]


SHARED_PREFIX = shared_prefix()


def _completed_jobs(scheduler: Any, output: Any) -> Any:
    """The offload connectors' worker metadata: this step's jobs all done."""
    meta = output.kv_connector_metadata
    if hasattr(meta, "store_jobs"):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        jobs = (*meta.load_jobs, *meta.store_jobs)
        return OffloadingWorkerMetadata(completed_jobs={j: 1 for j in jobs})
    if getattr(meta, "store_gpu_blocks", None):
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        return SimpleCPUOffloadWorkerMetadata(
            completed_store_events={meta.store_event: 1}
        )
    return None


def decode_request(
    i: int, prefix: bool = False, prefix_blocks: int = PREFIX_BLOCKS
) -> Any:
    """Running request i of a step benchmark: a fixed PROMPT_LEN-token prompt
    (after the `prefix_blocks`-block shared prefix with `prefix`) that
    decodes to near MAX_MODEL_LEN."""
    prompt = [(i * 131 + 7 * t) % 991 + 3 for t in range(PROMPT_LEN)]
    if prefix:
        prompt = shared_prefix(prefix_blocks) + prompt
    return make_request(
        f"d{i}",
        prompt,
        max_tokens=MAX_MODEL_LEN - PROMPT_LEN - 8,
        block_size=BLOCK_SIZE,
    )


def prefix_max_model_len(prefix_blocks: int) -> int:
    """max_model_len of a `--prefix` engine: MAX_MODEL_LEN, or room for a
    longer shared prefix plus MAX_MODEL_LEN // 2 tokens."""
    return max(MAX_MODEL_LEN, prefix_blocks * BLOCK_SIZE + MAX_MODEL_LEN // 2)


@dataclass
class Bench:
    """One engine (scheduler only) with `n` running requests in decode.

    With `worker` (prefix mode, checksums on): a real `KVChecksumWorker` over
    CPU KV caches runs `bind` and `post_forward` between `schedule()` and
    `update_from_output()`, whose output carries its record, so the hit
    checks are verified against real entries (as in a TP 1 engine, where
    the scheduler finalizes the worker's record).
    """

    model_dir: str
    connector: str
    extra: dict[str, Any]
    enabled: bool
    n: int
    loads: bool = False
    prefix: bool = False
    steps: int = 0
    prefix_blocks: int = PREFIX_BLOCKS
    hit_tail: int = PROMPT_LEN  # tokens of a hit request after the prefix
    hits_per_step: int = 1  # new requests hitting the prefix each step
    worker: bool = False
    _pending_loads: list[str] = field(default_factory=list)
    # per step: seconds in schedule(), the worker, update_from_output()
    phases: list[tuple[float, float, float]] = field(default_factory=list)
    # per step: hit blocks checked and entries saved (worker bound steps)
    checked: list[tuple[int, int]] = field(default_factory=list)
    # a step's metadata with hit checks, for `bench_hit_worker`
    hit_scheduled: Any = None
    profiler: cProfile.Profile | None = None

    def __post_init__(self) -> None:
        extra = dict(self.extra)
        if self.enabled:
            extra["enable_kv_checksum"] = True
            if self.prefix:
                extra[VERIFY_PREFIX_HITS_KEY] = True
        max_model_len = MAX_MODEL_LEN
        spare, hits = 64, 0
        if self.prefix:
            max_model_len = prefix_max_model_len(self.prefix_blocks)
            # the prefix, and hit requests (each lives about 3 steps) or
            # their cached blocks until evicted
            hits = self.hits_per_step
            spare = 240 + self.prefix_blocks + 4 * hits * (self.hit_tail // 16 + 2)
        config = make_vllm_config(
            self.model_dir,
            num_blocks=self.n * (max_model_len // BLOCK_SIZE) + spare,
            kv_connector=self.connector,
            extra_config=extra,
            max_model_len=max_model_len,
            max_num_seqs=self.n + 8 + 3 * hits,
            max_num_batched_tokens=max(
                max_model_len, (self.n + 8) * PROMPT_LEN + hits * self.hit_tail
            ),
        )
        kv_cache_config = make_kv_cache_config(config)
        self.scheduler: Any = make_scheduler(config, kv_cache_config)
        self.checksum_worker: KVChecksumWorker | None = None
        if self.worker and self.enabled:
            self.checksum_worker = cpu_checksum_worker(kv_cache_config)
            self.checksum_worker.enable_prefix_entries()
        for i in range(self.n):
            self.scheduler.add_request(
                decode_request(i, self.prefix, self.prefix_blocks)
            )
        for _ in range(3):  # prefill, then decode
            self.step()
        for _ in range(64):  # long shared prefixes: until every prompt is done
            if not any(r.request_id.startswith("d") for r in self.scheduler.waiting):
                break
            self.step()

    def step(self) -> float:
        """One step; returns the seconds in schedule() and update_from_output()."""
        scheduler = self.scheduler
        finished: list[str] = []
        if self.loads:
            finished, self._pending_loads = self._pending_loads, []
            self._add_consumer()
        if self.prefix:
            self._add_prefix_hit()
        profiler = self.profiler  # the scheduler's two calls only
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        output = scheduler.schedule()
        if profiler is not None:
            profiler.disable()
        scheduled = time.perf_counter()
        records = self._worker_step(output)
        worked = time.perf_counter()
        self._pending_loads = [
            r.request_id
            for r in scheduler.waiting
            if r.request_id.startswith("c")
            and r.request_id not in finished
            and r.status.name == "WAITING_FOR_REMOTE_KVS"
        ][:1]
        kv_output = make_kv_connector_output(finished_recving=finished)
        kv_output.kv_connector_worker_meta = _completed_jobs(scheduler, output)
        if records:
            kv_output.kv_checksums = records  # type: ignore[attr-defined]
        model_output = make_model_runner_output(
            output, scheduler=scheduler, kv_connector_output=kv_output
        )
        updating = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        scheduler.update_from_output(output, model_output)
        if profiler is not None:
            profiler.disable()
        done = time.perf_counter()
        self.steps += 1
        self.phases.append((scheduled - start, worked - scheduled, done - updating))
        return (scheduled - start) + (done - updating)

    def _worker_step(self, output: Any) -> list[Any]:
        """The checksum worker's part of the step (bind, post_forward)."""
        worker = self.checksum_worker
        if worker is None:
            return []
        meta = getattr(output, "kv_checksum_scheduled", None)
        if meta is not None:
            if meta.reqs_to_check:
                self.hit_scheduled = meta
            self.checked.append(
                (
                    sum(len(b.groups[0][1]) for b in meta.reqs_to_check.values()),
                    sum(len(run[2]) for run in meta.blocks_to_save),
                )
            )
        worker.bind(meta)
        pending = worker.post_forward(set(), set(), None, output.finished_req_ids)
        return [] if pending is None else [pending]

    def _add_prefix_hit(self) -> None:
        i = self.steps
        for j in range(self.hits_per_step):
            seed = i * self.hits_per_step + j
            tail = [(seed * 17 + 5 * t) % 991 + 3 for t in range(self.hit_tail)]
            self.scheduler.add_request(
                make_request(
                    f"h{i}" if self.hits_per_step == 1 else f"h{i}.{j}",
                    shared_prefix(self.prefix_blocks) + tail,
                    max_tokens=2,
                    block_size=BLOCK_SIZE,
                )
            )

    def _add_consumer(self) -> None:
        i = self.steps
        prompt = [(i * 17 + 5 * t) % 991 + 3 for t in range(PROMPT_LEN)]
        params = {"do_remote_prefill": True, "do_remote_decode": False}
        self.scheduler.add_request(
            make_request(
                f"c{i}",
                prompt,
                max_tokens=2,
                kv_transfer_params=params,
                block_size=BLOCK_SIZE,
            )
        )


OFFLOAD_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")
OFFLOAD_PREFIX_BLOCKS = 128  # 2,048 tokens
OFFLOAD_TAIL = 17  # tokens after the prefix: one more full block, then 1
# Load requests in flight or freed but still cached on the GPU, at most.
OFFLOAD_HEADROOM = 6 * (OFFLOAD_PREFIX_BLOCKS + 3)
HOST_BLOCK_BYTES = 32 << 10  # the tests' model: bytes of one block, all layers


class OffloadLoadBench:
    """`n` requests in decode on an offload simulation; every step a new
    request loads a 128-block prefix back from the host tier, its load
    reported finished in the next step. `step()` returns the seconds spent in
    schedule() and update_from_output().

    The GPU holds the decoding requests' blocks for `total_steps` steps plus
    `OFFLOAD_HEADROOM`; the prefixes (more blocks than the GPU's free ones)
    come back round-robin, so each was evicted from the GPU (least recently
    used first) before it returns and loads from the host tier again.
    """

    def __init__(
        self, model_dir: str, connector: str, enabled: bool, n: int, total_steps: int
    ) -> None:
        self.n, self.enabled = n, enabled
        decode_blocks = -(-(PROMPT_LEN + total_steps + 8) // BLOCK_SIZE) + 1
        num_blocks = n * decode_blocks + OFFLOAD_HEADROOM
        num_prefixes = num_blocks // OFFLOAD_PREFIX_BLOCKS + 2
        host_blocks = (
            num_prefixes * (OFFLOAD_PREFIX_BLOCKS + 2)
            + n * decode_blocks
            + 2 * (total_steps + 8)
            + 64
        )
        extra: dict[str, Any] = {"cpu_bytes_to_use": host_blocks * HOST_BLOCK_BYTES}
        if connector == "SimpleCPUOffloadConnector":
            extra["num_cpu_blocks"] = host_blocks
        side = SideConfig(
            num_blocks=num_blocks,
            connector=connector,
            connector_extra=extra,
            enabled=enabled,
            max_model_len=2 * MAX_MODEL_LEN,
            max_num_batched_tokens=2 * MAX_MODEL_LEN + (n + 8) * PROMPT_LEN,
            max_num_seqs=n + 8,
            # `vllm serve`'s default: vLLM records prefix-cache stats, asking
            # the connector for each starting load's sources itself.
            log_stats=True,
        )
        kind = (
            OffloadSimEngine
            if connector == "OffloadingConnector"
            else SimpleOffloadSimEngine
        )
        self.engine: Any = kind(model_dir, side, f"offload-loads-{enabled}-{n}")
        self.engine.delay_loads = True
        # make_stats drains the verdict counts each step (log_stats): keep them.
        self.drained: Counter[str] = Counter()
        if enabled:
            stats = self.engine.checksums.stats
            drain = stats.take

            def take() -> Any:
                taken = drain()
                self.drained.update(taken.loads)
                return taken

            stats.take = take
        rng = random.Random(0)
        self.prefixes = [
            [rng.randrange(3, 200) for _ in range(OFFLOAD_PREFIX_BLOCKS * BLOCK_SIZE)]
            for _ in range(num_prefixes)
        ]
        for start in range(0, num_prefixes, 4):  # stored to the host tier
            run_together(self.engine, self.prefixes[start : start + 4], f"s{start}")
        # ... and only there: the GPU's prefix cache starts empty.
        assert self.engine.scheduler.kv_cache_manager.reset_prefix_cache()
        scheduler = self.engine.scheduler
        self._spent = 0.0
        for name in ("schedule", "update_from_output"):
            setattr(scheduler, name, self._timer(getattr(scheduler, name)))
        for i in range(n):
            self.engine.add(decode_request(i))
        self.steps = 0
        self.loads = 0  # host-tier loads started
        self.loaded_blocks = 0  # GPU blocks they wrote
        for _ in range(3):  # prefill, then decode
            self.step()

    def _timer(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._spent += time.perf_counter() - start

        return timed

    def _host_loads(self) -> tuple[int, int]:
        """Loads the last step started and the GPU blocks they write."""
        meta = self.engine.history[-1].kv_connector_metadata
        offload = offload_metadata(meta)
        if offload is not None:
            jobs = offload.load_jobs.values()
            return len(jobs), sum(len(j.dst_spec.block_ids) for j in jobs)
        simple = simple_offload_metadata(meta)
        if simple is not None and simple.load_cpu_blocks:
            reqs = simple.load_event_to_reqs.get(simple.load_event, ())
            return len(reqs), len(simple.load_gpu_blocks)
        return 0, 0

    def step(self) -> float:
        i = self.steps
        rng = random.Random(i)
        tail = [rng.randrange(3, 200) for _ in range(OFFLOAD_TAIL)]
        prompt = self.prefixes[i % len(self.prefixes)] + tail
        self.engine.add(
            make_request(f"o{i}", prompt, max_tokens=2, block_size=BLOCK_SIZE)
        )
        self._spent = 0.0
        self.engine.step()
        loads, blocks = self._host_loads()
        self.loads += loads
        self.loaded_blocks += blocks
        self.steps += 1
        return self._spent

    def verdicts(self) -> dict[str, int]:
        return dict(self.drained + Counter(verdicts(self.engine)))


def _timed_inner(fn: Callable[[], float], count: int) -> float:
    """As `_timed`, of the seconds each call of `fn` returns."""
    times = []
    gc.collect()
    gc.disable()
    try:
        times = [fn() for _ in range(count)]
    finally:
        gc.enable()
    return statistics.median(times) * 1e6


def _timed(fn: Callable[[], object], count: int) -> float:
    """Median microseconds of `count` calls of `fn` (garbage collection off,
    so a collection landing in one engine's round does not count)."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(count):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return statistics.median(times) * 1e6


@dataclass
class Result:
    name: str
    n: int
    on: list[float]
    off: list[float]

    def row(self) -> str:
        diffs = [a - b for a, b in zip(self.on, self.off)]
        on, off = statistics.median(self.on), statistics.median(self.off)
        return (
            f"| {self.name} | {self.n} | {off:.0f} | {on:.0f} | "
            f"{statistics.median(diffs):+.0f} | {min(diffs):+.0f} .. "
            f"{max(diffs):+.0f} | {off / on:.3f} |"
        )


def bench_scheduler(
    model_dir: str,
    name: str,
    n: int,
    rounds: int,
    steps: int,
    loads: bool,
    profile: bool,
) -> Result:
    connector, extra = CONNECTORS[name]
    on = Bench(model_dir, connector, extra, True, n, loads)
    off = Bench(model_dir, connector, extra, False, n, loads)
    result = Result(name + (" +loads" if loads else ""), n, [], [])
    for _ in range(rounds):
        result.on.append(_timed(on.step, steps))
        result.off.append(_timed(off.step, steps))
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            on.step()
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
        stats.print_stats("kv_checksum", 20)
        print(f"\ncProfile, checksums on, {result.name}, {n} requests, {steps} steps")
        print("(functions of the package, by own time):")
        print(text.getvalue()[-4000:])
    return result


def bench_offload_loads(
    model_dir: str, name: str, n: int, rounds: int, steps: int
) -> tuple[Result, OffloadLoadBench]:
    """On vs off with a host-tier load every step; returns the on engine too."""
    import pytest  # its MonkeyPatch undoes the CPU stand-ins for CUDA streams

    total = rounds * steps + 8
    result = Result(name + " +offload-loads", n, [], [])
    with pytest.MonkeyPatch.context() as patch, cpu_cuda_streams(patch):
        on = OffloadLoadBench(model_dir, name, True, n, total)
        off = OffloadLoadBench(model_dir, name, False, n, total)
        for _ in range(rounds):
            result.on.append(_timed_inner(on.step, steps))
            result.off.append(_timed_inner(off.step, steps))
    return result, on


def cpu_checksum_worker(kv_cache_config: Any) -> KVChecksumWorker:
    """A TP 1 checksum worker over the tests' model's KV caches on CPU."""
    import torch

    caches = make_kv_caches(kv_cache_config, seed=0)
    topology = WorkerTopology(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        num_blocks=kv_cache_config.num_blocks,
        uniform_model_kv_heads=2,
        device=torch.device("cpu"),
    )
    return KVChecksumWorker(kv_cache_config, caches, topology)


def bench_worker(model_dir: str, n: int, count: int) -> float:
    """Microseconds of a decode step's bind + post_forward on one worker."""
    config = make_vllm_config(model_dir, max_num_seqs=n)
    worker = cpu_checksum_worker(make_kv_cache_config(config, pp_rank=0))

    def step() -> None:
        worker.bind(None)
        worker.post_forward(None, set(), None, ())

    return _timed(step, count)


@dataclass
class PrefixResult:
    """`--prefix` rounds: per round, the median step's phases (seconds)."""

    n: int
    prefix_blocks: int
    on: list[tuple[float, float, float]] = field(default_factory=list)
    off: list[tuple[float, float, float]] = field(default_factory=list)
    checked: tuple[int, int] = (0, 0)  # median hit blocks checked, saved / step

    def add_round(self, on: Bench, off: Bench, steps: int) -> None:
        for bench, rows in ((on, self.on), (off, self.off)):
            last = bench.phases[-steps:]
            schedule, worker, update = (
                statistics.median(p[i] for p in last) for i in range(3)
            )
            rows.append((schedule, worker, update))

    def row(self) -> str:
        """| running | blocks | schedule off/on/diff | update off/on/diff |
        sum diff | worker (on) |, microseconds, median over rounds."""

        def med(rows: list[tuple[float, float, float]], i: int) -> float:
            return statistics.median(r[i] for r in rows) * 1e6

        def diff(i: int) -> float:
            return (
                statistics.median(a[i] - b[i] for a, b in zip(self.on, self.off)) * 1e6
            )

        total = statistics.median(
            (a[0] + a[2]) - (b[0] + b[2]) for a, b in zip(self.on, self.off)
        )
        return (
            f"| {self.n} | {self.prefix_blocks} | "
            f"{self.checked[0]} / {self.checked[1]} | "
            f"{med(self.off, 0):.0f} | {med(self.on, 0):.0f} | {diff(0):+.0f} | "
            f"{med(self.off, 2):.0f} | {med(self.on, 2):.0f} | {diff(2):+.0f} | "
            f"{total * 1e6:+.0f} | {med(self.on, 1):.0f} |"
        )


PREFIX_HEADER = (
    "| running | hit blocks | checked / saved per step | schedule off | "
    "schedule on | on - off | update off | update on | on - off | "
    "step on - off | worker on (CPU kernels) |\n" + "|---" * 11 + "|"
)


def profile_diff(on: pstats.Stats, off: pstats.Stats, top: int) -> str:
    """Functions by own time on - off (microseconds per run, both runs of
    the same number of steps), then the package's by cumulative time on."""
    on_stats: dict = on.stats  # type: ignore[attr-defined]
    off_stats: dict = off.stats  # type: ignore[attr-defined]
    rows = []
    for key, (_, calls, tottime, cumtime, _) in on_stats.items():
        off_calls, off_tt = 0, 0.0
        if key in off_stats:
            off_calls, off_tt = off_stats[key][1], off_stats[key][2]
        rows.append((tottime - off_tt, calls - off_calls, cumtime, key))
    rows.sort(reverse=True)
    lines = ["own time on - off (us) | calls on - off | cumulative on (us) | function"]
    for dt, dcalls, cum, (path, line, name) in rows[:top]:
        where = "/".join(Path(path).parts[-2:])
        lines.append(
            f"{dt * 1e6:10.0f} | {dcalls:6d} | {cum * 1e6:10.0f} | "
            f"{where}:{line} {name}"
        )
    package = sorted(
        ((v[3], v[1], k) for k, v in on_stats.items() if "/kv_checksum/" in k[0]),
        reverse=True,
    )
    lines.append("package functions, cumulative on (us) | calls | function")
    for cum, calls, (path, line, name) in package[:top]:
        where = "/".join(Path(path).parts[-2:])
        lines.append(f"{cum * 1e6:10.0f} | {calls:6d} | {where}:{line} {name}")
    return "\n".join(lines)


def bench_prefix(
    model_dir: str,
    n: int,
    rounds: int,
    steps: int,
    prefix_blocks: int,
    hit_tail: int,
    profile: bool,
    hits_per_step: int = 1,
) -> tuple[Result, PrefixResult, Bench]:
    """`--prefix`: on vs off, a `prefix_blocks`-block hit every step; the on
    engine's worker runs between the scheduler's calls (not timed in them;
    its kernels stubbed unless `--cpu-kernels`: on CPU they take
    milliseconds and leave the host's caches cold for the scheduler, which a
    GPU's kernels do not).
    Returns the whole-step rows, the phase rows and the on engine."""
    import torch

    # One thread: no OpenMP worker left spinning after the CPU kernels takes
    # the other core from the on engine's update_from_output.
    torch.set_num_threads(1)
    connector, extra = CONNECTORS[CARRIER_NAME]
    engine = functools.partial(
        Bench,
        model_dir,
        connector,
        extra,
        prefix=True,
        prefix_blocks=prefix_blocks,
        hit_tail=hit_tail,
        hits_per_step=hits_per_step,
    )
    on, off = engine(True, n, worker=True), engine(False, n)
    name = f"{PREFIX_NAME}, {prefix_blocks} blocks"
    result = Result(name, n, [], [])
    phases = PrefixResult(n, prefix_blocks)
    for _ in range(rounds):
        result.on.append(_timed_inner(on.step, steps))
        result.off.append(_timed_inner(off.step, steps))
        phases.add_round(on, off, steps)
    counts = on.checked[-rounds * steps :]
    phases.checked = (
        int(statistics.median(c[0] for c in counts)),
        int(statistics.median(c[1] for c in counts)),
    )
    if profile:
        stats = []
        for bench in (on, off):
            bench.profiler = cProfile.Profile()
            gc.collect()
            for _ in range(steps):
                bench.step()
            stats.append(pstats.Stats(bench.profiler))
            bench.profiler = None
        print(
            f"\ncProfile, schedule() and update_from_output() only, {n} requests, "
            f"{prefix_blocks}-block hits, {steps} steps each engine"
        )
        print(profile_diff(stats[0], stats[1], 25))
    return result, phases, on


def _no_kernel(launch: Any, rows: Any, out: Any) -> None:
    """A stubbed checksum launch: adds nothing, so every sum is zero; saved
    entries and checks agree (zero XOR the tag), so hits still verify."""


def bench_hit_worker(bench: Bench, count: int, profile: bool) -> dict[str, float]:
    """Microseconds of the worker's bind + post_forward of one step with a
    prefix-hit check (the on engine's last such step, replayed), with the
    CPU checksum kernels and with them stubbed out (host bookkeeping only);
    then aten operators dispatched per step (each a host-side dispatch, and
    on CUDA a kernel launch or copy)."""
    import pytest
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (
        KVChecksumLaunch,
    )

    worker, meta = bench.checksum_worker, bench.hit_scheduled
    assert worker is not None and meta is not None

    def step() -> None:
        worker.bind(meta)
        worker.post_forward(set(), set(), None, ())

    figures = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KVChecksumLaunch, "__call__", REAL_LAUNCH)
        figures["with CPU kernels"] = _timed(step, max(8, count // 20))
        patch.setattr(KVChecksumLaunch, "__call__", _no_kernel)
        figures["kernels stubbed (bookkeeping)"] = _timed(step, count)

        class Count(TorchDispatchMode):
            ops: dict[str, int] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                Count.ops[str(func)] = Count.ops.get(str(func), 0) + 1
                return func(*args, **(kwargs or {}))

        with Count():
            step()
        figures["aten ops per step (kernels stubbed)"] = float(sum(Count.ops.values()))
        print("aten ops of one hit-check worker step:", dict(sorted(Count.ops.items())))
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(count):
                step()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
            print(f"\ncProfile, worker hit step, kernels stubbed, {count} steps:")
            print(text.getvalue()[-5000:])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--connectors", nargs="+", default=list(CONNECTORS))
    parser.add_argument("--no-loads", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--prefix", action="store_true", help="prefix hits only")
    parser.add_argument(
        "--prefix-blocks",
        type=int,
        default=PREFIX_BLOCKS,
        help="--prefix: blocks of the shared prefix each new request hits",
    )
    parser.add_argument(
        "--cpu-kernels",
        action="store_true",
        help="--prefix: the worker runs the CPU checksum kernels in the "
        "scheduler rounds (default: stubbed, see _no_kernel)",
    )
    parser.add_argument(
        "--hits-per-step",
        type=int,
        default=1,
        help="--prefix: new requests with the shared prefix each step",
    )
    parser.add_argument(
        "--hit-tail",
        type=int,
        default=PROMPT_LEN,
        help="--prefix: a new request's own tokens after the shared prefix",
    )
    parser.add_argument(
        "--offload-loads",
        action="store_true",
        help="loads from the CPU offload tier only (offload connectors)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write OUT/summary.json"
    )
    args = parser.parse_args()
    plugin.register()
    register_carrier_connector()
    model_dir = write_model_dir(Path(tempfile.mkdtemp()))
    results = []
    load_counts = []
    if args.offload_loads:
        args.connectors = []
        for name in OFFLOAD_CONNECTORS:
            for n in args.requests:
                result, on = bench_offload_loads(
                    model_dir, name, n, args.rounds, args.steps
                )
                results.append(result)
                load_counts.append(
                    f"| {result.name} | {n} | {on.steps} | {on.loads} | "
                    f"{on.loaded_blocks} | {on.verdicts()} |"
                )
    prefix_rows: list[PrefixResult] = []
    hit_worker: dict[str, float] = {}
    if args.prefix:
        args.connectors = []
        import pytest  # its MonkeyPatch undoes the CPU stand-ins for CUDA streams

        with pytest.MonkeyPatch.context() as patch, cpu_cuda_streams(patch):
            if not args.cpu_kernels:
                patch.setattr(KVChecksumLaunch, "__call__", _no_kernel)
            for n in args.requests:
                profile = args.profile and n == max(args.requests)
                result, phases, hit_bench = bench_prefix(
                    model_dir,
                    n,
                    args.rounds,
                    args.steps,
                    args.prefix_blocks,
                    args.hit_tail,
                    profile,
                    args.hits_per_step,
                )
                results.append(result)
                prefix_rows.append(phases)
                kcs = hit_bench.scheduler.kv_checksum_scheduler
                print(f"{n} running: prefix-hit verdicts {dict(kcs.stats.prefix_hits)}")
                if n == max(args.requests):
                    hit_worker = bench_hit_worker(hit_bench, 400, args.profile)
    for name in args.connectors:
        for n in args.requests:
            results.append(
                bench_scheduler(
                    model_dir,
                    name,
                    n,
                    args.rounds,
                    args.steps,
                    False,
                    args.profile and n == max(args.requests),
                )
            )
            if not args.no_loads and CONNECTORS[name][0] == CARRIER_CONNECTOR_NAME:
                results.append(
                    bench_scheduler(
                        model_dir,
                        name,
                        n,
                        args.rounds,
                        args.steps,
                        True,
                        args.profile and n == max(args.requests),
                    )
                )
    print("\nScheduler step (schedule + update_from_output), microseconds: the")
    print(f"median step of a round, {args.rounds} interleaved rounds of")
    print(f"{args.steps} steps; median over rounds, spread of on - off:")
    print("| connector | running | off | on | on - off | spread | off/on |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        print(result.row())
    if prefix_rows:
        print("\nPrefix-hit steps by phase, microseconds (median step of a round,")
        print("median over rounds; on - off: median of the round differences;")
        print("worker: bind + post_forward on CPU, not in the scheduler's figures):")
        print(PREFIX_HEADER)
        for phases in prefix_rows:
            print(phases.row())
        print("\nWorker step of one hit check, replayed (bind + post_forward):")
        for label, value in hit_worker.items():
            print(f"| {label} | {value:.1f} |")
    if load_counts:
        print("\nHost-tier loads of the checksums-on engines (all steps):")
        print("| connector | running | steps | loads | blocks | verdicts |")
        print("|---|---|---|---|---|---|")
        print("\n".join(load_counts))
    print("\nWorker decode step (bind + post_forward, nothing to checksum):")
    worker_us = {n: bench_worker(model_dir, n, 2000) for n in args.requests}
    for n, us in worker_us.items():
        print(f"| {n} | {us:.1f} us |")
    if args.out is not None:  # gpu_runs.sh host-step: the rows come back as JSON
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {
            "scheduler_rows": [result.row() for result in results],
            "worker_decode_step_us": worker_us,
            "prefix_phase_rows": [phases.row() for phases in prefix_rows],
            "prefix_hit_worker_us": hit_worker,
        }
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
