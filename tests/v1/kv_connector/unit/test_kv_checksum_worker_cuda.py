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

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumRecord,
    KVChecksumScheduled,
    block_checksum_tags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
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
