# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A worker's step on CUDA caches: entry saves and a step's results (R55, R118).

An entry save uploads its rows and tags in one pinned array; a step's results and
stored entries come back in one pinned buffer by one side-stream copy. On the
device both must give the values a worker on CPU caches of the same bytes gives
(the PyTorch path, which the CPU tests check against the reference), without a
host sync. Run on a GPU host with the package importable (`gpu_runs.sh
cuda-tests`); skipped without CUDA.
"""

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_entry_cases import check_entry_kernels
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumRecord,
    KVChecksumScheduled,
    block_checksum_tags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.entry_kernels import (
    EntryKernels,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
    HIT_KEY_SUFFIX,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.records import (
    KVChecksumPendingRecord,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import KVChecksumWorker
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_BLOCKS = 16
BLOCK_IDS = np.array([3, 7, 11])
HASHES = [bytes([i + 1]) * 32 for i in range(len(BLOCK_IDS))]
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def kv_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """Three float16 attention layers, two KV heads of 64, one page each."""
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * num_blocks * len(LAYERS),
            layers=[layer],
            layer_stride=page * num_blocks,
            block_stride=page,
            offset=i * page * num_blocks,
        )
        for i, layer in enumerate(LAYERS)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )


def worker_on(
    device: torch.device,
    source: dict[str, torch.Tensor] | None,
    num_blocks: int = NUM_BLOCKS,
):
    """A TP 1 worker whose caches hold `source`'s bytes (random when None)."""
    config = kv_config(num_blocks)
    caches = allocate_kv_cache(config, device, KVCacheLayout.LBHNC, None)
    generator = torch.Generator().manual_seed(5)
    for layer, cache in caches.items():
        words = cache.view(torch.int16)
        if source is None:
            noise = torch.randint(-(2**15), 2**15, words.shape, generator=generator)
            words.copy_(noise)
        else:
            words.copy_(source[layer].view(torch.int16))
    topology = WorkerTopology(0, 1, 0, num_blocks, 2, device)
    worker = KVChecksumWorker(config, caches, topology)
    worker.warm_up()
    return worker, caches


def pending_step(worker: KVChecksumWorker) -> KVChecksumPendingRecord:
    """Save the entries of three blocks, then one step that loads them and sends
    them; the step's record, not yet finalized."""
    worker.init_block_checksums([0])
    worker.save_block_checksums([(0, 0, BLOCK_IDS, HASHES)])
    blocks = KVChecksumBlocks(num_tokens=48, groups={0: (0, BLOCK_IDS)})
    worker.bind(KVChecksumScheduled(reqs_to_load={"load": blocks}))
    worker.bind(KVChecksumScheduled(reqs_to_send={"send": blocks}))
    pending = worker.post_forward(finished_recving={"load"}, failed_recving=set())
    assert pending is not None
    return pending


def check_against(got: KVChecksumRecord, want: KVChecksumRecord, fingerprint: int):
    """Equal results and stored entries; the entries untag to the load's column
    sums (the load verifies)."""
    for req_id in ("load", "send"):
        np.testing.assert_array_equal(
            got.checksums[req_id][0].values, want.checksums[req_id][0].values
        )
    stored, values = got.checksums["load"][0].stored, got.checksums["load"][0].values
    assert stored is not None and want.checksums["load"][0].stored is not None
    np.testing.assert_array_equal(stored, want.checksums["load"][0].stored)
    tags = block_checksum_tags(HASHES, fingerprint).view(np.uint64)
    np.testing.assert_array_equal(stored ^ tags, values.sum(axis=1, dtype=np.uint64))


