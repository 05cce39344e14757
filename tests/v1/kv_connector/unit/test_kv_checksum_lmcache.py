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

A prefix goes the way an engine sends it: request A computes it and LMCache's
`wait_for_save` stores it; the GPU prefix cache is reset (as an eviction
would); request B with the same prefix loads it back through
`get_num_new_matched_tokens`, `update_state_after_alloc` and `start_load_kv`.

Skipped when `lmcache` is not importable (it is not a test dependency).
"""

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip(
    "lmcache.integration.vllm.vllm_v1_adapter",
    reason="lmcache (PyPI 0.5.6) is not installed: LMCacheConnectorV1 needs it",
)

from tests.v1.kv_connector.unit.kv_checksum_helpers import (  # noqa: E402
    BLOCK_SIZE,
    make_kv_cache_config,
    make_kv_caches,
    make_model_runner_output,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from vllm.distributed.kv_transfer.kv_checksum import plugin  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (  # noqa: E402
    LMCacheConnectorV1,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

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


@dataclass
class LMCacheEngine:
    """One engine's two LMCacheConnectorV1 sides and its KV cache views."""

    scheduler: Scheduler
    worker: LMCacheConnectorV1
    kv_caches: dict[str, torch.Tensor]

    @property
    def store(self) -> Any:
        """LMCache's engine on the worker side."""
        return self.worker._lmcache_engine.lmcache_engine

    def step(self) -> SchedulerOutput:
        """schedule(), the worker's load and save around the forward, update."""
        return self.finish_step(self.scheduler.schedule())

    def finish_step(self, out: SchedulerOutput) -> SchedulerOutput:
        """The worker's load and save around the forward of `out`, update."""
        meta = out.kv_connector_metadata
        assert meta is not None
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(FORWARD_CONTEXT)  # type: ignore[arg-type]
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        runner = make_model_runner_output(out, scheduler=self.scheduler)
        self.scheduler.update_from_output(out, runner)
        return out

    def run(self, request: Request) -> list[int]:
        """Run `request` (max_tokens 1) to its end; its block ids."""
        self.scheduler.add_request(request)
        out = self.step()
        assert request.is_finished()
        return list(out.scheduled_new_reqs[0].block_ids[0])

    def page_bytes(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        return {
            name: view[block_ids].view(torch.int16).clone()
            for name, view in self.kv_caches.items()
        }


@pytest.fixture(scope="module")
def lmcache_engine(model_dir: str) -> Iterator[LMCacheEngine]:
    """One engine for the module: LMCache's shutdown cannot run in a process
    holding both sides (its lookup client terminates the process's shared
    ZMQ context, which waits for the worker's sockets; the worker's servers
    close sockets another thread is blocked on). Its threads are daemons but
    one: the storage manager's event loop, stopped here."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        engine = _build_engine(model_dir, monkeypatch)
        try:
            yield engine
        finally:
            manager = engine.store.storage_manager
            manager.loop.call_soon_threadsafe(manager.loop.stop)
            manager.thread.join(timeout=10)


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
    plugin.register()
    # TODO(R147): add "kv_checksum_verify_external_loads": True once the
    # external-load verification lands, and assert its verdicts below.
    vllm_config = make_vllm_config(
        model_dir,
        kv_connector="LMCacheConnectorV1",
        extra_config={"enable_kv_checksum": True},
        kv_cache_layout=KVCacheLayout.LBHNC,
    )
    kv_cache_config = make_kv_cache_config(vllm_config)
    worker = LMCacheConnectorV1(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    kv_caches = make_kv_caches(kv_cache_config, KVCacheLayout.LBHNC)
    worker.register_kv_caches(kv_caches)
    scheduler = make_scheduler(vllm_config, kv_cache_config)
    return LMCacheEngine(scheduler, worker, kv_caches)


def prefix(first: int) -> list[int]:
    """A prompt prefix of NUM_CHUNKS chunks (tests use distinct ones: the
    engine and LMCache's store are shared by the module)."""
    return list(range(first, first + NUM_CHUNKS * CHUNK))


def store_and_evict(engine: LMCacheEngine, tokens: list[int]) -> dict[str, Any]:
    """Request A computes `tokens` and LMCache stores them; the GPU prefix
    cache is reset and the KV views zeroed. Returns A's pages as computed."""
    blocks = engine.run(make_request(f"a{tokens[0]}", tokens + [3, 4], max_tokens=1))
    computed = engine.page_bytes(blocks[:NUM_CHUNKS])
    assert engine.scheduler.reset_prefix_cache()
    for view in engine.kv_caches.values():
        view.zero_()
    return computed


def test_checksums_stay_off_without_a_carrier(
    lmcache_engine: LMCacheEngine,
) -> None:
    """R15: LMCacheConnectorV1 carries no checksums, so `enable_kv_checksum`
    alone (fail-open) leaves the package off for this engine and LMCache runs
    unwrapped. TODO(R147): with `kv_checksum_verify_external_loads` the
    package attaches; build a second engine with it and assert it does.

    Catches: `connector_declares_carrier` (config.py) answering True for a
    connector that overrides neither `kv_checksum_carrier` nor
    `get_kv_checksum_sources` (the package would attach, wrap LMCache's
    update_state_after_alloc and claim loads it cannot verify)."""
    scheduler = lmcache_engine.scheduler
    assert getattr(scheduler, "kv_checksum_scheduler", None) is None
    assert scheduler.connector is not None
    assert "update_state_after_alloc" not in vars(scheduler.connector)


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

    engine.scheduler.add_request(request)
    out = engine.scheduler.schedule()
    # The prefix comes from LMCache; only the 5 new tokens are computed.
    assert out.num_scheduled_tokens == {request.request_id: 5}
    assert request.num_computed_tokens == len(tokens) + 5
    meta: Any = out.kv_connector_metadata  # LMCache's LMCacheConnectorMetadata
    (spec,) = [r.load_spec for r in meta.requests]
    assert (spec.vllm_cached_tokens, spec.lmcache_cached_tokens) == (0, len(tokens))
    assert spec.can_load
    # LMCacheConnectorV1 names no tier: its hits are "external_unspecified".
    assert connector.get_external_cache_hit_sources(request, len(tokens)) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: len(tokens)
    }
    engine.finish_step(out)
    assert request.is_finished()


def test_loaded_prefix_equals_the_computed_one(lmcache_engine: LMCacheEngine) -> None:
    """R147 groundwork: a prefix stored by this engine and loaded back by
    LMCacheConnectorV1's worker side lands byte for byte in B's blocks (the
    baseline the external-load verdict "verified" will rest on).

    Catches: a copier stand-in writing loads one slot off (the bytes of B's
    blocks would differ from A's; the verdict tests would then test it)."""
    engine = lmcache_engine
    tokens = prefix(2000)
    computed = store_and_evict(engine, tokens)
    blocks = engine.run(make_request("b2000", tokens + [7, 8, 9], max_tokens=1))
    loaded = engine.page_bytes(blocks[:NUM_CHUNKS])
    for name, pages in computed.items():
        assert torch.equal(loaded[name], pages), name
    # TODO(R147): with kv_checksum_verify_external_loads, this load is
    # verified: vllm:kv_checksum_external_loads_total{verdict="verified"} +1.


def test_corrupted_chunk_is_loaded_without_any_error(
    lmcache_engine: LMCacheEngine,
) -> None:
    """R147 groundwork: a byte flipped in a chunk in LMCache's local CPU backend
    is loaded into B's blocks and LMCache reports no load error: only the
    external-load verification can catch it.

    Catches: a corruption that misses the stored copy (B's pages would equal
    the computed ones and the TODO's mismatch would be vacuous)."""
    engine = lmcache_engine
    tokens = prefix(3000)
    computed = store_and_evict(engine, tokens)
    backend = engine.store.storage_manager.storage_backends["LocalCPUBackend"]
    chunks = list(backend.hot_cache.values())[-NUM_CHUNKS:]  # this test's store
    chunks[1].tensor.view(torch.uint8).view(-1)[0] ^= 0x01  # chunk 1, layer 0 K

    blocks = engine.run(make_request("b3000", tokens + [7, 8, 9], max_tokens=1))
    loaded = engine.page_bytes(blocks[:NUM_CHUNKS])
    differ = {
        name: [i for i in range(NUM_CHUNKS) if not torch.equal(pages[i], ref[i])]
        for name, (pages, ref) in ((n, (loaded[n], computed[n])) for n in computed)
    }
    layers = list(differ)
    assert differ[layers[0]] == [1], differ
    assert all(not differ[name] for name in layers[1:]), differ
    assert engine.worker.get_block_ids_with_load_errors() == set()
    # TODO(R147): with kv_checksum_verify_external_loads, assert the verdict
    # "mismatch" at block position 1 and the request recomputed (fail-open).
