# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block checksum entries for vLLM's CPU offload tier (R139 with R116-R121).

vLLM 0.33.0's OffloadingConnector (CPU backend) copies GPU blocks into host
chunks (stores) and back (loads) as transfer jobs: a store job's source spec
lists GPU block ids per KV cache group with each group's first logical block
index; its destination lists CPU chunk ids, each holding `blocks_per_chunk`
GPU blocks. This module moves each block's checksum entry (R117) with it:

- scheduler side, `store_runs`: the (group, first position, GPU block ids,
  block hashes) runs of each store job, so each worker can write the entries
  of the blocks it is about to offload (`save_block_checksums`);
- worker side, `HostEntryTable`: one int64 entry per host sub-block slot
  (chunk id * blocks_per_chunk + offset), filled from the worker's block table
  when a store is queued and written back into the table at the GPU block ids
  when a load is submitted, so the load's finished report carries the stored
  entries (R118). The table lives on the KV cache's device, next to the block
  table, so moving entries is one indexed copy queued on the current stream:
  no host sync on the engine step (R55);
- scheduler side, `failed_keys` and `HostCopyDropper`: a failed check drops
  the host copies of the mismatched positions (R121), so no later request
  loads them.

Nothing here knows vLLM's wiring; wiring.py calls in.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.entry_kernels import (
    entry_kernels,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
    EntryCopy,
    EntryRestore,
    FullBlocks,
    move_indices,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import host_to_device
from vllm.distributed.kv_transfer.kv_checksum.offload.entries import position_hashes
from vllm.logger import init_logger

logger = init_logger(__name__)

# (group id, first position, GPU block ids, block hash at each block's last token)
StoreRun = tuple[int, int, list[int], list[bytes]]
# (groups, GPU block ids) -> per block, whether the workers already hold its
# entry (written by prefix-hit verification in an earlier step, R140)
EntriesWrittenFn = Callable[[np.ndarray, np.ndarray], np.ndarray]

# Block ids or host slots: an array or a list.
IndexLike = np.ndarray | Sequence[int]


def _int64(ids: IndexLike) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


# The hit source whose loads are verified (CacheHitSource.HOST.value).
HOST_SOURCE = "host"

# try_remove(key) -> True: the host copy was freed; False: a load still holds
# it; None: no such copy (any more). Supplied by the wiring, which knows the
# offloading manager's internals.
TryRemoveFn = Callable[[Any], bool | None]
# stored_keys(request id) -> (chunk end token, key) of the chunks the request
# stored itself (R138: dropped when it is contained).
StoredKeysFn = Callable[[str], Iterable[tuple[int | None, Any]]]


@dataclass(frozen=True)
class OffloadGroup:
    """One offloaded KV cache group, in the order of the GPU specs' groups."""

    group_id: int
    block_size: int  # tokens per GPU block
    hash_block_size: int  # tokens per request block hash


def offload_groups(group_configs: Iterable[Any]) -> tuple[OffloadGroup, ...]:
    """The groups of OffloadingConnectorScheduler's `kv_group_configs`."""
    groups = []
    for config in group_configs:
        per_hash = config.tokens_per_chunk // max(1, config.hashes_per_chunk)
        groups.append(OffloadGroup(config.group_idx, config.tokens_per_block, per_hash))
    return tuple(groups)


def _gpu_runs(gpu_spec: Any) -> list[tuple[int, int, np.ndarray]]:
    """(group index, first logical block, GPU block ids) per non-empty group."""
    ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
    sizes = np.asarray(gpu_spec.group_sizes, dtype=np.int64)
    ends = np.cumsum(sizes)
    return [
        (i, int(gpu_spec.block_indices[i]), ids[end - size : end])
        for i, (size, end) in enumerate(zip(sizes.tolist(), ends.tolist()))
        if size
    ]


