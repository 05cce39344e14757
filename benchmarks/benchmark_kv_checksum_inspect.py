# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Wall time of the payload inspect command (R132), each run a fresh process.

Times `--runs` calls of each command on one valid payload and prints the
median, minimum and maximum wall time, the median CPU time of the call's
process (user + system: what the machine's load does not change), and whether
every call exited 0 with nothing on standard error (the tool's own output goes
to standard output). The load average is printed beside them. Commands:
`script` is `vllm-kv-checksum` where it is installed, else this checkout's
`vllm_kv_checksum_cli.py` run by the same Python; `module` is `python -m
vllm.distributed.kv_transfer.kv_checksum`, which imports vLLM's parent
packages (torch).

    python benchmarks/benchmark_kv_checksum_inspect.py --runs 10
    python benchmarks/benchmark_kv_checksum_inspect.py --commands script,module \\
        --runs 5 --json inspect.json
"""

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = ROOT / "vllm/distributed/kv_transfer/kv_checksum/wire/payload.py"
SCRIPT = "vllm-kv-checksum"


def load_payload() -> ModuleType:
    """This checkout's payload module, by file path (no vLLM import)."""
    spec = importlib.util.spec_from_file_location("_bench_payload", PAYLOAD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sample_value() -> str:
    """A valid base64 payload: two groups of 64 chunk checksums each."""
    import numpy as np

    payload = load_payload()
    values = np.arange(1, 65, dtype=np.uint64) * 0x9E3779B97F4A7C15
    groups = [
        payload.KVChecksumPayloadGroup(group, 0xDEADBEEF + group, 16, 0, values)
        for group in range(2)
    ]
    return payload.KVChecksumPayload(2, 1, 1024, groups).to_base64()


def command(name: str) -> list[str]:
    """The argument list that runs `name`'s inspect."""
    if name == "script":
        installed = shutil.which(SCRIPT)
        if installed:
            return [installed]
        return [sys.executable, str(ROOT / "vllm_kv_checksum_cli.py")]
    if name == "module":
        return [sys.executable, "-m", "vllm.distributed.kv_transfer.kv_checksum"]
    raise ValueError(f"unknown command {name!r}")


def time_command(argv: list[str], value: str, runs: int) -> dict:
    """Wall seconds of `runs` calls, and whether each was clean."""
    times, cpu_times, clean, stderr = [], [], True, ""
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(
            [*argv, "inspect", value], capture_output=True, text=True, timeout=600
        )
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_times.append(
            after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        )
        ok = done.returncode == 0 and done.stderr == "" and "version: 2" in done.stdout
        if not ok and clean:
            stderr = done.stderr[-2000:]
        clean &= ok
    return {
        "command": label(argv),
        "runs": runs,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "times_s": times,
        "median_cpu_s": statistics.median(cpu_times),
        "clean": clean,
        "first_stderr": stderr,
    }


def label(argv: list[str]) -> str:
    """`argv` as a reader would type it: "python" for this interpreter,
    file names without their folders."""
    words = ["python" if arg == sys.executable else arg for arg in argv]
    return " ".join(Path(word).name if "/" in word else word for word in words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", default="script", help="script,module")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    value = sample_value()
    results = {}
    print(f"load average before: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    print(
        "| command | runs | median s | min s | max s | median CPU s "
        "| exit 0, stderr empty |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.commands.split(","):
        result = time_command(command(name), value, args.runs)
        results[name] = result
        print(
            f"| {result['command']} inspect | {args.runs} | {result['median_s']:.3f} "
            f"| {result['min_s']:.3f} | {result['max_s']:.3f} "
            f"| {result['median_cpu_s']:.3f} | {'yes' if result['clean'] else 'NO'} |",
            flush=True,
        )
        if not result["clean"]:
            print(result["first_stderr"])
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        results["load_average"] = os.getloadavg()[0]
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
