# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host-side cost of verifying one load's KV checksums (R133).

The target: verifying a 128K-token load (one group, 16-token blocks, 8
consumer workers) within 1 ms. Run as a script to print the time.
"""

import time

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumGroup,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    KV_CHECKSUM_PAYLOAD_VERSION,
    KVChecksumPayload,
    KVChecksumPayloadGroup,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
    KVChecksumStatus,
    KVChecksumWorkerReport,
    verify_load,
)


def _make_load(
    num_tokens: int, block_size: int, num_workers: int, seed: int = 0
) -> tuple[KVChecksumPayload, dict[tuple[int, int], KVChecksumWorkerReport]]:
    """A consistent payload and TP-`num_workers` consumer reports, one column each."""
    rng = np.random.default_rng(seed)
    positions = -(-num_tokens // block_size)
    parts = rng.integers(0, 1 << 64, size=(num_workers, positions), dtype=np.uint64)
    truth = parts.sum(axis=0, dtype=np.uint64)
    fingerprint = int(rng.integers(0, 1 << 63))
    reports = {
        (0, rank): KVChecksumWorkerReport(
            groups={0: KVChecksumGroup(0, ((1, 0),), parts[rank][:, None].copy())},
            fingerprints={0: fingerprint},
        )
        for rank in range(num_workers)
    }
    payload = KVChecksumPayload(
        version=KV_CHECKSUM_PAYLOAD_VERSION,
        tp_size=num_workers,
        num_tokens=num_tokens,
        groups=[KVChecksumPayloadGroup(0, fingerprint, block_size, 0, truth)],
    )
    return payload, reports


def bench_verification(
    num_tokens: int = 128 * 1024,
    block_size: int = 16,
    num_workers: int = 8,
    iterations: int = 2000,
) -> float:
    """Mean time of one `verify_load` call over `iterations` calls, in µs."""
    payload, reports = _make_load(num_tokens, block_size, num_workers)
    block_ids = np.arange(-(-num_tokens // block_size), dtype=np.int64)
    scheduled = KVChecksumBlocks(num_tokens, {0: (0, block_ids)})
    groups = {0: KVChecksumGroupInfo(block_size)}

    def run() -> KVChecksumStatus:
        verdict = verify_load(
            payload, None, reports, scheduled, num_workers, num_workers, groups
        )
        return verdict.status

    assert run() is KVChecksumStatus.VERIFIED
    for _ in range(min(iterations, 50)):  # warm-up
        run()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    return (time.perf_counter() - start) / iterations * 1e6


if __name__ == "__main__":
    micros = bench_verification()
    print(
        f"verify_load, 128K tokens, 16-token blocks, 8 workers: {micros:.1f} us "
        "(target 1000 us)"
    )
