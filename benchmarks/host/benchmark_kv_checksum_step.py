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
requests share a 256-token prefix and every step a new request with that
prefix arrives (a local prefix-cache hit, checked) and finishes two steps on.
With `--offload-loads` (rows "+offload-loads"), OffloadingConnector and
SimpleCPUOffloadConnector on the tests' offload simulations
(`OffloadSimEngine`: real checksum workers, host tensors, simulated copies):
2,048-token prefixes are stored to the host tier and dropped from the GPU's
prefix cache first; then every step one new request whose prefix (128
blocks) is only in the host tier arrives and loads it back, the load
reported finished a step after the one that started it, and verified; only
schedule() and update_from_output() are timed (not the simulated workers).

Worker side: a `KVChecksumWorker` over CPU KV caches, `bind` and
`post_forward` of a decode step (nothing to checksum), as the wiring's
pre/post forward hooks call them.

Run from the repository root:
    python benchmarks/host/benchmark_kv_checksum_step.py [--requests 8 64 256]
"""

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
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
}
PREFIX_NAME = "prefix hits (carrier test connector, verify_prefix_hits)"
SHARED_PREFIX = [(11 * t) % 991 + 3 for t in range(256)]


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


def decode_request(i: int, prefix: bool = False) -> Any:
    """Running request i of a step benchmark: a fixed PROMPT_LEN-token prompt
    (after SHARED_PREFIX with `prefix`) that decodes to near MAX_MODEL_LEN."""
    prompt = [(i * 131 + 7 * t) % 991 + 3 for t in range(PROMPT_LEN)]
    if prefix:
        prompt = SHARED_PREFIX + prompt
    return make_request(
        f"d{i}",
        prompt,
        max_tokens=MAX_MODEL_LEN - PROMPT_LEN - 8,
        block_size=BLOCK_SIZE,
    )


@dataclass
class Bench:
    """One engine (scheduler only) with `n` running requests in decode."""

    model_dir: str
    connector: str
    extra: dict[str, Any]
    enabled: bool
    n: int
    loads: bool = False
    prefix: bool = False
    steps: int = 0
    _pending_loads: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        extra = dict(self.extra)
        if self.enabled:
            extra["enable_kv_checksum"] = True
            if self.prefix:
                extra[VERIFY_PREFIX_HITS_KEY] = True
        config = make_vllm_config(
            self.model_dir,
            num_blocks=self.n * (MAX_MODEL_LEN // BLOCK_SIZE)
            + (256 if self.prefix else 64),
            kv_connector=self.connector,
            extra_config=extra,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=self.n + 8,
            max_num_batched_tokens=max(MAX_MODEL_LEN, (self.n + 8) * PROMPT_LEN),
        )
        self.scheduler = make_scheduler(config, make_kv_cache_config(config))
        for i in range(self.n):
            self.scheduler.add_request(decode_request(i, self.prefix))
        for _ in range(3):  # prefill, then decode
            self.step()

    def step(self) -> None:
        scheduler = self.scheduler
        finished: list[str] = []
        if self.loads:
            finished, self._pending_loads = self._pending_loads, []
            self._add_consumer()
        if self.prefix:
            self._add_prefix_hit()
        output = scheduler.schedule()
        self._pending_loads = [
            r.request_id
            for r in scheduler.waiting
            if r.request_id.startswith("c")
            and r.request_id not in finished
            and r.status.name == "WAITING_FOR_REMOTE_KVS"
        ][:1]
        kv_output = make_kv_connector_output(finished_recving=finished)
        kv_output.kv_connector_worker_meta = _completed_jobs(scheduler, output)
        model_output = make_model_runner_output(
            output, scheduler=scheduler, kv_connector_output=kv_output
        )
        scheduler.update_from_output(output, model_output)
        self.steps += 1

    def _add_prefix_hit(self) -> None:
        i = self.steps
        tail = [(i * 17 + 5 * t) % 991 + 3 for t in range(PROMPT_LEN)]
        self.scheduler.add_request(
            make_request(
                f"h{i}", SHARED_PREFIX + tail, max_tokens=2, block_size=BLOCK_SIZE
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
        )
        kind = (
            OffloadSimEngine
            if connector == "OffloadingConnector"
            else SimpleOffloadSimEngine
        )
        self.engine: Any = kind(model_dir, side, f"offload-loads-{enabled}-{n}")
        self.engine.delay_loads = True
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
        return verdicts(self.engine)


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


def _timed(fn: Callable[[], None], count: int) -> float:
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
    prefix: bool = False,
) -> Result:
    connector, extra = CONNECTORS[CARRIER_NAME if prefix else name]
    on = Bench(model_dir, connector, extra, True, n, loads, prefix)
    off = Bench(model_dir, connector, extra, False, n, loads, prefix)
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


def bench_worker(model_dir: str, n: int, count: int) -> float:
    """Microseconds of a decode step's bind + post_forward on one worker."""
    config = make_vllm_config(model_dir, max_num_seqs=n)
    kv_cache_config = make_kv_cache_config(config, pp_rank=0)
    caches = make_kv_caches(kv_cache_config, seed=0)
    import torch

    topology = WorkerTopology(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        num_blocks=kv_cache_config.num_blocks,
        uniform_model_kv_heads=2,
        device=torch.device("cpu"),
    )
    worker = KVChecksumWorker(kv_cache_config, caches, topology)

    def step() -> None:
        worker.bind(None)
        worker.post_forward(None, set(), None, ())

    return _timed(step, count)


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
    if args.prefix:
        args.connectors = []
        for n in args.requests:
            profile = args.profile and n == max(args.requests)
            results.append(
                bench_scheduler(
                    model_dir,
                    PREFIX_NAME,
                    n,
                    args.rounds,
                    args.steps,
                    False,
                    profile,
                    True,
                )
            )
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
        }
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
