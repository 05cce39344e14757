# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LMCacheConnectorV1 (PyPI `lmcache` 0.5.6) with checksums on, on CPU (R147).

Both sides are real: vLLM 0.33.0's Scheduler and LMCacheConnectorV1 (scheduler
and worker roles, in one process), LMCache's engine, its lookup client and
server (ZMQ IPC) and its local CPU backend. One piece is replaced: LMCache has
no CPU copier for vLLM's paged KV (`CreateGPUConnector` raises "No supported
cpu connector found." and its CUDA copier asserts a CUDA device), so
`CpuPagedCopier` copies between vLLM's per-layer views and LMCache's chunks
with torch indexing. vLLM's process groups are not started: the three calls
LMCache makes into them (TP group broadcasts, TP rank, last PP rank) get
single-rank answers.

The checksum side is the package's own: the Scheduler carries its hooks
(`enable_kv_checksum` and `kv_checksum_verify_external_loads` on, policy
"recompute", fail-open) and `kv_checksum_pd.SimEngine` runs one real
`KVChecksumWorker` over the same CPU KV views LMCache's worker side copies to
and from; each step's "forward" writes a deterministic KV per token and
position between LMCache's `start_load_kv` and its `wait_for_save`.

A prefix goes the way an engine sends it: request A computes it and LMCache's
`wait_for_save` stores it; the GPU prefix cache is reset (as an eviction
would); request B with the same prefix loads it back through
`get_num_new_matched_tokens`, `update_state_after_alloc` and `start_load_kv`.
The independent reference is the KV itself: the bytes A computed, the chunk
byte the test flips, and KV another instance computed (another salt).

Skipped when `lmcache` is not importable (it is not a test dependency).
"""

import dataclasses
import importlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip(
    "lmcache.integration.vllm.vllm_v1_adapter",
    reason="lmcache (PyPI 0.5.6) is not installed: LMCacheConnectorV1 needs it",
)

from tests.v1.kv_connector.unit.kv_checksum_helpers import (  # noqa: E402
    BLOCK_SIZE,
    cpu_cuda_streams,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    prefix_hit_verifier,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (  # noqa: E402
    SideConfig,
    SimEngine,
)
from vllm.distributed.kv_transfer.kv_checksum.config import (  # noqa: E402
    VERIFY_EXTERNAL_LOADS_KEY,
    read_flags,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (  # noqa: E402
    UnverifiedReason,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (  # noqa: E402
    LMCacheConnectorV1,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

pytestmark = pytest.mark.cpu

CHUNK = BLOCK_SIZE  # LMCache chunk = one vLLM block
NUM_CHUNKS = 4  # each test stores a prefix of four full chunks
LMCACHE_ENV = {
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_CHUNK_SIZE": str(CHUNK),
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05",  # GB
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
}
FORWARD_CONTEXT = SimpleNamespace(
    attn_metadata=object(), no_compile_layers={}, virtual_engine=0
)


def lmcache_module(name: str) -> ModuleType:
    return importlib.import_module(name)


def _copier_class() -> type:
    """`CpuPagedCopier`, built once LMCache's interface class is importable."""
    base = lmcache_module("lmcache.v1.gpu_connector").GPUConnectorInterface
    kv_2ltd = lmcache_module("lmcache.v1.memory_management").MemoryFormat.KV_2LTD

    class CpuPagedCopier(base):  # type: ignore[misc, valid-type]
        """Copies LMCache chunks ([2, layers, tokens, heads * head]) to and from
        vLLM 0.33.0's per-layer views ([blocks, heads, tokens, 2 * head]) by
        slot, on CPU."""

        def __init__(self, metadata: Any) -> None:
            self.num_layers, _, _, self.num_heads, self.head = metadata.kv_shape
            self.kvcaches = None

        def _copy(self, obj: Any, start: int, end: int, kw: Any, load: bool) -> None:
            slots = kw["slot_mapping"][start:end].long()
            chunk = obj.tensor
            for index, layer in enumerate(kw["kvcaches"]):
                block, offset = slots // layer.shape[2], slots % layer.shape[2]
                for kv in range(2):
                    page = layer[..., kv * self.head : (kv + 1) * self.head]
                    rows = chunk[kv, index, : end - start]
                    if load:
                        page[block, :, offset, :] = rows.view(
                            -1, self.num_heads, self.head
                        )
                    else:
                        rows.copy_(page[block, :, offset, :].flatten(1))
            if not load:
                obj.metadata.fmt = kv_2ltd

        def to_gpu(self, obj: Any, start: int, end: int, **kw: Any) -> None:
            self._copy(obj, start, end, kw, load=True)

        def from_gpu(self, obj: Any, start: int, end: int, **kw: Any) -> None:
            self._copy(obj, start, end, kw, load=False)

        def batched_to_gpu(
            self, objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any
        ) -> None:
            for obj, start, end in zip(objs, starts, ends):
                self.to_gpu(obj, start, end, **kw)

        def batched_from_gpu(
            self, objs: Any, starts: Any, ends: Any, **kw: Any
        ) -> None:
            for obj, start, end in zip(objs, starts, ends):
                self.from_gpu(obj, start, end, **kw)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size(
                [2, self.num_layers, num_tokens, self.num_heads * self.head]
            )

    return CpuPagedCopier


