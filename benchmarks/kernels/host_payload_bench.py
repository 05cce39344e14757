# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host-side timing of the KV checksum payload (R133: encode + decode < 0.5 ms).

Times base64 encoding and decoding of the payload of a 128K-token prompt with
one KV cache group of 16-token blocks (8192 positions, R81).

    python benchmarks/kernels/host_payload_bench.py
"""

import time
from collections.abc import Callable

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    KV_CHECKSUM_PAYLOAD_VERSION,
    KVChecksumPayload,
    KVChecksumPayloadGroup,
)

NUM_TOKENS = 128 * 1024
BLOCK_SIZE = 16


def make_payload(
    num_tokens: int = NUM_TOKENS, block_size: int = BLOCK_SIZE
) -> KVChecksumPayload:
    """A one-group payload with random values covering `num_tokens`."""
    positions = -(-num_tokens // block_size)
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**64, size=positions, dtype=np.uint64)
    group = KVChecksumPayloadGroup(0, 0x0123456789ABCDEF, block_size, 0, values)
    return KVChecksumPayload(KV_CHECKSUM_PAYLOAD_VERSION, 2, num_tokens, [group])


def _best_mean_us(fn: Callable[[], object], iterations: int, repeats: int) -> float:
    """Mean wall time of `fn()` in microseconds, best of `repeats` runs.

    The best run is the least disturbed by other processes on a shared host.
    """
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / iterations * 1e6


def bench_payload(
    iterations: int = 500, repeats: int = 5
) -> tuple[float, float, int, int]:
    """Time to_base64 and from_base64 of the 128K-token payload (base64 included).

    Returns (encode_us, decode_us, raw_bytes, b64_bytes).
    """
    payload = make_payload()
    text = payload.to_base64()
    decoded = KVChecksumPayload.from_base64(text)
    assert np.array_equal(decoded.groups[0].values, payload.groups[0].values)
    for _ in range(20):  # warm up
        KVChecksumPayload.from_base64(payload.to_base64())
    encode_us = _best_mean_us(payload.to_base64, iterations, repeats)
    decode_us = _best_mean_us(
        lambda: KVChecksumPayload.from_base64(text), iterations, repeats
    )
    return encode_us, decode_us, len(payload.to_bytes()), len(text)


if __name__ == "__main__":
    encode_us, decode_us, raw_bytes, b64_bytes = bench_payload()
    print(
        f"128K tokens, 1 group, block size {BLOCK_SIZE}: raw {raw_bytes} B, "
        f"base64 {b64_bytes} B; encode {encode_us:.1f} us, decode {decode_us:.1f} "
        f"us, total {encode_us + decode_us:.1f} us (target 500 us)"
    )
