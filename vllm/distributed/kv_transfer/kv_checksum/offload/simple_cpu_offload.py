# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block checksum entries for vLLM's SimpleCPUOffloadConnector (R139, R116-R121).

vLLM 0.33.0's SimpleCPUOffloadConnector copies GPU blocks into CPU blocks
(stores) and back (loads) as flat, parallel block id lists keyed by event ids:
no request is attached to a store, and in lazy mode the stored blocks are
cached GPU blocks near eviction, whose requests may be long gone. A block's
entry (R117) depends on its position in its request and on the request's
block hash at its last token; both travel with the GPU block itself: vLLM's
block pool caches a full block under that hash (with its KV cache group) and
the number of prefix tokens it covers, (position + 1) * block size. So:

- scheduler side, `SimpleOffloadSchedulerSide.attach`: after vLLM built the
  step's metadata, the (group, position, GPU block id, hash) arrays of the
  stored blocks (`FullBlocks`), read from those cache keys (`block_places`),
  go on the metadata for the workers. CPU blocks stored without a known place (a block
  cached under a partial hash) are remembered, and a load that reads one is
  not declared (no false mismatch); storing the block again with a place
  forgets it;
- worker side, `SimpleOffloadWorkerSide`: at a store event the workers write
  the entries of the stored blocks (`save_block_checksums`) and copy them
  into a host-slot table indexed by CPU block id (`HostEntryTable` with one
  block per chunk); before a load event's copy is submitted, the entries of
  the loaded CPU blocks go back into the block table at the GPU block ids,
  queued on the current stream (no host sync, R55). When the wiring keeps
  the step's copies back until its checksum pass (`in_pass`), both are
  queued for that pass instead, in its one upload;
- scheduler side, `on_failure`: the CPU blocks of a failed load at the
  mismatched positions are dropped (R121) through `HostCopyDropper`; the
  wiring's removal takes the block's hashes out of the CPU prefix cache at
  once (no later lookup hits it) and vLLM frees the block when the load that
  reads it releases it.