class LMCacheEngine(SimEngine):
    """One engine: vLLM's Scheduler with the package's hooks and
    LMCacheConnectorV1's scheduler side, one checksum worker over CPU KV
    views and LMCacheConnectorV1's worker side over the same views. Each
    step's forward runs LMCache's `start_load_kv` before the KV writes and
    its `wait_for_save` after them, as vLLM's model runner does."""

    def __init__(self, model_dir: str) -> None:
        side = SideConfig(
            num_blocks=64,
            policy="recompute",
            connector="LMCacheConnectorV1",
            connector_extra={VERIFY_EXTERNAL_LOADS_KEY: True},
        )
        super().__init__(model_dir, side, "lmcache")
        self.vllm_config.cache_config.kv_cache_layout = side.layout.name
        (worker,) = self.workers
        self.kv_caches = worker.caches
        self.connector = LMCacheConnectorV1(
            self.vllm_config, KVConnectorRole.WORKER, self.scheduler.kv_cache_config
        )
        try:
            self.connector.register_kv_caches(self.kv_caches)
            # As create_kv_checksum_worker does on a real worker (the
            # simulated engine builds its worker directly).
            flags = read_flags(self.vllm_config.kv_transfer_config)
            worker.checksum.enable_external_entries(flags.external_entry_limit)
        except BaseException:
            self.stop()  # else the storage manager's thread keeps pytest alive
            raise
        self.before_writes = self._load
        self.after_writes = self._save
        # Pages of each new request's first NUM_CHUNKS blocks right after
        # LMCache's load, per step (before any check or recovery).
        self.after_load: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.verdicts: list[Any] = []
        if self.checksums is None:  # the package did not attach: tests fail
            return
        record = self.checksums.stats.record_external_load

        def keep(verdict: Any) -> None:
            self.verdicts.append(verdict)
            record(verdict)

        self.checksums.stats.record_external_load = keep

    def stop(self) -> None:
        """Stops LMCache's one non-daemon thread, its storage manager's loop."""
        manager = self.store.storage_manager
        manager.loop.call_soon_threadsafe(manager.loop.stop)
        manager.thread.join(timeout=10)

    @property
    def store(self) -> Any:
        """LMCache's engine on the worker side."""
        return self.connector._lmcache_engine.lmcache_engine

    def _load(self, output: SchedulerOutput) -> None:
        meta = output.kv_connector_metadata
        assert meta is not None
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(FORWARD_CONTEXT)  # type: ignore[arg-type]
        for new in output.scheduled_new_reqs:
            blocks = list(new.block_ids[0][:NUM_CHUNKS])
            pages = self.page_bytes(blocks)
            self.after_load.setdefault(new.req_id, []).append(pages)

    def _save(self, output: SchedulerOutput) -> None:
        self.connector.wait_for_save()
        self.connector.clear_connector_metadata()

    def blocks_of(self, req_id: str) -> list[int]:
        """The blocks `req_id` was first scheduled on."""
        for output in self.history:
            for new in output.scheduled_new_reqs:
                if new.req_id == req_id:
                    return list(new.block_ids[0])
        raise AssertionError(f"{req_id} was never scheduled")

    def page_bytes(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        return {
            name: view[block_ids].view(torch.int16).clone()
            for name, view in self.kv_caches.items()
        }

    def new_verdicts(self, since: int) -> list[str]:
        return [v.status.value for v in self.verdicts[since:]]


@pytest.fixture(scope="module")
def lmcache_engine(model_dir: str) -> Iterator[LMCacheEngine]:
    """One engine for the module: LMCache's shutdown cannot run in a process
    holding both sides (its lookup client terminates the process's shared
    ZMQ context, which waits for the worker's sockets; the worker's servers
    close sockets another thread is blocked on). Its threads are daemons but
    one: the storage manager's event loop, stopped here."""
    with pytest.MonkeyPatch.context() as monkeypatch, cpu_cuda_streams(monkeypatch):
        engine = _build_engine(model_dir, monkeypatch)
        try:
            yield engine
        finally:
            engine.stop()


def _build_engine(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> LMCacheEngine:
    for key, value in LMCACHE_ENV.items():
        monkeypatch.setenv(key, value)
    # LMCache reads its config once per process.
    monkeypatch.setattr(
        lmcache_module("lmcache.integration.vllm.utils"), "_config_instance", None
    )
    copier = _copier_class()
    monkeypatch.setattr(
        lmcache_module("lmcache.v1.gpu_connector"),
        "CreateGPUConnector",
        lambda config, metadata, engine, layout_hints=None: copier(metadata),
    )
    parallel_state = importlib.import_module("vllm.distributed.parallel_state")
    single_rank = SimpleNamespace(
        broadcast=lambda tensor, src: tensor,
        broadcast_object=lambda obj, src: obj,
        is_last_rank=True,
    )
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: single_rank)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(
        lmcache_module("lmcache.integration.vllm.vllm_v1_adapter"),
        "get_pp_group",
        lambda: single_rank,
    )
    return LMCacheEngine(model_dir)


def prefix(first: int) -> list[int]:
    """A prompt prefix of NUM_CHUNKS chunks (tests use distinct ones: the
    engine and LMCache's store are shared by the module)."""
    return list(range(first, first + NUM_CHUNKS * CHUNK))


def run(engine: LMCacheEngine, req_id: str, tokens: list[int]) -> Any:
    engine.add(make_request(req_id, tokens, max_tokens=1))
    return engine.run(req_id)


def store_and_evict(engine: LMCacheEngine, tokens: list[int]) -> dict[str, Any]:
    """Request A computes `tokens` and LMCache stores them; the GPU prefix
    cache is reset and the KV views zeroed. Returns A's pages as computed."""
    req_id = f"a{tokens[0]}"
    run(engine, req_id, tokens + [3, 4])
    computed = engine.page_bytes(engine.blocks_of(req_id)[:NUM_CHUNKS])
    assert engine.scheduler.reset_prefix_cache()
    for view in engine.kv_caches.values():
        view.zero_()
    return computed


def test_external_loads_flag_attaches_checksums(
    lmcache_engine: LMCacheEngine, model_dir: str
) -> None:
    """R147, R15: LMCacheConnectorV1 carries no checksums; with
    `kv_checksum_verify_external_loads` the package attaches anyway (its
    scheduler, the external-load state, the wrap of LMCache's
    update_state_after_alloc); with `enable_kv_checksum` alone it stays off
    and LMCache runs unwrapped.

    Catches: the external flag ignored, either by the checksum scheduler's
    set-up (no external-load state: every load goes unchecked) or by the
    carrier check in config.py (the package stays off for LMCache);
    `connector_declares_carrier` (config.py) answering True for a connector
    that overrides neither `kv_checksum_carrier` nor
    `get_kv_checksum_sources` (the flag-less scheduler would attach and claim
    loads it cannot verify)."""
    scheduler = lmcache_engine.scheduler
    assert scheduler.kv_checksum_scheduler is not None
    verifier = prefix_hit_verifier(scheduler)
    assert verifier is not None and verifier.external is not None
    assert scheduler.connector is not None
    assert "update_state_after_alloc" in vars(scheduler.connector)

    # A second scheduler (LMCache's scheduler side only) without the flag.
    config = make_vllm_config(
        model_dir,
        kv_connector="LMCacheConnectorV1",
        extra_config={"enable_kv_checksum": True},
        kv_cache_layout=KVCacheLayout.LBHNC,
    )
    plain = make_scheduler(config, make_kv_cache_config(config))
    assert getattr(plain, "kv_checksum_scheduler", None) is None
    assert plain.connector is not None
    assert "update_state_after_alloc" not in vars(plain.connector)


def test_stored_prefix_is_reported_as_external_tokens(
    lmcache_engine: LMCacheEngine,
) -> None:
    """R147 groundwork: what LMCacheConnectorV1 tells the scheduler about a
    prefix it stored (what the external-load verification hooks): the
    tokens of its full chunks, a load spec the worker acts on, and the
    source "external_unspecified" (it names no tier).

    Catches: a prefix the store did not index (LMCache's lookup would find
    fewer tokens): re-introduced as request A finishing before its step's
    `wait_for_save` (no store), the lookup answers 0."""
    engine = lmcache_engine
    tokens = prefix(1000)
    store_and_evict(engine, tokens)
    # LMCache's own index holds the four chunks (reference: what was stored).
    assert engine.store.lookup(torch.tensor(tokens)) == len(tokens)

    request = make_request("b1000", tokens + [7, 8, 9, 10, 11], max_tokens=1)
    connector = engine.scheduler.connector
    assert connector is not None
    assert connector.get_num_new_matched_tokens(request, 0) == (len(tokens), False)
    # A prompt differing in its first token shares no chunk.
    other = make_request("c1000", [999] + tokens[1:] + [7], max_tokens=1)
    assert connector.get_num_new_matched_tokens(other, 0) == (0, False)

    engine.add(request)
    out = engine.step()
    # The prefix comes from LMCache; only the 5 new tokens are computed.
    assert out.num_scheduled_tokens == {request.request_id: 5}
    meta: Any = out.kv_connector_metadata  # LMCache's LMCacheConnectorMetadata
    (spec,) = [r.load_spec for r in meta.requests]
    assert (spec.vllm_cached_tokens, spec.lmcache_cached_tokens) == (0, len(tokens))
    assert spec.can_load
    # LMCacheConnectorV1 names no tier: its hits are "external_unspecified".
    assert connector.get_external_cache_hit_sources(request, len(tokens)) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: len(tokens)
    }
    assert request.is_finished()


