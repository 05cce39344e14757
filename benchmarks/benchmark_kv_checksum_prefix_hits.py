# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What verifying local prefix-cache hits costs (issue 31 item 4): `vllm bench
serve` with a shared-prefix workload against one engine with checksums off and
one with `kv_checksum_verify_prefix_hits` on, both on the same GPU at once.

Each launch starts two `vllm serve` engines together (dummy-weight Qwen3 of the
chosen shape, word-level tokenizer, `--enable-prefix-caching`, a fixed KV cache
each) with SimpleCPUOffloadConnector kv_both, the connector vLLM 0.33.0 needs to
read `kv_connector_extra_config` without P/D. `off`: the connector alone. `on`:
`enable_kv_checksum`, `kv_checksum_verify_prefix_hits` and the Quick start's
consumer policy (`kv_checksum_fail_closed`; `kv_load_failure_policy` "recompute"
is vLLM's own key and set on both). Rounds then alternate between the engines in
ABBA order (off, on, on, off, off, on, ...); round k uses seed k // 2 for every
workload, so the two runs of one off/on pair send the same prompts and each
engine sees every prefix once: the first requests miss, the rest hit.

Verdict per workload (printed, not a timed test): on/off request throughput
>= 0.98 and, at concurrency 1, median TTFT on - off <= +1 ms (means over the
rounds; above concurrency 1 queueing moves the median by tens of ms between
rounds, so it is reported, as the reference table reads TTFT at c1 and
throughput at c32), whether each difference is inside the off-vs-off spread
(max - min over off rounds), and
every hit checked: `vllm:kv_checksum_prefix_hits_total` of the on engine grew by
verified > 0 and mismatch 0 over its rounds (unverified reported). Beside the
means, the paired on - off: the difference within each off/on pair of rounds
that sent the same prompts, and its median over the pairs (drift between pairs
cancels; reported, not judged). Defaults: 8
rounds of `shared_c1` and `shared_c32` after one unrecorded warm-up run per
engine (other prompts: the first measured round was the slowest of both engines
without it). `--bench-batch` runs every bench of a launch in one process (vLLM
imported once, 20-30 s saved a run on the H200 host).

`--tier offloading` / `--tier multi` (issue 26 item 3) / `--tier simple-offload`
(issue 30 item 3) measure the CPU offload tier instead: OffloadingConnector
alone, MultiConnector(NixlConnector, OffloadingConnector) or
SimpleCPUOffloadConnector, `on` = `enable_kv_checksum` + `kv_checksum_fail_closed`
(configs in `kv_checksum_bench_tiers.py`), a GPU KV cache for the running
requests and two prefixes only and `prefix_repetition` with 16 prefixes, so
most reuses load from host memory. Their verdict: on/off throughput >= 0.98,
host loads (`vllm:kv_offload_load_size_count`, SimpleCPUOffloadConnector's
`vllm:simple_kv_offload_load_blocks_total`) > 0 on both engines and the on
engine's `vllm:kv_checksum_loads_total` verified > 0, mismatch 0 (TTFT is
reported). Defaults: 4 rounds of `host16_c8`, about 270 s at 8B on an H200.
`--tier lmcache` (issue 78 item 3) is the same with LMCacheConnectorV1 and its
local CPU backend: `on` adds `kv_checksum_verify_external_loads`, and its
verdict reads vLLM's `vllm:external_prefix_cache_hits` and the package's
`vllm:kv_checksum_external_loads` instead (lmcache installed beside vLLM:
`scripts/lmcache_gpu.sh` installs it).

    python benchmarks/benchmark_kv_checksum_prefix_hits.py --out /tmp/prefix \\
        --shape 8b --rounds 8

`--profile-warmup` runs each engine's first warm-up under vLLM's torch profiler
(`--profiler-config`, `vllm bench serve --profile`) and puts a summary of the
traces (CUDA kernels, memcpys, runtime calls and host synchronize calls by
total time, per worker) into summary.json's `warmup_profiles`: where an on/off
difference goes, without timing the measured rounds. `--profile-steps N` traces
only the first N engine steps of it (vLLM's `max_iterations`);
`--profile-with-stack` adds Python functions (inclusive and self time by name;
a slower trace: keep `--profile-steps` small).

Every round also records, from /proc, both engines' CPU seconds and context
switches per thread (`processes`; `kv_checksum_proc_stats.py`) and each
launch records its processes' CPUs (`affinity`): more CPU time in a thread
the "off" engine lacks means added work; the same CPU time with more
involuntary switches means the engine waited for a core (issue 30).

`--control` is the A/A run: the "on" slot starts with checksums off too, so its
"on/off" is what the two engine slots differ by alone (start order, port,
memory placement on the shared GPU, which engine's rounds come when). A cost is
a checksum cost only where it exceeds that. `--swap-slots` with an even
`--launches` removes that bias from the same run instead: odd launches run
"on" in the first slot, so the means over all rounds cancel it, and the
verdict prints the checksum effect and the slot bias apart (`slot_bias`). On
the H200 host the A/A of `shared_c32` at 8B put slot b 2 % and 16-20 ms of
TTFT behind slot a (2026-12-01h). `--pin-cores N` gives each slot its own N
physical cores and the driver with its clients the rest
(`kv_checksum_cpu_pinning.py`), so that where the kernel runs the engines'
threads does not differ between the slots.

Writes OUT/summary.json (per round: the bench's scalar results, every request's
TTFT, each engine's prefix-hit, host-load and load-verdict counter deltas) and
prints the tables; `benchmarks/plot_kv_checksum_serve.py OUT/summary.json` draws
the TTFTs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_kv_checksum_serve import (  # noqa: E402
    CLI,
    SHAPES,
    build_model,
    counter_delta,
    histogram_means_ms,
    http_get,
    log,
    mode_values,
    pair_summary,
    print_slot_bias,
    read_result,
    slot_bias,
    verdict_counts,
)
from kv_checksum_bench_tiers import (  # noqa: E402
    HOST_LOADS,
    LOADED_KEYS,
    OFFLOAD_TIERS,
    TIER_DEFAULTS,
    TIERS,
    host_load_totals,
    host_loads_ok,
    kv_cache_bytes,
    load_verdict_pattern,
    tier_env,
    transfer_config,
)
from kv_checksum_cpu_pinning import (  # noqa: E402
    physical_cores,
    split_cores,
    usable_cpus,
)
from kv_checksum_proc_stats import (  # noqa: E402
    affinity,
    cpu_brief,
    sample_tree,
    tree_delta,
)

# Targets of issue 31 item 4.
MIN_THROUGHPUT_RATIO = 0.98
MAX_TTFT_DELTA_MS = 1.0
PREFIX_HITS = re.compile(
    r'^vllm:kv_checksum_prefix_hits_total\{[^}]*verdict="(\w+)"[^}]*\} (\S+)'
)
ABBA = ("off", "on", "on", "off")
# `gpu_runs.sh pair` runs a second driver on the other GPU, ports apart.
PORT_OFFSET = int(os.environ.get("KV_CHECKSUM_PORT_OFFSET", "0"))
METRICS = ("request_throughput", "median_ttft_ms", "median_tpot_ms")
NIXL_SIDE_OFFSET = 5000
COUNTERS = ("prefix_hits", "host_loads", "load_verdicts", "server_times")
# vLLM's own latency histograms (sum and count): the engine's side of a
# round's TTFT, apart from the client's.
SERVER_TIMES = re.compile(
    r"^vllm:((?:time_to_first_token|request_prefill_time|request_queue_time)"
    r"_seconds_(?:sum|count))\{[^}]*\} (\S+)"
)
# Seeds of the unrecorded warm-up runs, far from the measured rounds' k // 2.
WARMUP_SEED = 10_000
BATCH = Path(__file__).resolve().parent / "kv_checksum_bench_serve_batch.py"
BATCH_DONE = "[bench_batch] done"


@dataclass(frozen=True)
class Workload:
    """One `vllm bench serve` run: prompts sharing `num_prefixes` prefixes."""

    name: str
    dataset: str  # "random" (one shared prefix) or "prefix_repetition"
    prefix_len: int
    suffix_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    num_prefixes: int = 1


# Prompt counts sized for about 8 s of requests a run at 8B on an H200 (a round
# took 31-38 s there with the bench CLI's start).
WORKLOADS = [
    # Latency: one request at a time, so a +1 ms TTFT is not lost in queueing
    # (the reference table reads TTFT at c1 and throughput at c32 alike).
    Workload("shared_c1", "random", 2048, 256, 8, 1, 48),
    Workload("shared_c8", "random", 2048, 256, 32, 8, 160),
    Workload("shared_c32", "random", 2048, 256, 32, 32, 320),
    Workload("prefixes4_c32", "prefix_repetition", 2048, 256, 32, 32, 320, 4),
    # The offload tiers: 16 prefixes, 12 prompts each, shuffled, 8 at a time on a
    # GPU cache of the running requests plus 2 prefixes: most reuses load the
    # prefix back from host memory (about 8 s a run at 8B on an H200).
    Workload("host16_c8", "prefix_repetition", 2048, 256, 32, 8, 192, 16),
    # 64 at a time (issue 30 item 2: the host cost per step at 64 running):
    # more prefixes than running requests, or every prefix stays on the GPU
    # and nothing loads from host memory (host16 at 64 at a time: no load,
    # H200 2026-12-04).
    Workload("host128_c64", "prefix_repetition", 2048, 256, 32, 64, 384, 128),
    # 256 at a time, the same way (item 2's third load; tiny model: its 512
    # prefixes take 1 GiB of the CPU tier, at 8B they would not fit).
    Workload("host512_c256", "prefix_repetition", 2048, 256, 32, 256, 1536, 512),
]


WORKLOAD_BY_NAME = {w.name: w for w in WORKLOADS}


def ttft_judged(name: str) -> bool:
    """Whether a workload's median TTFT is held to MAX_TTFT_DELTA_MS: at
    concurrency 1 (and for unknown names); above it, queueing moves the median
    by tens of ms between rounds, so it is reported beside its spread."""
    workload = WORKLOAD_BY_NAME.get(name)
    return workload is None or workload.concurrency <= 1


def round_modes(rounds: int) -> list[str]:
    """Modes of the rounds in ABBA order: off, on, on, off, off, on, ..."""
    return [ABBA[k % 4] for k in range(rounds)]


def bench_args(
    args: argparse.Namespace, workload: Workload, port: int, seed: int, result: Path
) -> list[str]:
    """The arguments of `vllm bench serve` for one workload, one round, one
    engine (what follows `bench serve`)."""
    cmd = ["--backend", "vllm"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions"]
    cmd += ["--model", "model", "--tokenizer", str(args.model)]
    cmd += ["--dataset-name", workload.dataset]
    if workload.dataset == "random":
        cmd += ["--random-prefix-len", str(workload.prefix_len)]
        cmd += ["--random-input-len", str(workload.suffix_len)]
        cmd += ["--random-output-len", str(workload.output_len)]
    else:
        cmd += ["--prefix-repetition-prefix-len", str(workload.prefix_len)]
        cmd += ["--prefix-repetition-suffix-len", str(workload.suffix_len)]
        cmd += ["--prefix-repetition-num-prefixes", str(workload.num_prefixes)]
        cmd += ["--prefix-repetition-output-len", str(workload.output_len)]
    prompts = max(workload.num_prefixes, round(workload.num_prompts * args.scale))
    cmd += ["--num-prompts", str(prompts)]
    cmd += ["--max-concurrency", str(workload.concurrency)]
    cmd += ["--ignore-eos", "--seed", str(seed), "--disable-tqdm"]
    # No warm-up and no ready check: both would cache the prefix before the
    # measured requests, so none of them would miss.
    cmd += ["--num-warmups", "0", "--ready-check-timeout-sec", "0"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el"]
    cmd += ["--metric-percentiles", "50,90,99"]
    cmd += ["--save-result", "--save-detailed"]
    cmd += ["--result-dir", str(result.parent), "--result-filename", result.name]
    return cmd


class BenchRunner:
    """Runs `vllm bench serve` argument lists: one CLI process each, or with
    `--bench-batch` one batch process for the whole launch (vLLM imported
    once, kv_checksum_bench_serve_batch.py --stdin), answering after each run
    so that engine counters can be read between runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.proc: subprocess.Popen | None = None

    def run(self, argv: list[str], log_path: Path) -> int:
        """One run's exit status (0: ran); its output goes to `log_path`."""
        if not self.args.bench_batch:
            cmd = [*shlex.split(self.args.bench_cmd), "bench", "serve", *argv]
            with open(log_path, "wb") as sink:
                ran = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT)
            return ran.returncode
        proc = self._batch()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(argv) + "\n")
        proc.stdin.flush()
        with open(log_path, "w") as sink:
            for line in proc.stdout:
                if line.startswith(BATCH_DONE):
                    return int(line.split()[-1])
                sink.write(line)
        return 1  # the batch process ended

    def _batch(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(BATCH), "--stdin"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
        return self.proc

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc = None


class Engine:
    """One `vllm serve` process group on the shared GPU."""

    def __init__(
        self,
        args: argparse.Namespace,
        mode: str,
        port: int,
        logs: Path,
        cpus: set[int] | None = None,
    ):
        self.args, self.mode, self.port, self.logs = args, mode, port, logs
        self.cpus = cpus  # --pin-cores: the slot's CPUs, inherited by vLLM's
        self.proc: subprocess.Popen | None = None
        self.trace_dir = (logs / f"trace_{mode}").resolve()

    def start(self) -> None:
        args = self.args
        env = dict(os.environ)
        env.pop("VLLM_PORT", None)
        if args.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = args.gpu
        env.update(mode_env(self.mode, args.mode_env))
        env.update(tier_env(args.tier, args.cpu_gib))
        env.update(
            VLLM_USE_FLASHINFER_SAMPLER="0",
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            # `--tier multi`: each engine's NixlConnector its own side channel.
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.port + NIXL_SIDE_OFFSET),
        )
        cmd = [*shlex.split(args.serve_cmd), "serve", str(args.model)]
        cmd += ["--port", str(self.port), "--served-model-name", "model"]
        cmd += ["--load-format", "dummy", "--enable-prefix-caching"]
        cmd += ["--max-model-len", str(args.max_model_len)]
        cmd += ["--gpu-memory-utilization", str(args.util)]
        # A fixed KV cache: the two engines start together without a profiling race.
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
        config = transfer_config(
            configured_mode(self.mode, args.control),
            args.cpu_gib,
            args.tier,
        )
        cmd += ["--kv-transfer-config", json.dumps(config), *args.serve_arg]
        if args.profile_warmup:
            config = profiler_config(
                self.trace_dir, args.profile_steps, args.profile_with_stack
            )
            cmd += ["--profiler-config", json.dumps(config)]
        self.logs.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=open(self.logs / f"{self.mode}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=self._pin if self.cpus else None,
        )

    def _pin(self) -> None:
        """In the child before exec: the slot's CPUs for it and its children."""
        os.sched_setaffinity(0, self.cpus or set())

    def ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"{self.mode} engine ended: see {self.logs}")
        return http_get(f"http://127.0.0.1:{self.port}/health") is not None

    def counters(self) -> dict[str, dict[str, float]]:
        """Prefix-hit verdicts, host loads (vLLM's offload transfer counters)
        and the package's load verdicts (host loads alike) from /metrics."""
        page = http_get(f"http://127.0.0.1:{self.port}/metrics")
        return {
            "prefix_hits": verdict_counts(page, PREFIX_HITS),
            "host_loads": verdict_counts(page, HOST_LOADS),
            "load_verdicts": verdict_counts(page, load_verdict_pattern(self.args.tier)),
            "server_times": verdict_counts(page, SERVER_TIMES),
        }

    def stop(self) -> None:
        """Ends this engine's process group (its engine core included)."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)


def engine_threads(engine: Engine) -> dict[int, Any]:
    """The engine's threads' CPU counters (issue 30); empty off Linux."""
    try:
        return sample_tree(engine.proc.pid) if engine.proc else {}
    except OSError:
        return {}


def engine_affinity(engine: Engine) -> dict[str, list[int]]:
    """The CPUs the engine's processes may run on; empty off Linux."""
    try:
        return affinity(engine.proc.pid) if engine.proc else {}
    except OSError:
        return {}


def idle_mode(mode: str) -> str:
    """The engine slot not measured in a round of `mode`."""
    return "on" if mode == "off" else "off"


def start_pair(engines: dict[str, Engine], timeout: float) -> float:
    """Starts both engines at once; seconds until both answer /health."""
    t0 = time.time()
    for engine in engines.values():
        engine.start()
    waiting = set(engines)
    while waiting:
        if time.time() - t0 > timeout:
            raise RuntimeError(f"engines {sorted(waiting)} not ready in {timeout} s")
        waiting = {mode for mode in waiting if not engines[mode].ready()}
        if waiting:
            time.sleep(2)
    return time.time() - t0


def configured_mode(slot: str, control: bool) -> str:
    """The checksum configuration of the engine in `slot` ("off" or "on"):
    with `--control` both run "off" (an A/A run: the slots' own difference)."""
    return "off" if control else slot


def mode_env(mode: str, settings: list[str]) -> dict[str, str]:
    """The `--mode-env MODE:KEY=VALUE` settings of `mode`'s engine: e.g. a
    diagnosis setting in one slot only, following the mode when
    `--swap-slots` moves it."""
    env = {}
    for setting in settings:
        name, _, assignment = setting.partition(":")
        key, sep, value = assignment.partition("=")
        if name not in ("on", "off") or not key or not sep:
            raise ValueError(f"--mode-env {setting!r}: want on|off:KEY=VALUE")
        if name == mode:
            env[key] = value
    return env


def launch_slots(launch: int, swap: bool) -> dict[str, str]:
    """Which engine slot each mode runs in, in start order: "a" (--port-off,
    started first) and "b" (--port-on). With `swap`, odd launches put "on" in
    slot a, so that slot bias (start order, port, placement) cancels in the
    means over an even number of launches, and is estimated apart."""
    if swap and launch % 2:
        return {"on": "a", "off": "b"}
    return {"off": "a", "on": "b"}


def paired(rounds: list[dict[str, Any]], name: str, metric: str) -> dict[str, Any]:
    """`pair_summary` of `metric` within each pair of rounds that sent the same
    prompts (same launch and seed, next to each other in ABBA order), so drift
    between pairs cancels. Empty without pairs (rounds recorded without seeds)."""
    pairs: dict[tuple[int, int], dict[str, float]] = {}
    for r in rounds:
        value = r["results"].get(name, {}).get(metric)
        if value is not None and "seed" in r:
            pairs.setdefault((r["launch"], r["seed"]), {})[r["mode"]] = float(value)
    return pair_summary([p for p in pairs.values() if len(p) == 2])


def judge(
    rounds: list[dict[str, Any]], tier: str = "simple-hits", control: bool = False
) -> dict[str, Any]:
    """Per workload: means by mode, on/off ratio and delta, off-vs-off spread,
    prefix-hit verdicts (on rounds), host loads by mode and the verdict of the
    docstring (an offload tier's: throughput and host loads, TTFT reported).
    `control` (A/A): no slot verifies anything, so none is required."""
    workloads: dict[str, Any] = {}
    names = dict.fromkeys(name for r in rounds for name in r["results"])
    for name in names:
        row: dict[str, Any] = {}
        for metric in METRICS:
            values = mode_values(rounds, name, metric)
            if not values["off"] or not values["on"]:
                row[metric] = {"values": values}
                continue
            off, on = statistics.mean(values["off"]), statistics.mean(values["on"])
            row[metric] = {
                "values": values,
                "off_mean": off,
                "on_mean": on,
                "on_minus_off": on - off,
                "on_over_off": on / off if off else None,
                "off_spread": max(values["off"]) - min(values["off"]),
                "paired": paired(rounds, name, metric),
                "slot_bias": slot_bias(rounds, name, metric),
            }
        hits: dict[str, float] = {}
        for r in rounds:
            if r["mode"] == "on":
                for key, value in r["prefix_hits"].get(name, {}).items():
                    hits[key] = hits.get(key, 0.0) + value
        failed = sum(
            (r["results"].get(name, {}).get("failed") or 0)
            + (1 if "error" in r["results"].get(name, {"error": 1}) else 0)
            for r in rounds
        )
        rps, ttft = row["request_throughput"], row["median_ttft_ms"]
        timed = "off_mean" in rps and "off_mean" in ttft
        ratio_ok = timed and rps["on_over_off"] >= MIN_THROUGHPUT_RATIO
        ttft_ok = timed and ttft["on_minus_off"] <= MAX_TTFT_DELTA_MS
        if not ttft_judged(name):
            ttft_ok = timed
        hits_ok = hits.get("verified", 0) > 0 and hits.get("mismatch", 0) == 0
        host = host_load_totals(rounds, name)
        if tier in OFFLOAD_TIERS:
            ttft_ok, hits_ok = True, host_loads_ok(host)
        if control or tier == "simple-stores":  # nothing that checks hits
            hits_ok = True
        row.update(
            prefix_hits_on=hits,
            host_loads=host,
            failed=failed,
            throughput_ok=ratio_ok,
            ttft_judged=ttft_judged(name) and tier not in OFFLOAD_TIERS,
            ttft_ok=ttft_ok,
            hits_ok=hits_ok,
            # Informational: is the cost measurable against launch noise at all?
            throughput_inside_spread=timed
            and rps["off_mean"] - rps["on_mean"] <= rps["off_spread"],
            ttft_inside_spread=timed and ttft["on_minus_off"] <= ttft["off_spread"],
            passed=ratio_ok and ttft_ok and hits_ok and failed == 0,
        )
        workloads[name] = row
    return {
        "workloads": workloads,
        "control": control,
        "pass": bool(workloads) and all(w["passed"] for w in workloads.values()),
    }


def print_tables(rounds: list[dict[str, Any]], verdict: dict[str, Any]) -> None:
    print(
        "\n| round | launch | mode | workload | req/s | median TTFT ms "
        "| median TPOT ms | prefix hits | host loads | load verdicts |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rounds:
        for name, res in r["results"].items():
            cells = [
                f"{res[m]:.3f}" if res.get(m) is not None else "-" for m in METRICS
            ]
            hits = r["prefix_hits"].get(name, "-")
            loaded = r.get("host_loads", {}).get(name, {})
            host = next((loaded[k] for k in LOADED_KEYS if k in loaded), "-")
            loads = r.get("load_verdicts", {}).get(name, "-")
            print(
                f"| {r['round']} | {r['launch']} | {r['mode']} | {name} | "
                + " | ".join(cells)
                + f" | {hits} | {host} | {loads} |"
            )
    print(
        "\n| workload | metric | off mean | on mean | on-off | on/off | off spread "
        "| paired on-off: median (min .. max), pairs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, row in verdict["workloads"].items():
        for metric in METRICS:
            m = row[metric]
            if "off_mean" not in m:
                print(f"| {name} | {metric} | - | - | - | - | - | - |")
                continue
            pair = m.get("paired") or {}
            pair_cell = (
                f"{pair['median_on_minus_off']:+.3f} ({pair['min_on_minus_off']:+.3f}"
                f" .. {pair['max_on_minus_off']:+.3f}), {len(pair['on_minus_off'])}"
                if pair
                else "-"
            )
            print(
                f"| {name} | {metric} | {m['off_mean']:.3f} | {m['on_mean']:.3f} | "
                f"{m['on_minus_off']:+.3f} | {m['on_over_off']:.4f} | "
                f"{m['off_spread']:.3f} | {pair_cell} |"
            )
    print_slot_bias(verdict["workloads"], METRICS)
    for name, row in verdict["workloads"].items():
        print(
            f"\n{name}: throughput on/off >= {MIN_THROUGHPUT_RATIO}: "
            f"{row['throughput_ok']} (inside off spread: "
            f"{row['throughput_inside_spread']}); median TTFT delta <= "
            f"+{MAX_TTFT_DELTA_MS} ms: "
            f"{row['ttft_ok'] if row['ttft_judged'] else 'reported only'} "
            "(inside off spread: "
            f"{row['ttft_inside_spread']}); prefix hits on {row['prefix_hits_on']}, "
            f"host loads {row['host_loads']}: "
            f"{'ok' if row['hits_ok'] else 'NO'}; failed {row['failed']}; "
            f"{'PASS' if row['passed'] else 'FAIL'}"
        )
    print(f"\nPASS: {verdict['pass']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tier", choices=TIERS, default="simple-hits")
    parser.add_argument("--rounds", type=int, default=None, help="per launch, ABBA")
    parser.add_argument("--launches", type=int, default=1, help="engine pairs")
    parser.add_argument("--workloads", default=None, help="names, comma-separated")
    parser.add_argument("--scale", type=float, default=1.0, help="prompts x SCALE")
    parser.add_argument("--seed", type=int, default=0, help="seed of round 0")
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="unrecorded runs per engine"
    )
    parser.add_argument(
        "--profile-warmup",
        action="store_true",
        help="torch-profile each engine's first warm-up run (vLLM's profiler); "
        "the traces' summary goes to summary.json",
    )
    parser.add_argument(
        "--keep-traces", action="store_true", help="keep the trace files in OUT"
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="with --profile-warmup: trace only this many engine steps (0: all)",
    )
    parser.add_argument(
        "--profile-with-stack",
        action="store_true",
        help="with --profile-warmup: record Python functions too (their "
        "inclusive time by name, and the package's, go to summary.json)",
    )
    parser.add_argument(
        "--swap-slots",
        action="store_true",
        help="odd launches run checksums on in the first slot: with an even "
        "--launches, slot bias cancels and is reported apart",
    )
    parser.add_argument(
        "--pin-cores",
        type=int,
        default=0,
        help="each engine slot on its own N physical cores (SMT siblings "
        "together), this driver and its clients on the rest (0: no pinning)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="A/A: the 'on' slot runs checksums off too, so 'on/off' measures "
        "the two engine slots' own difference (start order, port, placement)",
    )
    parser.add_argument(
        "--mode-env",
        action="append",
        default=[],
        help="on|off:KEY=VALUE: an environment setting of that mode's engine only",
    )
    parser.add_argument("--gpu", default=None, help="default: the inherited one")
    parser.add_argument("--util", type=float, default=0.4)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=None, help="default: by tier"
    )
    parser.add_argument("--cpu-gib", type=int, default=None, help="offload tier size")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--port-off", type=int, default=8300 + PORT_OFFSET)
    parser.add_argument("--port-on", type=int, default=8400 + PORT_OFFSET)
    parser.add_argument("--startup-timeout", type=float, default=400)
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="extra `vllm serve` arg"
    )
    parser.add_argument("--serve-cmd", default=shlex.join(CLI), help="serves")
    parser.add_argument("--bench-cmd", default=shlex.join(CLI), help="benches")
    parser.add_argument(
        "--bench-batch",
        action="store_true",
        help="every bench run of a launch in one process (vLLM imported once; "
        "--bench-cmd unused)",
    )
    args = parser.parse_args(argv)
    try:
        mode_env("on", args.mode_env)
    except ValueError as err:
        parser.error(str(err))
    rounds, workloads, cpu_gib = TIER_DEFAULTS[args.tier]
    args.rounds = rounds if args.rounds is None else args.rounds
    args.workloads = args.workloads or workloads
    args.cpu_gib = cpu_gib if args.cpu_gib is None else args.cpu_gib
    args.profiles = {}  # --profile-warmup's trace summaries, by launch and mode
    args.affinity = {}  # each engine's processes' CPUs, by launch and mode
    args.slots = {}  # each launch's engine slot of each mode
    args.slot_cpus = {}  # --pin-cores: each slot's CPUs
    return args


def warm_up(
    args: argparse.Namespace,
    engines: dict[str, Any],
    chosen: list[Workload],
    logs: Path,
    launch: int,
    runner: BenchRunner,
) -> None:
    """--warmup-rounds unrecorded runs of the first workload on each engine,
    with seeds no measured round uses (their prefixes are not the measured
    ones): the first measured round then pays no first-traffic cost."""
    for k in range(args.warmup_rounds):
        for mode, engine in engines.items():
            seed = WARMUP_SEED + launch * 100 + k
            path = logs / f"warmup{k}_{mode}.json"
            argv = bench_args(args, chosen[0], engine.port, seed, path)
            if args.profile_warmup and k == 0:
                argv.append("--profile")  # vLLM's /start_profile and /stop_profile
            rc = runner.run(argv, path.with_suffix(".log"))
            result = read_result(path, rc)
            log(
                f"warm-up {k} ({mode}): {result.get('request_throughput')} req/s, "
                f"TTFT {result.get('median_ttft_ms')} ms (not recorded)"
            )


def profiler_config(
    trace_dir: Path, max_steps: int = 0, with_stack: bool = False
) -> dict[str, Any]:
    """vLLM's --profiler-config for a torch trace of both CPU and CUDA
    activity (Python functions only `with_stack`: a larger, slower trace);
    `max_steps` > 0 traces only the first engine steps and not the API front
    end, so the trace is written in seconds (a whole 8B warm-up's took minutes
    on the H200 host)."""
    config: dict[str, Any] = {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": with_stack,
    }
    if max_steps:
        config.update(max_iterations=max_steps, ignore_frontend=True)
    return config


# Trace event categories summed by name, and the CUDA calls that block the host.
TRACE_CATEGORIES = ("kernel", "gpu_memcpy", "cuda_runtime", "cpu_op", "user_annotation")
# Python functions (traces --profile-with-stack): inclusive time, so nested
# calls count in each caller; ranked deeper than the other categories.
PYTHON_CATEGORY = "python_function"
PYTHON_TOP = 60
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
# Events of any category summed apart whatever their rank: the package's own
# kernels and the runtime calls its step work makes (pinned allocations,
# copies, events), lower-case substrings of the name.
WATCHED = (
    "checksum",
    "copy_words",
    "cudahostalloc",
    "cudafreehost",
    "cudahostregister",
    "cudamemcpyasync",
    "cudaeventrecord",
    "cudaeventquery",
    "cudastreamwaitevent",
    "kv_checksum",  # the package's Python functions (with stacks)
)


def summarize_trace_events(events: list[dict[str, Any]], top: int = 15) -> dict:
    """Per category of TRACE_CATEGORIES: total microseconds, event count and the
    `top` names by total time (every user annotation: vLLM's step phases); every
    host wait (synchronize calls); and every WATCHED event by category/name."""
    categories = (*TRACE_CATEGORIES, PYTHON_CATEGORY)
    totals: dict[str, dict[str, list[float]]] = {c: {} for c in categories}
    for event in events:
        cat = event.get("cat")
        if cat in totals and "dur" in event:
            entry = totals[cat].setdefault(str(event.get("name")), [0.0, 0])
            entry[0] += float(event["dur"])
            entry[1] += 1
    summary: dict[str, Any] = {}
    watched: dict[str, list] = {}
    for cat, names in totals.items():
        if cat == PYTHON_CATEGORY and not names:
            continue  # a trace without stacks
        ranked = sorted(names.items(), key=lambda kv: -kv[1][0])
        depth = PYTHON_TOP if cat == PYTHON_CATEGORY else top
        shown = ranked if cat == "user_annotation" else ranked[:depth]
        summary[cat] = {
            "total_us": round(sum(v[0] for v in names.values()), 1),
            "events": sum(int(v[1]) for v in names.values()),
            "top": [[n, round(v[0], 1), int(v[1])] for n, v in shown],
        }
        for name, (us, count) in ranked:
            if any(w in name.lower() for w in WATCHED):
                watched[f"{cat}/{name[:120]}"] = [round(us, 1), int(count)]
    summary["watched"] = watched
    if totals[PYTHON_CATEGORY]:
        summary["python_self"] = python_self_times(events)
    runtime = totals["cuda_runtime"]
    summary["host_waits"] = {
        name: [round(runtime[name][0], 1), int(runtime[name][1])]
        for name in HOST_WAITS
        if name in runtime
    }
    return summary


def python_self_times(events: list[dict[str, Any]]) -> list[list]:
    """The PYTHON_TOP Python functions by self time (their duration less that
    of the Python functions they call, per thread), [name, us, calls]: where
    the interpreter itself spends a step, which inclusive time hides."""
    by_thread: dict[Any, list[dict[str, Any]]] = {}
    for event in events:
        if event.get("cat") == PYTHON_CATEGORY and "dur" in event:
            by_thread.setdefault((event.get("pid"), event.get("tid")), []).append(event)
    own: dict[str, list[float]] = {}
    for calls in by_thread.values():
        calls.sort(key=lambda e: (float(e.get("ts", 0.0)), -float(e["dur"])))
        open_calls: list[tuple[float, list]] = []  # (end, [name, self us])
        for event in calls:
            start, dur = float(event.get("ts", 0.0)), float(event["dur"])
            while open_calls and open_calls[-1][0] <= start:
                name, us = open_calls.pop()[1]
                own.setdefault(name, [0.0, 0])[0] += us
            if open_calls:
                open_calls[-1][1][1] -= dur  # the caller's self time
            open_calls.append((start + dur, [str(event.get("name")), dur]))
            own.setdefault(str(event.get("name")), [0.0, 0])[1] += 1
        for _, (name, us) in open_calls:
            own[name][0] += us
    ranked = sorted(own.items(), key=lambda kv: -kv[1][0])[:PYTHON_TOP]
    return [[name, round(us, 1), int(n)] for name, (us, n) in ranked]


def summarize_traces(trace_dir: Path) -> dict[str, Any]:
    """`summarize_trace_events` of every torch trace file under `trace_dir`
    (vLLM writes one per worker and one for the API process), by file name."""
    import gzip

    found: dict[str, Any] = {}
    for path in sorted(trace_dir.rglob("*.json*")):
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rt") as f:
                events = json.load(f).get("traceEvents", [])
        except (OSError, ValueError) as err:
            found[path.name] = {"error": repr(err)[:200]}
            continue
        found[path.name] = summarize_trace_events(events)
    return found


def run_launch(
    args: argparse.Namespace,
    launch: int,
    chosen: list[Workload],
    rounds: list[dict[str, Any]],
) -> None:
    """One pair of engines and its rounds, appended to ``rounds``."""
    logs = args.out / f"launch{launch}"
    slots = launch_slots(launch, args.swap_slots)
    ports = {"a": args.port_off, "b": args.port_on}
    # In slot order: slot a's engine is started first.
    engines = {
        mode: Engine(args, mode, ports[slot], logs, args.slot_cpus.get(slot))
        for mode, slot in slots.items()
    }
    args.slots[f"launch{launch}"] = slots
    log(f"launch {launch}: slots {slots}")
    runner = BenchRunner(args)
    try:
        startup = start_pair(engines, args.startup_timeout)
        log(f"launch {launch}: both engines ready in {startup:.0f} s")
        args.affinity[f"launch{launch}"] = cpus = {
            mode: engine_affinity(engine) for mode, engine in engines.items()
        }
        for mode, processes in cpus.items():
            counts = sorted({len(c) for c in processes.values()})
            log(f"launch {launch}: {mode}: {len(processes)} processes on {counts} CPUs")
        warm_up(args, engines, chosen, logs, launch, runner)
        if args.profile_warmup:
            args.profiles[f"launch{launch}"] = {
                mode: summarize_traces(engine.trace_dir)
                for mode, engine in engines.items()
            }
            if not args.keep_traces:  # 10-100 MB each: the summary comes back
                for engine in engines.values():
                    shutil.rmtree(engine.trace_dir, ignore_errors=True)
            log(f"launch {launch}: warm-up profiles summarized")
        for k, mode in enumerate(round_modes(args.rounds)):
            index = launch * args.rounds + k
            seed = args.seed + index // 2
            entry: dict[str, Any] = {
                "round": index,
                "launch": launch,
                "mode": mode,
                "seed": seed,
                "slot": slots[mode],
                "results": {},
                **{counter: {} for counter in COUNTERS},
                "processes": {},
            }
            engine = engines[mode]
            for workload in chosen:
                path = logs / f"round{index}_{mode}_{workload.name}.json"
                before = engine.counters()
                threads = {m: engine_threads(e) for m, e in engines.items()}
                argv = bench_args(args, workload, engine.port, seed, path)
                rc = runner.run(argv, path.with_suffix(".log"))
                result = read_result(path, rc)
                entry["results"][workload.name] = result
                after = engine.counters()
                # Both engines: the idle one may take cores from the measured one.
                usage = {
                    m: tree_delta(threads[m], engine_threads(e)) if threads[m] else {}
                    for m, e in engines.items()
                }
                entry["processes"][workload.name] = usage
                for counter in COUNTERS:
                    delta = counter_delta(before[counter], after[counter])
                    entry[counter][workload.name] = delta
                hits = entry["prefix_hits"][workload.name]
                host = entry["host_loads"][workload.name]
                log(
                    f"round {index} ({mode}) {workload.name}: "
                    f"{result.get('request_throughput')} req/s, TTFT "
                    f"{result.get('median_ttft_ms')} ms, TPOT "
                    f"{result.get('median_tpot_ms')} ms, hits {hits}, host "
                    f"loads {host} {entry['load_verdicts'][workload.name]}, "
                    "server means ms "
                    f"{histogram_means_ms(entry['server_times'][workload.name])} "
                    f"CPU s (involuntary switches) {cpu_brief(usage[mode])}, "
                    f"idle engine {cpu_brief(usage[idle_mode(mode)], 0)} "
                    f"{result.get('error', '')}"
                )
            rounds.append(entry)
            write_summary(args, chosen, rounds)
    except RuntimeError as err:
        log(f"launch {launch} failed: {err}")
    finally:
        runner.close()
        for engine in engines.values():
            engine.stop()


def write_summary(
    args: argparse.Namespace, chosen: list[Workload], rounds: list[dict[str, Any]]
) -> dict[str, Any]:
    verdict = judge(rounds, args.tier, args.control)
    config = {
        "shape": args.shape,
        "dims": SHAPES[args.shape],
        "tp": 1,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup_rounds,
        "profile_warmup": args.profile_warmup,
        "launches": args.launches,
        "workloads": [asdict(w) for w in chosen],
        "scale": args.scale,
        "tier": args.tier,
        "kv_cache_bytes": args.kv_cache_bytes,
        "transfer_config": {
            m: transfer_config(
                configured_mode(m, args.control), args.cpu_gib, args.tier
            )
            for m in ABBA[:2]
        },
        "control": args.control,
        "mode_env": args.mode_env,
        "swap_slots": args.swap_slots,
        "slot_cpus": {k: sorted(v) for k, v in args.slot_cpus.items()},
        "slots": args.slots,
        "serve_args": args.serve_arg,
        "title": f"vllm bench serve, {args.tier}: "
        + (
            "A/A control, both slots checksums off"
            if args.control
            else "checksums off vs on"
        ),
    }
    record = {"config": config, "rounds": rounds, "summary": verdict}
    if args.profiles:
        record["warmup_profiles"] = args.profiles
    if args.affinity:
        record["affinity"] = args.affinity
    (args.out / "summary.json").write_text(json.dumps(record, indent=1))
    return verdict


def pin_slots(args: argparse.Namespace) -> None:
    """--pin-cores: slots a and b on disjoint whole cores, and this driver
    (with the bench clients it starts) on the rest, so neither engine's main
    thread shares a core with the other's or with the client's."""
    (cpus_a, cpus_b), rest = split_cores(
        physical_cores(usable_cpus()), args.pin_cores, slots=2
    )
    args.slot_cpus = {"a": cpus_a, "b": cpus_b}
    os.sched_setaffinity(0, rest)
    log(
        f"pinned: slot a {sorted(cpus_a)}, slot b {sorted(cpus_b)}, "
        f"driver and clients {sorted(rest)}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.pin_cores:
        try:
            pin_slots(args)
        except ValueError as err:  # too few cores on this host
            log(f"--pin-cores {args.pin_cores}: {err}")
            return 2
    # Not the serve benchmark's folder: that one is built for 34K tokens.
    args.model = args.model or Path(f"/tmp/kv-checksum-prefix-bench-{args.shape}")
    build_model(args.model, args.shape, args.max_model_len)
    chosen = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    args.kv_cache_bytes = kv_cache_bytes(
        args.tier, args.kv_cache_gib, SHAPES[args.shape], chosen, args.max_model_len
    )
    rounds: list[dict[str, Any]] = []
    for launch in range(args.launches):
        run_launch(args, launch, chosen, rounds)
    verdict = write_summary(args, chosen, rounds)
    print_tables(rounds, verdict)
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