def store_runs(
    store_jobs: Mapping[int, Any],
    requests: Mapping[str, Any],
    groups: Sequence[OffloadGroup],
) -> dict[int, list[StoreRun]]:
    """Per store job, the runs whose entries the workers save (R118).

    `requests` maps request ids to vLLM Requests (for their block hashes).
    A run of a group with no hash for one of its positions (a partial block)
    is left out: its host copy then carries no fresh entry and a load of it
    ends unverified, never a false mismatch.
    """
    runs: dict[int, list[StoreRun]] = {}
    for job_id, job in store_jobs.items():
        request = requests.get(job.req_id)
        if request is None or not hasattr(job.src_spec, "group_sizes"):
            continue
        job_runs: list[StoreRun] = []
        for index, start, ids in _gpu_runs(job.src_spec):
            if index >= len(groups):
                continue
            group = groups[index]
            hashes = position_hashes(
                request.block_hashes,
                start,
                len(ids),
                group.block_size,
                group.hash_block_size,
            )
            if hashes is not None:
                job_runs.append((group.group_id, start, ids.tolist(), hashes))
        if job_runs:
            runs[job_id] = job_runs
    return runs


def runs_to_write(
    runs: dict[int, list[StoreRun]], entries_written: EntriesWrittenFn
) -> dict[int, Any]:
    """Per store job, the blocks whose entries the workers must still write:
    a block whose entry they already hold is only copied to its host slot
    (issue 30: not checksummed a second time). Jobs left with nothing to
    write are dropped; their copies still happen."""
    out: dict[int, Any] = {}
    for job_id, job_runs in runs.items():
        blocks = FullBlocks.from_runs(job_runs)
        written = entries_written(blocks.groups, blocks.block_ids)
        if not written.any():
            out[job_id] = job_runs
        elif not written.all():
            out[job_id] = blocks.select(~written)
    return out


def host_slots(gpu_spec: Any, cpu_ids: np.ndarray, blocks_per_chunk: int) -> np.ndarray:
    """The host sub-block slot of each GPU block of a transfer, in spec order.

    Group i's blocks start at logical block `block_indices[i]`, so its first
    block sits at offset `block_indices[i] % blocks_per_chunk` of the group's
    first chunk (vLLM's CPU worker skips the same sub-blocks); the chunks of
    consecutive groups follow each other in `cpu_ids`.
    """
    return _slots_of_runs(_gpu_runs(gpu_spec), cpu_ids, blocks_per_chunk)


