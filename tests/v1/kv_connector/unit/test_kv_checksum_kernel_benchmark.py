# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU smoke run of `benchmark_kv_checksum.py --mode kernel` (R133, R143): the
main table is what a GPU run must produce, so its code path runs here on tiny
shapes under Triton's interpreter, with CPU stand-ins for the CUDA timer and
the plain-read anchor. Bugs caught: a Python error in the table found only on
the GPU; a Triton result that differs from the PyTorch path not reported (the
test breaks the kernel's sums and expects the mismatch).

Run as a script (`--smoke JSON [--break]`) it writes the benchmark's JSON; the
test runs it in a subprocess with TRITON_INTERPRET=1, which must be set before
Triton is imported.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[4]


def load_benchmark() -> tuple[ModuleType, ModuleType]:
    """The kernel benchmark script and the kernels it times: this checkout's
    kernels.py (an installed package may hold another copy)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

    bench = load_script(
        "benchmark_kv_checksum", ROOT / "benchmarks/kernels/benchmark_kv_checksum.py"
    )
    kernels = load_script("kv_checksum_kernels", bench.KERNELS_PATH)
    bench.load_kernels = lambda: kernels
    return bench, kernels


def smoke(json_path: str, broken: bool) -> None:
    """The kernel benchmark on tiny shapes, on the CPU; with `broken` the
    Triton launch's sums are off by one in one block."""
    import torch

    bench, kernels = load_benchmark()
    plain = bench.load_sibling("kernel_plain_read")
    shape = bench.KernelShape
    bench.DEVICE = "cpu"
    bench.L2_FLUSH_BYTES = 16
    bench.SHAPES = [
        shape("(a) tiny", 1, 4, 6, "head", heads=2, tokens=16, head_size=64),
        shape("(a) tiny", 1, 4, 6, "token", heads=2, tokens=16, head_size=64),
        shape("(b) tiny", 2, 3, 5, heads=2, tokens=16, head_size=64),
        shape("(d) tiny", 1, 3, 5, heads=2, tokens=16, head_size=64),
        shape("(e) tiny", 1, 3, 5, heads=2, tokens=32, head_size=64, chunk=16),
    ]

    def cpu_time_ms(fn: Any, iters: int, flush: Any) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    bench.time_ms = cpu_time_ms
    bench.environment = lambda: {
        "device": "cpu",
        "sms": 1,
        "torch": torch.__version__,
        "cuda": None,
        "triton": "interpreter",
        "date": "smoke",
    }
    plain.best_plain_read = lambda words, timer: plain.PlainResult(
        timer(words.sum), "cpu", True, 1, []
    )
    bench.load_sibling = lambda name: plain
    if broken:
        launch = kernels.KVChecksumLaunch.__call__

        def off_by_one(self: Any, rows: Any, out: Any) -> Any:
            result = launch(self, rows, out)
            if self.backend == "triton":
                out[0, 0] += 1
            return result

        kernels.KVChecksumLaunch.__call__ = off_by_one
    bench.run_kernel_benchmarks(iters=1, json_path=json_path)


def run_smoke(tmp_path: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    """The smoke run in a subprocess under the interpreter: stdout and JSON."""
    out = tmp_path / "kernel.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--smoke", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout, json.loads(out.read_text())


def test_main_table_smoke(tmp_path: Path) -> None:
    """Every shape timed against the plain read and bit-identical, the R143
    and R133 verdicts printed, no errors."""
    pytest.importorskip("triton")
    stdout, data = run_smoke(tmp_path)
    assert data["errors"] == []
    assert len(data["shapes"]) == 5
    for entry in data["shapes"].values():
        assert entry["identical"] is True
        assert entry["kernel_over_plain"] == pytest.approx(
            entry["plain_ms"] / entry["triton_ms"]
        )
    assert "R143 (every shape >=" in stdout
    assert "| R133 target |" in stdout
    assert "MISMATCH" not in stdout


def test_main_table_reports_a_wrong_sum(tmp_path: Path) -> None:
    """Positive control: a Triton launch whose sums differ from the PyTorch
    path's is reported on every shape."""
    pytest.importorskip("triton")
    stdout, data = run_smoke(tmp_path, "--break")
    assert all(entry["identical"] is False for entry in data["shapes"].values())
    assert stdout.count("MISMATCH") == 5


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", required=True, help="JSON output path")
    parser.add_argument("--break", dest="broken", action="store_true")
    args = parser.parse_args()
    smoke(args.smoke, args.broken)