def test_clean_load_verified(lmcache_engine: LMCacheEngine) -> None:
    """R147: a prefix this engine computed, stored through LMCache, evicted
    from the GPU prefix cache and loaded back by LMCacheConnectorV1's worker
    side lands byte for byte in B's blocks and is verified (one external
    load verdict "verified"); B runs on it.

    Catches: the external flag ignored by `attach` (no verdict at all); the
    entry table not kept (`KVChecksumExternalLoads.keep` adding nothing:
    unverified, no_entry); the check's block start or hashes shifted by one
    block in `KVChecksumExternalLoads.check` (unverified); a copier
    stand-in writing loads one slot off (B's bytes differ from A's, and the
    verdict is a mismatch)."""
    engine = lmcache_engine
    tokens = prefix(2000)
    computed = store_and_evict(engine, tokens)
    since = len(engine.verdicts)
    verified = engine.checksums.stats.external_loads.get("verified", 0)
    final = run(engine, "b2000", tokens + [7, 8, 9])
    loaded = engine.after_load["b2000"][0]
    for name, pages in computed.items():
        assert torch.equal(loaded[name], pages), name
    assert engine.new_verdicts(since) == ["verified"]
    assert engine.checksums.stats.external_loads["verified"] == verified + 1
    assert engine.scheduled_tokens("b2000") == 3  # ran on the loaded prefix
    assert final.finish_reason is not None


