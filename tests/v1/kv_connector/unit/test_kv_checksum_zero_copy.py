# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Zero-copy writes of step results into pinned host memory (R55 without a copy engine;
issues 26, 30, 31): the package's `kernels.copy_words` (used with ZERO_COPY_RESULTS),
also as the copy probe (`benchmarks/kernels/copy_engine_probe.py`) loads it, under
Triton's interpreter on the CPU: every word of a length that is no multiple of the block
arrives, and nothing past it is written. Bugs caught: an unmasked tail (words past `n`
overwritten: in pinned memory shared with other buffers), a grid one program short (the
last partial block lost). The interpreter must be on before Triton is imported, so the
checks run in a subprocess."""

from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import run_interpreted

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[4]
CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script
from vllm.distributed.kv_transfer.kv_checksum.definition import kernels
probe = load_script("copy_probe", sys.argv[2])
copies = {
    "package": kernels.copy_words,
    "probe": probe.zero_copy,
}
for name, copy in copies.items():
    src = torch.arange(1, 2501, dtype=torch.int64) * 7
    dst = torch.full((2600,), -1, dtype=torch.int64)
    copy(src, dst)
    assert torch.equal(dst[:2500], src), name + ": a word did not arrive"
    assert bool((dst[2500:] == -1).all()), name + ": a word past n was written"
print("ok")
"""


def test_zero_copy_writes_exactly_n_words() -> None:
    script = ROOT / "benchmarks/kernels/copy_engine_probe.py"
    run_interpreted(CHECK, str(ROOT), str(script), timeout=300)
