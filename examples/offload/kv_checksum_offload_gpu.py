# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real-engine validation of KV checksums on vLLM's CPU offload tier (R139).

Engines (separate processes on one GPU, tiny random-weight Qwen3 built by
`kv_checksum_pd_gpu.build_model`), each with a small GPU KV cache
(`num_gpu_blocks_override`) and the OffloadingConnector's CPU backend, or
with ``--connector simple`` (``simple-lazy``) SimpleCPUOffloadConnector in
eager (lazy) mode:

- ``off``: checksums off (the reference),
- ``on``: checksums on, fail-closed, kv_load_failure_policy "recompute",
- ``faulty``: like ``on`` plus host-copy fault injection
  (`kv_checksum_host_fault_injection`, both kinds),
- ``multi``: like ``on`` but through MultiConnector(NixlConnector, the
  offload connector) (``--phases`` includes ``multi``),
- ``fresh``: no connector, no prefix caching: every prompt computed whole,
  the reference of a recomputed request.

All in vLLM's batch-invariant mode (``--no-batch-invariant`` turns it off), so
a recompute does not change the tokens of the requests batched beside it.

Workload: prompts made of one of `--num-prefixes` shared prefixes and a
unique suffix, sent round-robin over the prefixes in batches, so each
prefix has been evicted from the GPU cache by the time it is used again and
is loaded back from host memory.

Phases:
1. loads: the same requests on ``off`` and ``on``: outputs must be equal; on
   ``on``, at least `--min-loads` verified loads (the package's own verdict
   counter `vllm:kv_checksum_loads`), 0 mismatches and 0 unverified.
2. faults: the same requests on ``faulty``: every injected fault is followed
   by a mismatch of that request, every bad host copy is dropped (one log
   line per copy); recomputed requests equal ``fresh``'s outputs, all others
   ``off``'s.
3. multi: the same requests on ``multi``: verified loads, none failing,
   outputs equal to ``off``'s.
