# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Invalid-block recovery on vLLM 0.33.0's Scheduler (R140, R147).

The in-tree series gives the Scheduler `recover_invalid_blocks`,
`restart_request` and `evict_cached_blocks_from`; prefix-hit verification
(engine/prefix_hit_checks.py) calls them on the Scheduler there. vLLM 0.33.0
has none of them: `SchedulerRecovery` is the same three methods over the
Scheduler's internals, wrapped around one scheduler. Nothing is installed on
vLLM's classes; the object is built when a check fails.

Internals used (target; why; how; the upstream change that lets it go):

Scheduler._preempt_request(drop_stale_output=True), running,
prev_step_scheduled_req_ids
    Why: a running request on a bad block starts over, and the output of its
    steps still in flight (async scheduling) must not reach the client
    How: as vLLM's reset_prefix_cache preempts: out of `running`, preempted
    with `drop_stale_output`, out of `prev_step_scheduled_req_ids`
    Upstream: `Scheduler.restart_request` (series commit "[Core] Recover
    every holder of an invalid block, dropping in-flight output")
Scheduler._handle_failed_recving, kv_holding_waiting
    Why: a request waiting for its remote KV may hold a bad block: its load
    fails so that it is recomputed once the load ends
    How: vLLM's own failed-load recovery for the request
    Upstream: as above (`restart_request`, `recover_invalid_blocks`)
"""

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from vllm.v1.request import RequestStatus


class SchedulerRecovery:
    """The series' invalid-block recovery methods for one vLLM 0.33.0
    Scheduler (`InvalidBlockRecovery` of engine/prefix_hit_checks.py)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    @property
    def requests(self) -> Mapping[str, Any]:
        return self.scheduler.requests

    @property
    def recompute_kv_load_failures(self) -> bool:
        return self.scheduler.recompute_kv_load_failures

    @property
    def kv_cache_manager(self) -> Any:
        return self.scheduler.kv_cache_manager

    def evict_cached_blocks_from(
        self, request: Any, start: int, kv_cache_group_id: int = 0
    ) -> None:
        """Every block cached under the request's block hashes from its block
        `start` on leaves the prefix cache (vLLM's `evict_blocks`)."""
        from vllm.v1.core.kv_cache_utils import (
            make_block_hash_with_group_id,
            resolve_block_hashes,
        )

        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        group = scheduler.kv_cache_config.kv_cache_groups[kv_cache_group_id]
        block_hashes = resolve_block_hashes(
            request.block_hashes,
            manager.block_pool.hash_block_size,
            group.kv_cache_spec.block_size,
        )
        cached = manager.block_pool.cached_block_hash_to_block
        evicted: set[int] = set()
        for position in range(start, len(block_hashes)):
            key = make_block_hash_with_group_id(
                block_hashes[position], kv_cache_group_id
            )
            while (block := cached.get_one_block(key)) is not None:
                if block.block_id in evicted:
                    break  # vLLM kept it: never loop on it
                evicted.add(block.block_id)
                manager.evict_blocks({block.block_id})

    def restart_request(self, request: Any) -> bool:
        """A running request is preempted with its in-flight output dropped;
        one waiting for its remote KV has its load failed (recomputed once
        the load ends). False for a request holding no blocks."""
        scheduler = self.scheduler
        if request.status == RequestStatus.RUNNING:
            scheduler.running.remove(request)
            scheduler._preempt_request(
                request, time.monotonic(), drop_stale_output=True
            )
            # Resumed in the next step as if not scheduled in this one (V1 runner).
            scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
            return True
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # vLLM's own failed-load recovery (it restarts the request only
            # under "recompute", the one policy that restarts).
            scheduler._handle_failed_recving({request.request_id})
            return True
        return False

    def recover_invalid_blocks(
        self,
        invalid_block_ids: set[int],
        kv_cache_group_id: int = 0,
        restart: bool = True,
    ) -> list[Any]:
        """Every request holding one of the blocks (running, or waiting for its
        remote KV) has its cached blocks from its first invalid one on evicted
        and, with `restart`, starts over. Returns the holders."""
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        waiting = [
            request
            for request in scheduler.kv_holding_waiting
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]
        invalid = np.fromiter(invalid_block_ids, dtype=np.int64)
        holders: list[tuple[Any, int]] = []
        for request in [*scheduler.running, *waiting]:
            block_ids = manager.get_block_ids(request.request_id)[kv_cache_group_id]
            bad = np.flatnonzero(np.isin(np.asarray(block_ids, np.int64), invalid))
            if bad.size:
                holders.append((request, int(bad[0])))
        for request, first in holders:
            self.evict_cached_blocks_from(request, first, kv_cache_group_id)
        if restart:
            for request, _ in holders:
                self.restart_request(request)
        return [request for request, _ in holders]


def recovery_of(scheduler: Any) -> Any:
    """The scheduler's invalid-block recovery: its own methods where vLLM has
    them (the in-tree series), the stand-in on vLLM 0.33.0."""
    if hasattr(type(scheduler), "recover_invalid_blocks"):
        return scheduler
    return SchedulerRecovery(scheduler)
