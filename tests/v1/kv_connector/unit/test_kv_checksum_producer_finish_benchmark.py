# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The producer-finish benchmark measures what it says (issue 30, R142).

It times `request_finished` with and without the freed-block scan on the
same inputs; both must send the payload the reported sums make.
"""

from pathlib import Path

import numpy as np
import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload

pytestmark = pytest.mark.cpu

SCRIPT = (
    Path(__file__).resolve().parents[4]
    / "benchmarks/host/benchmark_kv_checksum_producer_finish.py"
)


def test_both_modes_send_the_reported_sums() -> None:
    """R74, R142: in both modes each finished producer sends one value per
    16-token block, the worker's reported value (position + step + 1), from
    position 0. Bugs caught: a mode that times requests sending nothing (a
    not-finished status, a missing carrier), or payloads of the other step."""
    bench = load_script("_producer_finish_bench", SCRIPT)
    for name, hold in bench.MODES.items():
        kcs = bench._scheduler(hold)
        manager = bench._BlockManager()
        _, params = bench.finish_step(kcs, manager, 3, num_requests=2, num_blocks=5)
        assert len(params) == 2, name
        for p in params:
            payload = KVChecksumPayload.from_base64(p[KV_TRANSFER_PARAMS_KEY])
            (group,) = payload.groups
            assert (group.start, payload.num_tokens) == (0, 80)
            assert np.array_equal(group.values, np.arange(5, dtype=np.uint64) + 4)
        assert manager.blocks == {}
    result = bench.run(num_requests=2, num_blocks=4, rounds=1, steps=2)
    assert set(result["us_per_request"]) == set(bench.MODES)
