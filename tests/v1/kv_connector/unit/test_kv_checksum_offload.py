# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Offloaded-KV checksums (R116-R121).

Workers write per-block entries (partial checksum summed over columns, XOR a
tag of the block hash) into one table a connector moves with the KV; a load
from a stored-checksum source is checksummed again and compared with the
entries that came back. Worker values are checked against the NumPy reference
and an independent SHA-256 tag; the end-to-end cases run a real vLLM
scheduler with `KVChecksumOffloadTestConnector`.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit import kv_checksum_device_paths as device_paths
from tests.v1.kv_connector.unit import kv_checksum_reference as ref
from tests.v1.kv_connector.unit.kv_checksum_helpers import make_request
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    OFFLOAD_CONNECTOR_NAME,
    OFFLOAD_TOKENS_KEY,
    SideConfig,
    SimEngine,
    per_group,
)
from tests.v1.kv_connector.unit.test_kv_checksum import (
    NUM_BLOCKS,
    REQ,
    _module_worker,
    attn,
    blocks,
    hexes,
    recv,
    truth_worker,
    u64_sum,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumGroup,
    KVChecksumScheduled,
    block_checksum_tags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import FullBlocks
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import KVChecksumWorker
from vllm.distributed.kv_transfer.kv_checksum.offload import entries
from vllm.distributed.kv_transfer.kv_checksum.offload.entries import (
    BlockTagCache,
    position_hashes,
    verify_offloaded_load,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumWorkerReport,
    UnverifiedReason,
)

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

U64 = np.uint64
BLOCK_IDS = [5, 2, 7]


def reference_tags(hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
    """R116 written out: low 8 bytes (LE) of SHA-256(fingerprint LE8 + hash)."""
    prefix = fingerprint.to_bytes(8, "little")
    return np.array(
        [
            int.from_bytes(hashlib.sha256(prefix + h).digest()[:8], "little")
            for h in hashes
        ],
        dtype=U64,
    )


def fake_hashes(count: int, seed: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"block {seed} {i}".encode()).digest() for i in range(count)]


def table_entries(table: torch.Tensor, ids: Sequence[int]) -> np.ndarray:
    return table.numpy().view(U64)[list(ids)].copy()


def load_step(worker: KVChecksumWorker, reqs: dict) -> dict[int, KVChecksumGroup]:
    """One step whose offload loads `reqs` finish; the record's entry for REQ."""
    worker.bind(KVChecksumScheduled(reqs_to_load=dict(reqs)))
    pending = worker.post_forward(finished_recving=set(reqs), failed_recving=set())
    assert pending is not None
    return pending.finalize().checksums[REQ]


def test_tag_vector() -> None:
    """R116: the spec's example, and the reference formula for other inputs."""
    assert int(block_checksum_tags([bytes(32)], 0xD8FE581622DF5382)[0]) == (
        0x17186C21C96033CF
    )
    hashes = fake_hashes(4)
    got = block_checksum_tags(hashes, 0x0123456789ABCDEF)
    assert hexes(got) == hexes(reference_tags(hashes, 0x0123456789ABCDEF))


def _traced_lines(fn: Any, *args: Any) -> int:
    """Python line events executed inside `fn`'s own frame during one call."""
    code = fn.__code__
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


def test_R142_tags_have_no_python_loop_per_block() -> None:
    """R116, R142: the tags of 2 and of 256 blocks (a 4K-token offload load,
    verified on the scheduler; a store batch, on each worker) run the same
    Python lines, and equal the reference formula. Fails on a `for` loop
    over the block hashes (one iteration, about 1 us, per block)."""
    hashes = fake_hashes(256)
    few = _traced_lines(block_checksum_tags, hashes[:2], 0x0123456789ABCDEF)
    many = _traced_lines(block_checksum_tags, hashes, 0x0123456789ABCDEF)
    assert few == many, (few, many)
    for fingerprint in (0, 0x0123456789ABCDEF, (1 << 64) - 1):
        got = block_checksum_tags(hashes, fingerprint)
        assert got.dtype == U64 and got.shape == (256,)
        assert hexes(got) == hexes(reference_tags(hashes, fingerprint))
    assert block_checksum_tags([], 5).shape == (0,)


def test_R142_tag_cache_hashes_each_block_once_and_equals_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R116, R142 (issue 31): `BlockTagCache` returns the reference tags for
    any mix of seen and unseen hashes, duplicates and fingerprints, hashes a
    (fingerprint, hash) once while it is kept, and stays within its limit.

    Bugs caught: SHA-256 per hit block on every request (the cost the cache
    removes: about 1 us per block, 128 per 2,048-token hit); a cache keyed by
    hash alone, which answers one fingerprint's tags for another (PP stages);
    stale or missing tags after the cache forgets on reaching its limit; an
    unbounded cache."""
    hashed: list[int] = []

    def counting(hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
        hashed.append(len(hashes))
        return block_checksum_tags(hashes, fingerprint)

    monkeypatch.setattr(entries, "block_checksum_tags", counting)
    cache = BlockTagCache(limit=40)
    prefix, other = fake_hashes(16, seed=1), fake_hashes(16, seed=2)
    fp1, fp2 = 0x0123456789ABCDEF, (1 << 64) - 1
    calls = [
        (prefix, fp1, 16),  # all new
        (prefix, fp1, 0),  # the shared prefix again: nothing hashed
        (prefix[::2] + other[:4] + other[:4], fp1, 4),  # 4 new, duplicated
        (prefix, fp2, 16),  # same hashes, another fingerprint
        (other, fp1, 16),  # 12 new pass the limit (36 + 12 > 40): all 16 again
        (other[:8], fp1, 0),
        (prefix, fp1, 16),  # forgotten at the limit: hashed again
        (fake_hashes(41, seed=3), fp1, 41),  # larger than the limit: not kept
        (prefix, fp1, 0),
        ([], fp1, 0),
    ]
    for hashes, fingerprint, new in calls:
        hashed.clear()
        got = cache(hashes, fingerprint)
        assert got.dtype == U64 and got.shape == (len(hashes),)
        assert hexes(got) == hexes(reference_tags(hashes, fingerprint))
        assert sum(hashed) == new, (len(hashes), fingerprint, hashed)
        assert cache.size <= cache.limit


def test_R142_tag_cache_runs_answer_equal_runs_only() -> None:
    """R116, R142 (issue 31): a run of hashes asked for again (another
    request hitting the same prefix, with its own equal hash objects) is
    answered from the kept run, and every answer equals the reference tags:
    runs differing from a kept one only in the middle, in length or in
    fingerprint get their own tags; changing an answer changes no later one;
    kept runs stay within the limit.

    Bugs caught: runs keyed by their first or last hash or their length
    (another run's tags for a middle block: a false mismatch, or a missed
    one); the kept array handed out (a caller's change corrupts later
    answers); runs kept without bound."""
    cache = BlockTagCache(limit=40)
    prefix = fake_hashes(16, seed=1)
    middle = list(prefix)
    middle[7] = fake_hashes(1, seed=9)[0]
    fp1, fp2 = 0x0123456789ABCDEF, 5
    calls = [
        (prefix, fp1),
        ([bytes(bytearray(h)) for h in prefix], fp1),  # equal, other objects
        (middle, fp1),
        (prefix[:15], fp1),
        (prefix, fp2),
        (prefix, fp1),
    ]
    for hashes, fingerprint in calls:
        got = cache(hashes, fingerprint)
        assert hexes(got) == hexes(reference_tags(hashes, fingerprint))
        got[:] = 0  # the caller's copy
        assert cache.run_rows <= cache.limit
    assert hexes(cache(prefix, fp1)) == hexes(reference_tags(prefix, fp1))


# --------------------------------------------------------------------------
# Worker (R117, R118)
# --------------------------------------------------------------------------


def test_block_table_is_one_tensor_of_registered_groups() -> None:
    """R117: one int64 (num_blocks,) table, the same on every call; runs of a
    group the worker did not register write nothing. Catches a table per
    call (the connector would move a stale one) or unregistered groups
    written."""
    kv = ref.random_kv(np.random.default_rng(1), 2, 48, 2, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    table = worker.init_block_checksums([0, 9])
    assert worker.init_block_checksums([0]) is table
    assert table.dtype == torch.int64 and tuple(table.shape) == (NUM_BLOCKS,)
    worker.save_block_checksums([(9, 0, [5], fake_hashes(1))])
    assert not table.any()
    unregistered = truth_worker(kv, BLOCK_IDS)
    blank = unregistered.init_block_checksums([])
    unregistered.save_block_checksums([(0, 0, [5], fake_hashes(1))])
    assert not blank.any()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_saved_entries_are_partial_sums_xor_tags(tp_size: int) -> None:
    """R118: a worker's entry of block b at position p is its partial checksum
    of p (all columns) XOR tag(hash, its fingerprint); untag and sum over TP
    ranks gives the reference checksum. Only the given blocks are written.
    Catches a missing tag or one made with another fingerprint, and positions
    counted from the run instead of the request (the checksum weights tokens
    by position)."""
    kv = ref.random_kv(np.random.default_rng(tp_size), 4, 48, 4, 16)
    whole = ref.reference_block_checksums(kv, 16)
    hashes = fake_hashes(3)
    untagged = []
    for tp_rank in range(tp_size):
        worker = truth_worker(kv, BLOCK_IDS, tp_rank=tp_rank, tp_size=tp_size)
        table = worker.init_block_checksums([0])
        worker.save_block_checksums([(0, 1, BLOCK_IDS[1:], hashes[1:])])
        entries = table_entries(table, BLOCK_IDS[1:])
        untagged.append(entries ^ reference_tags(hashes[1:], worker.fingerprints[0]))
        others = [b for b in range(NUM_BLOCKS) if b not in BLOCK_IDS[1:]]
        assert not table[others].any()
    assert hexes(u64_sum(untagged)) == hexes(whole[1:])


def test_R142_saved_entries_from_block_arrays_keep_each_position() -> None:
    """R142, R118: a `FullBlocks` (per-block arrays, out of position order,
    with a block of an unregistered group in between) writes each block's
    entry for its own position and hash, and nothing for the other group.
    Bug caught (tried): positions counted from the first block as in a run
    (start + index), so out-of-order blocks get another position's weights."""
    kv = ref.random_kv(np.random.default_rng(5), 4, 48, 4, 16)
    whole = ref.reference_block_checksums(kv, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    table = worker.init_block_checksums([0])
    hashes = fake_hashes(4, seed=3)
    order = [2, 0, 1]
    ids = [BLOCK_IDS[p] for p in order]
    arrays = FullBlocks(
        np.array([0, 9, 0, 0]),
        np.array([2, 0, 0, 1]),
        np.array([ids[0], 3, ids[1], ids[2]]),
        np.array(hashes, dtype=object),
    )
    worker.save_block_checksums(arrays)
    tags = reference_tags([hashes[0], hashes[2], hashes[3]], worker.fingerprints[0])
    assert hexes(table_entries(table, ids) ^ tags) == hexes(whole[order])
    assert not table[[b for b in range(NUM_BLOCKS) if b not in ids]].any()


def count_uploads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the block table's and the host entry table's uploads to
    the device, as they happen."""
    from vllm.distributed.kv_transfer.kv_checksum.engine import block_table
    from vllm.distributed.kv_transfer.kv_checksum.offload import offloading

    uploads: list[tuple[int, ...]] = []
    real = offloading.host_to_device
    real_segments = block_table.upload_segments

    def counting(array: np.ndarray, device: torch.device) -> torch.Tensor:
        uploads.append(tuple(array.shape))
        return real(array, device)

    def counting_segments(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, list]:
        uploaded, columns = real_segments(*args, **kwargs)
        uploads.append(tuple(uploaded.shape))
        return uploaded, columns

    monkeypatch.setattr(offloading, "host_to_device", counting)
    monkeypatch.setattr(block_table, "upload_segments", counting_segments)
    return uploads


def test_R118_saving_entries_uploads_once_per_group(monkeypatch) -> None:
    """R118, issue 30 (host work per step): a save of several blocks copies its
    rows and tags to the device in one upload, and the entries still equal
    the reference partial sums XOR the reference tags. Bug caught (tried):
    the tags read from the rows' columns instead of their own (entries XOR a
    block id), and one upload per array (three pinned copies per save)."""
    kv = ref.random_kv(np.random.default_rng(7), 4, 48, 4, 16)
    whole = ref.reference_block_checksums(kv, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    table = worker.init_block_checksums([0])
    uploads = count_uploads(monkeypatch)
    hashes = fake_hashes(3, seed=11)
    worker.save_block_checksums([(0, 0, BLOCK_IDS, hashes)])
    assert len(uploads) == 1
    tags = reference_tags(hashes, worker.fingerprints[0])
    assert hexes(table_entries(table, BLOCK_IDS) ^ tags) == hexes(whole)


def test_R118_a_save_copies_its_entries_to_host_slots(monkeypatch) -> None:
    """R118, issue 30 (host work per step): a save given an `EntryCopy` writes
    the entries, then copies each block's entry to its host slot, with the
    copy's indices in the save's one upload; with nothing to save it still
    copies the table's current entries. Bugs caught (tried): the copy taken
    before the table write (slots get the old zero entries), block ids and
    slots swapped, and a second upload for the copy's indices."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
    )

    kv = ref.random_kv(np.random.default_rng(9), 4, 48, 4, 16)
    whole = ref.reference_block_checksums(kv, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    worker.init_block_checksums([0])
    uploads = count_uploads(monkeypatch)
    hashes = fake_hashes(3, seed=13)
    host = torch.zeros(8, dtype=torch.int64)
    slots = [6, 0, 3]  # BLOCK_IDS[i] -> slots[i]
    copy = EntryCopy(np.array(BLOCK_IDS), np.array(slots), host)
    worker.save_block_checksums([(0, 0, BLOCK_IDS, hashes)], copy)
    assert len(uploads) == 1
    expected = whole ^ reference_tags(hashes, worker.fingerprints[0])
    assert hexes(table_entries(host, slots)) == hexes(expected)
    assert np.count_nonzero(host.numpy()) == 3

    # Nothing to save: the current entries are copied all the same.
    again = torch.zeros(8, dtype=torch.int64)
    worker.save_block_checksums([], EntryCopy(np.array([2]), np.array([1]), again))
    assert table_entries(again, [1]).tolist() == table_entries(host, [0]).tolist()


def _stored_entries(
    seed: int, hash_seed: int
) -> tuple[KVChecksumWorker, np.ndarray, list[bytes]]:
    """A worker over random KV with group 0 registered, the reference
    entries (partial sums XOR R116 tags) of BLOCK_IDS under fake hashes, and
    those hashes."""
    kv = ref.random_kv(np.random.default_rng(seed), 4, 48, 4, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    worker.init_block_checksums([0])
    hashes = fake_hashes(3, seed=hash_seed)
    tags = reference_tags(hashes, worker.fingerprints[0])
    return worker, ref.reference_block_checksums(kv, 16) ^ tags, hashes


def _count_entry_kernels(worker: KVChecksumWorker) -> dict[str, int]:
    """Counts the block table's entry writes and moves, as they are queued."""
    kernels = worker.block_table.kernels
    counts = {"write": 0, "move": 0}
    for name in counts:
        real = getattr(kernels, name)

        def counted(*args: Any, _name: str = name, _real: Any = real) -> Any:
            counts[_name] += 1
            return _real(*args)

        setattr(kernels, name, counted)
    return counts


@pytest.mark.parametrize(
    "copy_ids, copy_slots, moves",
    [
        ([5, 2, 7], [6, 0, 3], 0),  # in the write's order (eager stores)
        ([7, 5, 2], [3, 6, 0], 0),  # another order (lazy: eviction order)
        ([7, 4, 5, 2], [3, 1, 6, 0], 1),  # block 4's entry is held already
        ([5, 2, 7, 5], [6, 0, 3, 4], 1),  # block 5 copied to two slots
    ],
    ids=["in-order", "shuffled", "held-entry", "twice"],
)
@pytest.mark.parametrize("queued", [True, False], ids=["in-pass", "now"])
def test_R118_a_stores_copy_rides_in_its_entry_write(
    copy_ids: list[int], copy_slots: list[int], moves: int, queued: bool
) -> None:
    """Issue 30, R118: a store, queued for the checksum pass or saved at
    once, puts each written block's entry in its host slot with the same
    write that fills the table (`fold_copy`); only blocks the write does not
    cover (an entry the table already holds, a second slot of one block)
    are moved apart. Every slot ends equal to the reference entry (partial
    sums XOR R116 tags) of the block it was asked for. Bugs caught (each
    tried): the copy's slots taken in its own order, not the write's
    (shuffled: entries in the wrong slots); the uncovered rest dropped
    (block 4's slot stays zero); a block counted as covered when only its
    first slot is (the second slot stays zero)."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
    )

    worker, entries, hashes = _stored_entries(23, 29)
    table = worker.init_block_checksums([0])
    table[4] = 0x5EED
    counts = _count_entry_kernels(worker)
    host = torch.zeros(8, dtype=torch.int64)
    copy = EntryCopy(np.array(copy_ids), np.array(copy_slots), host)
    if queued:
        worker.queue_block_checksums([(0, 0, BLOCK_IDS, hashes)], copy)
        worker.flush_queued_entries()
    else:
        worker.save_block_checksums([(0, 0, BLOCK_IDS, hashes)], copy)
    assert counts == {"write": 1, "move": moves}
    expected = {b: int(e) for b, e in zip(BLOCK_IDS, entries)} | {4: 0x5EED}
    got = table_entries(host, copy_slots)
    assert [hex(v) for v in got] == [hex(expected[b]) for b in copy_ids]
    assert np.count_nonzero(host.numpy()) == len(set(copy_slots))


@pytest.mark.kv_checksum_capability("simple_cpu_offload")
@pytest.mark.parametrize("in_pass", [False, True], ids=["now", "in-pass"])
def test_R142_a_store_never_counts_its_runs(
    in_pass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, R142: SimpleCPUOffloadConnector's worker side takes a step's
    stored blocks (`FullBlocks`, as the scheduler side attaches them) as
    arrays: it never asks for their runs (`len`, which cuts them with NumPy:
    about 20 us a store step on CPU, 2026-12-05e), its truth test included
    (`FullBlocks.__bool__` counts blocks), and the entries still reach their
    slots. Bug caught (tried): `FullBlocks` without its own `__bool__`, so
    that the worker side's `runs or []` falls back to `len` (as until
    2026-12-05e)."""
    from vllm.distributed.kv_transfer.kv_checksum.offload.simple_cpu_offload import (
        SimpleOffloadWorkerSide,
    )

    worker, entries, hashes = _stored_entries(43, 47)
    side = SimpleOffloadWorkerSide(worker, [0], num_cpu_blocks=8)
    runs = FullBlocks(
        np.zeros(3, dtype=np.int64),
        np.arange(3, dtype=np.int64),
        np.array(BLOCK_IDS, dtype=np.int64),
        np.array(hashes, dtype=object),
    )
    counted: list[int] = []
    real_len = FullBlocks.__len__

    def counting_len(self: FullBlocks) -> int:
        counted.append(1)
        return real_len(self)

    monkeypatch.setattr(FullBlocks, "__len__", counting_len)
    meta = type("M", (), {})()
    meta.store_gpu_blocks, meta.store_cpu_blocks = BLOCK_IDS, [3, 0, 6]
    meta.kv_checksum_store_runs = runs
    side.save_stores(meta, in_pass=in_pass)
    worker.flush_queued_entries()
    assert counted == []
    assert hexes(table_entries(side.entries.entries, [3, 0, 6])) == hexes(entries)


def test_R118_stores_queued_for_one_launch_share_one_entry_write() -> None:
    """Issue 30, R118, R142: two stores queued for one launch make one entry
    write for the group (`merge_entry_rows`), their copies folded in, and
    every slot gets its block's reference entry; two stores of the same
    block are not joined (one kernel would leave either entry). Bugs caught
    (each tried): the joined tags misaligned with the joined rows (entries
    XOR another block's tag); joining a repeated block id (one write)."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
    )

    worker, entries, hashes = _stored_entries(37, 41)
    counts = _count_entry_kernels(worker)
    host = torch.zeros(8, dtype=torch.int64)
    first = EntryCopy(np.array(BLOCK_IDS[:2]), np.array([4, 1]), host)
    second = EntryCopy(np.array(BLOCK_IDS[2:]), np.array([6]), host)
    worker.queue_block_checksums([(0, 0, BLOCK_IDS[:2], hashes[:2])], first)
    worker.queue_block_checksums([(0, 2, BLOCK_IDS[2:], hashes[2:])], second)
    worker.flush_queued_entries()
    assert counts == {"write": 1, "move": 0}
    assert hexes(table_entries(host, [4, 1, 6])) == hexes(entries)

    again = EntryCopy(np.array(BLOCK_IDS[:1]), np.array([2]), host)
    for slots in (again, again):
        worker.queue_block_checksums([(0, 0, BLOCK_IDS[:1], hashes[:1])], slots)
    worker.flush_queued_entries()
    assert counts == {"write": 3, "move": 0}
    assert hexes(table_entries(host, [2])) == hexes(entries[:1])


def test_R118_a_save_brings_a_loads_entries_back_first_in_its_upload(
    monkeypatch,
) -> None:
    """R118, issue 30 (a step's load and store entries in one upload): a save
    given an `EntryRestore` first sets the table's entries of the load's
    blocks from their host slots, then writes and copies its own, in the
    save's one upload; with nothing to save, the restore and a copy still
    share one upload, the restore first. Bugs caught (tried): the restore
    queued after the copy (a copied block that is also restored takes its
    old entry), block ids and slots swapped, a second upload for the
    restore."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
        EntryRestore,
    )

    kv = ref.random_kv(np.random.default_rng(31), 4, 48, 4, 16)
    whole = ref.reference_block_checksums(kv, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    table = worker.init_block_checksums([0])
    host = torch.zeros(8, dtype=torch.int64)
    host[1], host[4] = 111, 222  # entries stored by earlier steps
    uploads = count_uploads(monkeypatch)
    hashes = fake_hashes(3, seed=37)
    restore = EntryRestore(np.array([0, 1]), np.array([1, 4]), host)
    # Block 0 is restored and copied out again in the same call.
    copy = EntryCopy(np.array([*BLOCK_IDS, 0]), np.array([6, 0, 3, 5]), host)
    worker.save_block_checksums([(0, 0, BLOCK_IDS, hashes)], copy, restore)
    assert len(uploads) == 1
    assert table[[0, 1]].tolist() == [111, 222]
    expected = whole ^ reference_tags(hashes, worker.fingerprints[0])
    assert hexes(table_entries(host, [6, 0, 3])) == hexes(expected)
    assert host[5].item() == 111

    # Nothing to save: block 3 restored from slot 4, then copied to slot 7.
    again = torch.zeros(8, dtype=torch.int64)
    worker.save_block_checksums(
        [],
        EntryCopy(np.array([3]), np.array([7]), again),
        EntryRestore(np.array([3]), np.array([4]), host),
    )
    assert len(uploads) == 2
    assert table[3].item() == 222 and again[7].item() == 222
    assert np.count_nonzero(again.numpy()) == 1


def test_R118_a_copy_of_other_blocks_takes_their_table_entries() -> None:
    """R118, R142: when a save's copy lists other blocks than it saves (or
    the same in another order), each slot gets its own block's table entry:
    the new one for a block saved now, the earlier one for a block saved
    before. Bug caught (tried): the shortcut that copies the new entries in
    save order taken for any copy (slots get another block's entry)."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
    )

    kv = ref.random_kv(np.random.default_rng(23), 4, 48, 4, 16)
    whole = ref.reference_block_checksums(kv, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    worker.init_block_checksums([0])
    hashes = fake_hashes(3, seed=29)
    expected = whole ^ reference_tags(hashes, worker.fingerprints[0])
    # Block 7 (position 2) saved earlier; now blocks 5 and 2 (positions 0-1).
    worker.save_block_checksums([(0, 2, BLOCK_IDS[2:], hashes[2:])])
    host = torch.zeros(8, dtype=torch.int64)
    copy = EntryCopy(np.array([7, 5, 2]), np.array([4, 1, 6]), host)
    worker.save_block_checksums([(0, 0, BLOCK_IDS[:2], hashes[:2])], copy)
    got = table_entries(host, [4, 1, 6])
    assert hexes(got) == hexes(expected[[2, 0, 1]])


def test_saved_entries_sum_every_replica_column() -> None:
    """R118: on a worker with two replica columns (a sharded attention cache
    and a one-head indexer on every rank, TP 2), the entry untagged is the sum
    of both columns, the value its receive reports summed over columns.
    Catches entries of replica 0 (the first column) only."""
    rng = np.random.default_rng(21)
    kv_attn = ref.random_kv(rng, 2, 40, 2, 16)
    kv_index = ref.random_kv(rng, 2, 40, 1, 16)
    ids = [3, 5, 6]
    index_spec = attn(1, max_tp_shards=1)
    worker = _module_worker(kv_attn, kv_index, 1, 2, attn(1), index_spec, ids)
    table = worker.init_block_checksums([0])
    hashes = fake_hashes(2)
    worker.save_block_checksums([(0, 0, ids[:2], hashes)])
    untagged = table_entries(table, ids[:2]) ^ reference_tags(
        hashes, worker.fingerprints[0]
    )
    got = recv(worker, {REQ: blocks(40, (0, 0, ids))}).checksums[REQ][0]
    assert len(got.replica_keys) == 2
    columns = got.values[:2].sum(axis=1, dtype=U64)
    assert hexes(untagged) == hexes(columns)
    assert hexes(untagged) != hexes(got.values[:2, 0])


def test_load_reports_checksums_and_stored_entries() -> None:
    """R117, R119: a finished offload load reports the loaded blocks' checksums
    (as a receive) and the entries the table holds for them; a P/D receive on
    a worker with no registered group reports no entries. Catches entries
    captured from other blocks or not at all."""
    kv = ref.random_kv(np.random.default_rng(3), 2, 48, 2, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    table = worker.init_block_checksums([0])
    worker.save_block_checksums([(0, 0, BLOCK_IDS, fake_hashes(3))])
    group = load_step(worker, {REQ: blocks(48, (0, 0, BLOCK_IDS))})[0]
    assert group.stored is not None
    assert hexes(group.stored) == hexes(table_entries(table, BLOCK_IDS))
    want = ref.reference_block_checksums(kv, 16)
    assert hexes(group.values.sum(axis=1, dtype=U64)) == hexes(want)
    plain = truth_worker(kv, BLOCK_IDS)
    plain.bind(KVChecksumScheduled(reqs_to_recv={REQ: blocks(48, (0, 0, BLOCK_IDS))}))
    pending = plain.post_forward(finished_recving={REQ}, failed_recving=set())
    assert pending is not None and pending.finalize().checksums[REQ][0].stored is None


def test_R55_a_steps_results_come_back_as_one_run(monkeypatch) -> None:
    """R55, R117, issue 30 (host work per step): a step with a receive and an
    offload load writes both passes' outputs and the load's stored entries
    into segments of its one upload and copies them back as one run, no
    concatenation, and each request still reads its own values. Bugs caught
    (tried): a pass's host view taken at the offset of the previous pass's
    segment (the receive reads the load's values), and the stored entries
    gathered into the output segment."""
    from vllm.distributed.kv_transfer.kv_checksum.engine import launches

    def no_cat(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("the step's results were concatenated")

    kv = ref.random_kv(np.random.default_rng(5), 2, 48, 2, 16)
    whole = ref.reference_block_checksums(kv, 16)
    worker = truth_worker(kv, BLOCK_IDS)
    table = worker.init_block_checksums([0])
    loaded, received = BLOCK_IDS, BLOCK_IDS[1:]
    worker.save_block_checksums([(0, 0, loaded, fake_hashes(3, seed=3))])
    monkeypatch.setattr(launches.torch, "cat", no_cat)
    other = "recv-req"
    worker.bind(
        KVChecksumScheduled(
            reqs_to_load={REQ: blocks(48, (0, 0, loaded))},
            reqs_to_recv={other: blocks(48, (0, 1, received))},
        )
    )
    pending = worker.post_forward(finished_recving={REQ, other}, failed_recving=set())
    assert pending is not None
    record = pending.finalize().checksums
    load, recv_group = record[REQ][0], record[other][0]
    assert load.stored is not None and recv_group.stored is None
    assert hexes(load.stored) == hexes(table_entries(table, loaded))
    assert hexes(load.values.sum(axis=1, dtype=U64)) == hexes(whole)
    assert hexes(recv_group.values.sum(axis=1, dtype=U64)) == hexes(whole[1:])


def memory_ops(fn: Any) -> list[str]:
    """The aten operators `fn` dispatches that are not views (on CUDA each a
    kernel, a copy or an allocation), the checksum kernel stubbed."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (
        KVChecksumLaunch,
    )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KVChecksumLaunch, "__call__", lambda launch, rows, out: None)
        with device_paths.OpCount() as count:
            fn()
    return count.memory_ops


def test_R142_offload_paths_dispatch_a_fixed_handful_of_device_ops() -> None:
    """R142, issue 30: on the H200 every torch call of a store or load cost
    tens of microseconds of the engine thread, so the offload paths keep
    their device operations (not views) to a fixed few whatever the block
    count: a save with its slot copy 4 (the upload's host buffer, packed in
    place since 2026-12-02i; XOR, table write, slot copy), a finished load's
    step 4 (the upload's host buffer, the entries' gather, the host buffer
    and copy of the results), a restore 2. Bugs caught (tried, the code
    before 2026-12-02): a `torch.zeros` per pass for the launch output, a
    gather into a new tensor and a `cat` of the results before their copy
    (load 6); a zeroed launch output of the save's own (save 5)."""
    for count in (3, 40):
        save, load, restore = offload_paths(count)
        assert len(memory_ops(save)) <= 4, memory_ops(save)
        assert len(memory_ops(load)) <= 4, memory_ops(load)
        assert len(memory_ops(restore)) <= 2, memory_ops(restore)


def test_R142_a_load_and_store_step_uploads_once(monkeypatch) -> None:
    """Issue 30: the device-calls benchmark's load + store step (a restore
    of N blocks and a save of N others) makes one upload the way both
    offload tiers run it after the forward and two the way they ran it
    before, with the same device operations besides and the same table
    after: the loads' entries from their host slots, the stores' written.
    Bug caught (tried): the restore's indices uploaded apart from the save's
    (two uploads)."""
    states = []
    for way in (0, 1):
        kv = ref.random_kv(np.random.default_rng(41), 2, 96, 2, 16)
        worker = truth_worker(kv, list(range(1, 7)), num_blocks=7)
        paths = device_paths.load_store_step_paths(worker, 3)
        uploads = count_uploads(monkeypatch)
        paths[way]()
        assert len(uploads) == 1 + way
        assert len(memory_ops(paths[way])) <= 6
        table = worker.block_table.tensor
        assert table is not None
        assert table[4:7].tolist() == [1001, 1002, 1003]  # the loads' entries
        states.append(table.clone())
    assert torch.equal(states[0], states[1])
    assert np.count_nonzero(states[0][1:4].numpy()) == 3  # the stores' entries


def offload_paths(count: int) -> tuple[Any, Any, Any]:
    """The save, finished load and restore of `count` blocks on a CPU worker."""
    kv = ref.random_kv(np.random.default_rng(count), 2, 16 * count, 2, 16)
    worker = truth_worker(kv, list(range(1, count + 1)), num_blocks=count + 1)
    return device_paths.offload_paths(worker, count)


# --------------------------------------------------------------------------
# Comparison (R120)
# --------------------------------------------------------------------------


def offload_reports(
    tp_size: int,
    flip: tuple[int, int] | None = None,
    swap: bool = False,
    seed: int = 5,
) -> tuple[dict, list[bytes]]:
    """Each TP rank saves the three blocks, then loads them back: its report.

    `flip` = (tp rank, position) flips one KV bit on that rank after saving;
    `swap` swaps the stored entries of positions 0 and 1 on every rank.
    """
    kv = ref.random_kv(np.random.default_rng(seed), 2, 48, 4, 16)
    hashes = fake_hashes(3, seed)
    reports = {}
    for tp_rank in range(tp_size):
        worker = truth_worker(kv, BLOCK_IDS, tp_rank=tp_rank, tp_size=tp_size)
        table = worker.init_block_checksums([0])
        worker.save_block_checksums([(0, 0, BLOCK_IDS, hashes)])
        if flip is not None and flip[0] == tp_rank:
            cache = next(iter(worker.kv_caches.values())).view(torch.uint8)
            cache[BLOCK_IDS[flip[1]]].view(-1)[3] ^= 1
        if swap:
            a, b = BLOCK_IDS[0], BLOCK_IDS[1]
            table[[a, b]] = table[[b, a]].clone()
        groups = load_step(worker, {REQ: blocks(48, (0, 0, BLOCK_IDS))})
        reports[(0, tp_rank)] = KVChecksumWorkerReport(
            groups, fingerprints=dict(worker.fingerprints)
        )
    return reports, hashes


def verify(reports: dict, hashes: Sequence[bytes], num_workers: int, **kw):
    scheduled = kw.pop("scheduled", blocks(48, (0, 0, BLOCK_IDS)))
    return verify_offloaded_load(
        reports, scheduled, num_workers, hashes, {0: 16}, kw.pop("hash_bs", None)
    )


@pytest.mark.parametrize("tp_size", [1, 2])
def test_clean_offload_load_verifies(tp_size: int) -> None:
    """R120: entries saved and loaded back unchanged verify on every rank."""
    reports, hashes = offload_reports(tp_size)
    verdict = verify(reports, hashes, tp_size)
    assert verdict.status == KVChecksumStatus.VERIFIED
    assert verdict.compared_groups == [0]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_corrupted_kv_on_one_rank_is_a_mismatch(tp_size: int) -> None:
    """R120: one flipped bit on the last rank fails its position; positions
    are the union over workers. Catches comparing rank 0 only or summing ranks
    before comparing (rank entries are tagged with their own fingerprints)."""
    reports, hashes = offload_reports(tp_size, flip=(tp_size - 1, 1))
    verdict = verify(reports, hashes, tp_size)
    assert verdict.status == KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {0: [1]}


@pytest.mark.parametrize(("tp_size", "rank"), [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2)])
def test_corrupted_kv_on_each_rank_is_a_mismatch(tp_size: int, rank: int) -> None:
    """R120 (issue 32): a flipped bit on any one TP rank, not only the last,
    fails its position. Catches combining the workers' comparisons with
    `bad = ...` instead of `bad |= ...` (only the last worker would count, so
    corruption on every other rank of an offload load came back verified)."""
    reports, hashes = offload_reports(tp_size, flip=(rank, 2))
    verdict = verify(reports, hashes, tp_size)
    assert verdict.status == KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {0: [2]}


def test_entries_of_other_blocks_are_mismatches() -> None:
    """R116, R120: swapped stored entries, or a load whose request has another
    block hash at a position (another block's KV with its entry), mismatch.
    Catches entries compared without their tags."""
    reports, hashes = offload_reports(1, swap=True)
    assert verify(reports, hashes, 1).mismatches == {0: [0, 1]}
    reports, hashes = offload_reports(1)
    other = [hashes[0], hashes[1], fake_hashes(1, 99)[0]]
    assert verify(reports, other, 1).mismatches == {0: [2]}


def test_R142_offload_loads_hash_a_prefix_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """R116, R120, R142: the scheduler's offload loads keep tags, so a prefix loaded
    from host memory again is not hashed again, and a later load whose entries are
    wrong still mismatches. Bugs caught: a cache answering the first load's verdict
    rather than its tags (the swapped load would verify), and no cache (every load
    hashing its blocks)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_checksum.offload.loads import (
        KVChecksumOffloadLoads,
        PendingOffloadLoad,
    )

    hashed: list[int] = []

    def counting(hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
        hashed.append(len(hashes))
        return block_checksum_tags(hashes, fingerprint)

    monkeypatch.setattr(entries, "block_checksum_tags", counting)
    loads = KVChecksumOffloadLoads(1, {0: 16}, None)
    clean, hashes = offload_reports(1)
    swapped, _ = offload_reports(1, swap=True)
    request = SimpleNamespace(request_id=REQ, block_hashes=list(hashes))
    statuses = []
    for reports in (clean, clean, swapped):
        load = PendingOffloadLoad(blocks(48, (0, 0, BLOCK_IDS)), request, reports)
        verdict = loads.verify(load)
        statuses.append((verdict.status, dict(verdict.mismatches)))
    assert statuses == [
        (KVChecksumStatus.VERIFIED, {}),
        (KVChecksumStatus.VERIFIED, {}),
        (KVChecksumStatus.MISMATCH, {0: [0, 1]}),
    ]
    assert hashed == [3]


def test_incomplete_or_other_blocks_are_unverified() -> None:
    """R82, R84 for offload loads: a missing worker, or one reporting another
    range than scheduled, leaves the load unverified; a group no worker stored
    entries for is not compared."""
    reports, hashes = offload_reports(2)
    missing = verify({(0, 0): reports[(0, 0)]}, hashes, 2)
    assert missing.status == KVChecksumStatus.UNVERIFIED
    assert missing.reasons[0][0] == UnverifiedReason.NOT_ALL_WORKERS
    shifted = verify(reports, hashes, 2, scheduled=blocks(48, (0, 1, BLOCK_IDS[1:])))
    assert shifted.status == KVChecksumStatus.UNVERIFIED
    assert shifted.reasons[0][0] == UnverifiedReason.OTHER_BLOCKS
    for report in reports.values():
        report.groups[0].stored = None
    nothing = verify(reports, hashes, 2)
    assert nothing.status == KVChecksumStatus.VERIFIED
    assert nothing.compared_groups == []


def test_position_hashes_with_smaller_hash_blocks() -> None:
    """R120: with hash blocks of 16 tokens and 32-token blocks, position p is
    identified by hash 2p + 1; a missing hash gives None. Catches indexing the
    request's hashes by position."""
    hashes = fake_hashes(6)
    assert position_hashes(hashes, 1, 2, 32, 16) == [hashes[3], hashes[5]]
    assert position_hashes(hashes, 0, 3, 16, None) == hashes[:3]
    assert position_hashes(hashes, 2, 2, 32, 16) is None


# --------------------------------------------------------------------------
# Scheduler end to end (R119, R121)
# --------------------------------------------------------------------------

PROMPT = [(23 * i + 7) % 997 + 3 for i in range(60)]
STORED = 48  # three full 16-token blocks come from the host tier


def offload_engine(model_dir: str, name: str, **side) -> SimEngine:
    engine = SimEngine(
        model_dir, SideConfig(connector=OFFLOAD_CONNECTOR_NAME, **side), name
    )
    for worker in engine.workers:
        worker.checksum.init_block_checksums([0])
    return engine


def stored_copy(source: SimEngine) -> tuple[dict, dict, list[bytes]]:
    """Compute PROMPT on `source` and offload its first three blocks: the KV,
    every worker's entries and the request's block hashes."""
    source.add(make_request("a", PROMPT, max_tokens=4))
    source.step()
    ids = source.block_ids("a")[0][: STORED // 16]
    hashes = [bytes(h) for h in source.scheduler.requests["a"].block_hashes[:3]]
    entries = {}
    for worker in source.workers:
        worker.checksum.save_block_checksums([(0, 0, ids, hashes)])
        table = worker.checksum.init_block_checksums([0])
        entries[(worker.pp_rank, worker.tp_rank)] = table[ids].clone()
    return source.read_global(ids, range(STORED)), entries, hashes


def load_stored(
    engine: SimEngine,
    kv: dict,
    entries: dict,
    corrupt: bool = False,
    rank: int = 0,
    stage: int = 0,
) -> str:
    """A request for PROMPT whose first blocks load from the host tier;
    `corrupt` flips a bit of position 1 in a head TP rank `rank` holds, in a
    layer of PP stage `stage`."""
    engine.add(
        make_request(
            "b", PROMPT, max_tokens=2, kv_transfer_params={OFFLOAD_TOKENS_KEY: STORED}
        )
    )
    engine.step()
    load = engine.loads["b"]
    ids = per_group(load.block_ids)[0][: STORED // 16]
    if corrupt:
        kv = {key: value.copy() for key, value in kv.items()}
        head = rank * engine.heads_per_rank
        layers = {
            layer
            for worker in engine.workers
            if worker.pp_rank == stage
            for layer, _, _ in worker.layers.values()
        }
        key = next(k for k in kv if k[1] == head and k[0] in layers)
        kv[key][20, 0] ^= 0x10  # position 1 of one layer, one head
    engine.write_global(ids, list(range(STORED)), kv)
    for worker in engine.workers:
        table = worker.checksum.init_block_checksums([0])
        table[ids] = entries[(worker.pp_rank, worker.tp_rank)]
    engine.finish_load("b")
    engine.step()
    return str(engine.run("b").finish_reason)


@pytest.mark.parametrize("tp", [1, 2])
def test_offload_load_verifies_end_to_end(model_dir: str, tp: int) -> None:
    """R119: a load whose hit source ("host") the connector declares is
    registered in the step it starts (reqs_to_load) and verifies; nothing is
    reported to the connector. Catches offload loads left unregistered."""
    source = offload_engine(model_dir, "S", tp=tp)
    engine = offload_engine(model_dir, "D", tp=tp, fail_closed=True)
    kv, entries, _ = stored_copy(source)
    assert load_stored(engine, kv, entries) == "length"
    scheduled = [
        o.kv_checksum_scheduled.reqs_to_load
        for o in engine.history
        if o.kv_checksum_scheduled is not None and o.kv_checksum_scheduled.reqs_to_load
    ]
    assert len(scheduled) == 1 and list(scheduled[0]) == ["b"]
    start, ids = scheduled[0]["b"].groups[0]
    assert (start, len(ids)) == (0, STORED // 16)
    assert dict(engine.checksums.stats.loads) == {"verified": 1}
    assert engine.scheduler.connector.failures == []


@pytest.mark.parametrize("fail_closed", [False, True])
def test_corrupted_offload_load_reports_failure(
    model_dir: str, vllm_caplog, fail_closed: bool
) -> None:
    """R120, R121: a bit flipped in the loaded KV is a mismatch at its
    position, logged; the connector hears of it in both modes
    (`on_kv_checksum_failure`, so it can drop the bad copy); fail-closed with
    "recompute" computes the prompt again. Catches the failure callback only
    fail-closed, or the comparison dropped."""
    source = offload_engine(model_dir, "S")
    engine = offload_engine(model_dir, "D", fail_closed=fail_closed, policy="recompute")
    kv, entries, _ = stored_copy(source)
    assert load_stored(engine, kv, entries, corrupt=True) == "length"
    assert dict(engine.checksums.stats.loads) == {"mismatch": 1}
    assert engine.scheduler.connector.failures == [("b", {0: [1]})]
    errors = [r.getMessage() for r in vllm_caplog.records if r.levelno == logging.ERROR]
    assert any("KV checksum mismatch for request b" in m for m in errors)
    recomputed = engine.scheduled_tokens("b") >= len(PROMPT)
    assert recomputed == fail_closed


@pytest.mark.parametrize("rank", [0, 1])
def test_offload_load_corrupted_on_each_rank_end_to_end(
    model_dir: str, rank: int
) -> None:
    """R120 (issue 32): at TP 2 on the real scheduler, KV corrupted on either
    rank alone is a mismatch at its position. Catches a verification where
    only the last worker's comparison counts (`bad = ...` for `bad |= ...`):
    rank 0's corruption would come back verified."""
    source = offload_engine(model_dir, "S", tp=2)
    engine = offload_engine(model_dir, "D", tp=2)
    kv, entries, _ = stored_copy(source)
    assert load_stored(engine, kv, entries, corrupt=True, rank=rank) == "length"
    assert dict(engine.checksums.stats.loads) == {"mismatch": 1}
    assert engine.scheduler.connector.failures == [("b", {0: [1]})]


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted"])
def test_offload_load_of_pp_stages_end_to_end(model_dir: str, corrupt: bool) -> None:
    """R120, R139: at PP 2 each stage's worker tags its entries with its own
    fingerprint (its own layers); a clean host load verifies, and KV
    corrupted in a layer of the second stage alone is a mismatch at its
    position only (fail-closed: only it is computed again).

    Bug caught: offload verification reusing the first worker's fingerprint
    tags for every worker (`offload/entries.py`): the second stage's entries
    never match, so every host load mismatches at every position."""
    source = offload_engine(model_dir, "S", pp=2)
    engine = offload_engine(model_dir, "D", pp=2, fail_closed=True, policy="recompute")
    stages = {w.pp_rank: w.checksum.fingerprints[0] for w in engine.workers}
    assert len(stages) == 2 and stages[0] != stages[1]
    kv, entries, _ = stored_copy(source)
    assert load_stored(engine, kv, entries, corrupt=corrupt, stage=1) == "length"
    if corrupt:
        assert dict(engine.checksums.stats.loads) == {"mismatch": 1}
        assert engine.scheduler.connector.failures == [("b", {0: [1]})]
    else:
        assert dict(engine.checksums.stats.loads) == {"verified": 1}
        assert engine.scheduler.connector.failures == []
    # Fail-closed: only the corrupted load computes the prompt again.
    assert (engine.scheduled_tokens("b") >= len(PROMPT)) == corrupt


def test_loads_from_undeclared_sources_are_not_checked(model_dir: str) -> None:
    """R119: a hit source the connector does not declare (here none) leaves
    the load unchecked: not registered, no verdict. Catches checking every
    external load (its blocks would carry no entries)."""
    source = offload_engine(model_dir, "S")
    engine = offload_engine(model_dir, "D")
    engine.scheduler.connector.get_kv_checksum_sources = lambda request: set()
    kv, entries, _ = stored_copy(source)
    assert load_stored(engine, kv, entries, corrupt=True) == "length"
    assert not any(
        o.kv_checksum_scheduled is not None and o.kv_checksum_scheduled.reqs_to_load
        for o in engine.history
    )
    assert dict(engine.checksums.stats.loads) == {}
