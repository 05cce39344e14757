# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Offload tier stores with prefix-hit verification on (R118, R140, issue
30): a block whose entry the workers wrote when vLLM cached it goes to its
CPU slot with that entry; it is not checksummed a second time.

The scheduler side is vLLM's real Scheduler with SimpleCPUOffloadConnector
(eager and lazy) or OffloadingConnector; the workers are the plugin's, with
vLLM's copies simulated on CPU (`kv_checksum_offload_sim`).
"""

from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import make_request
from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
    OffloadSimEngine,
    SimpleOffloadSimEngine,
    assert_every_load_verified,
    shared_prefix_prompts,
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


TIERS = ["simple-eager", "simple-lazy", "offloading"]


def tier_params(tiers: list[str]) -> list[Any]:
    """The tiers as parameters; SimpleCPUOffloadConnector's wait for its
    commit on a vLLM with the in-tree series."""
    simple = pytest.mark.kv_checksum_capability("simple_cpu_offload")
    return [
        pytest.param(tier, marks=[simple] if tier.startswith("simple") else [])
        for tier in tiers
    ]


def engine_for(model_dir: str, name: str, tier: str, verify_hits: bool = True) -> Any:
    """24 GPU blocks: each 4-block prefix is evicted before it comes back, so
    its reuse loads from host memory."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": 1 << 22}
    if tier != "offloading":
        extra.update(num_cpu_blocks=64, lazy_offload=tier == "simple-lazy")
    if verify_hits:
        extra[VERIFY_PREFIX_HITS_KEY] = True
    connector = (
        "OffloadingConnector" if tier == "offloading" else ("SimpleCPUOffloadConnector")
    )
    side = SideConfig(num_blocks=24, connector=connector, connector_extra=extra)
    engine_cls = OffloadSimEngine if tier == "offloading" else SimpleOffloadSimEngine
    engine = engine_cls(model_dir, side, name)
    if verify_hits:  # as the ActiveKVConnector.__init__ hook does
        for worker in engine.workers:
            worker.checksum.enable_prefix_entries()
    return engine


def scheduler_side(engine: Any) -> Any:
    attr = "_kv_checksum_simple_offload"
    if isinstance(engine, OffloadSimEngine):
        attr = "_kv_checksum_offload"
    return engine.offload.__dict__[attr]


def record_saves(engine: Any) -> list[tuple[str, set[int]]]:
    """Worker 0's entry writes: ("store" | "prefix", block ids checksummed).
    Stores write through the table's `save`; a step's prefix entries ride in
    the launcher's upload, from the rows `prefix_entry_rows` hands it."""
    table = engine.workers[0].checksum.block_table
    original = table.save
    original_prefix = table.prefix_entry_rows
    saves: list[tuple[str, set[int]]] = []

    def save(
        runs: Any, groups: Any = None, copy: Any = None, restore: Any = None
    ) -> None:
        blocks = runs if isinstance(runs, FullBlocks) else FullBlocks.from_runs(runs)
        kind = "store" if copy is not None else "prefix"
        saves.append((kind, set(blocks.block_ids.tolist())))
        original(blocks, groups, copy, restore)

    def prefix_entry_rows(runs: Any) -> Any:
        per_group = original_prefix(runs)
        ids = {int(i) for entry_rows in per_group for i in entry_rows.rows[0]}
        saves.append(("prefix", ids))
        return per_group

    table.save = save  # type: ignore[method-assign]
    table.prefix_entry_rows = prefix_entry_rows  # type: ignore[method-assign]
    return saves


def cached_blocks(engine: Any) -> int:
    """Blocks whose prefix entries the scheduler asked for, over all steps."""
    total = 0
    for output in engine.history:
        scheduled = getattr(output, "kv_checksum_scheduled", None)
        for _, _, block_ids, _ in getattr(scheduled, "blocks_to_save", None) or ():
            total += len(block_ids)
    return total


