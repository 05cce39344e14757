# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on SimpleCPUOffloadConnector (R116-R121, R139); the logic is in
offload/simple_cpu_offload.py.

Hooks (target; why; how; the upstream change that lets it go):

SimpleCPUOffloadConnector (class methods)
    Why: declare `host` as a checked source, drop bad CPU blocks, build the entry
    table (CPU backend only)
    How: answer only when the instance holds checksum state
    Upstream: the connector implementing the offloaded-KV API
SimpleCPUOffloadConnector.build_connector_meta
    Why: workers need the stored blocks' places
    How: after the original, runs from the stored GPU blocks' cache keys
    Upstream: the metadata carrying each stored block's place
SimpleCPUOffloadConnector.wait_for_save
    Why: entries go to their CPU slots before the store event; while the
    step's copies are held, queued for the step's checksum pass instead (one
    upload a step, issue 30)
    How: before the original
    Upstream: the worker moving a per-block payload
SimpleCPUOffloadConnector.start_load_kv
    Why: entries come back before the load copy; host faults first (R131);
    while the step's copies are held, the move is queued for the step's
    checksum pass (one upload a step, issue 30)
    How: before the original; "after the forward" read from the scheduler
    output V2 passes and the config (no drafter forward still to come)
    Upstream: as above, with the worker told where in the step it is
DmaCopyBackend.launch_copy (instance, CPU backend)
    Why: vLLM's copy thread keeps the CUDA driver busy for milliseconds a
    batch, and every device call the engine thread makes meanwhile waits;
    the step's checksum work (stores, load checks) runs after the hand-offs
    (issue 30)
    How: `HeldCalls` on the instance: from a start_load_kv called after the
    forward until the end of ActiveKVConnector.post_forward (wiring/worker.py
    releases them in a `finally`), the hand-offs are kept, then made in order
    Upstream: a connector hook run before the step's copies are handed off
SimpleCPUOffloadScheduler internals (read)
    Why: stored blocks' keys, a failed load's CPU blocks; drop via `evict_blocks`
    How: reads only
    Upstream: a public view of the loads and a "drop copy" call