def test_step_on_cuda_equals_cpu_without_host_sync() -> None:
    """R55, R118: on CUDA, entries saved and a load's and a send's results read back
    equal to a CPU worker's over the same bytes, the entries untag to the load's
    column sums (a verified load), and neither the save nor the step syncs with
    the host. Bugs caught: the one-buffer copy placing stored entries over the
    checksums or read before the side stream's copy, the save's tags taken from
    the wrong columns of its upload, a pinned copy path that raises on CUDA, a
    host sync in the save or the step."""
    on_cpu, caches = worker_on(torch.device("cpu"), None)
    on_cuda, _ = worker_on(torch.device("cuda"), caches)
    want = pending_step(on_cpu).finalize()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = pending_step(on_cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_against(pending.finalize(), want, on_cuda.fingerprints[0])


def test_step_on_a_non_default_stream_behind_queued_work() -> None:
    """R55, issue 30 (the side copy through the accelerator API): a step run
    on a non-default compute stream (vLLM runs its model on one of its own),
    behind a long GPU sleep queued on that stream, reads back the CPU
    worker's values; afterwards that stream is still current and the
    current device unchanged. Bugs caught: the side stream waiting on another
    stream than the compute stream (the copy would read results the sleeping
    stream had not written yet), and the compute stream or device not
    restored after the copy. Not yet run on a GPU when written (2026-12-02i)."""
    on_cpu, caches = worker_on(torch.device("cpu"), None)
    on_cuda, _ = worker_on(torch.device("cuda", torch.cuda.current_device()), caches)
    want = pending_step(on_cpu).finalize()
    device = torch.cuda.current_device()
    compute = torch.cuda.Stream()
    compute.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: every launch waits behind it
        pending = pending_step(on_cuda)
        assert torch.cuda.current_stream() == compute
        assert torch.cuda.current_device() == device
    check_against(pending.finalize(), want, on_cuda.fingerprints[0])


def test_save_copies_entries_to_slots_on_cuda_without_host_sync() -> None:
    """R118, issue 30: a save given an `EntryCopy` (an offload tier's store)
    writes the same host-slot entries on CUDA as on CPU over the same bytes,
    with the copy's indices in the save's one upload and no host sync. Bugs
    caught: the copy's indices sliced from the wrong columns of the upload
    (slots get the rows' positions or the tags), and a host sync in the copy."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
    )

    slots = np.array([5, 0, 2])
    on_cpu, caches = worker_on(torch.device("cpu"), None)
    on_cuda, _ = worker_on(torch.device("cuda"), caches)
    results = []
    for worker, device in ((on_cpu, "cpu"), (on_cuda, "cuda")):
        worker.init_block_checksums([0])
        dest = torch.zeros(8, dtype=torch.int64, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            worker.save_block_checksums(
                [(0, 0, BLOCK_IDS, HASHES)], EntryCopy(BLOCK_IDS, slots, dest)
            )
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        results.append(dest.cpu().numpy())
    np.testing.assert_array_equal(results[1], results[0])
    assert np.count_nonzero(results[1][slots]) == len(slots)


def test_restore_rides_in_a_save_on_cuda_without_host_sync() -> None:
    """R118, issue 30: a save given an `EntryRestore` (a step's loads, both
    offload tiers after the forward) sets the loaded blocks' entries from
    their host slots before it writes and copies its own, on CUDA as on CPU
    over the same bytes, in one upload and without a host sync; with nothing
    to save, a restore and a copy share an upload the same way. Bugs caught
    on CPU (test_R118_a_save_brings_a_loads_entries_back_first_in_its_upload):
    the restore after the copy, its ids and slots swapped. Not yet run on a
    GPU when written (2026-12-05)."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
        EntryRestore,
    )

    on_cpu, caches = worker_on(torch.device("cpu"), None)
    on_cuda, _ = worker_on(torch.device("cuda"), caches)
    results = []
    for worker, device in ((on_cpu, "cpu"), (on_cuda, "cuda")):
        table = worker.init_block_checksums([0])
        host = torch.arange(8, dtype=torch.int64, device=device) * 1000 + 7
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            # Blocks 1 and 4 load from slots 6 and 4; block 1 is copied out
            # again to slot 1 with the stored blocks.
            worker.save_block_checksums(
                [(0, 0, BLOCK_IDS, HASHES)],
                EntryCopy(np.array([*BLOCK_IDS, 1]), np.array([5, 0, 2, 1]), host),
                EntryRestore(np.array([1, 4]), np.array([6, 4]), host),
            )
            worker.save_block_checksums(
                [],
                EntryCopy(np.array([2]), np.array([3]), host),
                EntryRestore(np.array([2]), np.array([7]), host),
            )
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        results.append((table.cpu().numpy().copy(), host.cpu().numpy().copy()))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)
    cuda_table, cuda_host = results[1]
    assert cuda_host[1] == 6007 and cuda_host[3] == 7007 and cuda_table[2] == 7007


