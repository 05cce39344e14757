# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks of external-load verification (R147); the logic is in
engine/external_loads.py.

With checksums or `kv_checksum_verify_external_loads` off nothing is attached
and vLLM runs unchanged. It wraps no vLLM method of its own: it is called from
the package's scheduler hooks (wiring/scheduler.py: the starting loads its
connector wrapper notes, `_update_after_schedule`), from the prefix-hit
verification it shares the entries, checks and recovery of
(wiring/prefix_cache.py: its block-pool wrappers record the entries, its
`verify` compares and recovers) and from the worker hook
(wiring/worker.py: one line). It stops, and drops its state, with prefix-hit
verification (R134, R141).

Hooks (target; why; how; the upstream change that lets it go):

connector update_state_after_alloc (through the scheduler hook's wrapper)
    Why: the one call that sees every load start, sync or async, with the
    request's blocks and external token count
    How: `note_loads` takes the loads that no P/D receive or offload load
    registered (R119) and remembers their full blocks
    Upstream: the Scheduler reporting load starts with their sources
Scheduler._update_after_schedule (through the package's hook)
    Why: a load is checked in the step its request first runs on the loaded
    blocks (a sync load's own step; an async load's first step after
    WAITING_FOR_REMOTE_KVS); the step's new entries join the table
    How: `schedule` registers each check with the prefix-hit checker, takes
    the checked blocks out of the step's entry writes and moves their
    entries from the slots into the block table first; after the prefix-hit
    step is built, the entries it writes get slots (copied after the writes)
    Upstream: a verification hook on external-cache hits
Scheduler.update_from_output (through wiring/prefix_cache.py's `verify`)
    Why: a bad external load is handled as a bad prefix hit: output of the
    step dropped, blocks evicted, request restarted or failed per
    kv_load_failure_policy
    How: engine/external_loads.py's `judge` logs and counts the verdict like
    a load's and returns the blocks the request must not run on
    Upstream: as for prefix hits
"""

from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.config import read_flags
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.external_loads import (
    DEVICE_BYTES_PER_ENTRY,
    HOST_BYTES_PER_ENTRY,
    KVChecksumExternalLoads,
    judge_external,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import prefix_cache
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

logger = init_logger(__name__)

_STATE_ATTR = "_kv_checksum_external_loads"


class _SchedulerState:
    """One scheduler's external loads and the entry count last reported."""

    def __init__(self, loads: KVChecksumExternalLoads) -> None:
        self.loads = loads
        self.entries_sent: int | None = None
        # Block ids of the loads checked this step.
        self.checked: list[np.ndarray] = []


def verify_external_loads(vllm_config: Any) -> bool:
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    return read_flags(kv_transfer_config).verify_external_loads


def attach(scheduler: Any, kcs: Any) -> None:
    """R147. Called by the Scheduler.__init__ hook after prefix-hit
    verification attached (its entries are the ones kept here): nothing is
    attached with the flag off or when the prefix-hit side is off."""
    try:
        flags = read_flags(scheduler.vllm_config.kv_transfer_config)
        verifier = kcs.prefix_hits
        if not flags.verify_external_loads or verifier is None:
            return
        verifier.judge_external = judge_external
        hits = verifier.hits
        limit = flags.external_entry_limit
        loads = KVChecksumExternalLoads(
            limit, hits.group_id, hits.block_size, hits.hash_block_size
        )
        scheduler.__dict__[_STATE_ATTR] = _SchedulerState(loads)
        kcs.tracked_sources.append(loads.request_ids)  # R141
        logger.info(
            "KV checksums verify external-cache loads against up to %d entries "
            "(%.1f MiB on each worker's device, about %.0f MiB here).",
            limit,
            limit * DEVICE_BYTES_PER_ENTRY / 2**20,
            limit * HOST_BYTES_PER_ENTRY / 2**20,
        )
    except Exception:
        logger.exception("KV checksums: external-load verification is off.")


def enable_worker(worker: Any, vllm_config: Any) -> None:
    """R147. Called by the ActiveKVConnector.__init__ hook: the worker keeps
    entries in slots for external loads. An error is left to that hook's
    guard, which turns this worker's checksums off and tells the scheduler
    (R134): a worker without slots, checking what the scheduler asks, would
    report false mismatches."""
    flags = read_flags(vllm_config.kv_transfer_config)
    if flags.verify_external_loads:
        worker.enable_external_entries(flags.external_entry_limit)


def _live_state(scheduler: Any) -> _SchedulerState | None:
    """The state while verification runs; released once prefix-hit
    verification (whose checks and entries it uses) stopped."""
    state = scheduler.__dict__.get(_STATE_ATTR)
    if state is not None and prefix_cache.live_state(scheduler) is None:
        _release(scheduler)
        return None
    return state


def _release(scheduler: Any) -> None:
    state = scheduler.__dict__.get(_STATE_ATTR)
    scheduler.__dict__[_STATE_ATTR] = None
    if state is not None:
        state.loads.release()


def _turn_off(scheduler: Any, where: str) -> None:
    """Last-resort guard (R134): log once; external-load and prefix-hit
    verification off, since a check this step registered may lack the entry
    moves it needs (no verdict is better than a false one)."""
    logger.exception(
        "KV checksum external-load and prefix-hit verification turned off "
        "after an error in %s; vLLM goes on without them.",
        where,
    )
    _release(scheduler)
    prefix_cache._release(scheduler)


def note_loads(scheduler: Any, starting: list, output: Any) -> None:
    """R147. Called by the _update_after_schedule hook after the P/D and
    offload paths registered this step's starting loads: each one they left
    is an external load, checked when its request runs on it."""
    state = _live_state(scheduler) if starting else None
    if state is None:
        return
    try:
        consumer = scheduler.kv_checksum_scheduler.consumer
        scheduled = output.num_scheduled_tokens
        manager = scheduler.kv_cache_manager
        for request, _, num_external in starting:
            req_id = request.request_id
            if consumer.pending(req_id) is not None:
                continue  # a P/D receive or an offload load checks it (R119)
            local = (
                request.num_computed_tokens - scheduled.get(req_id, 0) - num_external
            )
            block_ids = manager.get_block_ids(req_id)[state.loads.group_id]
            state.loads.note(request, block_ids, local, num_external)
    except Exception:
        _turn_off(scheduler, "noting loads")


def schedule(scheduler: Any, output: Any) -> None:
    """R147. Called by the _update_after_schedule hook in place of
    `prefix_cache.schedule`, which it calls: external loads whose requests
    run this step become checks, and this step's new entries get slots."""
    state = _live_state(scheduler)
    if state is not None:
        try:
            restore = _add_checks(scheduler, state, output)
        except Exception:
            _turn_off(scheduler, "scheduling")
            state, restore = None, None
    prefix_cache.schedule(scheduler, output)
    if state is None or _live_state(scheduler) is None:
        return
    try:
        _keep_entries(scheduler, state, output, restore)
    except Exception:
        _turn_off(scheduler, "keeping entries")


def _add_checks(scheduler: Any, state: _SchedulerState, output: Any) -> Any:
    """Checks of the loads whose requests run this step; returns the
    (block ids, slots) whose entries come back before the checks read them."""
    loads = state.loads
    if not loads.loads:
        return None
    hits = prefix_cache.live_state(scheduler).hits  # type: ignore[union-attr]
    manager = scheduler.kv_cache_manager
    requests = scheduler.requests
    restores: list[tuple[np.ndarray, np.ndarray]] = []
    for req_id, load in list(loads.loads.items()):
        request = load.request
        if requests.get(req_id) is not request or request.is_finished():
            del loads.loads[req_id]  # R141: freed or aborted before its check
            continue
        if request.status != RequestStatus.RUNNING:
            continue  # still loading, or not scheduled yet
        del loads.loads[req_id]
        ids = np.asarray(manager.get_block_ids(req_id)[loads.group_id], np.int64)
        scheduled = output.num_scheduled_tokens.get(req_id, 0)
        computed = request.num_computed_tokens - scheduled
        checked = loads.check(load, ids[load.start :], computed)
        if checked is None:
            logger.debug(
                "KV checksums: external load of request %s not checked: the "
                "request no longer holds the loaded blocks.",
                req_id,
            )
            continue
        pending, restore = checked
        state.checked.append(load.block_ids)
        hits.add_check(pending, check=bool(restore[0].size))
        if restore[0].size:
            hits.skip_saves(restore[0])
            restores.append(restore)
    if not restores:
        return None
    return (
        np.concatenate([ids for ids, _ in restores]),
        np.concatenate([slots for _, slots in restores]),
    )


def _keep_entries(
    scheduler: Any, state: _SchedulerState, output: Any, restore: Any
) -> None:
    """The step's entry writes of computed blocks get slots, copied after the
    writes; the restores join the step's checksum metadata; the entry count
    is reported when it changed."""
    meta = output.kv_checksum_scheduled
    saves = [] if meta is None else meta.blocks_to_save
    checked, state.checked = state.checked, []
    if not saves and restore is None:
        return  # most steps (R142)
    # Blocks of loads, checked this step or not yet: their entries were
    # taken from loaded KV, not computed here.
    loaded = np.concatenate([state.loads.loaded_ids(), *checked])
    ids, slots = state.loads.keep(saves, loaded)
    if restore is not None or ids.size:
        if meta is None:
            meta = output.kv_checksum_scheduled = KVChecksumScheduled()
        meta.entries_to_restore = restore
        meta.entries_to_keep = (ids, slots) if ids.size else None
    count = state.loads.table.count
    if count != state.entries_sent:
        scheduler.kv_checksum_scheduler.stats.external_entries = count
        state.entries_sent = count