"""

from collections.abc import Callable
from operator import attrgetter
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.offload import (
    simple_cpu_offload as simple_offload,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.held_calls import HeldCalls
from vllm.distributed.kv_transfer.kv_checksum.offload.offloading import EntriesWrittenFn
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    _guard,
    _wrap,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring.offloading import (
    _disable_offload_worker,
    loads_after_forward,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def install_simple_offload_connector() -> None:
    """R139. Target: SimpleCPUOffloadConnector (the API methods), its
    build_connector_meta, start_load_kv and wait_for_save.

    Why: it copies GPU blocks to CPU blocks and back as flat block lists per
    event (no request attached to a store; in lazy mode, cached blocks near
    eviction); each block's checksum entry must travel with it, and its loads
    from host memory must be declared so they are verified (R117-R121).
    How: class methods for the API; thin wrappers that call the original and
    pass through unless the instance holds checksum state, which only
    `_attach_simple_offload_schedulers` (Scheduler.__init__ hook, checksums
    on) and `register_kv_checksum_worker` (worker, checksums on) create. The
    store runs, read from the stored GPU blocks' cache keys after the
    original built the metadata, ride on it; entries move before the original
    submits a load event (start_load_kv) or a store event (wait_for_save).
    After the forward, the events' hand-offs to vLLM's copy thread wait
    until the step's checksum work is queued (`_hold_copy_hand_offs`).
    Upstream: SimpleCPUOffloadConnector moving an opaque per-block payload
    with each block, and declaring its host source.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
        SimpleCPUOffloadConnector,
    )

    def get_kv_checksum_sources(self: Any, request: Any) -> set[str]:
        side = self.__dict__.get("_kv_checksum_simple_offload")
        return set() if side is None else side.sources(request)

    def on_kv_checksum_failure(
        self: Any, request: Any, mismatches: dict[int, list[int]]
    ) -> None:
        side = self.__dict__.get("_kv_checksum_simple_offload")
        if side is not None:
            side.on_failure(request, mismatches)

    def register_kv_checksum_worker(self: Any, worker: Any) -> None:
        _attach_simple_offload_worker(self, worker)

    connector = SimpleCPUOffloadConnector
    connector.get_kv_checksum_sources = get_kv_checksum_sources  # type: ignore[attr-defined]
    connector.on_kv_checksum_failure = on_kv_checksum_failure  # type: ignore[attr-defined]
    connector.register_kv_checksum_worker = register_kv_checksum_worker  # type: ignore[attr-defined]

    @_wrap(connector, "build_connector_meta")
    def build_connector_meta(original: Callable, self: Any, *args: Any) -> Any:
        """R118: the runs of the stored blocks go to the workers."""
        side = self.__dict__.get("_kv_checksum_simple_offload")
        if side is None:
            return original(self, *args)
        meta = original(self, *args)
        with _guard(self, "_kv_checksum_simple_offload", "build_connector_meta"):
            side.attach(meta)
        return meta

    @_wrap(connector, "start_load_kv")
    def start_load_kv(original: Callable, self: Any, *args: Any, **kw: Any) -> Any:
        """R118, R131: host faults (if configured), then the loads' entries
        (after the forward: the copy hand-offs held, issue 30)."""
        side = self.__dict__.get("_kv_checksum_simple_offload_worker")
        if side is not None:
            after = loads_after_forward(getattr(self, "_vllm_config", None), kw)
            held = self.__dict__.get("_kv_checksum_held_copies")
            if after and held is not None:
                held.hold()  # released at the end of post_forward (issue 30)
            with _guard(
                self,
                "_kv_checksum_simple_offload_worker",
                "load",
                _disable_offload_worker,
            ):
                side.start_loads(self._connector_metadata, _moves_in_pass(held))
        return original(self, *args, **kw)

    @_wrap(connector, "wait_for_save")
    def wait_for_save(original: Callable, self: Any) -> Any:
        """R118: the stored blocks' entries, into their CPU blocks' slots."""
        side = self.__dict__.get("_kv_checksum_simple_offload_worker")
        if side is not None:
            held = self.__dict__.get("_kv_checksum_held_copies")
            with _guard(
                self,
                "_kv_checksum_simple_offload_worker",
                "store",
                _disable_offload_worker,
            ):
                side.save_stores(self._connector_metadata, _moves_in_pass(held))
        return original(self)


def _moves_in_pass(held: HeldCalls | None) -> bool:
    """Whether the step's entry moves wait for its checksum pass: only while
    its copy hand-offs are held, which the ActiveKVConnector.post_forward
    hook releases after that pass (and after making whatever the pass did
    not, `flush_queued_entries`)."""
    return held is not None and held.holding