def queued_moves_step(worker: KVChecksumWorker, queued: bool) -> tuple:
    """Entries of three blocks saved; then a step that finishes their load
    and, as an offload tier's store and load do, writes blocks 2 and 5's
    entries, brings blocks 1 and 4's back from host slots 6 and 4 and copies
    blocks 2, 5 and 1 to slots 3, 0 and 1: queued for the pass (`queued`)
    or saved at once. Returns the block table, the host slots and the step's
    pending record (not finalized)."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
        EntryRestore,
    )

    device = worker.topology.device
    table = worker.init_block_checksums([0])
    host = torch.arange(8, dtype=torch.int64, device=device) * 1000 + 7
    worker.save_block_checksums([(0, 0, BLOCK_IDS, HASHES)])
    blocks = KVChecksumBlocks(num_tokens=48, groups={0: (0, BLOCK_IDS)})
    worker.bind(KVChecksumScheduled(reqs_to_load={"load": blocks}))
    moves = (
        [(0, 0, np.array([2, 5]), [b"a" * 32, b"b" * 32])],
        EntryCopy(np.array([2, 5, 1]), np.array([3, 0, 1]), host),
        EntryRestore(np.array([1, 4]), np.array([6, 4]), host),
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        if queued:
            worker.queue_block_checksums(*moves)
        else:
            worker.save_block_checksums(*moves)
        pending = worker.post_forward(finished_recving={"load"}, failed_recving=set())
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert pending is not None
    return table, host, pending


def test_queued_entry_moves_ride_in_the_pass_on_cuda_without_host_sync() -> None:
    """Issue 30, R118: entry moves queued for the step's pass (an offload
    tier's store and load while its copies are held) leave on CUDA the same
    block table, host slots and load results as a CPU worker saving them at
    once over the same bytes, in the pass's one upload and without a host
    sync; block 1's entry reaches slot 1 after coming back from slot 6.
    Bugs caught on CPU (test_entry_moves_in_the_pass_are_made_before_the_hand_offs,
    test_R118_entry_moves_ride_in_the_pass_while_copies_are_held): the copies
    before the entry writes, the restores left out. Not yet run on a GPU
    when written (2026-12-05)."""
    on_cpu, caches = worker_on(torch.device("cpu"), None)
    on_cuda, _ = worker_on(torch.device("cuda"), caches)
    want_table, want_host, want = queued_moves_step(on_cpu, queued=False)
    table, host, pending = queued_moves_step(on_cuda, queued=True)
    got = pending.finalize()
    want_record = want.finalize()
    np.testing.assert_array_equal(table.cpu().numpy(), want_table.numpy())
    np.testing.assert_array_equal(host.cpu().numpy(), want_host.numpy())
    np.testing.assert_array_equal(
        got.checksums["load"][0].values, want_record.checksums["load"][0].values
    )
    np.testing.assert_array_equal(
        got.checksums["load"][0].stored, want_record.checksums["load"][0].stored
    )
    copied = host.cpu().numpy()
    assert copied[1] == 6007 and copied[3] != 3007 and copied[0] != 7


def shared_entries(device: torch.device, caches: dict[str, torch.Tensor] | None):
    """A store of three blocks, then in the next step a copy-only store of
    two of them (entries already held: 9e288ff) and, in the step after, a
    store of all three followed by the prefix entries of the same blocks
    (skipped: 259c985). Returns the two host tables and the block table."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
    )

    worker, caches = worker_on(device, caches)
    worker.init_block_checksums([0])
    worker.enable_prefix_entries()
    runs = [(0, 0, BLOCK_IDS, HASHES)]
    first = torch.zeros(8, dtype=torch.int64, device=device)
    again = torch.zeros(8, dtype=torch.int64, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        worker.bind(None)
        worker.save_block_checksums(
            runs, EntryCopy(BLOCK_IDS, np.array([5, 0, 2]), first)
        )
        worker.bind(None)
        worker.save_block_checksums(
            [], EntryCopy(BLOCK_IDS[1:], np.array([1, 6]), again)
        )
        worker.bind(None)
        table = worker.block_table
        written = table.tensor.clone()
        table.tensor.zero_()
        worker.save_block_checksums(
            runs, EntryCopy(BLOCK_IDS, np.array([5, 0, 2]), first)
        )
        # The prefix entries of the same blocks: every one stored this step.
        table.save(table.prefix_blocks_to_write(runs), table.prefix_groups)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    return first.cpu().numpy(), again.cpu().numpy(), written.cpu(), table, caches


def test_shared_entries_on_cuda_without_host_sync() -> None:
    """Issue 30, R118, R140: a store whose blocks' entries the workers already
    hold copies them (no runs), and prefix entries skip blocks a store of the
    same step wrote; on CUDA the host slots get the same entries as on CPU
    over the same bytes, with no host sync. Bugs caught: the copy-only save
    returning before its copy (zero slots), and its indices read from the
    wrong rows of its upload (slots get block ids)."""
    want_first, want_again, want_table, _, caches = shared_entries(
        torch.device("cpu"), None
    )
    first, again, table, block_table, _ = shared_entries(torch.device("cuda"), caches)
    np.testing.assert_array_equal(first, want_first)
    np.testing.assert_array_equal(again, want_again)
    np.testing.assert_array_equal(table.numpy(), want_table.numpy())
    assert np.count_nonzero(first[[5, 0, 2]]) == 3
    np.testing.assert_array_equal(again[[1, 6]], first[[0, 2]])
    assert block_table._stored_this_step  # the last store is remembered


def cache_and_check(device: torch.device, caches: dict[str, torch.Tensor] | None):
    """One step that caches block 0 of BLOCK_IDS (an odd count: a padding row
    follows it in the fused launch; blocks 1 and 2 got their entries a step
    before) and checks a hit on all three, so the launcher writes the entry
    and checks the hit in one launch. Returns the record's check group, the
    block table, the fingerprint and the caches."""
    worker, caches = worker_on(device, caches)
    worker.enable_prefix_entries()
    worker.bind(KVChecksumScheduled(blocks_to_save=[(0, 1, BLOCK_IDS[1:], HASHES[1:])]))
    worker.post_forward(finished_recving=set(), failed_recving=set())
    key = "hit" + HIT_KEY_SUFFIX
    hit = KVChecksumBlocks(num_tokens=48, groups={0: (0, BLOCK_IDS)})
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        worker.bind(
            KVChecksumScheduled(
                reqs_to_check={key: hit},
                blocks_to_save=[(0, 0, BLOCK_IDS[:1], HASHES[:1])],
            )
        )
        pending = worker.post_forward(finished_recving=set(), failed_recving=set())
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert pending is not None
    table = worker.block_table.tensor
    assert table is not None
    group = pending.finalize().checksums[key][0]
    return group, table.cpu(), worker.fingerprints[0], caches


def test_fused_entries_and_hit_checks_on_cuda_without_host_sync() -> None:
    """R140, issue 30: a step's prefix entries and its hit checks in one
    upload and one launch give on CUDA the values a CPU worker gives over the
    same bytes, the hit on blocks cached in that step reads their new
    entries (which untag to the check's sums: a verified hit), and the step
    does not sync with the host. Bugs caught: the check rows read without
    the padding row, or the entries taken from the check rows (either way the
    entries no longer untag to the check's sums, on both devices); a host
    sync in the fused path."""
    want, want_table, _, caches = cache_and_check(torch.device("cpu"), None)
    got, table, fingerprint, _ = cache_and_check(torch.device("cuda"), caches)
    np.testing.assert_array_equal(got.values, want.values)
    assert got.stored is not None and want.stored is not None
    np.testing.assert_array_equal(got.stored, want.stored)
    np.testing.assert_array_equal(table.numpy(), want_table.numpy())
    tags = block_checksum_tags(HASHES, fingerprint).view(np.uint64)
    sums = got.values.sum(axis=1, dtype=np.uint64)
    np.testing.assert_array_equal(got.stored ^ tags, sums)


def test_send_steps_on_cuda_behind_queued_work() -> None:
    """Issue 30, R55: send steps of changing widths, each queued behind a GPU
    sleep so the device lags the host (as with vLLM's async scheduling), and
    each record waited for only after the next step was queued. Every step
    reads back the CPU worker's values, and no step syncs with the host.
    Bugs caught: a step's upload or results reused or freed while the device
    still reads or writes them (a step's values overwritten by the next), a
    host sync in the step."""
    on_cpu, caches = worker_on(torch.device("cpu"), None)
    on_cuda, _ = worker_on(torch.device("cuda"), caches)
    widths = [np.arange(1, 11), BLOCK_IDS[:1], BLOCK_IDS, np.arange(2, 15), [5]]

    def send_step(worker: KVChecksumWorker, ids: object, req_id: str):
        block_ids = np.asarray(ids, dtype=np.int64)
        blocks = KVChecksumBlocks(16 * len(block_ids), {0: (0, block_ids)})
        worker.bind(KVChecksumScheduled(reqs_to_send={req_id: blocks}))
        return worker.post_forward(finished_recving=set(), failed_recving=set())

    waiting: list[tuple[str, KVChecksumPendingRecord, KVChecksumRecord]] = []
    for i, ids in enumerate(widths * 3):
        req_id = f"r{i}"
        want = send_step(on_cpu, ids, req_id).finalize()
        torch.cuda._sleep(20_000_000)  # the device lags the host
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = send_step(on_cuda, ids, req_id)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        waiting.append((req_id, pending, want))
        if len(waiting) == 2:  # the last step's record, read one step late
            last_id, last, last_want = waiting.pop(0)
            np.testing.assert_array_equal(
                last.finalize().checksums[last_id][0].values,
                last_want.checksums[last_id][0].values,
            )
    for req_id, pending, want in waiting:
        np.testing.assert_array_equal(
            pending.finalize().checksums[req_id][0].values,
            want.checksums[req_id][0].values,
        )


def test_entry_writes_and_moves_on_cuda() -> None:
    """R117, R118: the entry writes and moves on CUDA tensors against the
    independent reference. Bugs: a column or a tag left out, the slot copy
    writing the table's old entry, a gather written at the source index."""
    check_entry_kernels(EntryKernels(), "cuda", seed=3)


def test_entry_writes_and_moves_queue_without_host_sync() -> None:
    """R55: a write with its slot copy and a move queue behind a GPU sleep with
    torch's sync debug mode on, and their results match the same calls made
    without the debug mode. Bug: an operation that reads a count from the
    device or copies an index array to the host."""
    kernels = EntryKernels()
    reference = EntryKernels()
    rng = np.random.default_rng(5)
    sums = torch.from_numpy(rng.integers(-(1 << 62), 1 << 62, (40, 2))).cuda()
    tags = torch.from_numpy(rng.integers(-(1 << 62), 1 << 62, 40)).cuda()
    ids = torch.from_numpy(rng.permutation(100)[:40].astype(np.int64)).cuda()
    slots = torch.from_numpy(rng.permutation(60)[:40].astype(np.int64)).cuda()
    results = []
    for each in (kernels, reference, kernels):
        table = torch.zeros(100, dtype=torch.int64, device="cuda")
        dest = torch.zeros(60, dtype=torch.int64, device="cuda")
        back = torch.zeros(40, dtype=torch.int64, device="cuda")
        torch.cuda._sleep(20_000_000)
        if each is kernels:
            torch.cuda.set_sync_debug_mode("error")
        try:
            each.write(sums.clone(), tags, ids, table, slots, dest)
            each.move(dest, slots, back)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((table.cpu(), dest.cpu(), back.cpu()))
    for got, want in zip(results[::2], [results[1]] * 2):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
