# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SimpleCPUOffloadConnector's store places per step, on CPU (issue 30, R142).

At about 190 running requests the eager tier's `build_connector_meta` hook
took 0.5-0.9 ms of an H200 engine's step (2026-12-04h), most of it
`SimpleOffloadSchedulerSide.attach` reading the stored blocks' places from
their cache keys, one block at a time, for the hundreds of blocks a prefill
step stores. This times, interleaved call by call on the same keys, the
plain pass (`_places_one_by_one`, what every store took before) against
`block_places` (NumPy over the joined keys from `VECTOR_PLACES_FROM` blocks
on), and `attach` as a whole on each (`attach_one_by_one`: the package's
own `attach` with only `block_places` swapped back for the plain pass); both
must give the same places. The workers then tag each stored block
(`block_checksum_tags`, SHA-256 a block, R116): `tags` against `tags_before`,
the chain it was before 2026-12-04h (`_ref_tags`: a new SHA-256 of the
fingerprint and hash concatenated, its digest through
`operator.methodcaller`); the same tags. And the wiring's read of the keys
from a real vLLM BlockPool (`block_keys`, the blocks' fields in C since
2026-12-05) against the blocks' properties one by one, as it read them
before (`keys_by_property`); the same keys.

    python benchmarks/host/benchmark_kv_checksum_block_places.py \
        [--blocks 16 64 96 128 256 512] [--rounds 7] [--calls 200] [--json OUT]
"""

import argparse
import gc
import hashlib
import json
import operator
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_checksum_pieces import swapped  # noqa: E402, I001

from vllm.distributed.kv_transfer.kv_checksum.definition import checksum
from vllm.distributed.kv_transfer.kv_checksum.offload import (
    simple_cpu_offload as simple_offload,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    simple_cpu_offload as wiring_simple,
)

BLOCK_SIZE = 16
# (name, function of (keys, block sizes)) timed against each other.
PATHS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("one_by_one", simple_offload._places_one_by_one),
    ("block_places", simple_offload.block_places),
)


def _ref_tags(block_hashes: list[bytes], fingerprint: int) -> np.ndarray:
    """`block_checksum_tags` as it was before 2026-12-04h, for comparison."""
    prefix = (fingerprint & checksum.U64_MASK).to_bytes(8, "little")
    digests = b"".join(
        map(
            operator.methodcaller("digest"),
            map(hashlib.sha256, map(prefix.__add__, block_hashes)),
        )
    )
    heads = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 32)[:, :8]
    return np.ascontiguousarray(heads).view("<u8").reshape(-1).astype(np.uint64)


def prefill_keys(num_blocks: int, seed: int = 0) -> list[tuple[bytes, int]]:
    """Cache keys of a prefill's stored blocks: requests of up to 128 full
    blocks each, in order, one group, as vLLM's block pool keeps them."""
    rng = random.Random(seed)
    keys = []
    for i in range(num_blocks):
        digest = bytes(rng.getrandbits(8) for _ in range(32))
        keys.append((digest + (0).to_bytes(4, "big"), BLOCK_SIZE * (i % 128 + 1)))
    return keys


def keys_by_property(pool: Any, ids: list[int]) -> list[tuple[Any, Any]]:
    """The wiring's read of the stored blocks' keys before 2026-12-05: each
    block's two properties, one block at a time."""
    blocks = pool.blocks
    return [(blocks[i].block_hash, blocks[i].block_hash_num_tokens) for i in ids]


def pool_with(keys: list[tuple[bytes, int]]) -> Any:
    """A vLLM BlockPool whose block i + 1 is cached under `keys[i]`."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(len(keys) + 1, enable_caching=True, hash_block_size=BLOCK_SIZE)
    for block, (digest, covered) in zip(pool.blocks[1:], keys):
        block.set_block_hash(digest, covered)
    return pool


def _per_call_us(fn: Callable[..., Any], calls: int, *args: Any) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return 1e6 * (time.perf_counter() - start) / calls


def run(num_blocks: int, rounds: int, calls: int) -> dict[str, Any]:
    """Median microseconds a call of each path and of `attach`, the paths
    alternating within each round (collector off while timing)."""
    keys = prefill_keys(num_blocks)
    sizes = [BLOCK_SIZE]
    places = [fn(keys, sizes) for _, fn in PATHS]
    for other in places[1:]:
        assert other.groups.tolist() == places[0].groups.tolist()
        assert other.positions.tolist() == places[0].positions.tolist()
        assert other.hashes == places[0].hashes
    ids = list(range(num_blocks))

    def stored_keys(block_ids: Any) -> list[tuple[bytes, int]]:
        return [keys[i] for i in block_ids]

    side = simple_offload.SimpleOffloadSchedulerSide(
        sizes, stored_keys, stored_keys, lambda req_id: None, lambda cpu_id: None
    )
    meta = SimpleNamespace(store_gpu_blocks=ids, store_cpu_blocks=ids)
    timings: dict[str, list[float]] = {name: [] for name, _ in PATHS}
    timings["attach"] = []
    timings["attach_one_by_one"] = []
    plain_pass = [(simple_offload, "block_places", simple_offload._places_one_by_one)]
    hashes = places[0].hashes
    fingerprint = 0x0123456789ABCDEF
    tags = checksum.block_checksum_tags(hashes, fingerprint)
    assert (_ref_tags(hashes, fingerprint) == tags).all()
    timings["tags"] = []
    timings["tags_before"] = []
    pool = pool_with(keys)
    pool_ids = list(range(1, num_blocks + 1))
    assert wiring_simple.block_keys(pool, pool_ids) == keys_by_property(pool, pool_ids)
    timings["keys"] = []
    timings["keys_by_property"] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in PATHS:
                timings[name].append(_per_call_us(fn, calls, keys, sizes))
            timings["attach"].append(_per_call_us(side.attach, calls, meta))
            with swapped(plain_pass):
                timings["attach_one_by_one"].append(
                    _per_call_us(side.attach, calls, meta)
                )
            tag = checksum.block_checksum_tags
            timings["tags"].append(_per_call_us(tag, calls, hashes, fingerprint))
            timings["tags_before"].append(
                _per_call_us(_ref_tags, calls, hashes, fingerprint)
            )
            timings["keys"].append(
                _per_call_us(wiring_simple.block_keys, calls, pool, pool_ids)
            )
            timings["keys_by_property"].append(
                _per_call_us(keys_by_property, calls, pool, pool_ids)
            )
    finally:
        gc.enable()
    us = {name: round(statistics.median(v), 2) for name, v in timings.items()}
    return {
        "blocks": num_blocks,
        "us_per_call": us,
        "block_places_over_one_by_one": round(us["block_places"] / us["one_by_one"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--blocks", type=int, nargs="+", default=[16, 64, 96, 128, 256, 512]
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = [run(n, args.rounds, args.calls) for n in args.blocks]
    print(
        "| blocks | one by one, us | block_places, us | ratio "
        "| attach one by one, us | attach, us | tags before, us | tags, us "
        "| keys by property, us | keys, us |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        us = r["us_per_call"]
        print(
            f"| {r['blocks']} | {us['one_by_one']} | {us['block_places']} | "
            f"{r['block_places_over_one_by_one']} | {us['attach_one_by_one']} | "
            f"{us['attach']} | {us['tags_before']} | {us['tags']} | "
            f"{us['keys_by_property']} | {us['keys']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