Nothing here knows vLLM's wiring; wiring.py calls in with plain callables.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
    FullBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.offloading import (
    HOST_SOURCE,
    EntriesWrittenFn,
    HostCopyDropper,
    HostEntryTable,
    TryRemoveFn,
    failed_keys,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# (cache key: block hash + 4-byte big-endian group id, prefix tokens covered)
# of a block, as vLLM's block pool keeps them; (None, None) when not cached.
BlockKey = tuple[bytes | None, int | None]
# block ids -> their cache keys, in order
BlockKeysFn = Callable[[Sequence[int]], list[BlockKey]]
# request id -> the CPU block ids its pending load reads (None: no load)
LoadBlocksFn = Callable[[str], Sequence[int] | None]

_GROUP_BYTES = 4
# A cache key less its group id: the block hash.
_WITHOUT_GROUP = itemgetter(slice(None, -_GROUP_BYTES))

# (cache key, prefix tokens covered) of a vLLM KVCacheBlock, through its
# `block_hash` and `block_hash_num_tokens` properties.
block_key = attrgetter("block_hash", "block_hash_num_tokens")


def block_keys(
    pool: Any, ids: Sequence[int], key: Callable[[Any], BlockKey] = block_key
) -> list[BlockKey]:
    """The (cache key, covered tokens) of blocks `ids` of a vLLM BlockPool,
    in order, without a Python loop per block (R142). `key` reads one
    block's."""
    return list(map(key, map(pool.blocks.__getitem__, ids)))


# From this many stored blocks on NumPy reads the keys faster than a plain
# pass: its fixed cost lost below about 80 blocks (2026-12-02h: 0.86 of the
# pass's speed at 51 blocks, 1.30 times it at 128), and a decode step stores
# a few dozen, a prefill step hundreds.
VECTOR_PLACES_FROM = 96


@dataclass(frozen=True)
class BlockPlaces:
    """Where each block sits in the requests that cached it.

    `positions` is -1 where the place is unknown (not cached, or cached under
    a hash that ends inside the block); `hashes[i]` is then b"".
    """

    groups: np.ndarray
    positions: np.ndarray
    hashes: list[bytes]

    @property
    def known(self) -> np.ndarray:
        return self.positions >= 0


def block_places(keys: Sequence[BlockKey], block_sizes: Sequence[int]) -> BlockPlaces:
    """(group, position, hash at the last token) of each block, from its
    cache key and covered tokens; `block_sizes[g]` is group g's block size.

    A full block at position p of group g covers (p + 1) * block_sizes[g]
    tokens, and its hash is the request's hash at its last token (vLLM's
    `cache_full_blocks`), which is what its entry is tagged with (R117).
    From `VECTOR_PLACES_FROM` blocks on (a prefill's stores) the keys are
    read with NumPy; below, and for keys NumPy cannot take whole (a block
    not cached, keys of mixed lengths), in one plain pass.
    """
    if len(keys) >= VECTOR_PLACES_FROM:
        places = _places_from_joined_keys(keys, block_sizes)
        if places is not None:
            return places
    return _places_one_by_one(keys, block_sizes)


def _places_one_by_one(
    keys: Sequence[BlockKey], block_sizes: Sequence[int]
) -> BlockPlaces:
    """`block_places` in one plain-Python pass: few blocks, where a dozen
    NumPy calls cost more than the pass (R142)."""
    sizes = list(block_sizes)
    groups: list[int] = []
    positions: list[int] = []
    hashes: list[bytes] = []
    for key, num_tokens in keys:
        group, position, digest = -1, -1, b""
        if key is not None and num_tokens:
            group = int.from_bytes(key[-_GROUP_BYTES:], "big")
            if group < len(sizes) and num_tokens % sizes[group] == 0:
                position = num_tokens // sizes[group] - 1
                digest = key[:-_GROUP_BYTES]
        groups.append(group)
        positions.append(position)
        hashes.append(digest)
    return BlockPlaces(
        np.asarray(groups, dtype=np.int64),
        np.asarray(positions, dtype=np.int64),
        hashes,
    )


def _places_from_joined_keys(
    keys: Sequence[BlockKey], block_sizes: Sequence[int]
) -> BlockPlaces | None:
    """`block_places` with NumPy over the keys joined into one buffer: no
    Python loop over blocks (R142) but over those without a place. None
    (the caller takes the plain pass) unless every block is cached, under
    keys of one length, with its covered tokens."""
    digests, covered = zip(*keys)
    if None in covered or None in digests or not block_sizes:
        return None
    lengths = set(map(len, digests))
    width = lengths.pop()
    if lengths or width <= _GROUP_BYTES:
        return None
    joined = b"".join(digests)
    raw = np.frombuffer(joined, dtype=np.uint8).reshape(len(digests), width)
    groups = raw[:, -_GROUP_BYTES:].copy().view(">u4").reshape(-1).astype(np.int64)
    num_tokens = np.asarray(covered, dtype=np.int64)
    sizes = np.asarray(block_sizes, dtype=np.int64)
    cached = num_tokens != 0
    placed = cached & (groups < len(sizes))
    size = sizes[np.where(placed, groups, 0)]
    placed &= num_tokens % size == 0
    positions = np.where(placed, num_tokens // size - 1, -1)
    hashes = list(map(_WITHOUT_GROUP, digests))
    for i in np.flatnonzero(~placed).tolist():  # partial blocks: few, if any
        hashes[i] = b""
    return BlockPlaces(np.where(cached, groups, -1), positions, hashes)


def store_runs(
    block_ids: Sequence[int], places: BlockPlaces, wanted: np.ndarray | None = None
) -> FullBlocks:
    """The blocks at known places (those of them in `wanted`, a mask, when
    given), as `save_block_checksums` takes them, in store order.

    Every block carries its own group, position and hash (its entry depends
    on those only), so no order is needed: lazy-mode stores come in eviction
    order, a request's tail first, eager ones request after request. Kept in
    store order, the blocks line up with the store's copy to host slots, so
    the copy rides in the entry write as it is (`fold_copy`, issue 30).
    Arrays only: no Python loop over runs or blocks (R142).
    """
    mask = places.known if wanted is None else wanted
    ids = np.asarray(block_ids, dtype=np.int64)
    hashes = np.empty(len(places.hashes), dtype=object)
    hashes[:] = places.hashes
    if mask.all():  # every stored block, the usual case
        return FullBlocks(places.groups, places.positions, ids, hashes)
    return FullBlocks(
        places.groups[mask], places.positions[mask], ids[mask], hashes[mask]
    )


class SimpleOffloadSchedulerSide:
    """The checksum state of one SimpleCPUOffloadScheduler (R118, R119, R121).

    Plain inputs from the wiring: each group's block size, the cache keys of
    GPU and of CPU blocks, the CPU blocks of a request's pending load, and
    the removal of a CPU block from the CPU prefix cache; optionally, which
    GPU blocks' entries the workers already hold (prefix-hit verification).
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        gpu_keys: BlockKeysFn,
        cpu_keys: BlockKeysFn,
        load_blocks: LoadBlocksFn,
        try_remove: TryRemoveFn,
        entries_written: EntriesWrittenFn | None = None,
    ) -> None:
        self.block_sizes = list(block_sizes)
        self.entries_written = entries_written
        self.gpu_keys = gpu_keys
        self.cpu_keys = cpu_keys
        self.load_blocks = load_blocks
        self.try_remove = try_remove
        self.dropper = HostCopyDropper()
        # CPU block ids whose host copy carries no entry (bounded by the pool).
        self.unentried: set[int] = set()

    def attach(self, metadata: Any) -> None:
        """The runs of this step's stored blocks whose entries the workers
        must write (not those they already hold: the store copies every
        stored block's entry), and each loading request's block count (for
        host fault injection, R131), on the metadata (R118)."""
        gpu_ids = list(getattr(metadata, "store_gpu_blocks", None) or ())
        if gpu_ids:
            places = block_places(self.gpu_keys(gpu_ids), self.block_sizes)
            cpu_ids = np.asarray(metadata.store_cpu_blocks, dtype=np.int64)
            known = places.known
            self.unentried.difference_update(cpu_ids[known].tolist())
            if not known.all():
                self.unentried.update(cpu_ids[~known].tolist())
            wanted = known
            if self.entries_written is not None:
                # Blocks whose entry the workers already hold: copied to
                # their CPU slots, not checksummed a second time.
                ids = np.asarray(gpu_ids, dtype=np.int64)
                wanted = known & ~self.entries_written(places.groups, ids)
            if wanted.any():
                metadata.kv_checksum_store_runs = store_runs(gpu_ids, places, wanted)
        event = getattr(metadata, "load_event", -1)
        req_ids = (getattr(metadata, "load_event_to_reqs", None) or {}).get(event)
        if req_ids:
            metadata.kv_checksum_load_counts = [
                (req_id, len(self.load_blocks(req_id) or ())) for req_id in req_ids
            ]

    def sources(self, request: Any) -> set[str]:
        """The host source, unless the load reads a copy with no entry."""
        cpu_ids = self.load_blocks(request.request_id)
        if cpu_ids and not self.unentried.isdisjoint(cpu_ids):
            logger.debug("KV checksums: a host load reads copies with no entry.")
            return set()
        return {HOST_SOURCE}

    def on_failure(self, request: Any, mismatches: dict[int, list[int]]) -> None:
        """Drop the CPU blocks of the load at the mismatched positions (R121)."""
        cpu_ids = list(self.load_blocks(request.request_id) or ())
        if not cpu_ids or not mismatches:
            return
        places = block_places(self.cpu_keys(cpu_ids), self.block_sizes)
        ranges = []
        group_of: dict[int, int] = {}
        for cpu_id, group, position in zip(
            cpu_ids, places.groups.tolist(), places.positions.tolist()
        ):
            if position < 0:
                continue
            size = self.block_sizes[group]
            ranges.append((position * size, (position + 1) * size, cpu_id))
            group_of[cpu_id] = group
        sizes = dict(enumerate(self.block_sizes))
        bad = failed_keys(ranges, mismatches, sizes, group_of.__getitem__)
        self.dropper.add(bad)
        self.dropper.drop_ready(self.try_remove)


class SimpleOffloadWorkerSide:
    """The checksum state of one SimpleCPUOffloadWorker (R117, R118, R131)."""

    def __init__(
        self,
        checksum_worker: Any,
        group_ids: Sequence[int],
        num_cpu_blocks: int,
        injector: Any = None,
        host_tensors: Callable[[], Sequence[torch.Tensor]] = list,
    ) -> None:
        table = checksum_worker.init_block_checksums(group_ids)
        self.checksum_worker = checksum_worker
        self.entries = HostEntryTable(table, num_cpu_blocks, 1)
        self.injector = injector
        self.host_tensors = host_tensors

    def save_stores(self, metadata: Any, in_pass: bool = False) -> None:
        """Entries of this step's stored blocks, into their CPU blocks' slots.

        Queued on the current stream after the forward and before the store
        copy waits on it (vLLM's wait_for_save records that event after us).
        `in_pass`: the store's copy is kept back until the step's checksum
        pass, so the entries are queued for that pass's one upload (issue
        30).
        """
        gpu_ids = getattr(metadata, "store_gpu_blocks", None)
        if not gpu_ids:
            return
        runs = getattr(metadata, "kv_checksum_store_runs", None) or []
        copy = self.entries.copy_to_slots(gpu_ids, metadata.store_cpu_blocks)
        if in_pass:
            self.checksum_worker.queue_block_checksums(runs, copy)
        else:
            self.checksum_worker.save_block_checksums(runs, copy)

    def start_loads(self, metadata: Any, in_pass: bool = False) -> None:
        """Before the load copy is submitted: faults (if configured), then the
        loaded CPU blocks' entries into the block table at the GPU ids.

        `in_pass`: the load's copy is kept back until the step's checksum
        pass, so its entries' move is queued for that pass's one upload
        (issue 30).
        """
        cpu_ids = getattr(metadata, "load_cpu_blocks", None)
        if cpu_ids and self.injector is not None:
            self._inject(metadata, cpu_ids)
        if not cpu_ids:
            return
        if in_pass:
            restore = self.entries.restore_of(metadata.load_gpu_blocks, cpu_ids)
            self.checksum_worker.queue_block_checksums((), restore=restore)
        else:
            self.entries.restore_ids(metadata.load_gpu_blocks, cpu_ids)

    def _inject(self, metadata: Any, cpu_ids: Sequence[int]) -> None:
        """Each loading request's first CPU block may be corrupted (R131)."""
        host = self.host_tensors()
        offset = 0
        for req_id, count in getattr(metadata, "kv_checksum_load_counts", None) or ():
            if count and offset < len(cpu_ids) and host:
                self.injector.corrupt(req_id, int(cpu_ids[offset]), 0, 1, host)
            offset += count


def scheduler_side_of(
    manager: Any, entries_written: EntriesWrittenFn | None = None
) -> SimpleOffloadSchedulerSide:
    """The scheduler side over a SimpleCPUOffloadScheduler's public view (a
    vLLM with KV checksums built in): each group's block size, the stored
    GPU blocks' and the CPU blocks' cache keys, a request's pending load,
    and the "drop copy" call."""
    return SimpleOffloadSchedulerSide(
        manager.group_block_sizes,
        lambda ids: block_keys(manager.gpu_block_pool, ids),
        lambda ids: block_keys(manager.cpu_block_pool, ids),
        manager.get_load_cpu_block_ids,
        manager.drop_cpu_block,
        entries_written,
    )


def worker_side_of(
    checksum_worker: Any, handler: Any, vllm_config: Any
) -> SimpleOffloadWorkerSide:
    """The worker side of a SimpleCPUOffloadWorker with CPU tensors (its
    `cpu_kv_caches`: [CPU blocks, block bytes] pinned tensors per region),
    with its host fault injector (R131) when configured."""
    from vllm.distributed.kv_transfer.kv_checksum.offload.host_faults import (
        create_host_fault_injector,
    )

    topology = checksum_worker.topology
    injector = create_host_fault_injector(
        vllm_config, topology.tp_rank, topology.pp_rank
    )

    def host_tensors() -> list[torch.Tensor]:
        return list((handler.cpu_kv_caches or {}).values())

    return SimpleOffloadWorkerSide(
        checksum_worker,
        handler.kv_cache_config.prefix_cacheable_group_ids,
        handler.num_cpu_blocks,
        injector,
        host_tensors,
    )
