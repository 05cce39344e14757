# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host cost of dropping prefix-hit entries on eviction (issue 30, R140, R142).

vLLM's `BlockPool.get_new_blocks` runs `_maybe_evict_cached_block` once per
allocated block. Up to 2026-12-02g prefix-hit verification wrapped that method
per block (a Python frame per block); since then it wraps `get_new_blocks` and
`evict_blocks`, one frame per call. This times, in interleaved rounds of one
run on vLLM's real block pool with every block cached and holding an entry,
one allocation of N blocks (each evicting a cached block) and their release:

- vLLM alone (no hook);
- the package's hooks (`wiring/prefix_cache.py`);
- a per-block wrapper of `_maybe_evict_cached_block` doing the same work,
  as the package did before (written out here for the comparison).

Run from the repository root:
    python benchmarks/host/benchmark_kv_checksum_eviction_hook.py --blocks 16 128
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (  # noqa: E402
    KVChecksumPrefixHits,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (  # noqa: E402
    prefix_cache,
)
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    BlockHash,
    make_block_hash_with_group_id,
)

BLOCK_SIZE = 16


def cached_pool(num_blocks: int) -> tuple[BlockPool, KVChecksumPrefixHits]:
    """A block pool whose every free block is cached under its own hash, and
    a prefix-hit state holding an entry for each."""
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)
    hits = KVChecksumPrefixHits(num_blocks, 0, BLOCK_SIZE, BLOCK_SIZE, 1)
    refill(pool, hits)
    return pool, hits


def refill(pool: BlockPool, hits: KVChecksumPrefixHits) -> None:
    """Cache every block that lost its hash and give it an entry again."""
    for block in pool.blocks[1:]:
        if block.block_hash is None:
            key = make_block_hash_with_group_id(
                BlockHash(block.block_id.to_bytes(32, "little")), 0
            )
            block.set_block_hash(key, BLOCK_SIZE)
            pool.cached_block_hash_to_block.insert(key, block)
            hits.entry_keys[block.block_id] = key
            hits.has_entry[block.block_id] = True


def per_block_hook(pool: BlockPool, hits: KVChecksumPrefixHits) -> None:
    """The wrapper before 2026-12-02g: after each block's eviction, the
    scheduler state's lookup, then, guarded, drop its entry unless a key
    still reaches it."""
    maybe_evict = pool._maybe_evict_cached_block
    scheduler = SimpleNamespace(**{prefix_cache._STATE_ATTR: object()})

    def on_evicted(block_id: int, still_cached: bool) -> None:
        # KVChecksumPrefixHits.on_evicted as it was: one block a call.
        if not still_cached and hits.entry_keys.pop(block_id, None) is not None:
            hits.has_entry[block_id] = False
            hits.entry_handed[block_id] = False

    def hook(block: Any) -> bool:
        evicted = maybe_evict(block)
        if scheduler.__dict__.get(prefix_cache._STATE_ATTR) is None:
            return evicted
        try:
            key = hits.entry_keys.get(block.block_id)
            if key is not None:
                still = pool.cached_block_hash_to_block.contain(key, block.block_id)
                on_evicted(block.block_id, still)
        except Exception:
            prefix_cache._turn_off(scheduler, "dropping entries")
        return evicted

    pool._maybe_evict_cached_block = hook  # type: ignore[method-assign]


def package_hooks(pool: BlockPool, hits: KVChecksumPrefixHits) -> None:
    """The package's block pool hooks, on a stand-in scheduler holding them."""
    scheduler = SimpleNamespace(**{prefix_cache._STATE_ATTR: object()})
    prefix_cache._hook_block_pool(scheduler, pool, hits)


def one_round(
    pool: BlockPool, hits: KVChecksumPrefixHits, n: int, calls: int, hooked: bool
) -> float:
    """Mean us of `get_new_blocks(n)` over `calls` calls (refill and free
    outside the clock); with `hooked`, the evicted blocks' entries must be
    gone."""
    total = 0.0
    for _ in range(calls):
        start = time.perf_counter()
        blocks = pool.get_new_blocks(n)
        total += time.perf_counter() - start
        if hooked:
            assert not hits.has_entry[[b.block_id for b in blocks]].any()
        pool.free_blocks(blocks)
        refill(pool, hits)
    return total / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--pool", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    setups = {
        "vLLM alone": lambda pool, hits: None,
        "package hooks (one frame a call)": package_hooks,
        "per-block wrapper (before)": per_block_hook,
    }
    print(
        f"vLLM BlockPool.get_new_blocks(N), {args.pool} blocks all cached with "
        f"entries; us a call, median of {args.rounds} interleaved rounds of "
        f"{args.calls} calls"
    )
    print("| N | " + " | ".join(setups) + " | hook cost now / before |")
    print("|---|" + "---|" * (len(setups) + 1))
    for n in args.blocks:
        pools = {name: cached_pool(args.pool) for name in setups}
        for name, setup in setups.items():
            setup(*pools[name])
        times: dict[str, list[float]] = {name: [] for name in setups}
        gc.collect()
        gc.disable()
        try:
            for r in range(args.rounds):
                order = list(setups) if r % 2 == 0 else list(setups)[::-1]
                for name in order:
                    hooked = name != "vLLM alone"
                    times[name].append(one_round(*pools[name], n, args.calls, hooked))
        finally:
            gc.enable()
        med = {name: statistics.median(values) for name, values in times.items()}
        base = med["vLLM alone"]
        now = med["package hooks (one frame a call)"] - base
        before = med["per-block wrapper (before)"] - base
        ratio = now / before if before > 0 else float(np.nan)
        cells = " | ".join(f"{med[name]:.1f}" for name in setups)
        print(f"| {n} | {cells} | {now:.1f} / {before:.1f} ({ratio:.2f}) |")


if __name__ == "__main__":
    main()
