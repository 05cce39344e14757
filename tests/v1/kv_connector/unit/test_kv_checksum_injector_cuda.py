# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fault injector's "no effect" probe on CUDA caches (R131).

On the device the comparison of a copied block with its source lands in pinned
host memory behind an event; `report_no_effect` reads it only once the event
completed. Run on a GPU host with the package importable (`gpu_runs.sh
cuda-tests`); skipped without CUDA.
"""

import numpy as np
import pytest
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.faults.injector import KVFaultInjector

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_BLOCKS = 32
LOAD = KVChecksumBlocks(num_tokens=48, groups={0: (0, np.array([5, 9, 2]))})


@pytest.mark.parametrize("same", [True, False])
def test_no_effect_probe_on_cuda(same: bool) -> None:
    """R131: a stale_block copy of equal bytes is reported without effect once its
    device comparison completed, a real copy never (bugs caught: the flag read
    before the device wrote it, or a pinned-copy path that raised on CUDA and
    would turn the injecting worker's checksums off)."""
    caches = {
        f"layer{i}": torch.randint(
            0, 255, (NUM_BLOCKS, 2, 16, 256), dtype=torch.uint8, device="cuda"
        )
        for i in range(2)
    }
    injector = KVFaultInjector(1.0, ["stale_block"], 1)
    decision = injector.decide("req", LOAD, NUM_BLOCKS)
    assert decision is not None and decision.source_block_id is not None
    if same:
        for cache in caches.values():
            cache[decision.block_id] = cache[decision.source_block_id]
    injector.corrupt("req", LOAD, caches, {0: list(caches)}, NUM_BLOCKS)
    torch.cuda.synchronize()
    reported = injector.report_no_effect()
    assert [d.req_id for d in reported] == (["req"] if same else [])
