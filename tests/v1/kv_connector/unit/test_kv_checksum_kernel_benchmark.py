# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU smoke run of `benchmark_kv_checksum.py --mode kernel --variants` (issue
30): the variants table is what one H200 run must produce, so its code path
runs here on tiny shapes under Triton's interpreter, with CPU stand-ins for the
CUDA timer and the plain-read anchor. Bug caught: a Python error or a wrong
bit-identity check in the variants table (or in the queued-timing table)
found only on the GPU, or a variant missing from it.

Run as a script (`--smoke JSON`) it writes the benchmark's JSON; the test runs
it in a subprocess with TRITON_INTERPRET=1, which must be set before Triton is
imported.
"""

import argparse
import dataclasses
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


def smoke(json_path: str) -> None:
    """The kernel benchmark with --variants on tiny shapes, on the CPU."""
    import torch

    bench, _ = load_benchmark()
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

    def cpu_time_ms(
        fn: Any, iters: int, flush: Any, ahead_cycles: int = 0, prime: Any = None
    ) -> float:
        if prime is not None:
            prime()
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
    bench.run_kernel_benchmarks(
        iters=1, json_path=json_path, variants=True, rounds=2, anchor_sweep=True
    )


def test_variants_table_smoke(tmp_path: Path) -> None:
    """Every variant timed and bit-identical on every shape, no errors."""
    pytest.importorskip("triton")
    out = tmp_path / "variants.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--smoke", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "## Variants" in result.stdout
    data = json.loads(out.read_text())
    assert data["errors"] == []
    assert "## Queued timing" in result.stdout
    assert "## Primed timing" in result.stdout
    assert "## Arithmetic anchor" in result.stdout
    assert "## Anchor sweep" in result.stdout
    swept: dict[str, Any] = {}
    for entry in data["shapes"].values():
        queued = entry["queued"]
        assert queued["kernel_over_plain"] == pytest.approx(
            queued["plain_ms"] / queued["kernel_ms"]
        )
        assert queued["kernel_host_launch_us"] > 0
        assert queued["kernel_host_launch_us_jit"] > 0
        primed = entry["primed"]
        assert set(primed["kernel_over_plain"]) == {"cold", "inputs", "code"}
        # The mixed and kernel-shape reads ran for real (interpreter) and
        # matched torch's sums.
        assert entry["arithmetic"]["checked"] is True
        # Every launch shape of the anchor sweep (R143's diagnosis) ran and
        # matched torch's sum.
        sweep = entry["anchor_sweep"]
        assert len(sweep) >= 24
        swept.update(sweep)
        assert all(row["checked"] for row in sweep.values()), sweep
    # The permuted reads ran where a shape is a whole number of chunks.
    assert {"plain permuted C2048/B512/w4", "mixed permuted C2048/B512/w4"} <= set(
        swept
    )
    variants = data["variants"]
    assert len(variants) == 5
    names = set(data["variants_min_ratio"])
    assert {"default", "scalar 8w", "vector 8w", "vector 4w head order"} <= names
    for entry in variants.values():
        assert set(entry["ms"]) == names
        assert all(entry["identical"].values()), entry["identical"]


def test_token_major_shapes_take_the_memory_order_loop() -> None:
    """The benchmark's token-major shapes walk memory order (DENSE 3) under the
    default launch and not under the "vector 4w head order" variant (R143,
    issue 30 item 1). Bug caught: a shape or a variant of --variants timing the same
    loop twice, so the GPU run could not compare the two."""
    import torch

    bench, kernels = load_benchmark()
    default = kernels.default_config()
    configs = {
        "default": default,
        "head order": dataclasses.replace(
            default, **bench.variant_configs()["vector 4w head order"]
        ),
    }
    shapes = [shape for shape in bench.SHAPES if shape.layout == "token"]
    assert shapes
    for shape in shapes:
        # Two blocks of one layer: the same layout and strides, less memory.
        small = dataclasses.replace(shape, layers=1, blocks=2, cache_blocks=2)
        views = bench.make_views(small, torch.device("cpu"))
        dense = {}
        for name, config in configs.items():
            launch = kernels.KVChecksumLaunch(views, [0], [0], "torch", config=config)
            launch._init_triton()
            dense[name] = launch._constants["DENSE"]
        assert dense == {"default": 3, "head order": 0}, shape


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", required=True, help="JSON output path")
    smoke(parser.parse_args().smoke)