@pytest.mark.kv_checksum_capability("prefix_hits")
@pytest.mark.parametrize("tier", tier_params(TIERS))
def test_R140_each_cached_block_is_checksummed_once(model_dir: str, tier: str) -> None:
    """Every block vLLM caches is checksummed once, though both prefix-hit
    verification and the offload tier's store want its entry: a
    SimpleCPUOffloadConnector store (one or more steps after the caching)
    copies the entry already written; an OffloadingConnector store (in the
    caching step, before it) writes it and the prefix entries skip the
    block. Every load back from host memory is verified with the entries
    the stores copied. Bugs caught (tried): the store runs not filtered
    (each stored block checksummed twice); a save with no runs returning
    before its copy (the filtered blocks' CPU slots keep no entry: their
    loads mismatch); the blocks stored this step not reset at the next
    step's bind (a block cached again later keeps its old entry)."""
    engine = engine_for(model_dir, f"stores-{tier}", tier)
    saves = record_saves(engine)
    for i, tokens in enumerate(shared_prefix_prompts(18)):
        engine.add(make_request(f"r{i}", tokens, max_tokens=2, block_size=BS))
        engine.run(f"r{i}")
    assert engine.num_loads >= 6
    assert_every_load_verified(engine)
    checksummed = sum(len(ids) for _, ids in saves)
    assert cached_blocks(engine) > 0
    assert checksummed == cached_blocks(engine), saves
    stores = [ids for kind, ids in saves if kind == "store"]
    assert stores  # the stores happened (and copied the entries)
    if tier != "offloading":
        assert all(not ids for ids in stores), stores


@pytest.mark.parametrize("tier", tier_params(TIERS))
def test_R118_without_prefix_hits_stores_checksum_their_blocks(
    model_dir: str, tier: str
) -> None:
    """With prefix-hit verification off the stores write their blocks'
    entries themselves, as before, and the scheduler side holds no filter
    (bug caught, tried: the filter attached with the flag off, a call per
    store for nothing)."""
    engine = engine_for(model_dir, f"stores-no-hits-{tier}", tier, verify_hits=False)
    assert scheduler_side(engine).entries_written is None  # no per-store call at all
    saves = record_saves(engine)
    for i, tokens in enumerate(shared_prefix_prompts(12)):
        engine.add(make_request(f"r{i}", tokens, max_tokens=2, block_size=BS))
        engine.run(f"r{i}")
    assert_every_load_verified(engine)
    assert any(ids for kind, ids in saves if kind == "store")


@pytest.mark.kv_checksum_capability("prefix_hits")
@pytest.mark.parametrize("tier", tier_params(["simple-eager", "simple-lazy"]))
def test_R140_block_overwritten_before_its_store_is_caught_at_load(
    model_dir: str, tier: str
) -> None:
    """A cached block overwritten on the GPU after the forward that computed
    it and before SimpleCPUOffloadConnector stored it (one step later in
    eager mode, two in lazy mode; OffloadingConnector stores in the caching
    step, before any overwrite can come): its host copy carries the
    entry of the KV as computed, so its load back mismatches. Before this
    change the store checksummed the overwritten block and that load was
    verified: wrong KV served from host memory with a passing check (bug
    caught, tried: the store runs not filtered)."""
    engine = engine_for(model_dir, f"overwritten-{tier}", tier)
    batch = shared_prefix_prompts(NUM_PREFIXES + 1, NUM_PREFIXES)
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
    not clearing it, or a block evicted before the hand-over marked
    handed anyway (a store would copy a stale entry)."""
    hits = KVChecksumPrefixHits(8, 0, BS, None, 1)
    ids = np.asarray([3, 5], dtype=np.int64)
    zeros = np.zeros(2, dtype=np.int64)
    hits.on_cached(hashes(2), np.asarray([0, 1]), ids, ["k3", "k5"])
    assert hits.entries_written(zeros, ids).tolist() == [False, False]
    hits.take_step()
    assert hits.entries_written(zeros, ids).tolist() == [True, True]
    assert hits.entries_written(zeros + 1, ids).tolist() == [False, False]
    hits.on_evicted([3])
    assert hits.entries_written(zeros, ids).tolist() == [False, True]
    hits.on_cached(hashes(2), np.asarray([1]), ids[1:], ["k5"])
    assert hits.entries_written(zeros, ids).tolist() == [False, False]
    hits.take_step()
    assert hits.entries_written(zeros, ids).tolist() == [False, True]
    hits.clear()
    assert not hits.entries_written(zeros, ids).any()
    # Recorded, then evicted in the same step before the hand-over.
    six = np.asarray([6], dtype=np.int64)
    hits.on_cached(hashes(1), np.asarray([0]), six, ["k6"])
    hits.on_evicted([6])
    hits.take_step()
    assert not hits.entries_written(np.zeros(1, dtype=np.int64), six).any()
