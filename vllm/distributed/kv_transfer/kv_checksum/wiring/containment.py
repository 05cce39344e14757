# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on the KV cache coordinator for containment (R138); the logic is in
engine/containment.py.

Hooks (target; why; how; the upstream change that lets it go):

KV cache coordinator cache_blocks, free, pop_blocks_for_free (instance, set up with
  the checksum scheduler)
    Why: a failed load must not serve others through the prefix cache
    How: the series' `KVCacheManager.stop_caching` emulated (the request's
      `max_cacheable_tokens`, cache_blocks capped at it); released on free
    Upstream: `KVCacheManager.stop_caching` (series 0009), set by
      `attach_containment` from vLLM's Scheduler (series 0010)
"""

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.engine.containment import (
    MARK_ATTR,
    attach_containment,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    KVChecksumScheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring.offloading import (
    _offload_children,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["NO_CONTAINMENT_ENV"]

# Test deployments of the plugin only: "1" keeps checksums (and fault
# injection) on but leaves containment unattached, so a driver can show what a
# bad load does without it. vLLM with the series has no such switch.
NO_CONTAINMENT_ENV = "KV_CHECKSUM_TEST_NO_CONTAINMENT"


def _attach_containment(scheduler: Any, kcs: KVChecksumScheduler) -> None:
    """R138. Target: the KV cache coordinator instance's cache_blocks, free and
    pop_blocks_for_free, on each engine with checksums and prefix caching on
    (attached by the Scheduler.__init__ hook once it built the checksum
    scheduler: no second wrapper around a vLLM method).

    Why: a load that failed verification must not serve another request
    through the prefix cache or an offload tier, in either mode; vLLM caches
    a loaded request's blocks when it promotes the request
    (`_update_waiting_for_remote_kv`) and every later block as the request
    computes it (`allocate_slots`, `update_from_output`), all through
    `KVCacheCoordinator.cache_blocks`.
    How: the call the series' Scheduler makes, `attach_containment`, with a
    stand-in for the series' `KVCacheManager.stop_caching(request, tokens)`:
    the request's `max_cacheable_tokens` is set (the lowest mark kept), its
    blocks cached from the one holding that token on are evicted with vLLM's
    own `KVCacheManager.evict_blocks`, and while any request is marked
    cache_blocks is capped at the mark (R142: not wrapped otherwise); free and
    pop_blocks_for_free drop the mark of an unfinished request (a recomputed
    or resumed request computes its KV anew), a finished one keeps it for the
    offload tier's last stores. The CPU offload tier reads the same mark in
    its `prepare_store` filter (wiring/offloading.py) and drops the copies a
    contained request already stored (`OffloadSchedulerSide.on_contained`).
    Checksums off: no checksum scheduler is built, so nothing is set or
    wrapped. Errors are logged and never reach vLLM.
    Upstream: series 0009 (`KVCacheManager.stop_caching`) and 0010.
    """
    if os.environ.get(NO_CONTAINMENT_ENV) == "1":
        logger.warning(
            "KV checksum containment is OFF (%s=1): blocks of failed loads "
            "stay in the prefix cache. Test deployments only.",
            NO_CONTAINMENT_ENV,
        )
        return
    try:
        _contain_failed_loads(scheduler, kcs)
    except Exception:
        logger.exception("KV checksum containment could not be set up.")


def _contain_failed_loads(scheduler: Any, kcs: Any) -> None:
    manager = scheduler.kv_cache_manager
    if not manager.enable_caching:
        return  # no prefix cache: nothing can spread
    coordinator = manager.coordinator
    original_cache_blocks = coordinator.cache_blocks
    original_free = coordinator.free
    original_pop = coordinator.pop_blocks_for_free
    marked: set[str] = set()  # requests holding a mark set here

    def cache_blocks(request: Any, num_computed_tokens: int) -> None:
        limit = getattr(request, MARK_ATTR, None)
        if limit is not None:
            num_computed_tokens = min(num_computed_tokens, limit)
        original_cache_blocks(request, num_computed_tokens)

    def watch() -> None:
        """R142: cache_blocks is wrapped only while a request is marked, so
        steps without one pay nothing per request."""
        coordinator.cache_blocks = cache_blocks if marked else original_cache_blocks

    def stop_caching(request: Any, num_tokens: int) -> None:
        """vLLM 0.33.0's stand-in for the series' KVCacheManager.stop_caching."""
        limit = getattr(request, MARK_ATTR, None)
        limit = max(0, num_tokens if limit is None else min(limit, num_tokens))
        setattr(request, MARK_ATTR, limit)
        marked.add(request.request_id)
        watch()
        block_ids = {
            block.block_id
            for block_size, blocks in zip(
                coordinator.group_block_sizes,
                coordinator.get_blocks(request.request_id),
            )
            for block in blocks[limit // block_size :]
            if block.block_hash is not None and not block.is_null
        }
        if block_ids:
            manager.evict_blocks(block_ids)

    containment = attach_containment(
        kcs, scheduler.kv_cache_config, scheduler.requests, stop_caching
    )
    if containment is None:
        return  # turned off for a test deployment

    def release(request_id: str) -> None:
        marked.discard(request_id)
        request = scheduler.requests.get(request_id)
        if request is not None and not request.is_finished():
            setattr(request, MARK_ATTR, None)
        watch()

    def free(request_id: str) -> None:
        original_free(request_id)
        if request_id in marked:
            release(request_id)

    def pop_blocks_for_free(request_id: str) -> Any:
        blocks = original_pop(request_id)
        if request_id in marked:
            release(request_id)
        return blocks

    for child in _offload_children(scheduler.connector):
        side = child.__dict__.get("_kv_checksum_offload")
        if side is not None:  # R138: no store from the mark on, copies dropped
            side.quarantine = _mark_start(child.connector_scheduler, side)
            kcs.contained_listeners.append(side.on_contained)
    coordinator.free = free
    coordinator.pop_blocks_for_free = pop_blocks_for_free
    scheduler.kv_checksum_containment = containment
    kcs.tracked_sources.append(lambda: list(marked))  # R141


def _mark_start(sched: Any, side: Any) -> Any:
    """request id -> group -> first position the offload tier must not store,
    from the mark on the request the connector tracks (vLLM 0.33.0's
    `_req_status`; a finished request keeps its mark until its last stores)."""

    def start(req_id: str) -> dict[int, int] | None:
        status = sched._req_status.get(req_id)
        limit = None if status is None else getattr(status.req, MARK_ATTR, None)
        if limit is None:
            return None
        return {g: limit // size for g, size in side.block_sizes.items()}

    return start