def test_corrupted_chunk_is_a_mismatch_at_its_block(
    lmcache_engine: LMCacheEngine,
) -> None:
    """R147, R95: a byte flipped in a chunk in LMCache's local CPU backend is
    loaded into B's blocks with no load error from LMCache; the verification
    finds a mismatch at exactly that chunk's block (position 1), the block
    leaves the prefix cache and B is recomputed ("recompute").

    Catches: the external flag ignored by `attach` or the entry table not kept
    (no mismatch); the check's block start or hashes shifted by one block
    (unverified); the mismatched block positions off by one in
    `verify_offloaded_load` (offload/entries.py: reported at 2, block 2
    leaves the cache, the corrupted block 1 stays and the retry runs on it
    as a local hit, "verified"); a corruption that misses the stored copy
    (B's pages would equal the computed ones)."""
    engine = lmcache_engine
    tokens = prefix(3000)
    computed = store_and_evict(engine, tokens)
    backend = engine.store.storage_manager.storage_backends["LocalCPUBackend"]
    chunks = list(backend.hot_cache.values())[-NUM_CHUNKS:]  # this test's store
    chunks[1].tensor.view(torch.uint8).view(-1)[0] ^= 0x01  # chunk 1, layer 0 K
    since = len(engine.verdicts)
    quarantined = engine.checksums.stats.quarantined_blocks

    prompt = tokens + [7, 8, 9]
    final = run(engine, "b3000", prompt)
    loaded = engine.after_load["b3000"][0]
    differ = {
        name: [i for i in range(NUM_CHUNKS) if not torch.equal(pages[i], ref[i])]
        for name, (pages, ref) in ((n, (loaded[n], computed[n])) for n in computed)
    }
    layers = list(differ)
    assert differ[layers[0]] == [1], differ
    assert all(not differ[name] for name in layers[1:]), differ
    assert engine.connector.get_block_ids_with_load_errors() == set()

    # Loaded and caught twice (the restart reads the cache again), then
    # computed without reading any cache, as for ExampleConnector.
    assert engine.new_verdicts(since) == ["mismatch", "mismatch"]
    for verdict in engine.verdicts[since:]:
        assert verdict.mismatches == {0: [1]}
    assert engine.checksums.stats.quarantined_blocks > quarantined
    scheduled = [o.num_scheduled_tokens.get("b3000") for o in engine.history]
    assert [n for n in scheduled if n] == [3, 3, len(prompt)]
    assert final.finish_reason is not None


