# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host-side timing of KV checksum row building (R52; R133: 8192 rows < 150 us).

Times `segment_rows` + `pack_segments` of one group pass for the cases of SPEC
section 20 ("host row building"): block size, prompt tokens x requests.

    python benchmarks/kernels/host_rows_bench.py
"""

import time

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import (
    pack_segments,
    segment_rows,
)

# (label, block size, tokens per request, requests)
CASES = [
    ("bs 16, 128K x 1 (8192 rows)", 16, 128 * 1024, 1),
    ("bs 16, 16K x 32 (32768 rows)", 16, 16 * 1024, 32),
    ("bs 128, 128K x 1 (1024 rows)", 128, 128 * 1024, 1),
    ("bs 128, 4K x 128 (4096 rows)", 128, 4 * 1024, 128),
    ("bs 128, 1K x 1 (8 rows)", 128, 1024, 1),
]
TARGET_8192_ROWS_US = 150.0


def make_requests(
    block_size: int, num_tokens: int, num_requests: int, group_id: int = 0
) -> list[tuple[str, KVChecksumBlocks]]:
    """Requests holding `num_tokens` each in distinct, shuffled block ids."""
    rng = np.random.default_rng(0)
    per_request = -(-num_tokens // block_size)
    ids = rng.permutation(per_request * num_requests).astype(np.int64)
    return [
        (
            f"req-{i}",
            KVChecksumBlocks(
                num_tokens,
                {group_id: (0, ids[i * per_request : (i + 1) * per_request])},
            ),
        )
        for i in range(num_requests)
    ]


def _best_us(fn, repeats: int, number: int) -> float:
    """Best mean time of `number` calls over `repeats` rounds, in microseconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def bench_rows(repeats: int = 50, number: int = 20) -> list[tuple[str, float]]:
    """(case label, best time in us) of segment_rows + pack_segments per case."""
    results = []
    for label, block_size, num_tokens, num_requests in CASES:
        requests = make_requests(block_size, num_tokens, num_requests)

        def build(requests=requests, block_size=block_size):
            _, _, _, rows = segment_rows(requests, 0, block_size)
            return pack_segments([rows])

        packed, _ = build()
        expected = num_requests * -(-num_tokens // block_size)
        assert packed.shape[1] >= expected
        results.append((label, _best_us(build, repeats, number)))
    return results


def main() -> None:
    results = bench_rows()
    for label, us in results:
        print(f"{label:32} {us:9.1f} us")
    rows_8192 = results[0][1]
    verdict = "ok" if rows_8192 <= TARGET_8192_ROWS_US else "OVER TARGET"
    print(f"8192 rows: {rows_8192:.1f} us (target {TARGET_8192_ROWS_US} us): {verdict}")


if __name__ == "__main__":
    main()
