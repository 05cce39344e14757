# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks of prefix-hit verification (R140); the logic is in
engine/prefix_hit_checks.py (`PrefixHitVerifier`, reached through the
checksum scheduler's `attach_prefix_cache`, `note_local_hit`,
`schedule_prefix_hits` and `verify_prefix_hits`: the calls the in-tree
series' Scheduler makes at the same places).

With checksums off, or both `kv_checksum_verify_prefix_hits` and
`kv_checksum_verify_external_loads` off, nothing is attached and vLLM runs
unchanged; with the external flag alone entries are recorded (for
engine/external_loads.py) but hits are not looked up or checked. Called from
the package's scheduler and worker hooks (wiring/scheduler.py,
wiring/worker.py; one line each), so no vLLM method is wrapped twice.
Verification stops, and drops its state, with the engine's checksums (the
scheduler guard closes its checksum scheduler, a worker's disabled record:
R134, R141).

Hooks (target; why; how; the upstream change that lets it go):

BlockPool cache_full_blocks, get_new_blocks, evict_blocks, reset_prefix_cache
  (instance, set up with the checksum scheduler)
    Why: an entry is recorded when vLLM caches a full block, dropped when it
    evicts the block (its two callers of `_maybe_evict_cached_block` that a
    single-group attention model reaches: allocation and eviction by id)
    How: after vLLM's own call, the calls of the series' block-pool listener
    on `PrefixHitEntryListener` (engine/prefix_hits.py): the blocks cached
    (positions, hashes), the blocks no key reaches any more, the reset; one
    frame per call (issue 30: not one per allocated block)
    Upstream: `BlockPool.set_listener` (series commit 0003), set by
    `attach_prefix_cache` (series commit "[Core] Verify prefix-cache hits")
KVCacheManager record_prefix_cache_stats (instance; prefix-hit flag only)
    Why: the hit blocks of a request are checked before its output is used
    How: `note_local_hit` with the request's local hit at its admission (the
    one call site of vLLM's, after every adjustment of the hit)
    Upstream: the Scheduler calling `note_local_hit` next to it
Scheduler update_after_schedule / update_from_output (through the package's hooks)
    Why: ask the workers to save entries and check hits; compare the results
    How: `schedule_prefix_hits` and `verify_prefix_hits`, as the series'
    Scheduler calls them
    Upstream: the Scheduler making the same calls
Scheduler state on a mismatch (through `verify_prefix_hits`)
    Why: no token computed over a bad hit reaches a client and no block
    computed over it stays cached, whatever vLLM did since the check's step
    How: the series' invalid-block recovery (`recover_invalid_blocks`,
    `restart_request`, `evict_cached_blocks_from`), on vLLM 0.33.0 the
    stand-in of wiring/recovery.py over the Scheduler's internals
    Upstream: series commit "[Core] Recover every holder of an invalid
    block, dropping in-flight output"