def test_prefix_of_another_instance_is_unverified(
    lmcache_engine: LMCacheEngine,
) -> None:
    """R147, R94: a prefix another instance computed and stored in LMCache
    (this engine recorded no entry of it) is loaded, unverified with the
    reason no_entry and, fail-open, B runs on it.

    Catches: a load with no entry judged from its empty comparison
    (`PendingExternalLoad.judge` without its nothing-checked branch: another
    reason than no_entry); an unverified load failed under fail-open
    (`bad_positions` ignoring `fail_closed`: B loaded again and recomputed);
    the external flag ignored by `attach` (no verdict)."""
    engine = lmcache_engine
    tokens = prefix(4000)
    # "Another instance": its KV (another salt) written into spare blocks and
    # stored through LMCache's engine as its wait_for_save stores it.
    blocks = list(range(engine.side.num_blocks - NUM_CHUNKS, engine.side.num_blocks))
    positions = np.arange(len(tokens))
    side = engine.side
    engine.side = dataclasses.replace(side, kv_salt=7)
    try:
        engine.write_tokens([blocks], np.asarray(tokens), positions)
    finally:
        engine.side = side
    written = engine.page_bytes(blocks)
    slots = torch.tensor([blocks[p // CHUNK] * CHUNK + p % CHUNK for p in positions])
    engine.store.store(
        torch.tensor(tokens),
        mask=torch.ones(len(tokens), dtype=torch.bool),
        kvcaches=list(engine.kv_caches.values()),
        slot_mapping=slots,
        offset=0,
    )
    assert engine.store.lookup(torch.tensor(tokens)) == len(tokens)
    for view in engine.kv_caches.values():
        view.zero_()
    since = len(engine.verdicts)

    final = run(engine, "b4000", tokens + [7, 8, 9])
    loaded = engine.after_load["b4000"][0]
    for name, pages in written.items():
        assert torch.equal(loaded[name], pages), name
    assert engine.new_verdicts(since)[:1] == ["unverified"]
    reasons = [reason for reason, _ in engine.verdicts[since].reasons]
    assert reasons == [UnverifiedReason.NO_ENTRY]
    # Fail-open: B ran on the load (one verdict, 3 tokens computed).
    assert engine.new_verdicts(since) == ["unverified"]
    assert engine.scheduled_tokens("b4000") == 3
    assert final.finish_reason is not None
