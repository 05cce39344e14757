# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on OffloadingConnector and its CPU backend (R116-R121, R138, R139);
the logic is in offload/offloading.py.

Hooks (target; why; how; the upstream change that lets it go):

OffloadingConnector (class methods)
    Why: declare `host` as a checked source, drop bad copies, build the worker's
    entry table
    How: answer only when the instance holds checksum state
    Upstream: the connector implementing the offloaded-KV API
OffloadingConnector.build_connector_meta
    Why: workers need each store job's block hashes
    How: after the original, `kv_checksum_store_runs`
    Upstream: the metadata carrying per-job block hashes
OffloadingConnector.update_connector_output
    Why: bad copies are freed once their loads completed
    How: after the original
    Upstream: a "remove key" call on the manager
OffloadingConnector.handle_preemptions, .wait_for_save
    Why: entries go to their host slots when stores are queued
    How: before the original
    Upstream: the CPU worker moving a per-block payload
OffloadingConnector.start_load_kv
    Why: entries come back before loads are submitted; host faults first (R131)
    How: before the original
    Upstream: as above
CPU manager prepare_store, lookup (instance)
    Why: no store from a request's mark on (R138); bad keys pending removal MISS
    How: instance wrappers, checksums on only
    Upstream: the mark read by _calc_num_offloadable_tokens (series 0009); a
      "remove key" call (0007)
