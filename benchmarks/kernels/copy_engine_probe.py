# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Does a step record's small device-to-host copy wait behind an offload store?

On an H200 (2026-12-01d) the OffloadingConnector engine with checksums on
waited 71 more times on CUDA events than the one off, 163 ms in all, about
2.3 ms a wait. Each wait is for the side-stream copy of a step's checksum
results (a few KB). Those copies are queued after the step's offload store
copies (hundreds of MB, device to host, another stream). The hypothesis is that
the copy engine serves them in order, so the small copy waits for the store.

This probe times how long a small copy takes to complete (host clock, from issue
to its event) in three cases:
- `alone`: nothing else is copying;
- `behind_store`: issued right after a large device-to-host copy on another
  stream;
- `zero_copy_behind_store`: the same, but the small copy is the package's
  `kernels.copy_words` (the ZERO_COPY_RESULTS path), which stores into pinned
  host memory from the SMs (no copy engine). If Triton refuses a host pointer,
  the reason is reported instead.

If `behind_store` is close to the large copy's time and `zero_copy_behind_store`
is close to `alone`, the hypothesis holds and the zero-copy write is the fix to
try. Needs only torch and Triton.

    python benchmarks/kernels/copy_engine_probe.py [--store-mb 300] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_kv_checksum import load_kernels  # noqa: E402

# The package's copy of step results into pinned host memory.
zero_copy = load_kernels().copy_words


def _latency_ms(issue: Callable[[], None], stream: torch.cuda.Stream) -> float:
    """Host milliseconds from calling `issue` (on `stream`) to its event."""
    event = torch.cuda.Event()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        issue()
        event.record(stream)
    event.synchronize()
    return (time.perf_counter() - t0) * 1e3


def probe(store_mb: int, small_words: int, repeats: int) -> dict:
    """Median completion latencies of the small copy in each case (ms)."""
    device = torch.device("cuda")
    big = torch.ones(store_mb << 17, dtype=torch.int64, device=device)
    big_host = torch.empty(big.shape, dtype=torch.int64, pin_memory=True)
    small = torch.arange(small_words, dtype=torch.int64, device=device)
    small_host = torch.zeros(small_words, dtype=torch.int64, pin_memory=True)
    store_stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    results: dict = {"store_mb": store_mb, "small_bytes": small_words * 8}

    def store() -> None:
        with torch.cuda.stream(store_stream):
            big_host.copy_(big, non_blocking=True)

    def engine_copy() -> None:
        small_host.copy_(small, non_blocking=True)

    def kernel_copy() -> None:
        zero_copy(small, small_host)

    cases: dict[str, tuple[Callable[[], None], bool]] = {
        "alone": (engine_copy, False),
        "behind_store": (engine_copy, True),
        "zero_copy_alone": (kernel_copy, False),
        "zero_copy_behind_store": (kernel_copy, True),
    }
    store_ms = [_latency_ms(store, store_stream) for _ in range(3)]
    results["store_alone_ms"] = statistics.median(store_ms)
    for name, (issue, with_store) in cases.items():
        times = []
        try:
            for _ in range(repeats):
                torch.cuda.synchronize()
                small_host.zero_()
                if with_store:
                    store()
                times.append(_latency_ms(issue, side))
                torch.cuda.synchronize()
                if not torch.equal(small_host, small.cpu()):
                    raise RuntimeError("the small copy arrived wrong")
        except Exception as error:  # e.g. Triton refusing a host pointer
            results[name] = {"error": repr(error)[:300]}
            continue
        results[name] = {
            "median_ms": statistics.median(times),
            "max_ms": max(times),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store-mb", type=int, default=300)
    parser.add_argument("--small-words", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = probe(args.store_mb, args.small_words, args.repeats)
    results["device"] = torch.cuda.get_device_name()
    results["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
