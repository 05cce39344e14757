# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SimpleCPUOffloadConnector stores with prefix-hit verification on (R118,
R140, issue 30): a block whose entry the workers wrote when vLLM cached it
goes to its CPU slot with that entry; it is not checksummed a second time.

The scheduler side is vLLM's real Scheduler and SimpleCPUOffloadConnector;
the workers are the plugin's, with vLLM's DMA copies simulated on CPU
(`kv_checksum_offload_sim`).
"""

import random
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import make_request
from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
    SimpleOffloadSimEngine,
    assert_every_load_verified,
    verdicts,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig
from vllm.distributed.kv_transfer.kv_checksum.config import VERIFY_PREFIX_HITS_KEY
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
    FullBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
    KVChecksumPrefixHits,
)

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

BS = 16
NUM_PREFIXES = 6


def engine_for(
    model_dir: str, name: str, lazy: bool = False, verify_hits: bool = True
) -> SimpleOffloadSimEngine:
    """24 GPU blocks: each 4-block prefix is evicted before it comes back, so
    its reuse loads from host memory."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": 1 << 22,
        "num_cpu_blocks": 64,
        "lazy_offload": lazy,
    }
    if verify_hits:
        extra[VERIFY_PREFIX_HITS_KEY] = True
    side = SideConfig(
        num_blocks=24, connector="SimpleCPUOffloadConnector", connector_extra=extra
    )
    engine = SimpleOffloadSimEngine(model_dir, side, name)
    if verify_hits:  # as the ActiveKVConnector.__init__ hook does
        for worker in engine.workers:
            worker.checksum.enable_prefix_entries()
    return engine


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts over shared 4-block prefixes, round-robin, with own tails."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 200) for _ in range(4 * BS)] for _ in range(NUM_PREFIXES)
    ]
    return [
        prefixes[i % NUM_PREFIXES] + [rng.randrange(3, 200) for _ in range(BS + 1)]
        for i in range(count)
    ]


def record_saves(engine: SimpleOffloadSimEngine) -> list[tuple[str, set[int]]]:
    """Worker 0's entry writes: ("store" | "prefix", block ids checksummed)."""
    table = engine.workers[0].checksum.block_table
    original = table.save
    saves: list[tuple[str, set[int]]] = []

    def save(runs: Any, groups: Any = None, copy: Any = None) -> None:
        blocks = runs if isinstance(runs, FullBlocks) else FullBlocks.from_runs(runs)
        kind = "store" if copy is not None else "prefix"
        saves.append((kind, set(blocks.block_ids.tolist())))
        original(blocks, groups, copy)

    table.save = save  # type: ignore[method-assign]
    return saves


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_R140_stores_copy_the_entries_written_at_caching(
    model_dir: str, lazy: bool
) -> None:
    """Every block a store copies had its entry written by prefix-hit
    verification in an earlier step, so no store checksums a block again,
    and every load back from host memory is verified with the copied entry.
    Bugs caught (tried): the store runs not filtered (each block
    checksummed twice); a save with no runs returning before its copy (the
    filtered blocks' CPU slots keep no entry: their loads mismatch)."""
    engine = engine_for(model_dir, f"stores-{lazy}", lazy)
    saves = record_saves(engine)
    for i, tokens in enumerate(prompts(18)):
        engine.add(make_request(f"r{i}", tokens, max_tokens=2, block_size=BS))
        engine.run(f"r{i}")
    assert engine.num_stored_blocks > 0 and engine.num_loads >= 6
    assert_every_load_verified(engine)
    prefix_saved = set().union(*(ids for kind, ids in saves if kind == "prefix"))
    stores = [ids for kind, ids in saves if kind == "store"]
    assert stores and prefix_saved
    assert all(not ids for ids in stores), stores


def test_R118_without_prefix_hits_stores_checksum_their_blocks(
    model_dir: str,
) -> None:
    """With prefix-hit verification off the stores write their blocks'
    entries themselves, as before, and the scheduler side holds no filter
    (bug caught, tried: the filter attached with the flag off, a call per
    store for nothing)."""
    engine = engine_for(model_dir, "stores-no-hits", verify_hits=False)
    side = engine.offload.__dict__["_kv_checksum_simple_offload"]
    assert side.entries_written is None  # no per-store call at all
    saves = record_saves(engine)
    for i, tokens in enumerate(prompts(12)):
        engine.add(make_request(f"r{i}", tokens, max_tokens=2, block_size=BS))
        engine.run(f"r{i}")
    assert_every_load_verified(engine)
    assert any(ids for kind, ids in saves if kind == "store")


def test_R140_block_overwritten_before_its_store_is_caught_at_load(
    model_dir: str,
) -> None:
    """A cached block overwritten on the GPU after the forward that computed
    it and before the offload tier stored it: its host copy carries the
    entry of the KV as computed, so its load back mismatches. Before this
    change the store checksummed the overwritten block and that load was
    verified: wrong KV served from host memory with a passing check (bug
    caught, tried: the store runs not filtered)."""
    engine = engine_for(model_dir, "overwritten-before-store")
    batch = prompts(NUM_PREFIXES + 1)
    engine.add(make_request("r0", batch[0], max_tokens=2, block_size=BS))
    victim = None
    for _ in range(8):
        output = engine.step()
        scheduled = getattr(output, "kv_checksum_scheduled", None)
        if scheduled is not None and scheduled.blocks_to_save:
            _, _, block_ids, _ = scheduled.blocks_to_save[0]
            victim = int(block_ids[1])
            break
    assert victim is not None
    for worker in engine.workers:  # after the entry's step, before the store
        cache = next(iter(worker.caches.values())).view(torch.uint8)
        cache[victim].view(-1)[0] ^= 0x5A
    engine.run("r0")
    for i in range(1, NUM_PREFIXES + 1):  # the last one reuses r0's prefix
        engine.add(make_request(f"r{i}", batch[i], max_tokens=2, block_size=BS))
        engine.run(f"r{i}")
    assert engine.num_loads >= 1
    assert verdicts(engine).get("mismatch", 0) >= 1, verdicts(engine)


def hashes(count: int) -> Any:
    return type("R", (), {"block_hashes": [bytes([i]) * 32 for i in range(count)]})()


def test_R140_entries_written_once_handed_over_and_until_evicted() -> None:
    """An entry counts as written once `take_step` handed it to the workers
    (not in the step that records it), and no longer after its block was
    evicted, re-cached (until handed over again) or the cache reset; other
    groups never. Bugs caught (tried): entries counted from `on_cached` (a
    store in the same step would copy an entry not yet written); eviction
    not clearing it (a store would copy a stale entry)."""
    hits = KVChecksumPrefixHits(8, 0, BS, None, 1)
    ids = np.asarray([3, 5], dtype=np.int64)
    zeros = np.zeros(2, dtype=np.int64)
    hits.on_cached(hashes(2), np.asarray([0, 1]), ids, ["k3", "k5"])
    assert hits.entries_written(zeros, ids).tolist() == [False, False]
    hits.take_step()
    assert hits.entries_written(zeros, ids).tolist() == [True, True]
    assert hits.entries_written(zeros + 1, ids).tolist() == [False, False]
    hits.on_evicted(3, still_cached=False)
    assert hits.entries_written(zeros, ids).tolist() == [False, True]
    hits.on_cached(hashes(2), np.asarray([1]), ids[1:], ["k5"])
    assert hits.entries_written(zeros, ids).tolist() == [False, False]
    hits.take_step()
    assert hits.entries_written(zeros, ids).tolist() == [False, True]
    hits.clear()
    assert not hits.entries_written(zeros, ids).any()