"""

import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumRecord,
)
from vllm.distributed.kv_transfer.kv_checksum.offload import (
    offloading as offload_connectors,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.host_faults import (
    create_host_fault_injector,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.offloading import EntriesWrittenFn
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    _disable_after_error,
    _guard,
    _wrap,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def install_offload_connector() -> None:
    """R139. Target: OffloadingConnector (the API methods), its
    build_connector_meta, update_connector_output, handle_preemptions,
    start_load_kv and wait_for_save.

    Why: its CPU backend copies blocks to host chunks and back; each block's
    checksum entry must travel with it, and loads from host memory must be
    declared so they are verified (R117-R121).
    How: class methods for the API; thin wrappers that call the original and
    pass through unless the instance holds checksum state, which only
    `_attach_offload_schedulers` (Scheduler.__init__ hook, checksums on) and
    `register_kv_checksum_worker` (worker, checksums on) create. The store
    runs ride on the connector metadata; entries move before the original
    submits loads (start_load_kv) and when stores are queued (wait_for_save,
    handle_preemptions' flushed stores).
    Upstream: OffloadingConnector moving an opaque per-block payload with
    each block and declaring its host source.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    def get_kv_checksum_sources(self: Any, request: Any) -> set[str]:
        side = self.__dict__.get("_kv_checksum_offload")
        return set() if side is None else {offload_connectors.HOST_SOURCE}

    def on_kv_checksum_failure(
        self: Any, request: Any, mismatches: dict[int, list[int]]
    ) -> None:
        side = self.__dict__.get("_kv_checksum_offload")
        if side is not None:
            side.on_failure(request, mismatches)

    def register_kv_checksum_worker(self: Any, worker: Any) -> None:
        _attach_offload_worker(self, worker)

    OffloadingConnector.get_kv_checksum_sources = get_kv_checksum_sources  # type: ignore[attr-defined]
    OffloadingConnector.on_kv_checksum_failure = on_kv_checksum_failure  # type: ignore[attr-defined]
    OffloadingConnector.register_kv_checksum_worker = register_kv_checksum_worker  # type: ignore[attr-defined]

    @_wrap(OffloadingConnector, "build_connector_meta")
    def build_connector_meta(original: Callable, self: Any, *args: Any) -> Any:
        """R118: each store job's runs (block hashes) go to the workers."""
        side = self.__dict__.get("_kv_checksum_offload")
        if side is None:
            return original(self, *args)
        requests = side.requests()
        meta = original(self, *args)
        with _guard(self, "_kv_checksum_offload", "build_connector_meta"):
            side.attach_runs(meta, requests)
        return meta

    @_wrap(OffloadingConnector, "update_connector_output")
    def update_connector_output(original: Callable, self: Any, *args: Any) -> Any:
        """R121: bad host copies whose loads completed are freed."""
        result = original(self, *args)
        side = self.__dict__.get("_kv_checksum_offload")
        if side is not None:
            with _guard(self, "_kv_checksum_offload", "offload output"):
                side.after_output()
        return result

    @_wrap(OffloadingConnector, "handle_preemptions")
    def handle_preemptions(original: Callable, self: Any, meta: Any) -> Any:
        """R118: stores the original submits at once take their entries first."""
        side = self.__dict__.get("_kv_checksum_offload_worker")
        if side is not None and getattr(meta, "jobs_to_flush", None):
            with _guard(
                self, "_kv_checksum_offload_worker", "preempt", _disable_offload_worker
            ):
                side.save_stores(meta, meta.jobs_to_flush)
        return original(self, meta)

    @_wrap(OffloadingConnector, "start_load_kv")
    def start_load_kv(original: Callable, self: Any, *args: Any, **kw: Any) -> Any:
        """R118, R131: host faults (if configured), then entries of loads."""
        side = self.__dict__.get("_kv_checksum_offload_worker")
        if side is not None:
            with _guard(
                self, "_kv_checksum_offload_worker", "load", _disable_offload_worker
            ):
                side.start_loads(self._connector_metadata)
        return original(self, *args, **kw)

    @_wrap(OffloadingConnector, "wait_for_save")
    def wait_for_save(original: Callable, self: Any) -> Any:
        """R118: entries of this step's store jobs, into their host slots."""
        side = self.__dict__.get("_kv_checksum_offload_worker")
        if side is not None:
            with _guard(
                self, "_kv_checksum_offload_worker", "store", _disable_offload_worker
            ):
                side.save_step_stores(self._connector_metadata)
        return original(self)


def loads_after_forward(vllm_config: Any, load_kwargs: dict[str, Any]) -> bool:
    """Whether this start_load_kv call comes after the step's whole forward
    (then SimpleCPUOffloadConnector's copy hand-offs wait for the step's
    checksum work, issue 30).

    vLLM 0.33.0's Model Runner V2 passes the step's `scheduler_output` and
    calls start_load_kv after the forward launch unless the step has
    synchronous loads (`has_sync_kv_loads`, then before it). With a
    speculative config the drafter's forward may still write KV after it
    (`defer_finalize`), so never then; nor without the scheduler output (a
    step with no forward, or another caller) or the config.
    """
    scheduler_output = load_kwargs.get("scheduler_output")
    if vllm_config is None or scheduler_output is None:
        return False
    if getattr(scheduler_output, "has_sync_kv_loads", True):
        return False
    return getattr(vllm_config, "speculative_config", None) is None


# Checksum worker -> its "offload tier off" record, not yet sent (R134).
_offload_off: "weakref.WeakKeyDictionary[Any, KVChecksumRecord]" = (
    weakref.WeakKeyDictionary()
)


def _disable_offload_worker(connector: Any, attr: str, where: str) -> None:
    """`_disable_after_error` for an offload connector's worker side: its
    checksum worker stops comparing loads with the block table the side no
    longer keeps, and its next output tells the scheduler to stop checking
    host loads (`take_offload_off_records`). Only the offload tier goes off:
    the error was in its code, and P/D checks do not use its entries."""
    side = connector.__dict__.get(attr)
    _disable_after_error(connector, attr, where)
    try:
        worker = side.checksum_worker
        worker.stop_stored_entries()
        topology = worker.topology
        _offload_off[worker] = KVChecksumRecord(
            topology.pp_rank,
            topology.tp_rank,
            disabled_sources=(offload_connectors.HOST_SOURCE,),
        )
    except Exception:
        logger.exception("KV checksums: the scheduler could not be told.")


def take_offload_off_records(worker: Any) -> list[KVChecksumRecord]:
    """The pending "offload tier off" record of a checksum worker, sent once
    on its next output (ActiveKVConnector.post_forward)."""
    if not _offload_off:
        return []  # every step but the one after an offload-side error
    record = _offload_off.pop(worker, None)
    return [] if record is None else [record]


def _offload_children(connector: Any) -> list[Any]:
    """The OffloadingConnectors of a connector (itself, or MultiConnector's)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    children = getattr(connector, "_connectors", None) or [connector]
    return [c for c in children if isinstance(c, OffloadingConnector)]


def _attach_offload_schedulers(
    connector: Any, entries_written: EntriesWrittenFn | None = None
) -> None:
    """With checksums on only (Scheduler.__init__ hook): checksum state on
    each OffloadingConnector whose manager is the CPU backend's (R119).
    `entries_written(groups, block_ids)`: which GPU blocks' entries the
    workers already hold (prefix-hit verification's, R140), so their stores
    copy them instead of checksumming the blocks again."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    for child in _offload_children(connector):
        sched = child.connector_scheduler
        if sched is None or not isinstance(sched.manager, CPUOffloadingManager):
            logger.warning(
                "KV checksums: this OffloadingConnector backend is not covered; "
                "its loads are not checked."
            )
            continue
        side = _offload_scheduler_side(sched, entries_written)
        side.dropper.on_pending = _lookup_hider(sched.manager, side.dropper.hides)
        _filter_offload_stores(sched.manager, side)
        child._kv_checksum_offload = side


def _lookup_hider(manager: Any, hides: Callable[[Any], bool]) -> Callable[[bool], None]:
    """R121: while bad host copies wait for removal, an instance wrapper of
    the CPU manager's `lookup` answers MISS for them, so no request loads a
    copy that failed verification; once none waits, vLLM's own `lookup` is
    back. Target: CPUOffloadingManager.lookup (vLLM 0.33.0), which
    OffloadingConnectorScheduler looks up on the manager at every call.
    Why only then: vLLM calls it once per block of every request it schedules
    (issue 30: an extra Python frame per block otherwise). Upstream: a "remove
    key" call on the manager that takes effect while a load holds the key.
    """
    from vllm.v1.kv_offload.base import LookupResult

    own = "lookup" in manager.__dict__  # another instance wrapper to keep
    original = manager.lookup

    # No import or attribute chain per call, only the pending set's
    # membership test (R142).
    def lookup(
        key: Any,
        *args: Any,
        _o: Callable = original,
        _hides: Callable[[Any], bool] = hides,
        _miss: Any = LookupResult.MISS,
    ) -> Any:
        return _miss if _hides(key) else _o(key, *args)

    def on_pending(active: bool) -> None:
        if active:
            manager.lookup = lookup
        elif own:
            manager.lookup = original
        else:
            manager.__dict__.pop("lookup", None)

    return on_pending


def _filter_offload_stores(manager: Any, side: Any) -> None:
    """R138: an instance wrapper of the CPU manager's `prepare_store`, the one
    call through which OffloadingConnectorScheduler decides every store (full
    chunks, partial tails, aligned boundaries): a marked request's keys from
    the block holding its mark on (`max_cacheable_tokens`, read by
    `side.quarantine`) are left out, so vLLM never copies them to host memory
    and moves on past them. Other requests pass through as is.
    Upstream: `_calc_num_offloadable_tokens` capped at the request's mark
    (series 0009).
    """
    original = manager.prepare_store

    def prepare_store(keys: Any, req_context: Any, *args: Any, **kw: Any) -> Any:
        if side.quarantine(req_context.req_id):
            try:
                keys = side.store_filter(
                    req_context.req_id, list(keys), req_context.get_offload_key_position
                )
            except Exception:
                logger.exception("KV checksums: offload store filter failed.")
        return original(keys, req_context, *args, **kw)

    manager.prepare_store = prepare_store


def _offload_stored_keys(sched: Any, req_id: str) -> list[tuple[Any, Any]]:
    """(chunk end token, key) of the chunks a request offloaded itself (vLLM
    0.33.0's `_req_status`: past its hit chunks, before its store cursor).
    Upstream: `OffloadingConnectorScheduler.get_stored_keys` (series 0010)."""
    status = sched._req_status.get(req_id)
    if status is None:
        return []
    position = status.req_context.get_offload_key_position
    return [
        (position(key), key)
        for state in status.group_states
        for key in state.offload_keys[
            state.num_hit_chunks : state.next_stored_chunk_idx
        ]
    ]


def _offload_scheduler_side(
    sched: Any, entries_written: EntriesWrittenFn | None = None
) -> Any:
    """The scheduler-side state over vLLM 0.33.0's OffloadingConnectorScheduler
    and CPUOffloadingManager internals: the requests and their loaded key
    ranges (`_req_status`), and freeing a host copy (`_policy`, `_free_chunk`,
    the evictable count). Upstream: a "remove key" call on the manager and a
    public view of the connector's requests."""
    from vllm.v1.kv_offload.base import get_offload_group_idx

    def requests() -> Mapping[str, Any]:
        # R142: a C-level snapshot each step; Requests are looked up only for
        # the request ids of store jobs, not for every running request.
        return _RequestsOf(dict(sched._req_status))

    def load_key_ranges(req_id: str) -> Any:
        state = sched._req_status.get(req_id)
        return None if state is None else state.load_key_ranges

    def try_remove(key: Any) -> bool | None:
        return _remove_host_chunk(sched.manager, key)

    def stored_keys(req_id: str) -> list[tuple[Any, Any]]:
        return _offload_stored_keys(sched, req_id)

    return offload_connectors.OffloadSchedulerSide(
        sched.config.kv_group_configs,
        requests,
        load_key_ranges,
        try_remove,
        get_offload_group_idx,
        entries_written,
        stored_keys=stored_keys,
    )


class _RequestsOf(Mapping[str, Any]):
    """Request id -> vLLM Request over a snapshot of the connector's
    per-request states (`_req_status`)."""

    def __init__(self, states: dict[str, Any]) -> None:
        self._states = states

    def __getitem__(self, req_id: str) -> Any:
        return self._states[req_id].req

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)


def _remove_host_chunk(manager: Any, key: Any) -> bool | None:
    """Free one idle host chunk of a CPUOffloadingManager (R121, R138).

    vLLM 0.33.0 has no public call that removes one ready chunk; the closest
    path is the one its own eviction takes in `prepare_store`, kept whole: the
    policy is told the chunk stops being evictable (`mark_non_evictable`, its
    access state) and drops it (`remove`), the evictable count follows, the
    chunk goes back to the free list (`_free_chunk`) and a public removal
    event is queued, as for an evicted chunk. True: freed; False: a load or
    a store still holds it; None: no such chunk.
    """
    from vllm.v1.kv_offload.base import OffloadingEvent

    chunk = manager._policy.get(key)
    if chunk is None:
        return None
    if not chunk.is_ready or chunk.ref_cnt != 0:
        return False
    manager._policy.mark_non_evictable(key)
    manager._policy.remove(key)
    manager._num_evictable_cache_chunks -= 1
    manager._free_chunk(chunk)
    if manager.events is not None:
        manager.events.append(
            OffloadingEvent(keys=[key], medium=manager.medium, removed=True)
        )
    return True


def _attach_offload_worker(connector: Any, worker: Any) -> None:
    """With checksums on only: host entry table (and host fault injector,
    R131) of a CPU-backend OffloadingConnector worker (R117)."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    connector_worker = connector.connector_worker
    if connector_worker is None or not isinstance(
        connector_worker.spec, CPUOffloadingSpec
    ):
        return
    topology = worker.topology
    injector = create_host_fault_injector(
        connector._vllm_config, topology.tp_rank, topology.pp_rank
    )

    def host_tensors() -> list[Any]:
        # vLLM 0.33.0: the CPU worker's load handler reads from these tensors.
        handler = getattr(connector_worker.worker, "_load_handler", None)
        return list(getattr(handler, "src_tensors", None) or [])

    connector._kv_checksum_offload_worker = offload_connectors.OffloadWorkerSide(
        worker, connector_worker, injector, host_tensors
    )
