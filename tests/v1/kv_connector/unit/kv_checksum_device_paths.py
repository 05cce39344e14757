# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The offload tier's three worker paths over one request, as callables,
and a counter of the device operations a call dispatches.

Used by the device-operation budget test (`test_kv_checksum_offload.py`).
Only the package and torch are imported.
"""

from collections.abc import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import KVChecksumWorker
from vllm.distributed.kv_transfer.kv_checksum.offload.offloading import (
    HostEntryTable,
)

REQ = "req-0"
Path = Callable[[], None]
# Not views by their schema, but no memory touched either.
METADATA_OPS = {"aten.lift_fresh.default", "aten.detach.default"}


class OpCount(TorchDispatchMode):
    """Counts the aten operators dispatched inside the mode (`ops`), and
    lists apart those that touch memory, not views (`memory_ops`): on CUDA
    each of these is a kernel, a copy or an allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}
        self.memory_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        self.ops[name] = self.ops.get(name, 0) + 1
        if not func.is_view and name not in METADATA_OPS:
            self.memory_ops.append(name)
        return func(*args, **(kwargs or {}))


def offload_paths(worker: KVChecksumWorker, count: int) -> tuple[Path, Path, Path]:
    """On blocks 1..count of `worker` (at least count + 1 blocks): a save of
    their entries with the copy to host slots (a store), a step whose
    offload load of them finishes, and a restore of their entries (a load
    starting)."""
    ids = list(range(1, count + 1))
    host = HostEntryTable(worker.init_block_checksums([0]), count, 1)
    slots = np.arange(count, dtype=np.int64)
    copy = host.copy_to_slots(np.asarray(ids), slots)
    hashes = [bytes([i % 251 + 1]) * 32 for i in range(count)]
    blocks = KVChecksumBlocks(16 * count, {0: (0, np.asarray(ids, dtype=np.int64))})
    load = KVChecksumScheduled(reqs_to_load={REQ: blocks})

    def save() -> None:
        worker.save_block_checksums([(0, 0, ids, hashes)], copy)

    def load_step() -> None:
        worker.bind(load)
        worker.post_forward(finished_recving={REQ}, failed_recving=set())

    def restore() -> None:
        host.restore_ids(ids, slots)

    return save, load_step, restore


def load_store_step_paths(worker: KVChecksumWorker, count: int) -> tuple[Path, Path]:
    """On a worker with at least 2 * count + 1 blocks: a step that starts an
    offload load of blocks count+1..2*count and stores blocks 1..count, as
    the worker sides run it after the forward since 2026-12-05 (the restore
    riding in the store's save: one upload) and as they ran it before (the
    restore, then the save: two uploads). The loaded blocks' host slots
    hold entries 1001..1000 + count."""
    stored = list(range(1, count + 1))
    loaded = np.arange(count + 1, 2 * count + 1, dtype=np.int64)
    host = HostEntryTable(worker.init_block_checksums([0]), 2 * count, 1)
    store_slots = np.arange(count, dtype=np.int64)
    load_slots = np.arange(count, 2 * count, dtype=np.int64)
    host.entries[count:] = torch.arange(1001, 1001 + count, dtype=torch.int64)
    copy = host.copy_to_slots(np.asarray(stored), store_slots)
    hashes = [bytes([i % 251 + 1]) * 32 for i in range(count)]
    runs = [(0, 0, stored, hashes)]

    def one_upload() -> None:
        worker.save_block_checksums(runs, copy, host.restore_of(loaded, load_slots))

    def two_uploads() -> None:
        host.restore_ids(loaded, load_slots)
        worker.save_block_checksums(runs, copy)

    return one_upload, two_uploads


def send_path(worker: KVChecksumWorker, count: int) -> Path:
    """On blocks 1..count of `worker`: a P/D producer's step that sends them
    (its send pass: rows, launch, copy back), as `post_forward` runs it."""
    ids = np.arange(1, count + 1, dtype=np.int64)
    blocks = KVChecksumBlocks(16 * count, {0: (0, ids)})
    send = KVChecksumScheduled(reqs_to_send={REQ: blocks})

    def send_step() -> None:
        worker.bind(send)
        worker.post_forward(finished_recving=set(), failed_recving=set())

    return send_step


def prefix_step_paths(
    worker: KVChecksumWorker, hits: int, cached: int = 16
) -> tuple[Path, Path]:
    """On a worker with prefix entries (at least hits + cached + 1 blocks):
    the first step of a request that hits blocks 1..hits and caches the next
    `cached`, as the worker runs it (entries and checks in one upload and one
    launch) and as it ran before 2026-12-02g (the entries through the table's
    own save, then the checks alone)."""
    from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
        HIT_KEY_SUFFIX,
    )

    worker.enable_prefix_entries()
    hit_ids = np.arange(1, hits + 1, dtype=np.int64)
    new_ids = list(range(hits + 1, hits + cached + 1))
    hashes = [bytes([i % 251 + 1]) * 32 for i in range(cached)]
    runs = [(0, hits, new_ids, hashes)]
    checks = {REQ + HIT_KEY_SUFFIX: KVChecksumBlocks(16 * hits, {0: (0, hit_ids)})}

    def scheduled() -> KVChecksumScheduled:
        return KVChecksumScheduled(reqs_to_check=dict(checks), blocks_to_save=runs)

    def one_launch() -> None:
        worker.bind(scheduled())
        worker.post_forward(finished_recving=set(), failed_recving=set())

    def two_launches() -> None:
        worker.bind(scheduled())
        table = worker.block_table
        table.save(table.prefix_blocks_to_write(runs), table.prefix_groups)
        worker._to_save = []
        worker.post_forward(finished_recving=set(), failed_recving=set())

    return one_launch, two_launches
