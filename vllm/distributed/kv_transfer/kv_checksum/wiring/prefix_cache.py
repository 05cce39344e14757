# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks of prefix-hit verification (R140); the logic is in engine/prefix_hits.py.

With checksums off, or both `kv_checksum_verify_prefix_hits` and
`kv_checksum_verify_external_loads` off, nothing is attached and vLLM runs
unchanged; with the external flag alone entries are recorded (for
wiring/external_loads.py) but hits are not looked up or checked. Called from
the package's scheduler and worker hooks (wiring/scheduler.py,
wiring/worker.py; one line each), so no vLLM method is wrapped twice.
Verification stops, and drops its state, with the engine's checksums (the
scheduler guard, a worker's disabled record: R134, R141).

Hooks (target; why; how; the upstream change that lets it go):

BlockPool cache_full_blocks, get_new_blocks, evict_blocks, reset_prefix_cache
  (instance, set up with the checksum scheduler)
    Why: an entry is recorded when vLLM caches a full block, dropped when it
    evicts the block (its two callers of `_maybe_evict_cached_block` that a
    single-group attention model reaches: allocation and eviction by id)
    How: after vLLM's own call, the calls of the series' block-pool listener
    on `PrefixHitEntryListener` (engine/prefix_hits.py): the blocks cached
    (positions, hashes), the blocks no key reaches any more, the reset; one
    frame per call (issue 30: not one per allocated block)
    Upstream: `BlockPool.set_listener` (series commit 0003), which also
    reports the keys 0.33.0 removes elsewhere (`cache_partial_block` with
    `replace_existing_hashes`, `move_block_hashes`)
KVCacheManager get_computed_blocks (instance)
    Why: the hit blocks of a request are checked before its output is used
    How: note the request's local hit length after vLLM's lookup
    Upstream: a per-request "local hit" field on SchedulerOutput