def _simple_offload_children(connector: Any) -> list[Any]:
    """The SimpleCPUOffloadConnectors of a connector (itself, or
    MultiConnector's)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
        SimpleCPUOffloadConnector,
    )

    children = getattr(connector, "_connectors", None) or [connector]
    return [c for c in children if isinstance(c, SimpleCPUOffloadConnector)]


def _attach_simple_offload_schedulers(
    connector: Any, entries_written: EntriesWrittenFn | None = None
) -> None:
    """With checksums on only (Scheduler.__init__ hook): checksum state on
    each SimpleCPUOffloadConnector with a CPU (not disk) backend (R119).
    `entries_written(groups, block_ids)`: which GPU blocks' entries the
    workers already hold (prefix-hit verification's, R140), so their stores
    copy them instead of checksumming the blocks again."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    for child in _simple_offload_children(connector):
        manager = child.scheduler_manager
        if manager is None:  # prefix caching off: vLLM offloads nothing
            continue
        if child._cache_hit_source != CacheHitSource.HOST:
            logger.warning(
                "KV checksums: SimpleCPUOffloadConnector's disk backend is not "
                "covered; its loads are not checked."
            )
            continue
        child._kv_checksum_simple_offload = _simple_offload_scheduler_side(
            manager, entries_written
        )


# (cache key, prefix tokens covered) of a vLLM 0.33.0 KVCacheBlock: the
# fields its `block_hash` and `block_hash_num_tokens` properties return, read
# in C (no property frame a block: 0.7 of the time, issue 30).
_block_key = attrgetter("_block_hash", "_block_hash_num_tokens")


def block_keys(pool: Any, ids: Any) -> list[tuple[Any, Any]]:
    """The (cache key, covered tokens) of blocks `ids` of a vLLM BlockPool,
    in order, without a Python loop per block (R142); read from the fields
    (vLLM with the in-tree series reads the properties)."""
    return simple_offload.block_keys(pool, ids, _block_key)


def _simple_offload_scheduler_side(
    manager: Any, entries_written: EntriesWrittenFn | None = None
) -> Any:
    """The scheduler-side state over vLLM 0.33.0's SimpleCPUOffloadScheduler
    internals: the GPU block pool it stores from (`_gpu_block_pool`, bound by
    the Scheduler), the CPU blocks of a request's pending load
    (`_reqs_to_load`, `_abandoned_reqs_to_load` after a reset) and, to drop
    a bad copy, the CPU block pool's own `evict_blocks` (hashes out of the
    prefix cache now; the block is freed when its load releases it).
    Upstream: a public view of the manager's loads and of the stored blocks'
    places, and a "drop copy" call."""

    def load_blocks(req_id: str) -> Any:
        state = manager._reqs_to_load.get(req_id)
        if state is None:
            state = manager._abandoned_reqs_to_load.get(req_id)
        return None if state is None else state.transfer_meta.cpu_block_ids

    def try_remove(cpu_id: int) -> bool | None:
        pool = manager.cpu_block_pool
        if pool.blocks[cpu_id].block_hash is None:
            return None
        pool.evict_blocks({cpu_id})
        return True

    return simple_offload.SimpleOffloadSchedulerSide(
        manager.group_block_sizes,
        lambda ids: block_keys(manager._gpu_block_pool, ids),
        lambda ids: block_keys(manager.cpu_block_pool, ids),
        load_blocks,
        try_remove,
        entries_written,
    )


def _attach_simple_offload_worker(connector: Any, worker: Any) -> None:
    """With checksums on only: the host entry table (and host fault
    injector, R131) of a SimpleCPUOffloadConnector worker with CPU tensors
    (the disk backend has none and is not covered) (R117)."""
    handler = connector.worker_handler
    if handler is None or not handler.cpu_kv_caches:
        return
    # As vLLM with the in-tree series builds it (register_kv_checksum_worker).
    connector._kv_checksum_simple_offload_worker = simple_offload.worker_side_of(
        worker, handler, connector._vllm_config
    )
    _hold_copy_hand_offs(connector, handler)


def _hold_copy_hand_offs(connector: Any, handler: Any) -> None:
    """With checksums on only: vLLM 0.33.0's DMA copy backend
    (`handler._backend`, its `launch_copy` puts a batch on its copy thread's
    queue) gets a `HeldCalls` on the instance, which start_load_kv holds and
    the ActiveKVConnector.post_forward hook releases (issue 30); it holds
    only once that hook's __init__ armed it (nothing else releases it)."""
    from vllm.v1.simple_kv_offload.copy_backend import DmaCopyBackend

    backend = getattr(handler, "_backend", None)
    if not isinstance(backend, DmaCopyBackend):
        return
    held = HeldCalls(backend.launch_copy)
    backend.launch_copy = held  # type: ignore[method-assign]
    connector._kv_checksum_held_copies = held


def held_copies(connector: Any) -> tuple[HeldCalls, ...]:
    """The held copy hand-offs of a connector's SimpleCPUOffloadConnectors
    (itself, or MultiConnector's); empty with checksums off."""
    found = (
        c.__dict__.get("_kv_checksum_held_copies")
        for c in _simple_offload_children(connector)
    )
    return tuple(h for h in found if h is not None)
