# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on the KV cache coordinator for containment (R138); the logic is in
engine/containment.py.

Hooks (target; why; how; the upstream change that lets it go):

KV cache coordinator cache_blocks, free, pop_blocks_for_free (instance, set up with
  the checksum scheduler)
    Why: a failed load must not serve others through the prefix cache
    How: evict quarantined blocks right after vLLM caches them; release on free
    Upstream: a "do not cache" mark on a request's blocks from a position on
"""

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    KVChecksumScheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring.offloading import (
    _offload_children,
    _quarantine_offload_copies,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


# Test deployments only: "1" keeps checksums (and fault injection) on but turns
# containment off, so a driver can show what a bad load does without it.
NO_CONTAINMENT_ENV = "KV_CHECKSUM_TEST_NO_CONTAINMENT"


def _attach_containment(scheduler: Any, kcs: KVChecksumScheduler) -> None:
    """R138. Target: the KV cache coordinator instance's cache_blocks, free and
    pop_blocks_for_free, on each engine with checksums and prefix caching on
    (attached by the Scheduler.__init__ hook once it built the checksum
    scheduler: no second wrapper around a vLLM method).

    Why: a load that failed verification must not serve another request
    through the prefix cache, in either mode; vLLM caches a loaded request's
    blocks when it promotes the request (`_update_waiting_for_remote_kv`) and
    every later block as the request computes it (`allocate_slots`,
    `update_from_output`), all through `KVCacheCoordinator.cache_blocks`.
    How: the checksum scheduler's `on_failed_load` hands every failed load to
    `KVChecksumContainment`, which records from which position each group is
    quarantined; blocks already cached there are evicted at once. After each
    original cache_blocks of a quarantined request, the newly cached blocks at
    quarantined positions are evicted with vLLM's own
    `KVCacheManager.evict_blocks` (BlockPool.evict_blocks, the call vLLM's
    `_handle_invalid_blocks` uses), before any other request's lookup; free and
    pop_blocks_for_free release the request (a recomputed or resumed request
    computes its KV anew). Fail-closed failures still go through vLLM's
    `_handle_failed_recving` (R4); their blocks are never cached by vLLM
    0.33.0 before being freed, and are evicted should they be. Checksums off:
    no checksum scheduler is built, so nothing is set or wrapped. Errors are
    logged and never reach vLLM.
    Upstream: a "do not cache" mark on a request's blocks from a position on
    (honoured by cache_full_blocks), set by the load-failure path.
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
    from vllm.distributed.kv_transfer.kv_checksum.engine.containment import (
        KVChecksumContainment,
    )

    manager = scheduler.kv_cache_manager
    if not manager.enable_caching:
        return  # no prefix cache: nothing can spread
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = scheduler.kv_cache_config.kv_cache_groups
    containment = KVChecksumContainment(
        {g: group.kv_cache_spec.block_size for g, group in enumerate(groups)},
        kcs.fail_closed,
        kcs.stats,
        state_groups=[
            g
            for g, group in enumerate(groups)
            if isinstance(group.kv_cache_spec, MambaSpec)
        ],
    )
    coordinator = manager.coordinator

    def evict(req_id: str) -> None:
        """Evict the hashes of the request's cached blocks at quarantined
        positions (vLLM's evict_blocks; blocks stay with the request)."""
        try:
            start = containment.start(req_id)
            if not start:
                return
            tables = coordinator.get_blocks(req_id)
            cached = {
                block.block_id
                for g, q in start.items()
                if g < len(tables)
                for block in tables[g][q:]
                if block.block_hash is not None and not block.is_null
            }
            if cached:
                manager.evict_blocks(cached)
        except Exception:
            logger.exception("KV checksum containment failed for request %s", req_id)

    def on_failed_load(req_id: str, verdict: Any, blocks: Any) -> None:
        try:
            start = containment.on_failed_load(req_id, verdict, blocks)
            if start:
                watch(True)
                evict(req_id)
                _quarantine_offload_copies(scheduler.connector, req_id, start)
        except Exception:
            logger.exception("KV checksum containment failed for request %s", req_id)

    original_cache_blocks = coordinator.cache_blocks
    original_free = coordinator.free
    original_pop = coordinator.pop_blocks_for_free

    def cache_blocks(request: Any, num_computed_tokens: int) -> None:
        original_cache_blocks(request, num_computed_tokens)
        if containment and request.request_id in containment:
            evict(request.request_id)

    def watch(quarantined: bool) -> None:
        """R142: cache_blocks is wrapped only while a request is quarantined,
        so steps without one pay nothing per request."""
        coordinator.cache_blocks = (
            cache_blocks if quarantined else original_cache_blocks
        )

    def free(request_id: str) -> None:
        original_free(request_id)
        if containment:
            containment.release(request_id)
            watch(bool(containment))

    def pop_blocks_for_free(request_id: str) -> Any:
        blocks = original_pop(request_id)
        if containment:
            containment.release(request_id)
            watch(bool(containment))
        return blocks

    for child in _offload_children(scheduler.connector):
        side = child.__dict__.get("_kv_checksum_offload")
        if side is not None:  # R138: no store from a quarantine start on
            side.quarantine = containment.start
    coordinator.free = free
    coordinator.pop_blocks_for_free = pop_blocks_for_free
    scheduler.kv_checksum_containment = containment
    kcs.on_failed_load = on_failed_load
    kcs.tracked_sources.append(containment.request_ids)  # R141