4. overhead: ``off`` and ``on`` timed on the same batches, interleaved.
5. spread (issue 32, R138): on ``spread`` (checksums on, fail-open, host
   faults "host_other_block" at `--spread-fault-rate`), per scenario: P
   stores a prefix to host, fillers evict it from the GPU, A (prefix + a
   suffix) loads it (the fault may corrupt its first block: A mismatches and
   runs on it, fail-open), C (the prefix + another tail) brings a clean copy
   back, fillers evict again, then B (A's prompt) arrives. A scenario is
   exercised when A's fault was injected and caught and B's own load was not
   faulted; B is "served on bad-derived KV" when it found more than the
   prefix cached (`num_cached_tokens`: it loaded A's quarantined suffix) or
   its output parts clearly from ``fresh``'s. Pass: >= 1 exercised, 0 served.
6. prefix (issue 31, R140; not in the default ``--phases``): ``prefix``
   (checksums on, fail-closed, `kv_checksum_verify_prefix_hits`, fault kind
   "prefix_hit" at `--prefix-fault-rate`, a GPU cache holding every prefix so
   hits are local) runs `--prefix-requests` prompts over `--prefix-count`
   long shared prefixes, first one at a time, then in batches. Pass: every
   "fault injection: prefix_hit" line followed by a "mismatch in prefix-cache
   hit" line of that request, verified hits > 0 (`vllm:kv_checksum_prefix_hits`),
   faulted requests equal ``fresh``'s outputs, all others ``off``'s (both up
   to a near-tie).

Usage (vLLM 0.33.0, NIXL, transformers and this package installed):
    PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 \
        python examples/offload/kv_checksum_offload_gpu.py --out DIR \
        [--connector simple|simple-lazy]
Exit code 0 only if every check passed; DIR/summary.json holds the results.
"""

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import statistics
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "disaggregated"))

import kv_checksum_pd_gpu as pd_gpu  # noqa: E402
from kv_checksum_pd_gpu import (  # noqa: E402
    MISMATCH,
    MODELS,
    TOP,
    UNVERIFIED,
    build_model,
    compare_outputs,
    differing,
    top_logprobs,
)

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
HOST_INJECTION = re.compile(
    r"KV checksum host fault injection: (\w+) into request (\S+) chunk (\d+)\."
)
DROPPED = "KV checksums: dropped a host copy that failed verification."
PREFIX_INJECTION = re.compile(
    r"KV checksum fault injection: prefix_hit into request (\S+) group \d+"
)
PREFIX_MISMATCH = re.compile(
    r"KV checksum mismatch in prefix-cache hit of request (\S+):"
)


# --connector: the offload connector and its own settings.
CONNECTORS = {
    "offloading": ("OffloadingConnector", {}),
    "simple": ("SimpleCPUOffloadConnector", {}),
    "simple-lazy": ("SimpleCPUOffloadConnector", {"lazy_offload": True}),
}


def offload_config(extra: dict, multi: bool) -> dict:
    """kv_transfer_config keyword arguments of one engine."""
    name, settings = CONNECTORS[extra.get("_connector", "offloading")]
    offload = {"cpu_bytes_to_use": 512 << 20, **settings}
    flags = {k: v for k, v in extra.items() if not k.startswith("_")}
    host_faults = flags.pop("kv_checksum_host_fault_injection", None)
    if host_faults is not None:
        offload["kv_checksum_host_fault_injection"] = host_faults
    if not multi:
        return {
            "kv_connector": name,
            "kv_connector_extra_config": {**offload, **flags},
        }
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            **flags,
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {
                    "kv_connector": name,
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": offload,
                },
            ],
        },
    }


def engine_main(
    name: str, extra: dict, port: int, log: str, cmds: Any, results: Any
) -> None:
    """One engine process: build an LLM, then serve generate commands."""
    pd_gpu.engine_process_setup(log, port)
    # Outputs independent of batch composition: a recompute changes the
    # batches of the requests beside it, which must not change their tokens.
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if extra.get("_batch_invariant") else "0"

    def build() -> Any:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        return LLM(
            model=MODELS["tiny"],
            skip_tokenizer_init=True,
            enforce_eager=True,
            gpu_memory_utilization=0.12,
            # A fixed KV size skips memory profiling, which fails when engines
            # starting beside each other free memory while one profiles.
            kv_cache_memory_bytes=1 << 30,
            num_gpu_blocks_override=int(extra.get("_gpu_blocks", 256)),
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            dtype="bfloat16",
            seed=0,
            disable_log_stats=False,
            # ``fresh`` computes every prompt whole (what a recompute does).
            enable_prefix_caching=not extra.get("_fresh"),
            kv_transfer_config=None
            if extra.get("_fresh")
            else KVTransferConfig(
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                **offload_config(extra, bool(extra.get("_multi"))),
            ),
        )

    def answer(llm: Any, cmd: tuple) -> tuple:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        batch, max_tokens = cmd[1], cmd[2]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            logprobs=TOP,
        )
        start = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in batch],
            params,
            use_tqdm=False,
        )
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        top = [top_logprobs(o.outputs[0].logprobs) for o in outs]
        cached = [int(o.num_cached_tokens or 0) for o in outs]
        return tokens, read_counters(llm), elapsed, top, cached

    pd_gpu.serve_commands(name, build, answer, cmds, results)


def read_counters(llm: Any) -> dict[str, float]:
    """The package's verdict counters (cumulative) of this engine."""
    counts: dict[str, float] = {}
    try:
        for metric in llm.get_metrics():
            if metric.name == "vllm:kv_checksum_loads":
                key = (metric.labels or {}).get("verdict", "?")
                counts[key] = counts.get(key, 0) + float(metric.value)
            elif metric.name == "vllm:kv_checksum_prefix_hits":
                key = "prefix_" + (metric.labels or {}).get("verdict", "?")
                counts[key] = counts.get(key, 0) + float(metric.value)
            elif metric.name == "vllm:kv_checksum_mismatched_blocks":
                counts["mismatched_blocks"] = counts.get(
                    "mismatched_blocks", 0
                ) + float(metric.value)
    except Exception as e:
        counts["error"] = -1.0
        print(f"metrics unavailable: {e!r}", flush=True)
    return counts


class Engine(pd_gpu.Engine):
    """Handle of one offload engine process (the P/D driver's, another main)."""

    def __init__(self, ctx: Any, name: str, extra: dict, out: str) -> None:
        port = int(extra.get("_port", 5600)) + pd_gpu.PORT_OFFSET
        super().__init__(ctx, name, extra, port, out, target=engine_main)

    def run_batch(self, batch: list, max_tokens: int, timeout: float = 120) -> tuple:
        self.cmds.put(("gen", batch, max_tokens))
        return self.wait("gen", timeout)

    def run_all(self, batches: list, max_tokens: int) -> tuple[list, dict, float]:
        """Tokens per request, the last counters, the time in generate; the
        top logprobs of each request's tokens are kept in `self.top`."""
        tokens: list = []
        self.top: list = []
        self.cached: list = []
        counters: dict = {}
        total = 0.0
        for batch in batches:
            out, counters, elapsed, top, cached = self.run_batch(batch, max_tokens)
            tokens.extend(out)
            self.top.extend(top)
            self.cached.extend(cached)
            total += elapsed
        return tokens, counters, total


def workload(args: argparse.Namespace, seed: int) -> list[list[list[int]]]:
    """Batches of prompts: a shared prefix (round-robin) plus a unique suffix."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 2048) for _ in range(args.prefix_blocks * BLOCK_SIZE)]
        for _ in range(args.num_prefixes)
    ]
    prompts = [
        prefixes[i % args.num_prefixes]
        + [rng.randrange(3, 2048) for _ in range(BLOCK_SIZE + 1)]
        for i in range(args.num_requests)
    ]
    size = args.batch
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def scan(path: str) -> dict[str, Any]:
    with open(path, errors="replace") as f:
        text = f.read()
    return {
        "injected": HOST_INJECTION.findall(text),
        "mismatched": MISMATCH.findall(text),
        "unverified": UNVERIFIED.findall(text),
        "dropped": text.count(DROPPED),
        "errors": text.count("KV checksums disabled for this engine"),
    }


def scan_prefix_faults(text: str) -> dict[str, list[str]]:
    """Prefix-hit injections (in log order) and those not followed by a
    prefix-hit mismatch of the same request later in the log."""
    injected, uncaught = [], []
    for match in PREFIX_INJECTION.finditer(text):
        req = match.group(1)
        injected.append(req)
        later = (m.group(1) for m in PREFIX_MISMATCH.finditer(text, match.end()))
        if req not in later:
            uncaught.append(req)
    return {"injected": injected, "uncaught": uncaught}


def prefix_workload(args: argparse.Namespace, seed: int = 11) -> list[list[list[int]]]:
    """Prompts over a few long shared prefixes: the first quarter one request
    at a time, the rest in batches of `--batch`."""
    rng = random.Random(seed)
    length = args.prefix_blocks * BLOCK_SIZE
    prefixes = [
        [rng.randrange(3, 2048) for _ in range(length)]
        for _ in range(args.prefix_count)
    ]
    prompts = [
        prefixes[i % args.prefix_count]
        + [rng.randrange(3, 2048) for _ in range(BLOCK_SIZE // 2 + 1)]
        for i in range(args.prefix_requests)
    ]
    alone = max(1, len(prompts) // 4)
    batched = prompts[alone:]
    return [[p] for p in prompts[:alone]] + [
        batched[i : i + args.batch] for i in range(0, len(batched), args.batch)
    ]


def phase_prefix(engines: dict, args: Any, summary: dict) -> None:
    batches = prefix_workload(args)
    ref, _, _ = engines["off"].run_all(batches, args.max_tokens)
    ref_top = engines["off"].top
    got, counters, _ = engines["prefix"].run_all(batches, args.max_tokens)
    got_top = engines["prefix"].top
    fresh, _, _ = engines["fresh"].run_all(batches, args.max_tokens)
    with open(engines["prefix"].log, errors="replace") as f:
        text = f.read()
    faults = scan_prefix_faults(text)
    summary["prefix"] = {"counters": counters, **faults}
    injected = set(faults["injected"])
    check(summary, "prefix: some injected", len(injected) > 0, len(injected))
    check(
        summary,
        "prefix: every fault caught",
        not faults["uncaught"],
        faults["uncaught"],
    )
    verified = counters.get("prefix_verified", 0)
    check(summary, "prefix: verified hits > 0", verified > 0, counters)
    index = {req.split("-")[0] for req in injected}
    faulted = [i for i in range(len(got)) if str(i) in index]
    clean = [i for i in range(len(got)) if str(i) not in index]
    vs_fresh = compare_outputs(fresh, engines["fresh"].top, got, got_top, faulted)
    vs_off = compare_outputs(ref, ref_top, got, got_top, clean)
    summary["prefix"]["faulted_vs_fresh"] = vs_fresh
    summary["prefix"]["clean_vs_off"] = vs_off
    check(
        summary,
        "prefix: faulted outputs equal a whole-prompt computation (or part at a "
        "near-tie)",
        not vs_fresh["wrong"],
        vs_fresh,
    )
    check(
        summary,
        "prefix: clean outputs equal checksums off (or part at a near-tie)",
        not vs_off["wrong"],
        vs_off,
    )
    check(
        summary,
        "prefix: no checksum errors",
        "KV checksums disabled for this engine" not in text
        and "prefix-hit verification turned off" not in text,
        "",
    )


def check(summary: dict, name: str, ok: bool, detail: Any) -> None:
    summary["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def phase_loads(engines: dict, batches: list, args: Any, summary: dict) -> list:
    ref, _, t_off = engines["off"].run_all(batches, args.max_tokens)
    got, counters, t_on = engines["on"].run_all(batches, args.max_tokens)
    log = scan(engines["on"].log)
    summary["loads"] = {"counters": counters, "log": _short(log), "time_s": t_on}
    verified = counters.get("verified", 0)
    # The two engines see offload copies complete at other steps, so a prefix
    # one loads the other may compute: near-ties may part (as in faults).
    vs_off = compare_outputs(
        ref, engines["off"].top, got, engines["on"].top, list(range(len(got)))
    )
    summary["loads"]["vs_off"] = vs_off
    summary["loads"]["differing"] = differing(ref, got)
    check(
        summary,
        "loads: outputs equal checksums off (or part at a near-tie)",
        not vs_off["wrong"],
        vs_off,
    )
    check(summary, "loads: verified >= min", verified >= args.min_loads, verified)
    bad = counters.get("mismatch", 0) + counters.get("unverified", 0)
    check(
        summary,
        "loads: 0 mismatch, 0 unverified",
        bad == 0 and not log["mismatched"] and not log["unverified"],
        counters,
    )
    check(summary, "loads: no checksum errors", log["errors"] == 0, log["errors"])
    return ref, engines["off"].top


def phase_faults(
    engines: dict, batches: list, ref: tuple, args: Any, summary: dict
) -> None:
    got, counters, _ = engines["faulty"].run_all(batches, args.max_tokens)
    got_top = engines["faulty"].top
    log = scan(engines["faulty"].log)
    injected = {req for _, req, _ in log["injected"]}
    mismatched = set(log["mismatched"])
    summary["faults"] = {"counters": counters, "log": _short(log)}
    check(
        summary, "faults: some injected", len(log["injected"]) > 0, len(log["injected"])
    )
    check(
        summary,
        "faults: every fault caught",
        injected <= mismatched,
        sorted(injected - mismatched),
    )
    check(
        summary,
        "faults: every bad copy dropped",
        log["dropped"] >= len(log["injected"]),
        {"dropped": log["dropped"], "injected": len(log["injected"])},
    )
    # A recomputed request computes its prompt again: its reference is
    # ``fresh`` (the whole prompt computed); every other request's is ``off``.
    # Dropped copies change what later requests find cached, so some of them
    # compute a prefix that ``off`` loaded: their tokens may part from
    # ``off``'s at a near-tie, never with a clear margin.
    fresh, _, _ = engines["fresh"].run_all(batches, args.max_tokens)
    fresh_top = engines["fresh"].top
    index = {req.split("-")[0] for req in injected}
    recomputed = [i for i in range(len(got)) if str(i) in index]
    others = [i for i in range(len(got)) if str(i) not in index]
    vs_fresh = compare_outputs(fresh, fresh_top, got, got_top, recomputed)
    vs_off = compare_outputs(ref[0], ref[1], got, got_top, others)
    summary["faults"]["recomputed_vs_fresh"] = vs_fresh
    summary["faults"]["others_vs_off"] = vs_off
    check(
        summary,
        "faults: recomputed outputs equal a whole-prompt computation (or part "
        "at a near-tie)",
        not vs_fresh["wrong"],
        vs_fresh,
    )
    check(
        summary,
        "faults: other outputs equal checksums off (or part at a near-tie)",
        not vs_off["wrong"],
        vs_off,
    )


def phase_multi(
    engines: dict, batches: list, ref: tuple, args: Any, summary: dict
) -> None:
    got, counters, _ = engines["multi"].run_all(batches, args.max_tokens)
    log = scan(engines["multi"].log)
    summary["multi"] = {"counters": counters, "log": _short(log)}
    # NixlConnector sets its own KV cache layout, so the attention kernels
    # read the same KV in another order: near-ties may part.
    vs_off = compare_outputs(
        ref[0], ref[1], got, engines["multi"].top, list(range(len(got)))
    )
    summary["multi"]["vs_off"] = vs_off
    check(
        summary,
        "multi: outputs equal checksums off (or part at a near-tie)",
        not vs_off["wrong"],
        vs_off,
    )
    check(
        summary,
        "multi: verified offload loads",
        counters.get("verified", 0) > 0,
        counters,
    )
    bad = counters.get("mismatch", 0) + counters.get("unverified", 0)
    check(summary, "multi: 0 mismatch, 0 unverified", bad == 0, counters)


# Stages of the spread phase, in order; "fill" evicts the GPU prefix cache.
SPREAD_STAGES = ("p", "fill", "a", "c", "fill", "b")


def spread_prompts(args: Any, seed: int = 7) -> dict[str, list[list[int]]]:
    """The spread phase's prompts per stage: P, A, C, B per scenario (B is
    A's prompt) and the fillers of each eviction (more blocks than the GPU)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 2048) for _ in range(n)]

    prefix_len = args.prefix_blocks * BLOCK_SIZE
    prefixes = [toks(prefix_len) for _ in range(args.spread_scenarios)]
    suffixes = [toks(args.spread_suffix_blocks * BLOCK_SIZE + 1) for _ in prefixes]
    per_filler = args.prefix_blocks + 1
    num_fillers = args.gpu_blocks // per_filler + 8
    a = [p + s for p, s in zip(prefixes, suffixes)]
    return {
        "p": [p + toks(BLOCK_SIZE + 1) for p in prefixes],
        "a": a,
        "c": [p + toks(BLOCK_SIZE + 1) for p in prefixes],
        "b": [list(x) for x in a],
        "fill": [toks(per_filler * BLOCK_SIZE) for _ in range(num_fillers)],
    }


def spread_cases(
    a_ids: list[str],
    b_ids: list[str],
    injected: set[str],
    mismatched: set[str],
    b_cached: list[int],
    prefix_tokens: int,
) -> dict[str, list[int]]:
    """Scenario indices: exercised (A's fault injected and caught, B's own
    load clean) and, of those, B served on A's quarantined suffix (B found
    more than the prefix cached)."""
    exercised = [
        i
        for i, (a, b) in enumerate(zip(a_ids, b_ids))
        if a in injected and a in mismatched and b not in injected
    ]
    served = [i for i in exercised if b_cached[i] > prefix_tokens]
    return {"exercised": exercised, "served": served}


def phase_spread(engines: dict, args: Any, summary: dict) -> None:
    """Issue 32 scenario (R138): no B runs on KV computed over A's bad load."""
    engine = engines["spread"]
    prompts = spread_prompts(args)
    ids: dict[str, list[str]] = {}
    sent = 0
    b_out: tuple = ([], [], [])
    for stage in SPREAD_STAGES:
        batch = prompts[stage]
        ids[stage] = [str(sent + i) for i in range(len(batch))]
        sent += len(batch)
        size = args.batch
        chunks = [batch[i : i + size] for i in range(0, len(batch), size)]
        got, _, _ = engine.run_all(chunks, args.max_tokens)
        if stage == "b":
            b_out = (got, engine.top, engine.cached)
    log = scan(engine.log)
    injected = {req.split("-")[0] for _, req, _ in log["injected"]}
    mismatched = {req.split("-")[0] for req in log["mismatched"]}
    prefix_tokens = args.prefix_blocks * BLOCK_SIZE
    cases = spread_cases(
        ids["a"], ids["b"], injected, mismatched, b_out[2], prefix_tokens
    )
    fresh, _, _ = engines["fresh"].run_all([prompts["b"]], args.max_tokens)
    vs_fresh = compare_outputs(
        fresh, engines["fresh"].top, b_out[0], b_out[1], cases["exercised"]
    )
    summary["spread"] = {
        "log": _short(log),
        "cases": cases,
        "b_cached": b_out[2],
        "b_vs_fresh": vs_fresh,
    }
    check(
        summary,
        "spread: scenarios exercised (A's fault caught, B's load clean)",
        len(cases["exercised"]) > 0,
        len(cases["exercised"]),
    )
    check(
        summary,
        "spread: 0 requests served as verified on bad-derived KV",
        not cases["served"] and not vs_fresh["wrong"],
        {"loaded_quarantined_suffix": cases["served"], "wrong": vs_fresh["wrong"]},
    )


def phase_overhead(engines: dict, args: Any, summary: dict) -> None:
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.overhead_rounds):
        batches = workload(args, seed=1000 + r)
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for name in order:
            _, _, elapsed = engines[name].run_all(batches, args.max_tokens)
            times[name].append(elapsed)
    n = args.num_requests
    stats = {
        name: {
            "req_per_s": [n / t for t in ts],
            "mean_req_per_s": statistics.mean(n / t for t in ts),
            "stdev_req_per_s": statistics.pstdev(n / t for t in ts),
        }
        for name, ts in times.items()
    }
    ratio = stats["on"]["mean_req_per_s"] / stats["off"]["mean_req_per_s"]
    stats["on_over_off"] = ratio
    summary["overhead"] = stats
    print(f"overhead: {json.dumps(stats)}", flush=True)


def _short(log: dict) -> dict:
    return {
        "injected": len(log["injected"]),
        "injected_kinds": sorted({k for k, _, _ in log["injected"]}),
        "mismatched": len(log["mismatched"]),
        "unverified": log["unverified"][:5],
        "dropped": log["dropped"],
        "errors": log["errors"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phases", default="loads,faults,multi,spread,overhead")
    parser.add_argument("--num-prefixes", type=int, default=48)
    parser.add_argument("--prefix-blocks", type=int, default=12)
    parser.add_argument("--num-requests", type=int, default=640)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--gpu-blocks", type=int, default=256)
    parser.add_argument("--min-loads", type=int, default=500)
    parser.add_argument("--fault-rate", type=float, default=0.2)
    parser.add_argument("--overhead-rounds", type=int, default=4)
    parser.add_argument("--spread-scenarios", type=int, default=16)
    parser.add_argument("--spread-suffix-blocks", type=int, default=4)
    parser.add_argument("--spread-fault-rate", type=float, default=0.5)
    parser.add_argument("--prefix-count", type=int, default=4)
    parser.add_argument("--prefix-requests", type=int, default=96)
    parser.add_argument("--prefix-fault-rate", type=float, default=0.3)
    parser.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--connector",
        choices=sorted(CONNECTORS),
        default="offloading",
        help="OffloadingConnector, or SimpleCPUOffloadConnector (eager or lazy)",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    phases = set(args.phases.split(","))
    summary: dict[str, Any] = {"args": vars(args), "checks": {}, "errors": []}
    build_model("tiny")
    base = {
        "_gpu_blocks": args.gpu_blocks,
        "_batch_invariant": args.batch_invariant,
        "_connector": args.connector,
    }
    on = {**base, "enable_kv_checksum": True, "kv_checksum_fail_closed": True}
    configs = {"off": base, "on": on}
    if "faults" in phases:
        faults = {
            "rate": args.fault_rate,
            "kinds": ["host_bit_flip", "host_other_block"],
        }
        configs["faulty"] = {**on, "kv_checksum_host_fault_injection": faults}
        configs["fresh"] = {**base, "_fresh": True}
    if "multi" in phases:
        configs["multi"] = {**on, "_multi": True, "_port": 5611}
    if "spread" in phases:
        spread_faults = {"rate": args.spread_fault_rate, "kinds": ["host_other_block"]}
        configs["spread"] = {
            **base,
            "enable_kv_checksum": True,  # fail-open: A runs on its bad load
            "kv_checksum_host_fault_injection": spread_faults,
        }
        configs["fresh"] = {**base, "_fresh": True}
    if "prefix" in phases:
        hit_faults = {"rate": args.prefix_fault_rate, "kinds": ["prefix_hit"]}
        configs["prefix"] = {
            **on,
            # Every prefix stays in the GPU cache: its hits are local.
            "_gpu_blocks": max(args.gpu_blocks, 2048),
            "kv_checksum_verify_prefix_hits": True,
            "kv_checksum_fault_injection": hit_faults,
        }
        configs["fresh"] = {**base, "_fresh": True}
    ctx = mp.get_context("spawn")
    engines: dict[str, Engine] = {}
    start = time.time()
    try:
        for name, extra in configs.items():
            engines[name] = Engine(ctx, name, extra, args.out)
        for name in list(engines):
            try:
                engines[name].wait("ready", 240)
            except Exception as e:
                summary["errors"].append(f"{name}: {e}")
                print(f"engine {name} failed: {e}", flush=True)
                engines.pop(name).stop()
        batches = workload(args, seed=0)
        ref: tuple = ([], [])
        steps = [
            ("loads", lambda: phase_loads(engines, batches, args, summary)),
            ("faults", lambda: phase_faults(engines, batches, ref, args, summary)),
            ("multi", lambda: phase_multi(engines, batches, ref, args, summary)),
            ("spread", lambda: phase_spread(engines, args, summary)),
            ("overhead", lambda: phase_overhead(engines, args, summary)),
            ("prefix", lambda: phase_prefix(engines, args, summary)),
        ]
        for name, run in steps:
            if name not in phases:
                continue
            try:
                result = run()
                if name == "loads":
                    ref = result
            except Exception:
                summary["errors"].append(f"{name}: {traceback.format_exc()}")
                print(f"phase {name} failed:\n{traceback.format_exc()}", flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
        summary["wall_s"] = time.time() - start
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    ok = not summary["errors"] and all(c["ok"] for c in summary["checks"].values())
    print(f"{'ALL PASSED' if ok else 'FAILED'} in {summary['wall_s']:.0f}s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