"""

from collections.abc import Iterable
from operator import attrgetter
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.config import read_flags
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hit_checks import (
    PrefixHitVerifier,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.offloading import EntriesWrittenFn
from vllm.distributed.kv_transfer.kv_checksum.wiring.recovery import recovery_of
from vllm.logger import init_logger

logger = init_logger(__name__)


def _records_entries(vllm_config: Any) -> bool:
    """Entries of cached blocks are recorded for prefix hits (R140) or for
    external loads (R147, engine/external_loads.py)."""
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    flags = read_flags(kv_transfer_config)
    return flags.verify_prefix_hits or flags.verify_external_loads


def attach(scheduler: Any, kcs: Any) -> None:
    """R140. Called by the Scheduler.__init__ hook once it built the checksum
    scheduler `kcs`: `kcs.attach_prefix_cache`, as the series' Scheduler
    calls it, with the block-pool wrappers below in place of
    `BlockPool.set_listener`; the hit lookup noted (prefix-hit flag only).
    An error leaves prefix-hit verification off."""
    try:
        if not _records_entries(scheduler.vllm_config):
            return
        manager = scheduler.kv_cache_manager
        pool = manager.block_pool
        kcs.attach_prefix_cache(
            scheduler.vllm_config,
            scheduler.kv_cache_config,
            manager,
            set_listener=lambda listener: _hook_block_pool(pool, listener),
        )
        verifier = kcs.prefix_hits
        if verifier is not None and verifier.verify_hits:
            _hook_hit_lookup(manager, kcs)
    except Exception:
        logger.exception("KV checksums: prefix-hit verification is off.")
        if kcs.prefix_hits is not None:
            kcs.prefix_hits.release()


def schedule(scheduler: Any, output: Any) -> None:
    """R140. Called by the Scheduler._update_after_schedule hook after it set
    `kv_checksum_scheduled` (the series' Scheduler makes the same call)."""
    kcs = scheduler.kv_checksum_scheduler
    if kcs is not None:
        kcs.schedule_prefix_hits(output, scheduler.requests, scheduler.kv_cache_manager)


def verify(scheduler: Any, scheduler_output: Any, model_output: Any) -> None:
    """R140. Called by the Scheduler.update_from_output hook before vLLM's
    update_from_output; the holders of bad blocks recover through the
    series' recovery methods (wiring/recovery.py on vLLM 0.33.0)."""
    kcs = scheduler.kv_checksum_scheduler
    if kcs is not None and kcs.prefix_hits is not None:
        kcs.verify_prefix_hits(scheduler_output, model_output, recovery_of(scheduler))


def entries_written_of(scheduler: Any) -> EntriesWrittenFn | None:
    """R140, issue 30. For the offload tiers' scheduler sides (Scheduler.__init__
    hook): `(groups, block_ids) -> mask` of the GPU blocks whose entries this
    scheduler's prefix-hit verification already had the workers write (all
    false once it turned off: a store then checksums its blocks itself);
    None with the flag off."""
    if not _records_entries(scheduler.vllm_config):
        return None

    def entries_written(groups: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
        verifier = live_state(scheduler)
        if verifier is None:
            return np.zeros(block_ids.shape, dtype=bool)
        return verifier.entries_written(groups, block_ids)

    return entries_written


def live_state(scheduler: Any) -> PrefixHitVerifier | None:
    """The prefix-hit verifier while verification runs (external-load
    verification shares it, R147); None once it is off."""
    kcs = scheduler.kv_checksum_scheduler
    verifier = None if kcs is None else kcs.prefix_hits
    if verifier is None or not verifier.live():
        return None
    return verifier


def _release(scheduler: Any) -> None:
    """Prefix-hit verification off: every entry, check and note dropped."""
    kcs = scheduler.kv_checksum_scheduler
    if kcs is not None and kcs.prefix_hits is not None:
        kcs.prefix_hits.release()


_block_id = attrgetter("block_id")
_block_hash = attrgetter("block_hash")


def _cached_blocks(
    blocks: list, num_cached_blocks: int, num_full_blocks: int
) -> tuple[list, list[int]]:
    """The blocks vLLM just cached in `cache_full_blocks` (those it gave a
    hash: not null, not masked) and their positions, read with C-level maps,
    not a Python loop per block (issue 30)."""
    new = blocks[num_cached_blocks:num_full_blocks]
    positions = list(range(num_cached_blocks, num_cached_blocks + len(new)))
    keys = list(map(_block_hash, new))
    if None in keys:  # null or masked blocks (sliding window): vLLM skipped them
        kept = [i for i, key in enumerate(keys) if key is not None]
        new = [new[i] for i in kept]
        positions = [positions[i] for i in kept]
    return new, positions


def _hook_block_pool(pool: Any, listener: Any) -> None:
    """Instance wrappers on the block pool making the calls of the in-tree
    series' block-pool listener (`PrefixHitEntryListener`) after vLLM's own:
    blocks cached, blocks that lost their keys, reset."""
    hits = listener.hits
    cache_full_blocks = pool.cache_full_blocks
    get_new_blocks = pool.get_new_blocks
    evict_blocks = pool.evict_blocks
    reset = pool.reset_prefix_cache

    def cache_full_blocks_hook(
        request: Any,
        blocks: list,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        cache_full_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            *args,
            **kwargs,
        )
        try:
            new, positions = _cached_blocks(blocks, num_cached_blocks, num_full_blocks)
        except Exception:
            listener.on_error("recording entries")
            return
        listener.on_blocks_cached(
            request, new, positions, kv_cache_group_id, block_size
        )

    def uncached(block_ids: Iterable[int]) -> None:
        """Those of the blocks with entries that no key reaches any more (a
        surviving key keeps its entry, R140 (c), so a reuse is caught)."""
        entry_keys = hits.entry_keys
        if not entry_keys:
            return
        try:
            contain = pool.cached_block_hash_to_block.contain
            gone = [
                block_id
                for block_id in block_ids
                if block_id in entry_keys
                and not contain(entry_keys[block_id], block_id)
            ]
        except Exception:
            listener.on_error("dropping entries")
            return
        listener.on_blocks_uncached(gone)

    def get_new_blocks_hook(num_blocks: int, *args: Any, **kwargs: Any) -> list:
        blocks = get_new_blocks(num_blocks, *args, **kwargs)
        uncached(map(_block_id, blocks))
        return blocks

    def evict_blocks_hook(block_ids: set[int], *args: Any, **kwargs: Any) -> None:
        evict_blocks(block_ids, *args, **kwargs)
        uncached(block_ids)

    def reset_hook() -> bool:
        done = reset()
        if done:
            listener.on_prefix_cache_reset()
        return done

    pool.cache_full_blocks = cache_full_blocks_hook
    pool.get_new_blocks = get_new_blocks_hook
    pool.evict_blocks = evict_blocks_hook
    pool.reset_prefix_cache = reset_hook


def _hook_hit_lookup(manager: Any, kcs: Any) -> None:
    """Instance wrapper noting each request's local prefix hit at admission,
    where the series' Scheduler calls `note_local_hit`: after vLLM records
    the hit in its prefix-cache stats (one call per admitted lookup)."""
    record = manager.record_prefix_cache_stats

    def record_prefix_cache_stats_hook(request: Any, num_hits: int) -> None:
        record(request, num_hits)
        kcs.note_local_hit(request, num_hits)  # guarded by the verifier

    manager.record_prefix_cache_stats = record_prefix_cache_stats_hook