def _slots_of_runs(
    runs: Sequence[tuple[int, int, np.ndarray]],
    cpu_ids: np.ndarray,
    blocks_per_chunk: int,
) -> np.ndarray:
    """`host_slots` of a transfer whose `_gpu_runs` are known."""
    if blocks_per_chunk == 1:
        # vLLM's default: one GPU block a chunk, slots are the chunk ids.
        return cpu_ids[: sum(len(ids) for _, _, ids in runs)]
    slots = []
    chunk_offset = 0
    for _, start, ids in runs:
        skip = start % blocks_per_chunk
        logical = skip + np.arange(len(ids), dtype=np.int64)
        chunks = cpu_ids[chunk_offset + logical // blocks_per_chunk]
        slots.append(chunks * blocks_per_chunk + logical % blocks_per_chunk)
        chunk_offset += -(-(skip + len(ids)) // blocks_per_chunk)
    if not slots:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(slots)


class HostEntryTable:
    """The checksum entries of the host copies of one worker (R117, R118).

    Indexed like the host sub-blocks: slot = chunk id * blocks_per_chunk +
    offset. `block_table` is the worker's table from `init_block_checksums`.
    """

    def __init__(
        self, block_table: torch.Tensor, num_chunks: int, blocks_per_chunk: int
    ) -> None:
        self.block_table = block_table
        self.blocks_per_chunk = max(1, blocks_per_chunk)
        self.entries = torch.zeros(
            num_chunks * self.blocks_per_chunk,
            dtype=torch.int64,
            device=block_table.device,
        )
        self.kernels = entry_kernels(block_table.device)

    def indices(
        self, transfers: Sequence[tuple[Any, Any]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """GPU block ids and host slots of (GPU spec, CPU spec) transfers,
        concatenated for a whole step (parallel: one slot per block)."""
        gpu_ids: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        for gpu_spec, cpu_spec in transfers:
            runs = _gpu_runs(gpu_spec)  # once per transfer (R142)
            cpu_ids = np.asarray(cpu_spec.block_ids, dtype=np.int64)
            slots.append(_slots_of_runs(runs, cpu_ids, self.blocks_per_chunk))
            gpu_ids.extend(ids for _, _, ids in runs)
        empty = np.zeros(0, dtype=np.int64)
        return np.concatenate(gpu_ids or [empty]), np.concatenate(slots or [empty])

    def copy_to_slots(self, gpu_ids: IndexLike, slots: IndexLike) -> EntryCopy:
        """The copy of `gpu_ids`' entries to the host `slots` that a block
        table save does after writing them (R118; one upload per save)."""
        return EntryCopy(_int64(gpu_ids), _int64(slots), self.entries)

    def restore_of(self, gpu_ids: IndexLike, slots: IndexLike) -> EntryRestore:
        """The move of the host `slots`' entries to `gpu_ids` that a block
        table save does first (R118; one upload for a step's loads and
        stores)."""
        return EntryRestore(_int64(gpu_ids), _int64(slots), self.entries)

    def restore(self, transfers: Sequence[tuple[Any, Any]]) -> None:
        """Loads (GPU spec, CPU spec): the host slots' entries go to the GPU
        blocks written."""
        self.restore_ids(*self.indices(transfers))

    def restore_ids(self, gpu_ids: IndexLike, slots: IndexLike) -> None:
        """The entries of the host `slots` go to `gpu_ids` (parallel): both
        index arrays in one upload (R55: no sync; issue 30: one pinned copy,
        not one per array), packed as the launcher packs a move. Unequal
        lengths raise."""
        restore = self.restore_of(gpu_ids, slots)
        indices = move_indices(restore)
        if not indices.shape[1]:
            return
        both = host_to_device(indices, self.block_table.device)
        self.kernels.move(self.entries, both[1], self.block_table, both[0])


def failed_keys(
    load_key_ranges: Iterable[tuple[int, int, Any]],
    mismatches: Mapping[int, list[int]],
    block_sizes: Mapping[int, int],
    group_of_key: Any,
) -> set[Any]:
    """The offload keys of a load that hold a mismatched position (R121).

    `load_key_ranges` are the load's (first token, end token, key);
    `group_of_key(key)` is the key's KV cache group id. A key is bad when its
    token range overlaps a mismatched block of its group.
    """
    bad = set()
    ranges = list(load_key_ranges)
    for group_id, positions in mismatches.items():
        size = block_sizes.get(group_id)
        if size is None or not positions:
            continue
        starts = np.asarray(positions, dtype=np.int64) * size
        for lo, hi, key in ranges:
            if group_of_key(key) != group_id:
                continue
            if bool(((starts < hi) & (starts + size > lo)).any()):
                bad.add(key)
    return bad


@dataclass
class HostCopyDropper:
    """Drops bad host copies from a CPU offloading manager (R121).

    A copy still referenced by its load cannot be freed yet: it is kept in
    `pending`, answers MISS to lookups (`hides`) and is freed by `drop_ready`
    once its load completed.
    """

    pending: set[Any] = field(default_factory=set)
    dropped: int = 0
    # Told whether copies are pending whenever that changes: lookups need
    # `hides` only then (issue 30: no per-block call while nothing is bad).
    on_pending: Callable[[bool], None] | None = None

    def hides(self, key: Any) -> bool:
        return key in self.pending

    def add(self, keys: Iterable[Any]) -> None:
        had = bool(self.pending)
        self.pending.update(keys)
        self._tell(had)

    def drop_ready(self, try_remove: TryRemoveFn) -> None:
        """Free every pending copy no load holds any more."""
        if not self.pending:
            return  # every step without a bad copy (R142)
        had = True
        for key in list(self.pending):
            removed = try_remove(key)
            if removed is False:
                continue
            self.pending.discard(key)
            if removed:
                self.dropped += 1
                logger.warning(
                    "KV checksums: dropped a host copy that failed verification."
                )
        self._tell(had)

    def _tell(self, had: bool) -> None:
        if self.on_pending is not None and bool(self.pending) != had:
            self.on_pending(bool(self.pending))


def quarantined_keys(
    keyed: Iterable[tuple[int | None, Any]],
    start: Mapping[int, int],
    block_sizes: Mapping[int, int],
    group_of_key: Callable[[Any], int],
) -> set[Any]:
    """The keys among (chunk end token, key) that hold a quarantined block
    (R138): a chunk ending after its group's first quarantined token. A key of
    unknown position, or of a group with no start, is counted quarantined."""
    bad = set()
    for end, key in keyed:
        group = group_of_key(key)
        q, size = start.get(group), block_sizes.get(group)
        if end is None or q is None or size is None or end > q * size:
            bad.add(key)
    return bad


class OffloadSchedulerSide:
    """The checksum state of one OffloadingConnectorScheduler (R119, R121).

    Plain inputs from the wiring: the connector's group configs, its current
    requests, a request's loaded key ranges (first token, end token, key), the
    manager's removal of a host copy and, with prefix-hit verification, which
    GPU blocks' entries the workers already hold.
    """

    def __init__(
        self,
        group_configs: Iterable[Any],
        requests: Callable[[], Mapping[str, Any]],
        load_key_ranges: Callable[[str], Iterable[tuple[int, int, Any]] | None],
        try_remove: TryRemoveFn,
        group_of_key: Callable[[Any], int],
        entries_written: EntriesWrittenFn | None = None,
        stored_keys: StoredKeysFn | None = None,
    ) -> None:
        self.groups = offload_groups(group_configs)
        self.block_sizes = {g.group_id: g.block_size for g in self.groups}
        self.requests = requests
        self.load_key_ranges = load_key_ranges
        self.try_remove = try_remove
        self.group_of_key = group_of_key
        self.dropper = HostCopyDropper()
        # request id -> group -> first quarantined position (R138); set by
        # the plugin's wiring once containment is built (vLLM's connector
        # reads the request's own mark instead).
        self.quarantine: Callable[[str], Mapping[int, int] | None] = lambda _: None
        # request id -> (chunk end token, key) of the chunks it stored itself.
        self.stored_keys = stored_keys
        # Which GPU blocks' entries the workers already hold (prefix-hit
        # verification, R140); None with that flag off.
        self.entries_written = entries_written

    def store_filter(
        self, req_id: str, keys: Sequence[Any], position_of: Callable[[Any], Any]
    ) -> list[Any]:
        """The keys a request may store: none from its quarantine start on
        (R138), so no offload tier serves KV computed over a failed load."""
        start = self.quarantine(req_id)
        if not start:
            return list(keys)
        bad = quarantined_keys(
            ((position_of(k), k) for k in keys),
            start,
            self.block_sizes,
            self.group_of_key,
        )
        return [k for k in keys if k not in bad]

    def on_quarantine(
        self, stored: Iterable[tuple[int | None, Any]], start: Mapping[int, int]
    ) -> None:
        """Drop the host copies a newly quarantined request already stored
        (chunk end token, key) from its quarantine start on (R138)."""
        bad = quarantined_keys(stored, start, self.block_sizes, self.group_of_key)
        if bad:
            self.dropper.add(bad)
            self.dropper.drop_ready(self.try_remove)

    def on_contained(self, req_id: str, start: Mapping[int, int]) -> None:
        """A request was contained (R138): the copies it stored itself from
        its quarantine start on leave the tier."""
        if self.stored_keys is not None:
            self.on_quarantine(self.stored_keys(req_id), start)

    def attach_runs(self, metadata: Any, requests: Mapping[str, Any]) -> None:
        """Put each store job's runs on the metadata for the workers (R118),
        less the blocks whose entries they already hold."""
        if not metadata.store_jobs:
            return  # most steps store nothing (R142)
        runs: dict[int, Any] = store_runs(metadata.store_jobs, requests, self.groups)
        if runs and self.entries_written is not None:
            runs = runs_to_write(runs, self.entries_written)
        if runs:
            metadata.kv_checksum_store_runs = runs

    def on_failure(self, request: Any, mismatches: Mapping[int, list[int]]) -> None:
        """Drop the host copies of the mismatched positions (R121)."""
        ranges = self.load_key_ranges(request.request_id)
        if ranges is None:
            return
        keys = failed_keys(ranges, mismatches, self.block_sizes, self.group_of_key)
        self.dropper.add(keys)
        self.dropper.drop_ready(self.try_remove)

    def after_output(self) -> None:
        """Free bad copies whose loads completed in this output."""
        self.dropper.drop_ready(self.try_remove)


class OffloadWorkerSide:
    """The checksum state of one OffloadingConnectorWorker (R117, R118)."""

    def __init__(
        self,
        checksum_worker: Any,
        connector_worker: Any,
        injector: Any = None,
        host_tensors: Callable[[], Sequence[torch.Tensor]] = list,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_offloading_group_ids,
        )

        spec = connector_worker.spec
        table = checksum_worker.init_block_checksums(
            get_offloading_group_ids(connector_worker.kv_cache_config)
        )
        self.checksum_worker = checksum_worker
        self.connector_worker = connector_worker
        self.entries = HostEntryTable(table, spec.num_chunks, spec.blocks_per_chunk)
        self.injector = injector
        self.host_tensors = host_tensors

    def save_stores(self, metadata: Any, job_ids: Iterable[int]) -> None:
        """Entries of the blocks these store jobs copy, into their host slots.

        Queued on the current stream after the forward that wrote the blocks
        and before the store's copy stream waits on it.
        """
        jobs = {}
        if job_ids:  # most steps store nothing (R142)
            stored = metadata.store_jobs
            jobs = {j: stored[j] for j in job_ids if j in stored}
        if not jobs:
            return
        runs = getattr(metadata, "kv_checksum_store_runs", None) or {}
        gpu_ids, slots = self.entries.indices(
            [(job.src_spec, job.dst_spec) for job in jobs.values()]
        )
        self.checksum_worker.save_block_checksums(
            [run for job_id in jobs for run in runs.get(job_id, ())],
            self.entries.copy_to_slots(gpu_ids, slots),
        )

    def save_step_stores(self, metadata: Any) -> None:
        """The step's store jobs (wait_for_save)."""
        self.save_stores(metadata, metadata.store_jobs)

    def start_loads(self, metadata: Any) -> None:
        """Before loads are submitted: faults (if configured), then entries."""
        jobs = list(metadata.load_jobs.values()) if metadata.load_jobs else []
        if self.injector is not None:
            for job in jobs:
                self._inject(job)
        if jobs:
            self.entries.restore([(job.dst_spec, job.src_spec) for job in jobs])

    def _inject(self, job: Any) -> None:
        host = self.host_tensors()
        cpu_ids = np.asarray(job.src_spec.block_ids, dtype=np.int64)
        if not host or not len(cpu_ids) or not hasattr(job.dst_spec, "block_indices"):
            return
        runs = _gpu_runs(job.dst_spec)
        if not runs:
            return
        bpc = self.entries.blocks_per_chunk
        self.injector.corrupt(job.req_id, int(cpu_ids[0]), runs[0][1] % bpc, bpc, host)