Scheduler update_after_schedule / update_from_output (through the package's hooks)
    Why: ask the workers to save entries and check hits; compare the results
    How: `schedule` fills the step's checksum metadata (one record key per
    check, so a restarted request's re-hit is judged apart from its first
    hit; the request's `num_preemptions` noted), `verify` compares each
    check with its own step's reports
    Upstream: a verification hook on prefix-cache hits
Scheduler state on a mismatch (through `verify`; a mismatch's path only)
    Why: no token computed over a bad hit reaches a client and no block
    computed over it stays cached, whatever vLLM did since the check's step
    How: every request holding a bad block (`running`, and in
    `kv_holding_waiting` those WAITING_FOR_REMOTE_KVS) has its blocks from
    the first bad one on evicted by their prefix-cache keys
    (`resolve_block_hashes`, `make_block_hash_with_group_id`,
    `cached_block_hash_to_block.get_one_block`, vLLM's `evict_blocks`);
    "recompute": running holders are preempted (vLLM's
    `_preempt_request(drop_stale_output=True)`, as its reset_prefix_cache
    does; the second time with the request's `skip_reading_prefix_cache`
    set), holders waiting for their remote KV fail their load (vLLM's
    `_handle_failed_recving`: freed and recomputed once the load ends);
    "fail": the blocks join `invalid_block_ids` and vLLM fails the holders.
    A checked request preempted since its check's step (by vLLM, KV cache
    full) holds no blocks: its in-flight output is dropped
    (`drop_stale_output` set while `num_stale_output_tokens` is non-zero;
    vLLM otherwise delivers it unless its connector requires KV delivery)
    and its blocks are evicted by key, as they are no longer in its block
    table
    Upstream: invalid-block recovery that evicts every dependent block of
    every holder, fails or restarts requests in any queue, and drops
    in-flight output under async scheduling
"""

import contextlib
import time
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.config import read_flags
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine import external_loads
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
    KVChecksumPrefixHits,
    PrefixHitEntryListener,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import finalize_records
from vllm.distributed.kv_transfer.kv_checksum.offload.offloading import EntriesWrittenFn
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumWorkerReport,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

logger = init_logger(__name__)

_STATE_ATTR = "_kv_checksum_prefix_hits"


class _SchedulerState:
    """One scheduler's prefix-hit checker and the hits noted this step."""

    def __init__(self, hits: KVChecksumPrefixHits) -> None:
        self.hits = hits
        self.noted: dict[str, int] = {}  # request id -> local hit tokens
        self.step_keys: dict[int, list[str]] = {}  # id(SchedulerOutput) -> keys
        self.restarted: set[str] = set()  # requests restarted after bad hits


def _verify_prefix_hits(vllm_config: Any) -> bool:
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    return read_flags(kv_transfer_config).verify_prefix_hits


def _records_entries(vllm_config: Any) -> bool:
    """Entries of cached blocks are recorded for prefix hits (R140) or for
    external loads (R147, wiring/external_loads.py)."""
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    flags = read_flags(kv_transfer_config)
    return flags.verify_prefix_hits or flags.verify_external_loads


def attach(scheduler: Any, kcs: Any) -> None:
    """R140. Called by the Scheduler.__init__ hook once it built the checksum
    scheduler `kcs`.

    Why: entries are recorded when vLLM caches blocks and dropped when it
    evicts them; hits are noted when vLLM looks them up.
    How: instance wrappers on the block pool and KV cache manager; nothing is
    attached with the flag off. An error leaves prefix-hit verification off.
    """
    try:
        if _records_entries(scheduler.vllm_config):
            attach_scheduler(scheduler, kcs)
    except Exception:
        _turn_off(scheduler, "setup")


def schedule(scheduler: Any, output: Any) -> None:
    """R140. Called by the Scheduler._update_after_schedule hook after it set
    `kv_checksum_scheduled`: hits of this step's scheduled requests become
    checks; the step's entries to save and checks join the SchedulerOutput."""
    state = _live_state(scheduler)
    if state is None:
        return
    try:
        _schedule_step(scheduler, state, output)
    except Exception:
        _turn_off(scheduler, "scheduling")


def verify(scheduler: Any, scheduler_output: Any, model_output: Any) -> None:
    """R140. Called by the Scheduler.update_from_output hook before vLLM's
    update_from_output: verify the step's checks; with policy "recompute" the
    requests on mismatched blocks restart (vLLM's preemption), with "fail" the
    blocks join `invalid_block_ids` and vLLM fails those requests."""
    state = _live_state(scheduler)
    if state is None:
        return
    try:
        _verify_step(scheduler, state, scheduler_output, model_output)
    except Exception:
        _turn_off(scheduler, "verification")


def entries_written_of(scheduler: Any) -> EntriesWrittenFn | None:
    """R140, issue 30. For the offload tiers' scheduler sides (Scheduler.__init__
    hook): `(groups, block_ids) -> mask` of the GPU blocks whose entries this
    scheduler's prefix-hit verification already had the workers write (all
    false once it turned off: a store then checksums its blocks itself);
    None with the flag off."""
    if not _records_entries(scheduler.vllm_config):
        return None

    def entries_written(groups: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
        state = _live_state(scheduler)
        if state is None:
            return np.zeros(block_ids.shape, dtype=bool)
        return state.hits.entries_written(groups, block_ids)

    return entries_written


def enable_worker(worker: Any, vllm_config: Any) -> None:
    """R140. Called by the ActiveKVConnector.__init__ hook with the checksum
    worker it created: the worker saves entries and checks hits."""
    try:
        if _records_entries(vllm_config):
            worker.enable_prefix_entries()
    except Exception:
        logger.exception("KV checksums: prefix-hit verification is off.")


def _turn_off(scheduler: Any, where: str) -> None:
    """Last-resort guard (R134): log once, prefix-hit verification off."""
    logger.exception(
        "KV checksum prefix-hit verification turned off after an error in %s; "
        "vLLM goes on without it.",
        where,
    )
    _release(scheduler)


def live_state(scheduler: Any) -> "_SchedulerState | None":
    """The prefix-hit state while verification runs (external-load
    verification shares it, R147); None once it is off."""
    return _live_state(scheduler)


def attached_state(scheduler: Any) -> "_SchedulerState | None":
    """The prefix-hit state `attach` set up, if any (R147: read while the
    Scheduler.__init__ hook still builds the checksum scheduler)."""
    return scheduler.__dict__.get(_STATE_ATTR)


def _live_state(scheduler: Any) -> "_SchedulerState | None":
    """The scheduler's prefix-hit state while verification runs; None once
    it is off. Verification stops with the engine's checksums (the scheduler
    guard cleared its checksum scheduler, or a worker's checksums are off,
    R134): nothing would take the step's saves and checks any more, so its
    state is released then (R141)."""
    state = scheduler.__dict__.get(_STATE_ATTR)
    if state is not None:
        kcs = scheduler.kv_checksum_scheduler
        if kcs is None or kcs.disabled_workers:
            logger.warning(
                "KV checksum prefix-hit verification stopped: checksums are "
                "off for this engine."
            )
            _release(scheduler)
            return None
    return state


def _release(scheduler: Any) -> None:
    """Prefix-hit verification off: every entry, check and note dropped."""
    state = scheduler.__dict__.get(_STATE_ATTR)
    scheduler.__dict__[_STATE_ATTR] = None
    if state is not None:
        state.hits.release()
        state.noted.clear()
        state.step_keys.clear()
        state.restarted.clear()


def attach_scheduler(scheduler: Any, kcs: Any) -> None:
    """Attach prefix-hit verification to one scheduler (R140)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    manager = scheduler.kv_cache_manager
    groups = scheduler.kv_cache_config.kv_cache_groups
    if not manager.enable_caching:
        return
    if len(groups) != 1 or isinstance(groups[0].kv_cache_spec, MambaSpec):
        logger.warning(
            "KV checksum prefix-hit verification needs one attention KV cache "
            "group (vLLM recomputes invalid blocks only then); it is off."
        )
        return
    if 0 not in kcs.groups:
        return
    pool = manager.block_pool
    hits = KVChecksumPrefixHits(
        pool.num_gpu_blocks,
        0,
        groups[0].kv_cache_spec.block_size,
        getattr(pool, "hash_block_size", None),
        kcs.num_workers,
    )
    state = _SchedulerState(hits)
    _hook_block_pool(scheduler, pool, hits)
    if _verify_prefix_hits(scheduler.vllm_config):  # not for external loads only
        _hook_hit_lookup(scheduler, manager, state)
    scheduler.__dict__[_STATE_ATTR] = state
    kcs.tracked_sources.append(lambda: _pending_request_ids(scheduler))  # R141


def _pending_request_ids(scheduler: Any) -> list[str]:
    """The requests whose prefix-hit checks wait for their step's reports."""
    state = scheduler.__dict__.get(_STATE_ATTR)
    if state is None:
        return []
    return state.hits.request_ids()


_block_id = attrgetter("block_id")
_block_hash = attrgetter("block_hash")


def _cached_blocks(
    blocks: list, num_cached_blocks: int, num_full_blocks: int
) -> tuple[list, list[int]]:
    """The blocks vLLM just cached in `cache_full_blocks` (those it gave a
    hash: not null, not masked) and their positions, read with C-level maps,
    not a Python loop per block (issue 30)."""
    new = blocks[num_cached_blocks:num_full_blocks]
    positions = list(range(num_cached_blocks, num_cached_blocks + len(new)))
    keys = list(map(_block_hash, new))
    if None in keys:  # null or masked blocks (sliding window): vLLM skipped them
        kept = [i for i, key in enumerate(keys) if key is not None]
        new = [new[i] for i in kept]
        positions = [positions[i] for i in kept]
    return new, positions


def _hook_block_pool(scheduler: Any, pool: Any, hits: KVChecksumPrefixHits) -> None:
    """Instance wrappers on the block pool making the calls of the in-tree
    series' block-pool listener (`PrefixHitEntryListener`) after vLLM's own:
    blocks cached, blocks that lost their keys, reset."""
    listener = PrefixHitEntryListener(
        hits,
        lambda: _live_state(scheduler) is not None,
        lambda where: _turn_off(scheduler, where),
    )
    cache_full_blocks = pool.cache_full_blocks
    get_new_blocks = pool.get_new_blocks
    evict_blocks = pool.evict_blocks
    reset = pool.reset_prefix_cache

    def cache_full_blocks_hook(
        request: Any,
        blocks: list,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        cache_full_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            *args,
            **kwargs,
        )
        try:
            new, positions = _cached_blocks(blocks, num_cached_blocks, num_full_blocks)
        except Exception:
            _turn_off(scheduler, "recording entries")
            return
        listener.on_blocks_cached(
            request, new, positions, kv_cache_group_id, block_size
        )

    def uncached(block_ids: Iterable[int]) -> None:
        """Those of the blocks with entries that no key reaches any more (a
        surviving key keeps its entry, R140 (c), so a reuse is caught)."""
        entry_keys = hits.entry_keys
        if not entry_keys:
            return
        try:
            contain = pool.cached_block_hash_to_block.contain
            gone = [
                block_id
                for block_id in block_ids
                if block_id in entry_keys
                and not contain(entry_keys[block_id], block_id)
            ]
        except Exception:
            _turn_off(scheduler, "dropping entries")
            return
        listener.on_blocks_uncached(gone)

    def get_new_blocks_hook(num_blocks: int, *args: Any, **kwargs: Any) -> list:
        blocks = get_new_blocks(num_blocks, *args, **kwargs)
        uncached(map(_block_id, blocks))
        return blocks

    def evict_blocks_hook(block_ids: set[int], *args: Any, **kwargs: Any) -> None:
        evict_blocks(block_ids, *args, **kwargs)
        uncached(block_ids)

    def reset_hook() -> bool:
        done = reset()
        if done:
            listener.on_prefix_cache_reset()
        return done

    pool.cache_full_blocks = cache_full_blocks_hook
    pool.get_new_blocks = get_new_blocks_hook
    pool.evict_blocks = evict_blocks_hook
    pool.reset_prefix_cache = reset_hook


def _hook_hit_lookup(scheduler: Any, manager: Any, state: _SchedulerState) -> None:
    """Instance wrapper noting each request's local prefix hit."""
    get_computed_blocks = manager.get_computed_blocks

    def get_computed_blocks_hook(request: Any, *args: Any, **kwargs: Any) -> Any:
        result = get_computed_blocks(request, *args, **kwargs)
        with contextlib.suppress(Exception):  # R134: never into vLLM
            if result[1] > 0 and _live_state(scheduler) is state:
                state.noted[request.request_id] = result[1]
        return result

    manager.get_computed_blocks = get_computed_blocks_hook


def _schedule_step(scheduler: Any, state: _SchedulerState, output: Any) -> None:
    """Hits of this step's scheduled requests become checks (R140)."""
    hits = state.hits
    noted, state.noted = state.noted, {}
    scheduled = output.num_scheduled_tokens
    for req_id, num_tokens in noted.items():
        if req_id not in scheduled:
            continue
        count = num_tokens // hits.block_size
        ids = scheduler.kv_cache_manager.get_block_ids(req_id)[0][:count]
        request = scheduler.requests[req_id]
        hits.add_hits(request, np.asarray(ids, dtype=np.int64), request.num_preemptions)
    step = hits.take_step()
    if step.keys:
        state.step_keys[id(output)] = step.keys
    if not (step.saves or step.checks):
        return
    meta = output.kv_checksum_scheduled or KVChecksumScheduled()
    meta.blocks_to_save.extend(step.saves)
    meta.reqs_to_check.update(step.checks)
    output.kv_checksum_scheduled = meta


def _verify_step(
    scheduler: Any, state: _SchedulerState, output: Any, model_output: Any
) -> None:
    """Verify the step's checks; the requests on mismatched blocks restart or
    fail, and every block computed over them leaves the prefix cache (R140,
    R138)."""
    if state.restarted:  # R141: nothing kept for requests vLLM dropped
        state.restarted.intersection_update(scheduler.requests)
    keys = state.step_keys.pop(id(output), None)
    if not keys:
        return
    kcs = scheduler.kv_checksum_scheduler
    hits = state.hits
    kv_output = model_output.kv_connector_output
    records = finalize_records(getattr(kv_output, "kv_checksums", None))
    for record in records:
        for key in keys:
            load = hits.pending.get(key)
            report = KVChecksumWorkerReport.from_record(record, key)
            if load is not None and report is not None:
                load.reports[(record.pp_rank, record.tp_rank)] = report
    invalid: set[int] = set()
    for key in keys:
        pending = hits.pending.get(key)
        if pending is None:
            continue
        request = pending.request
        req_id = request.request_id
        if scheduler.requests.get(req_id) is not request or request.is_finished():
            # R141: aborted since its step was scheduled; vLLM freed (or
            # frees) its blocks: no verdict, and nothing kept for it.
            hits.pending.pop(key, None)
            continue
        result = hits.verify(key)
        if result is None:
            continue
        load, verdict = result
        if external_loads.is_external(load):  # R147
            bad = external_loads.judge(kcs, req_id, load, verdict)
            if not bad:
                continue
        else:
            kcs.stats.record_prefix_hit(verdict)
            if verdict.status != KVChecksumStatus.MISMATCH:
                logger.debug(
                    "KV checksums of prefix-cache hit of request %s: %s %s",
                    req_id,
                    verdict.status.value,
                    verdict.reasons,
                )
                continue
            bad = hits.bad_blocks(load, verdict)
            logger.error(
                "KV checksum mismatch in prefix-cache hit of request %s: group "
                "%d block positions %s (block ids %s); the blocks leave the "
                "prefix cache and the request is recomputed from its first bad "
                "block.",
                req_id,
                hits.group_id,
                [position for position, _ in bad],
                [block_id for _, block_id in bad],
            )
        if request.num_preemptions == load.attempt:
            # Still on the checked blocks: they are its own (never freed since)
            # and, through the holders below, its later blocks leave the cache.
            if kcs.on_failed_load is not None:  # R138 containment
                kcs.on_failed_load(req_id, verdict, load.blocks)
            invalid.update(block_id for _, block_id in bad)
        else:
            invalid |= _recover_preempted(scheduler, hits, request, bad)
    if invalid:
        _recover_holders(scheduler, state, invalid, kv_output)


def _recover_preempted(
    scheduler: Any, hits: KVChecksumPrefixHits, request: Any, bad: list[tuple[int, int]]
) -> set[int]:
    """A bad hit of a request preempted since its check's step (by vLLM, or
    restarted for another request's check): the output of that step is still
    in flight and is dropped (vLLM delivers a preempted request's in-flight
    output unless `drop_stale_output` is set, and resumes the request only
    once it is delivered); every block cached under its hashes from the first
    bad position on leaves the prefix cache (vLLM freed its blocks; those
    computed over the bad one are still cached). Returns the bad blocks still
    cached as checked, whose holders recover too: a block id freed since may
    be another request's now."""
    if request.num_stale_output_tokens:
        request.drop_stale_output = True
    first = bad[0][0]
    keys = _block_keys(scheduler, hits, request, first)
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    still_bad = {
        block_id
        for position, block_id in bad
        if position - first < len(keys)
        and blocks[block_id].block_hash == keys[position - first]
    }
    _evict_keys(scheduler, keys)
    return still_bad


def _block_keys(
    scheduler: Any, hits: KVChecksumPrefixHits, request: Any, start: int
) -> list[Any]:
    """The prefix-cache keys of the request's full blocks from `start` on,
    as vLLM's `BlockPool.cache_full_blocks` makes them."""
    from vllm.v1.core.kv_cache_utils import (
        make_block_hash_with_group_id,
        resolve_block_hashes,
    )

    pool = scheduler.kv_cache_manager.block_pool
    hashes = resolve_block_hashes(
        request.block_hashes, pool.hash_block_size, hits.block_size
    )
    return [
        make_block_hash_with_group_id(hashes[position], hits.group_id)
        for position in range(start, len(hashes))
    ]


def _evict_keys(scheduler: Any, keys: list[Any]) -> None:
    """Every block the prefix cache holds under these keys leaves it (vLLM's
    `evict_blocks`, the call `_handle_invalid_blocks` uses; one key may
    reach several blocks). A mismatch's path, not a step's."""
    manager = scheduler.kv_cache_manager
    cached = manager.block_pool.cached_block_hash_to_block
    evicted: set[int] = set()
    for key in keys:
        while (block := cached.get_one_block(key)) is not None:
            if block.block_id in evicted:
                break  # vLLM kept it: never loop on it
            evicted.add(block.block_id)
            manager.evict_blocks({block.block_id})


def _recover_holders(
    scheduler: Any, state: _SchedulerState, bad: set[int], kv_output: Any
) -> None:
    """R140: every request holding a bad block, running or waiting for its
    remote KV, recovers per kv_load_failure_policy, and its blocks from the
    first bad one on leave the prefix cache: they were computed over it
    (R138; vLLM's `_handle_invalid_blocks` evicts them under "fail" only for
    the first request on a shared bad block)."""
    recompute = scheduler.recompute_kv_load_failures
    manager = scheduler.kv_cache_manager
    bad_ids = np.fromiter(bad, dtype=np.int64, count=len(bad))
    waiting = [
        r
        for r in scheduler.kv_holding_waiting
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ]
    restart: list[Any] = []
    reload: list[Any] = []
    for request in [*scheduler.running, *waiting]:
        ids = manager.get_block_ids(request.request_id)[0]
        first = np.flatnonzero(np.isin(np.asarray(ids, dtype=np.int64), bad_ids))
        if not first.size:
            continue
        _evict_keys(
            scheduler, _block_keys(scheduler, state.hits, request, int(first[0]))
        )
        if request.status == RequestStatus.RUNNING:
            restart.append(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            reload.append(request)
    if not recompute:
        if kv_output is not None:  # policy "fail": vLLM fails the requests on them
            kv_output.invalid_block_ids = set(kv_output.invalid_block_ids or ()) | bad
        return
    _restart(scheduler, state, restart)
    if reload:
        # vLLM's failed-load recovery ("recompute"): once its load ends the
        # request frees its blocks and starts over, reading the prefix cache
        # again up to its first bad block (that hit is checked).
        for request in reload:
            _note_restart(state, request)
        scheduler._handle_failed_recving({r.request_id for r in reload})


def _note_restart(state: _SchedulerState, request: Any) -> None:
    """The second restart of a request reads no prefix cache."""
    if request.request_id in state.restarted:
        request.skip_reading_prefix_cache = True
    state.restarted.add(request.request_id)


def _restart(scheduler: Any, state: _SchedulerState, requests: list[Any]) -> None:
    """R140: each running request on a bad block starts over through vLLM's
    own preemption, which drops the output of its steps still in flight.

    vLLM's invalid-block recovery of a running request (truncate, recompute in
    place) answered wrong on an H200 under async scheduling in every faulted
    request it recovered (vLLM #49250); with this restart every faulted request
    answered right (H200 x2, 2026-12-01: 31 of 33 equal, 2 at a logprob
    near-tie, the 15 that met a bad block twice included). A restarted request
    hits the prefix cache again up to its first bad block (the bad blocks left
    it) and that hit is checked again; one that meets a bad block a second
    time restarts without reading the prefix cache (vLLM's per-request
    `skip_reading_prefix_cache`), so a block vLLM fails to evict cannot
    restart it forever.
    """
    timestamp = time.monotonic()
    for request in requests:
        _note_restart(state, request)
        scheduler.running.remove(request)
        scheduler._preempt_request(request, timestamp, drop_stale_output=True)
        # Resumed in the next step as if not scheduled in this one (V1 runner).
        scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
