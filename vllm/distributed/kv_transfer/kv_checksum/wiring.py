# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""All wiring of KV checksums into vLLM 0.33.0 internals (R9, R10).

Every hook is a thin wrapper that calls the original vLLM method and then a
short call into the core modules. With checksums disabled the scheduler's
`kv_checksum_scheduler` and the connector's `kv_checksum_worker` are None (class
defaults: nothing is set on vLLM's objects) and every hook is an exact
pass-through: no attribute set or deleted, no extra call (R1). With checksums
on, checksum code inside a hook runs under a last-resort guard (R134): an
exception is logged once as an error and turns checksums off for that engine
(scheduler or worker), while the original vLLM call's result or exception
passes through untouched. The only exceptions that reach vLLM on purpose are
start-up errors for invalid flags (R8). Each hook is documented as:

- Target: the vLLM 0.33.0 method wrapped.
- Why: what checksums need there.
- How: what the wrapper adds around the original.
- Upstream: the vLLM change that would let the hook go.

The list is repeated in docs/features/kv_checksum.md ("vLLM internals").
"""

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from vllm.distributed.kv_transfer.kv_checksum import (
    connectors,
    mamba_splits,
    mooncake,
    nixl_push,
    offload_connectors,
    simple_offload,
    wiring_prefix_cache,
)
from vllm.distributed.kv_transfer.kv_checksum import outbox as outbox_module
from vllm.distributed.kv_transfer.kv_checksum.checksum import (
    KVChecksumCarrier,
    KVChecksumRecord,
)
from vllm.distributed.kv_transfer.kv_checksum.config import (
    kv_checksum_enabled,
    read_flags,
)
from vllm.distributed.kv_transfer.kv_checksum.fault_injection import (
    create_fault_injector,
)
from vllm.distributed.kv_transfer.kv_checksum.metrics import STATS_KEY, split_stats
from vllm.distributed.kv_transfer.kv_checksum.offload_faults import (
    create_host_fault_injector,
)
from vllm.distributed.kv_transfer.kv_checksum.payload import (
    DEFAULT_MAX_ENCODED_BYTES,
    max_valid_payload_bytes,
)
from vllm.distributed.kv_transfer.kv_checksum.prom_metrics import (
    KVChecksumPromMetrics,
)
from vllm.distributed.kv_transfer.kv_checksum.scheduler import KVChecksumScheduler
from vllm.distributed.kv_transfer.kv_checksum.worker import (
    create_kv_checksum_worker,
    finalize_records,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

_installed = False
_kv_cache_config: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "kv_checksum_kv_cache_config", default=None
)


def _wrap(cls: type, name: str) -> Callable[[Callable], Callable]:
    """Install `hook(original, self, *args, **kwargs)` as `cls.name`."""

    def decorator(hook: Callable) -> Callable:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return hook(original, self, *args, **kwargs)

        wrapper.__kv_checksum_original__ = original  # type: ignore[attr-defined]
        setattr(cls, name, wrapper)
        return hook

    return decorator


def _disable_after_error(owner: Any, attr: str, where: str) -> None:
    """Last-resort guard (R134); call from an `except` block.

    Logs one error with the traceback and sets `owner.attr` (a scheduler's
    `kv_checksum_scheduler`, an ActiveKVConnector's `kv_checksum_worker`) to
    None, so the hooks pass that object through from now on.
    """
    logger.exception(
        "KV checksums disabled for this engine after an error in %s; vLLM "
        "goes on without them.",
        where,
    )
    with contextlib.suppress(Exception):
        setattr(owner, attr, None)


def _disable_worker(active: Any, where: str) -> None:
    """`_disable_after_error` for an ActiveKVConnector's checksum worker that
    also queues a "checksums disabled" record for its next output, so the
    scheduler stops expecting this worker's records (R134)."""
    worker = active.__dict__.get("kv_checksum_worker")
    _disable_after_error(active, "kv_checksum_worker", where)
    try:
        active._kv_checksum_disabled = _disabled_record(worker)
    except Exception:
        logger.exception("KV checksums: the scheduler could not be told.")


def _disabled_record(worker: Any) -> KVChecksumRecord:
    """The record telling the scheduler this worker's checksums are off."""
    if worker is not None:
        topology = worker.topology
        return KVChecksumRecord(topology.pp_rank, topology.tp_rank, disabled=True)
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return KVChecksumRecord(
        get_pp_group().rank_in_group, get_tp_group().rank_in_group, disabled=True
    )


def _with_disabled_record(active: Any, output: Any) -> Any:
    """`output` carrying the pending "checksums disabled" record, sent once."""
    record = active._kv_checksum_disabled
    if record is not None and output is not None:
        output.kv_checksums = [record]
        active._kv_checksum_disabled = None
    return output


def _disable_offload_worker(connector: Any, attr: str, where: str) -> None:
    """`_disable_after_error` for an offload connector's worker side: its
    checksum worker stops comparing loads with the block table the side no
    longer keeps, so later host loads are unverified, not falsely mismatched."""
    side = connector.__dict__.get(attr)
    _disable_after_error(connector, attr, where)
    with contextlib.suppress(Exception):
        side.checksum_worker.stop_stored_entries()


def _enabled(vllm_config: Any, where: str) -> bool:
    """`kv_checksum_enabled` for a constructor hook: invalid flags raise
    ValueError (a start-up error by design, R8); any other error is logged
    once and leaves checksums off (R134)."""
    try:
        return kv_checksum_enabled(vllm_config)
    except ValueError:
        raise
    except Exception:
        logger.exception(
            "KV checksums disabled for this engine: the configuration could not "
            "be read in %s.",
            where,
        )
        return False


def install() -> None:
    """Install every hook, once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    _install_records()
    _install_connector_api()
    _install_scheduler_hooks()
    _install_worker_hooks()
    _install_config_hooks()
    _install_metrics_hooks()
    _install_offload_connector()
    _install_simple_offload_connector()
    _install_mamba_split_hooks()


# ----------------------------------------------------------------------
# Records on vLLM dataclasses (R9): absent by default, tolerated when absent.
# ----------------------------------------------------------------------


def _install_records() -> None:
    """Target: SchedulerOutput, KVConnectorOutput, KVConnectorTransferResults.

    Why: the step's scheduled blocks travel to workers on the SchedulerOutput;
    worker records travel back on the KVConnectorOutput; connectors report
    received producer bytes on their transfer results.
    How: class attributes defaulting to None, so instances without them read
    None and vLLM's constructors are unchanged.
    Upstream: optional dataclass fields `kv_checksum_scheduled`,
    `kv_checksums` in vLLM.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    SchedulerOutput.kv_checksum_scheduled = None  # type: ignore[attr-defined]
    KVConnectorOutput.kv_checksums = None  # type: ignore[attr-defined]
    KVConnectorTransferResults.kv_checksums = None  # type: ignore[attr-defined]

    @_wrap(KVConnectorOutput, "is_empty")
    def is_empty(original: Callable, self: Any) -> bool:
        """R10 (i). Target: KVConnectorOutput.is_empty.

        Why: vLLM drops empty connector outputs; a step whose only news is a
        checksum record must still reach the scheduler.
        How: not empty while `kv_checksums` holds records.
        Upstream: `kv_checksums` as a field listed in is_empty.
        """
        return original(self) and not getattr(self, "kv_checksums", None)


# ----------------------------------------------------------------------
# Carrier API (R97-R102)
# ----------------------------------------------------------------------


def _install_connector_api() -> None:
    """Target: KVConnectorBase_V1, NixlPullConnector, MultiConnector.

    Why: generic code asks each connector how it carries checksums.
    How: default methods added to the base class (never overriding one a
    connector already has); NIXL pull declares the kv_transfer_params carrier;
    MultiConnector delegates and merges its children's received bytes.
    Upstream: the carrier methods on KVConnectorBase_V1 and in each connector.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPullConnector,
    )

    mixin = connectors.KVChecksumConnectorMixin
    for name in (
        "kv_checksum_carrier",
        "send_kv_checksums",
        "get_kv_checksum_sources",
        "on_kv_checksum_failure",
        "register_kv_checksum_worker",
    ):
        if name not in KVConnectorBase_V1.__dict__:
            setattr(KVConnectorBase_V1, name, mixin.__dict__[name])

    def nixl_pull_carrier(
        self: Any, request: Any, receiving: bool
    ) -> KVChecksumCarrier | None:
        return connectors.nixl_pull_carrier(request, receiving)

    NixlPullConnector.kv_checksum_carrier = nixl_pull_carrier  # type: ignore[attr-defined]
    _install_multi_connector(MultiConnector)
    _install_nixl_push()
    _install_mooncake()


def _install_multi_connector(multi: type) -> None:
    def kv_checksum_carrier(
        self: Any, request: Any, receiving: bool
    ) -> KVChecksumCarrier | None:
        chosen = self._requests_to_connector.get(request.request_id)
        return connectors.multi_carrier(self._connectors, chosen, request, receiving)

    def send_kv_checksums(self: Any, request: Any, checksums: bytes) -> None:
        sender = connectors.multi_sender(self._connectors, request)
        if sender is not None:
            sender.send_kv_checksums(request, checksums)

    def get_kv_checksum_sources(self: Any, request: Any) -> set[str]:
        chosen = connectors.chosen_connector(
            self._connectors, self._requests_to_connector.get(request.request_id)
        )
        return set() if chosen is None else chosen.get_kv_checksum_sources(request)

    def on_kv_checksum_failure(
        self: Any, request: Any, mismatches: dict[int, list[int]]
    ) -> None:
        chosen = connectors.chosen_connector(
            self._connectors, self._requests_to_connector.get(request.request_id)
        )
        if chosen is not None:
            chosen.on_kv_checksum_failure(request, mismatches)

    def register_kv_checksum_worker(self: Any, worker: Any) -> None:
        for child in self._connectors:
            child.register_kv_checksum_worker(worker)
        _capture_received(self)

    multi.kv_checksum_carrier = kv_checksum_carrier  # type: ignore[attr-defined]
    multi.send_kv_checksums = send_kv_checksums  # type: ignore[attr-defined]
    multi.get_kv_checksum_sources = get_kv_checksum_sources  # type: ignore[attr-defined]
    multi.on_kv_checksum_failure = on_kv_checksum_failure  # type: ignore[attr-defined]
    multi.register_kv_checksum_worker = register_kv_checksum_worker  # type: ignore[attr-defined]

    @_wrap(multi, "get_transfer_results")
    def get_transfer_results(original: Callable, self: Any, *args: Any) -> Any:
        """R101. Target: MultiConnector.get_transfer_results.

        Why: the merged transfer results vLLM builds drop the children's
        received checksum bytes.
        How: only with checksums on (`register_kv_checksum_worker` was
        called, see `_capture_received`): empty the capture, call the
        original, attach the children's merged bytes (first copy wins).
        Otherwise an exact pass-through (R1).
        Upstream: MultiConnector merging `kv_checksums` itself.
        """
        received = self.__dict__.get("_kv_checksum_received")
        if received is None:
            return original(self, *args)
        received.clear()
        results = original(self, *args)
        if received and self.__dict__.get("_kv_checksum_received") is received:
            with contextlib.suppress(Exception):
                results.kv_checksums = dict(received)
            received.clear()
        return results


def _capture_received(multi: Any) -> None:
    """R101, with checksums on only (called from `register_kv_checksum_worker`,
    which only an engine with a checksum worker calls): wrap each child's
    `get_transfer_results` once, as an instance attribute that stays, so that
    the children's received bytes collect in the MultiConnector's
    `_kv_checksum_received` during its own `get_transfer_results`."""
    if "_kv_checksum_received" in multi.__dict__:
        return
    multi._kv_checksum_received = {}
    for child in multi._connectors:
        child_original = child.get_transfer_results

        def call(*args: Any, _original: Callable = child_original, **kw: Any) -> Any:
            result = _original(*args, **kw)
            received = multi.__dict__.get("_kv_checksum_received")
            if received is not None:
                try:
                    connectors.merge_received(
                        received, getattr(result, "kv_checksums", None)
                    )
                except Exception:
                    multi._kv_checksum_received = None
                    logger.exception(
                        "KV checksums received by a MultiConnector child could "
                        "not be read; its children's checksums are ignored."
                    )
            return result

        child.get_transfer_results = call


# ----------------------------------------------------------------------
# NIXL push carrier (R103-R109)
# ----------------------------------------------------------------------


def _install_nixl_push() -> None:
    """Target: NixlPushConnector (carrier methods), NixlPushConnectorScheduler
    .build_connector_meta, NixlPushConnectorWorker.start_load_kv,
    ._do_start_push_kv and .get_transfer_results.

    Why: push moves the payload on the WRITE's completion notif (R104-R107).
    How: class methods for the carrier API; thin wrappers that pass through
    unless the instance holds checksum state, which only
    `send_kv_checksums` (producer scheduler) and
    `register_kv_checksum_worker` (worker, checksums on) create.
    Upstream: NixlPushConnector carrying checksums itself.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPushConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
        NixlPushConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    def kv_checksum_carrier(
        self: Any, request: Any, receiving: bool
    ) -> KVChecksumCarrier | None:
        return nixl_push.nixl_push_carrier(request, receiving)

    def send_kv_checksums(self: Any, request: Any, checksums: bytes) -> None:
        sched = self.connector_scheduler
        outbox = sched.__dict__.setdefault(
            "_kv_checksum_outbox", outbox_module.ChecksumOutbox()
        )
        pushed = request.request_id in sched._newly_finished_push_blocks
        outbox.keep(request.request_id, checksums, pushed)

    def register_kv_checksum_worker(self: Any, worker: Any) -> None:
        _attach_nixl_push_worker(self.connector_worker, self._vllm_config)

    NixlPushConnector.kv_checksum_carrier = kv_checksum_carrier  # type: ignore[attr-defined]
    NixlPushConnector.send_kv_checksums = send_kv_checksums  # type: ignore[attr-defined]
    NixlPushConnector.register_kv_checksum_worker = register_kv_checksum_worker  # type: ignore[attr-defined]

    @_wrap(NixlPushConnectorScheduler, "build_connector_meta")
    def build_connector_meta(original: Callable, self: Any, *args: Any) -> Any:
        """R104: the kept payloads travel with the finished blocks they belong
        to, as `push_finished_kv_checksums`; the outbox is emptied."""
        meta = original(self, *args)
        outbox = self.__dict__.get("_kv_checksum_outbox")
        if outbox is not None:
            try:
                shipped = outbox.ship(meta.push_finished_blocks)
                if shipped:
                    meta.push_finished_kv_checksums = shipped
            except Exception:
                _disable_after_error(
                    self, "_kv_checksum_outbox", "build_connector_meta"
                )
        return meta

    @_wrap(NixlPushConnectorWorker, "start_load_kv")
    def start_load_kv(original: Callable, self: Any, metadata: Any) -> Any:
        """R105: payloads reach the writer before the blocks they go with;
        the consumer's registrations ask for checksum notifs."""
        store = self.__dict__.get("_kv_checksum_push")
        if store is not None:
            try:
                store.add(getattr(metadata, "push_finished_kv_checksums", None))
                nixl_push.advertise(metadata.push_registrations)
            except Exception:
                _disable_push_worker(self, "start_load_kv")
        return original(self, metadata)

    @_wrap(NixlPushConnectorWorker, "_do_start_push_kv")
    def do_start_push_kv(
        original: Callable, self: Any, request_id: str, blocks: Any, reg: Any
    ) -> Any:
        """R105, R106: the WRITEs of this request carry its checksums when its
        consumer asked for them (see `_attach_nixl_push_worker`)."""
        store = self.__dict__.get("_kv_checksum_push")
        if store is None or not nixl_push.wants_checksum_notif(reg):
            return original(self, request_id, blocks, reg)
        nixl_push.PUSH_WRITE.data = store.get(request_id)
        try:
            return original(self, request_id, blocks, reg)
        finally:
            nixl_push.PUSH_WRITE.data = None

    @_wrap(NixlPushConnectorWorker, "get_transfer_results")
    def get_transfer_results(original: Callable, self: Any) -> Any:
        """R107: finished loads report their first checksums; sent or
        expired requests drop theirs."""
        results = original(self)
        store = self.__dict__.get("_kv_checksum_push")
        if store is None:
            return results
        try:
            store.evict(results.finished_sending)
            notifs = self._pending_completion_notifs
            if isinstance(notifs, nixl_push.ChecksumNotifQueue):
                taken = notifs.take(
                    results.finished_recving, list(self._recving_metadata)
                )
                if taken:
                    results.kv_checksums = {**taken, **(results.kv_checksums or {})}
        except Exception:
            _disable_push_worker(self, "get_transfer_results")
        return results


def _disable_push_worker(worker: Any, where: str) -> None:
    """Checksums off on a push worker after an error: its notif queue stops
    keeping bytes nobody will take."""
    _disable_after_error(worker, "_kv_checksum_push", where)
    notifs = getattr(worker, "_pending_completion_notifs", None)
    if isinstance(notifs, nixl_push.ChecksumNotifQueue):
        with contextlib.suppress(Exception):
            notifs.stop_keeping()


def _attach_nixl_push_worker(worker: Any, vllm_config: Any) -> None:
    """With checksums on only: the payload store, the notif queue that reads
    checksum notifs (kept items and all) and an instance wrapper of the NIXL
    agent's `make_prepped_xfer` swapping in the checksum notif (R105, R107)."""
    if worker is None or "_kv_checksum_push" in worker.__dict__:
        return
    max_bytes = _payload_byte_limit(vllm_config)
    nixl_push.ChecksumNotifQueue.attach(worker._pending_completion_notifs, max_bytes)
    agent = worker.nixl_wrapper
    original = agent.make_prepped_xfer

    def make_prepped_xfer(*args: Any, **kwargs: Any) -> Any:
        if "notif_msg" in kwargs:
            kwargs["notif_msg"] = nixl_push.PUSH_WRITE.notif_for(kwargs["notif_msg"])
        return original(*args, **kwargs)

    agent.make_prepped_xfer = make_prepped_xfer
    worker._kv_checksum_push = nixl_push.PushSendStore()


# ----------------------------------------------------------------------
# CPU offload tier (R139 with R116-R121)
# ----------------------------------------------------------------------


def _install_offload_connector() -> None:
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
        try:
            side.attach_runs(meta, requests)
        except Exception:
            _disable_after_error(self, "_kv_checksum_offload", "build_connector_meta")
        return meta

    @_wrap(OffloadingConnector, "update_connector_output")
    def update_connector_output(original: Callable, self: Any, *args: Any) -> Any:
        """R121: bad host copies whose loads completed are freed."""
        result = original(self, *args)
        side = self.__dict__.get("_kv_checksum_offload")
        if side is not None:
            try:
                side.after_output()
            except Exception:
                _disable_after_error(self, "_kv_checksum_offload", "offload output")
        return result

    @_wrap(OffloadingConnector, "handle_preemptions")
    def handle_preemptions(original: Callable, self: Any, meta: Any) -> Any:
        """R118: stores the original submits at once take their entries first."""
        side = self.__dict__.get("_kv_checksum_offload_worker")
        if side is not None and getattr(meta, "jobs_to_flush", None):
            try:
                side.save_stores(meta, meta.jobs_to_flush)
            except Exception:
                _disable_offload_worker(self, "_kv_checksum_offload_worker", "preempt")
        return original(self, meta)

    @_wrap(OffloadingConnector, "start_load_kv")
    def start_load_kv(original: Callable, self: Any, *args: Any, **kw: Any) -> Any:
        """R118, R131: host faults (if configured), then entries of loads."""
        side = self.__dict__.get("_kv_checksum_offload_worker")
        if side is not None:
            try:
                side.start_loads(self._connector_metadata)
            except Exception:
                _disable_offload_worker(self, "_kv_checksum_offload_worker", "load")
        return original(self, *args, **kw)

    @_wrap(OffloadingConnector, "wait_for_save")
    def wait_for_save(original: Callable, self: Any) -> Any:
        """R118: entries of this step's store jobs, into their host slots."""
        side = self.__dict__.get("_kv_checksum_offload_worker")
        if side is not None:
            try:
                meta = self._connector_metadata
                side.save_stores(meta, list(meta.store_jobs))
            except Exception:
                _disable_offload_worker(self, "_kv_checksum_offload_worker", "store")
        return original(self)


def _offload_children(connector: Any) -> list[Any]:
    """The OffloadingConnectors of a connector (itself, or MultiConnector's)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    children = getattr(connector, "_connectors", None) or [connector]
    return [c for c in children if isinstance(c, OffloadingConnector)]


def _attach_offload_schedulers(connector: Any) -> None:
    """With checksums on only (Scheduler.__init__ hook): checksum state on
    each OffloadingConnector whose manager is the CPU backend's (R119)."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    for child in _offload_children(connector):
        sched = child.connector_scheduler
        if sched is None or not isinstance(sched.manager, CPUOffloadingManager):
            logger.warning(
                "KV checksums: this OffloadingConnector backend is not covered; "
                "its loads are not checked."
            )
            continue
        side = _offload_scheduler_side(sched)
        original_lookup = sched.manager.lookup

        def lookup(
            key: Any, *args: Any, _o: Callable = original_lookup, _side: Any = side
        ) -> Any:
            from vllm.v1.kv_offload.base import LookupResult

            return LookupResult.MISS if _side.dropper.hides(key) else _o(key, *args)

        sched.manager.lookup = lookup  # type: ignore[method-assign, assignment]
        _filter_offload_stores(sched.manager, side)
        child._kv_checksum_offload = side


def _filter_offload_stores(manager: Any, side: Any) -> None:
    """R138: an instance wrapper of the CPU manager's `prepare_store`, the one
    call through which OffloadingConnectorScheduler decides every store (full
    chunks, partial tails, aligned boundaries): a quarantined request's keys
    from its quarantine start on are left out, so vLLM never copies them to
    host memory and moves on past them. Other requests pass through as is.
    Upstream: a "do not offload" mark on a request's blocks from a position on.
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
    0.33.0's `_req_status`: past its hit chunks, before its store cursor)."""
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


def _quarantine_offload_copies(
    connector: Any, req_id: str, start: dict[int, int]
) -> None:
    """R138: host copies a newly quarantined request already stored, from its
    quarantine start on, leave the CPU tier (OffloadingConnector; the simple
    connector stores only blocks with a GPU hash, which containment evicts)."""
    for child in _offload_children(connector):
        side = child.__dict__.get("_kv_checksum_offload")
        if side is not None:
            stored = _offload_stored_keys(child.connector_scheduler, req_id)
            side.on_quarantine(stored, start)


def _offload_scheduler_side(sched: Any) -> Any:
    """The scheduler-side state over vLLM 0.33.0's OffloadingConnectorScheduler
    and CPUOffloadingManager internals: the requests and their loaded key
    ranges (`_req_status`), and freeing a host copy (`_policy`, `_free_chunk`,
    the evictable count). Upstream: a "remove key" call on the manager and a
    public view of the connector's requests."""
    from vllm.v1.kv_offload.base import get_offload_group_idx

    def requests() -> dict[str, Any]:
        return {rid: state.req for rid, state in sched._req_status.items()}

    def load_key_ranges(req_id: str) -> Any:
        state = sched._req_status.get(req_id)
        return None if state is None else state.load_key_ranges

    def try_remove(key: Any) -> bool | None:
        return _remove_host_chunk(sched.manager, key)

    return offload_connectors.OffloadSchedulerSide(
        sched.config.kv_group_configs,
        requests,
        load_key_ranges,
        try_remove,
        get_offload_group_idx,
    )


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


def _install_simple_offload_connector() -> None:
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
        try:
            side.attach(meta)
        except Exception:
            _disable_after_error(
                self, "_kv_checksum_simple_offload", "build_connector_meta"
            )
        return meta

    @_wrap(connector, "start_load_kv")
    def start_load_kv(original: Callable, self: Any, *args: Any, **kw: Any) -> Any:
        """R118, R131: host faults (if configured), then the loads' entries."""
        side = self.__dict__.get("_kv_checksum_simple_offload_worker")
        if side is not None:
            try:
                side.start_loads(self._connector_metadata)
            except Exception:
                _disable_offload_worker(
                    self, "_kv_checksum_simple_offload_worker", "load"
                )
        return original(self, *args, **kw)

    @_wrap(connector, "wait_for_save")
    def wait_for_save(original: Callable, self: Any) -> Any:
        """R118: the stored blocks' entries, into their CPU blocks' slots."""
        side = self.__dict__.get("_kv_checksum_simple_offload_worker")
        if side is not None:
            try:
                side.save_stores(self._connector_metadata)
            except Exception:
                _disable_offload_worker(
                    self, "_kv_checksum_simple_offload_worker", "store"
                )
        return original(self)


def _simple_offload_children(connector: Any) -> list[Any]:
    """The SimpleCPUOffloadConnectors of a connector (itself, or
    MultiConnector's)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
        SimpleCPUOffloadConnector,
    )

    children = getattr(connector, "_connectors", None) or [connector]
    return [c for c in children if isinstance(c, SimpleCPUOffloadConnector)]


def _attach_simple_offload_schedulers(connector: Any) -> None:
    """With checksums on only (Scheduler.__init__ hook): checksum state on
    each SimpleCPUOffloadConnector with a CPU (not disk) backend (R119)."""
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
        child._kv_checksum_simple_offload = _simple_offload_scheduler_side(manager)


def _simple_offload_scheduler_side(manager: Any) -> Any:
    """The scheduler-side state over vLLM 0.33.0's SimpleCPUOffloadScheduler
    internals: the GPU block pool it stores from (`_gpu_block_pool`, bound by
    the Scheduler), the CPU blocks of a request's pending load
    (`_reqs_to_load`, `_abandoned_reqs_to_load` after a reset) and, to drop
    a bad copy, the CPU block pool's own `evict_blocks` (hashes out of the
    prefix cache now; the block is freed when its load releases it).
    Upstream: a public view of the manager's loads and of the stored blocks'
    places, and a "drop copy" call."""

    def keys(pool: Any, ids: Any) -> list[tuple[Any, Any]]:
        blocks = pool.blocks
        return [(blocks[i].block_hash, blocks[i].block_hash_num_tokens) for i in ids]

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
        lambda ids: keys(manager._gpu_block_pool, ids),
        lambda ids: keys(manager.cpu_block_pool, ids),
        load_blocks,
        try_remove,
    )


def _attach_simple_offload_worker(connector: Any, worker: Any) -> None:
    """With checksums on only: the host entry table (and host fault
    injector, R131) of a SimpleCPUOffloadConnector worker with CPU tensors
    (the disk backend has none and is not covered) (R117)."""
    handler = connector.worker_handler
    if handler is None or not handler.cpu_kv_caches:
        return
    topology = worker.topology
    injector = create_host_fault_injector(
        connector._vllm_config, topology.tp_rank, topology.pp_rank
    )

    def host_tensors() -> list[Any]:
        # vLLM 0.33.0: [num_cpu_blocks, block bytes] pinned tensors per region.
        return list((handler.cpu_kv_caches or {}).values())

    connector._kv_checksum_simple_offload_worker = (
        simple_offload.SimpleOffloadWorkerSide(
            worker,
            handler.kv_cache_config.prefix_cacheable_group_ids,
            handler.num_cpu_blocks,
            injector,
            host_tensors,
        )
    )


# ----------------------------------------------------------------------
# Mooncake P2P carrier (R110-R115)
# ----------------------------------------------------------------------


def _install_mooncake() -> None:
    """Target: MooncakeConnector (carrier methods), MooncakeConnectorScheduler
    .build_connector_meta, MooncakeConnectorWorker.start_load_kv,
    .send_kv_to_decode, .process_pulling_result and .get_transfer_results.

    Why: Mooncake moves the payload on the transfer response (R111-R114).
    How: class methods for the carrier API; thin wrappers that pass through
    unless the instance holds checksum state, which only `send_kv_checksums`
    (producer scheduler) and `register_kv_checksum_worker` (worker,
    checksums on) create. Not installed if vLLM's Mooncake module cannot be
    imported. The Mooncake store connector is left alone (R115).
    Upstream: MooncakeConnector carrying checksums itself.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
            mooncake_connector as mc,
        )
    except Exception:
        logger.debug("Mooncake connector not importable: no checksum carrier.")
        return

    def kv_checksum_carrier(
        self: Any, request: Any, receiving: bool
    ) -> KVChecksumCarrier | None:
        return mooncake.mooncake_carrier(request, receiving)

    def send_kv_checksums(self: Any, request: Any, checksums: bytes) -> None:
        sched = self.connector_scheduler
        outbox = sched.__dict__.setdefault(
            "_kv_checksum_outbox", outbox_module.ChecksumOutbox()
        )
        sending = request.request_id in sched._reqs_need_send
        outbox.keep(request.request_id, checksums, sending)

    def register_kv_checksum_worker(self: Any, worker: Any) -> None:
        _attach_mooncake_worker(
            self.connector_worker, self._vllm_config, mc.MooncakeXferResponse
        )

    connector = mc.MooncakeConnector
    connector.kv_checksum_carrier = kv_checksum_carrier  # type: ignore[attr-defined]
    connector.send_kv_checksums = send_kv_checksums  # type: ignore[attr-defined]
    connector.register_kv_checksum_worker = register_kv_checksum_worker  # type: ignore[attr-defined]

    @_wrap(mc.MooncakeConnectorScheduler, "build_connector_meta")
    def build_connector_meta(original: Callable, self: Any, *args: Any) -> Any:
        """R111: kept payloads travel with the blocks as `kv_checksums`."""
        meta = original(self, *args)
        outbox = self.__dict__.get("_kv_checksum_outbox")
        if outbox is not None:
            try:
                shipped = outbox.ship(meta.reqs_to_send)
                if shipped:
                    meta.kv_checksums = shipped
            except Exception:
                _disable_after_error(
                    self, "_kv_checksum_outbox", "build_connector_meta"
                )
        return meta

    @_wrap(mc.MooncakeConnectorWorker, "start_load_kv")
    def start_load_kv(original: Callable, self: Any, metadata: Any) -> Any:
        """R112: payloads are stored before the send is marked ready."""
        send = self.__dict__.get("_kv_checksum_send")
        if send is not None:
            try:
                send.add(getattr(metadata, "kv_checksums", None), metadata.reqs_to_send)
            except Exception:
                _disable_after_error(self, "_kv_checksum_send", "start_load_kv")
        return original(self, metadata)

    @_wrap(mc.MooncakeConnectorWorker, "send_kv_to_decode")
    async def send_kv_to_decode(
        original: Callable, self: Any, identity: Any, sock: Any, meta: Any
    ) -> Any:
        """R112: responses to this pull may carry its requests' checksums."""
        if self.__dict__.get("_kv_checksum_send") is None:
            return await original(self, identity, sock, meta)
        token = mooncake.CURRENT_PULL.set(meta.req_blocks)
        try:
            return await original(self, identity, sock, meta)
        finally:
            mooncake.CURRENT_PULL.reset(token)

    @_wrap(mc.MooncakeConnectorWorker, "process_pulling_result")
    def process_pulling_result(
        original: Callable, self: Any, response: Any, pull_metas: Any
    ) -> Any:
        """R114: keep the checksums before the loads are marked finished."""
        received = self.__dict__.get("_kv_checksum_received")
        if received is not None:
            try:
                # Only pulls with local blocks are ever reported finished.
                finishing = {
                    r for r, meta in pull_metas.items() if any(meta.local_block_ids)
                }
                received.keep(response, finishing)
            except Exception:
                logger.exception("KV checksums of a Mooncake response ignored.")
        return original(self, response, pull_metas)

    @_wrap(mc.MooncakeConnectorWorker, "get_transfer_results")
    def get_transfer_results(original: Callable, self: Any) -> Any:
        """R114: finished loads report their checksums; sent requests drop
        their payloads."""
        results = original(self)
        received = self.__dict__.get("_kv_checksum_received")
        if received is None:
            return results
        try:
            self._kv_checksum_send.evict(results.finished_sending)
            taken = received.take(results.finished_recving, results.failed_recving)
            if taken:
                results.kv_checksums = {**taken, **(results.kv_checksums or {})}
        except Exception:
            _disable_after_error(self, "_kv_checksum_received", "get_transfer_results")
        return results


def _payload_byte_limit(vllm_config: Any) -> int:
    """A worker's cap on one request's payload bytes (R129): the operator's
    setting, else derived from this engine's max_model_len and KV cache
    groups (the KVCacheConfig of the worker being built); 16 MiB if unknown."""
    configured = read_flags(vllm_config.kv_transfer_config).max_payload_bytes
    if configured is not None:
        return configured
    kv_cache_config = _kv_cache_config.get()
    if kv_cache_config is None:
        return DEFAULT_MAX_ENCODED_BYTES
    return max_valid_payload_bytes(
        vllm_config.model_config.max_model_len, len(kv_cache_config.kv_cache_groups)
    )


def _attach_mooncake_worker(worker: Any, vllm_config: Any, base: type) -> None:
    """With checksums on only: the payload stores, the response encoder that
    adds checksums and the decoder that reads them (R112-R114)."""
    if worker is None or "_kv_checksum_send" in worker.__dict__:
        return
    max_bytes = _payload_byte_limit(vllm_config)
    extended = mooncake.response_type(base)
    send = mooncake.SendChecksums()
    worker._encoder = mooncake.ChecksumResponseEncoder(
        worker._encoder, base, extended, send
    )
    worker._xfer_resp_decoder = msgspec.msgpack.Decoder(extended)
    worker._kv_checksum_received = mooncake.ReceivedChecksums(max_bytes)
    worker._kv_checksum_send = send


# ----------------------------------------------------------------------
# Scheduler hooks (R10 a-f, R73)
# ----------------------------------------------------------------------


def _create_scheduler(scheduler: Any) -> KVChecksumScheduler:
    """The checksum scheduler of a scheduler whose checksums are enabled."""
    connector = scheduler.connector
    vllm_config = scheduler.vllm_config
    flags = read_flags(vllm_config.kv_transfer_config)
    parallel = vllm_config.parallel_config
    return KVChecksumScheduler.create(
        scheduler.kv_cache_config,
        num_workers=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
        tp_size=parallel.tensor_parallel_size,
        fail_closed=flags.fail_closed,
        carrier=connector.kv_checksum_carrier,
        hit_sources=lambda request, n: {
            getattr(s, "value", s)
            for s in connector.get_external_cache_hit_sources(request, n)
        },
        max_model_len=vllm_config.model_config.max_model_len,
        max_payload_bytes=flags.max_payload_bytes,
        checksum_sources=lambda request: {
            getattr(s, "value", s) for s in connector.get_kv_checksum_sources(request)
        },
        on_failure=connector.on_kv_checksum_failure,
        hash_block_size=getattr(scheduler, "hash_block_size", None),
    )


def _install_scheduler_hooks() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    # Read when checksums are off: class defaults, nothing set on instances.
    Scheduler.kv_checksum_scheduler = None  # type: ignore[attr-defined]

    @_wrap(Scheduler, "__init__")
    def init(original: Callable, self: Any, *args: Any, **kwargs: Any) -> None:
        """R10 (a). Target: Scheduler.__init__ (also AsyncScheduler's).

        Why: one checksum scheduler per engine, None when disabled.
        How: created after vLLM's init, with the connector's carrier, hit
        sources, stored-checksum sources and failure callback (R119, R121);
        the connector's update_state_after_alloc gets an instance wrapper
        noting loads as they start (R10 d). Disabled: nothing is set (the
        class default None answers). Invalid flags raise (R8); any other
        error leaves checksums off for this engine with one error log.
        Upstream: the Scheduler constructing it next to its connector.
        """
        original(self, *args, **kwargs)
        if self.connector is None or not _enabled(self.vllm_config, "Scheduler"):
            return
        try:
            kcs = _create_scheduler(self)
            _attach_offload_schedulers(self.connector)
            _attach_simple_offload_schedulers(self.connector)
            _attach_containment(self, kcs)
            wiring_prefix_cache.attach(self, kcs)  # R140
            self._kv_checksum_starting_loads = []
            _note_starting_loads(self)
            self.kv_checksum_scheduler = kcs
        except Exception:
            _disable_after_error(self, "kv_checksum_scheduler", "Scheduler.__init__")

    @_wrap(Scheduler, "add_request")
    def add_request(original: Callable, self: Any, request: Any) -> None:
        """R10 (b). Target: Scheduler.add_request.

        Why: connectors clear `do_remote_prefill` when the load starts, so a
        consumer request must be noted on arrival (R69).
        How: `on_new_request` after vLLM's add_request.
        Upstream: a call next to the connector's on_new_request.
        """
        original(self, request)
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if kcs is None:
            return
        try:
            kcs.on_new_request(request)
        except Exception:
            _disable_after_error(self, "kv_checksum_scheduler", "add_request")

    @_wrap(Scheduler, "_update_after_schedule")
    def update_after_schedule(original: Callable, self: Any, output: Any) -> None:
        """R10 (c, d). Target: Scheduler._update_after_schedule.

        Why: only after it are `num_computed_tokens` final for the step, both
        for loads started in this schedule() and for prompts it finishes.
        How: `add_recv` per started load, `add_send` per scheduled request,
        then `build_checksum_meta()` on the SchedulerOutput.
        Upstream: a `kv_checksum_scheduled` field filled by the Scheduler.
        """
        original(self, output)
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if kcs is None:
            return
        starting, self._kv_checksum_starting_loads = (
            self._kv_checksum_starting_loads,
            [],
        )
        try:
            for request, blocks, num_external in starting:
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    local = request.num_computed_tokens - num_external
                    kcs.add_recv(request, blocks, local)
            for req_id, num_tokens in output.num_scheduled_tokens.items():
                kcs.add_send(self.requests[req_id], num_tokens, self.kv_cache_manager)
            output.kv_checksum_scheduled = kcs.build_checksum_meta()
            wiring_prefix_cache.schedule(self, output)  # R140
        except Exception:
            _disable_after_error(
                self, "kv_checksum_scheduler", "Scheduler._update_after_schedule"
            )

    @_wrap(Scheduler, "update_from_output")
    def update_from_output(
        original: Callable, self: Any, scheduler_output: Any, model_output: Any
    ) -> Any:
        """R10 (e), R73. Target: Scheduler.update_from_output.

        Why: a load must be verified before the request is rescheduled, and
        records must be stored before the per-request loop finishes producers.
        How: before the original, store records and verify the finished loads
        (skipping loads reported failed, already failed or hit by invalid
        blocks); fail-closed failures are added to `failed_recving`, so vLLM's
        own `_handle_failed_recving` and kv_load_failure_policy decide (R4).
        If checksum code raises, one error log and checksums off for this
        engine; vLLM's update_from_output then runs unchanged (R134).
        Upstream: a checksum step between vLLM's failure handling and its
        per-request loop.
        """
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if kcs is None:
            return original(self, scheduler_output, model_output)
        try:
            kv_output = model_output.kv_connector_output
            if kv_output is not None:
                failed = set(kv_output.failed_recving or ())
                failing = kcs.update_from_output(
                    finalize_records(getattr(kv_output, "kv_checksums", None)),
                    kv_output.finished_recving,
                    skip_req_ids=failed | self.failed_recving_kv_req_ids,
                    invalid_block_ids=kv_output.invalid_block_ids,
                )
                if failing:
                    kv_output.failed_recving = failed | failing
            wiring_prefix_cache.verify(self, scheduler_output, model_output)  # R140
        except Exception:
            _disable_after_error(
                self, "kv_checksum_scheduler", "Scheduler.update_from_output"
            )
        return original(self, scheduler_output, model_output)

    @_wrap(Scheduler, "_connector_finished")
    def connector_finished(
        original: Callable, self: Any, request: Any
    ) -> tuple[bool, Any]:
        """R10 (f). Target: Scheduler._connector_finished.

        Why: a finished producer's payload travels with what the connector
        returns (kv_transfer_params) or in the connector's own messages.
        How: after the original, `request_finished` adds "kv_checksums" to the
        returned params (leaving out blocks vLLM has freed since the prompt
        was checksummed); CONNECTOR bytes go to `send_kv_checksums`. On an
        error, vLLM's own result is returned (R134).
        Upstream: the Scheduler calling the checksum scheduler there.
        """
        result = original(self, request)
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if kcs is None:
            return result
        try:
            delay_free, params = result
            params = kcs.request_finished(request, params, self.kv_cache_manager)
            data = kcs.take_kv_checksums_to_send(request.request_id)
            if data is not None:
                self.connector.send_kv_checksums(request, data)
        except Exception:
            _disable_after_error(
                self, "kv_checksum_scheduler", "Scheduler._connector_finished"
            )
            return result
        return delay_free, params


def _note_starting_loads(scheduler: Any) -> None:
    """R10 (d). Target: the scheduler's connector instance's
    update_state_after_alloc (also reached from `_drain_deferred_loads`).

    Why: it is the one call that sees every async load start.
    How: an instance attribute wrapping the bound method notes (request,
    blocks, external tokens) for the next `_update_after_schedule`.
    Upstream: the Scheduler reporting load starts to the checksum scheduler.
    """
    connector = scheduler.connector
    original = connector.update_state_after_alloc

    def update_state_after_alloc(request: Any, blocks: Any, num_external: int) -> Any:
        result = original(request, blocks, num_external)
        if num_external > 0 and scheduler.kv_checksum_scheduler is not None:
            scheduler._kv_checksum_starting_loads.append(
                (request, blocks, num_external)
            )
        return result

    connector.update_state_after_alloc = update_state_after_alloc


# ----------------------------------------------------------------------
# Worker hooks (R10 g, h)
# ----------------------------------------------------------------------


def _install_worker_hooks() -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.worker.gpu import kv_connector as gpu_kv_connector
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    active = gpu_kv_connector.ActiveKVConnector
    # Read when checksums are off: class defaults, nothing set on instances.
    active.kv_checksum_worker = None  # type: ignore[attr-defined]
    active.kv_checksum_fault_injector = None  # type: ignore[attr-defined]
    active._kv_checksum_results = None  # type: ignore[attr-defined]
    active._kv_checksum_disabled = None  # type: ignore[attr-defined]

    @_wrap(GPUModelRunner, "initialize_kv_cache")
    def initialize_kv_cache(
        original: Callable, self: Any, kv_cache_config: Any, *args: Any, **kw: Any
    ) -> None:
        """R10 (g). Target: GPUModelRunner.initialize_kv_cache (V2 runner).

        Why: 0.33.0 does not pass the KVCacheConfig to get_kv_connector, and
        the checksum worker needs it.
        How: a context variable holds it for the duration of the call.
        Upstream: get_kv_connector(vllm_config, kv_caches, kv_cache_config).
        """
        token = _kv_cache_config.set(kv_cache_config)
        try:
            original(self, kv_cache_config, *args, **kw)
        finally:
            _kv_cache_config.reset(token)

    @_wrap(active, "__init__")
    def init(original: Callable, self: Any, vllm_config: Any, kv_caches: Any) -> None:
        """R10 (g). Target: ActiveKVConnector.__init__.

        Why: the worker-side connector wrapper is where each step's connector
        calls happen; it holds the checksum worker (and the fault injector,
        R131, when configured).
        How: after the original, create both; an instance wrapper keeps the
        connector's last transfer results for post_forward. Disabled: nothing
        is set (class defaults None); an error while creating them leaves
        checksums off for this worker with one error log (R134).
        Upstream: ActiveKVConnector owning a checksum worker.
        """
        original(self, vllm_config, kv_caches)
        if _kv_cache_config.get() is None or not _enabled(
            vllm_config, "ActiveKVConnector"
        ):
            return
        try:
            worker = _create_worker(vllm_config, kv_caches)
            if worker is None:
                return
            topology = worker.topology
            injector = create_fault_injector(
                vllm_config, topology.tp_rank, topology.pp_rank
            )
            self.kv_connector.register_kv_checksum_worker(worker)
            _remember_transfer_results(self)
            self.kv_checksum_fault_injector = injector
            self.kv_checksum_worker = worker
            wiring_prefix_cache.enable_worker(worker, vllm_config)  # R140
        except Exception:
            _disable_worker(self, "ActiveKVConnector")

    @_wrap(active, "pre_forward")
    def pre_forward(
        original: Callable, self: Any, scheduler_output: Any, *args: Any, **kw: Any
    ) -> None:
        """R10 (g). Target: ActiveKVConnector.pre_forward.

        Why: workers must know the step's blocks, no-forward steps included.
        How: `bind(scheduler_output.kv_checksum_scheduled)` after the original.
        Upstream: the same call inside pre_forward.
        """
        original(self, scheduler_output, *args, **kw)
        worker = getattr(self, "kv_checksum_worker", None)
        if worker is None or self._disabled:
            return
        try:
            worker.bind(getattr(scheduler_output, "kv_checksum_scheduled", None))
        except Exception:
            _disable_worker(self, "pre_forward")

    @_wrap(active, "post_forward")
    def post_forward(
        original: Callable, self: Any, finished_req_ids: set[str], *args: Any, **kw: Any
    ) -> Any:
        """R10 (g). Target: ActiveKVConnector.post_forward.

        Why: after the forward wrote a prompt's KV and the connector reported
        finished loads, before any later forward writes those blocks (R49).
        How: after the original, the worker checksums on the compute stream and
        its pending record goes on the KVConnectorOutput; configured fault
        injection (R131) corrupts finished loads just before. After an error
        turned this worker's checksums off, its next output carries one
        "checksums disabled" record instead (R134).
        Upstream: the same call inside post_forward.
        """
        output = original(self, finished_req_ids, *args, **kw)
        worker = getattr(self, "kv_checksum_worker", None)
        if worker is None:
            return _with_disabled_record(self, output)
        results, self._kv_checksum_results = self._kv_checksum_results, None
        if output is None or results is None:
            return output
        try:
            injector = self.kv_checksum_fault_injector
            if injector is not None:  # R131: corrupt finished loads first
                injector.corrupt_loads(
                    worker,
                    results.finished_recving,
                    results.failed_recving,
                    finished_req_ids,
                )
            pending = worker.post_forward(
                results.finished_recving,
                results.failed_recving,
                getattr(results, "kv_checksums", None),
                finished_req_ids,
            )
        except Exception:
            _disable_worker(self, "post_forward")
            return _with_disabled_record(self, output)
        if pending is not None:
            output.kv_checksums = [pending]
        return output

    @_wrap(KVOutputAggregator, "aggregate")
    def aggregate(
        original: Callable, self: Any, outputs: list, output_rank: int = 0
    ) -> Any:
        """R10 (h). Target: KVOutputAggregator.aggregate (multiprocess).

        Why: the scheduler needs every TP and PP worker's record; vLLM keeps
        only the output rank's KVConnectorOutput.
        How: concatenate the records of every worker and salvaged output onto
        the aggregated output (read before the original, which drops the
        salvaged outputs; instance attributes only, so nothing is looked up,
        let alone created, on stand-in objects). Without records (checksums
        off) the original's result is returned untouched.
        Upstream: the aggregator concatenating `kv_checksums`.
        """
        records = _records_of(
            [
                *_instance_attribute(self, "_salvaged_outputs", ()),
                *(_instance_attribute(o, "kv_connector_output") for o in outputs),
            ]
        )
        result = original(self, outputs, output_rank)
        if records and result is not None and result.kv_connector_output is not None:
            result.kv_connector_output.kv_checksums = records
        return result


def _instance_attribute(obj: Any, name: str, default: Any = None) -> Any:
    """`obj.name` if set on the instance itself, else `default`."""
    try:
        return vars(obj).get(name, default)
    except TypeError:  # no __dict__
        return default


def _records_of(kv_outputs: list) -> list:
    """The checksum records of KV connector outputs, in order; [] if none."""
    records: list = []
    for kv_output in kv_outputs:
        value = _instance_attribute(kv_output, "kv_checksums")
        if isinstance(value, list):
            records.extend(value)
    return records


def _create_worker(vllm_config: Any, kv_caches: Any) -> Any:
    """The checksum worker of an engine whose checksums are enabled."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    kv_cache_config = _kv_cache_config.get()
    device = next(
        (c.device for c in kv_caches.values() if c.device.type != "cpu"),
        torch.device("cpu"),
    )
    return create_kv_checksum_worker(
        vllm_config,
        kv_cache_config,
        kv_caches,
        device,
        tp_rank=get_tp_group().rank_in_group,
        pp_rank=get_pp_group().rank_in_group,
    )


def _remember_transfer_results(active: Any) -> None:
    """Keep the connector's last transfer results for `post_forward` (R99)."""
    connector = active.kv_connector
    original = connector.get_transfer_results

    def get_transfer_results(*args: Any, **kwargs: Any) -> Any:
        results = original(*args, **kwargs)
        if active.kv_checksum_worker is not None:
            active._kv_checksum_results = results
        return results

    connector.get_transfer_results = get_transfer_results


# ----------------------------------------------------------------------
# Config hooks (R10 j, R12)
# ----------------------------------------------------------------------


def _install_config_hooks() -> None:
    from vllm.config import VllmConfig

    @_wrap(VllmConfig, "_get_v1_model_runner_unsupported_features")
    def v1_unsupported(original: Callable, self: Any) -> list[str]:
        """R10 (j), R12. Target: VllmConfig._get_v1_model_runner_unsupported_features.

        Why: the hooks live in Model Runner V2 only.
        How: add "KV checksums" when enabled, so vLLM raises "Model Runner V1
        does not support: KV checksums" at start-up.
        Upstream: the same entry in vLLM's list.
        """
        unsupported = original(self)
        try:
            enabled = kv_checksum_enabled(self)
        except ValueError:
            enabled = False  # the engine refuses to start elsewhere (R8)
        except Exception:
            logger.exception("KV checksums: could not read the configuration.")
            enabled = False
        if enabled:
            unsupported = [*unsupported, "KV checksums"]
        return unsupported


# ----------------------------------------------------------------------
# Metrics hooks (R130)
# ----------------------------------------------------------------------


def _install_metrics_hooks() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )
    from vllm.v1.core.sched.scheduler import Scheduler

    # Read when checksums are off: a class default, nothing set on instances.
    KVConnectorProm.kv_checksum_metrics = None  # type: ignore[attr-defined]

    @_wrap(Scheduler, "make_stats")
    def make_stats(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
        """Target: Scheduler.make_stats. Why: the verdict counts must reach the
        API server's stat loggers. How: when vLLM returns SchedulerStats, move
        the counts as a plain dict under "kv_checksum" into a copy of its
        kv_connector_stats dict; an error disables checksums for the engine
        (R134). Upstream: a checksum stats field."""
        stats = original(self, *args, **kwargs)
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if stats is None or kcs is None:
            return stats
        try:
            if not kcs.stats.is_empty():
                merged = {
                    **(stats.kv_connector_stats or {}),
                    STATS_KEY: kcs.stats.take().to_dict(),
                }
                stats.kv_connector_stats = merged
        except Exception:
            _disable_after_error(self, "kv_checksum_scheduler", "make_stats")
        return stats

    @_wrap(KVConnectorProm, "__init__")
    def prom_init(
        original: Callable,
        self: Any,
        vllm_config: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        """Target: KVConnectorProm.__init__. Why: checksum counters on vLLM's
        /metrics. How: also build KVChecksumPromMetrics with this class's
        metric classes and vLLM's labels; set only when checksums are on (the
        class default None answers otherwise). Never raises: an error is
        logged once and leaves the counters out.
        Upstream: the same, next to the connector's build_prom_metrics."""
        original(self, vllm_config, labelnames, per_engine_labelvalues)
        try:
            metrics = KVChecksumPromMetrics.for_connector_prom(
                self, vllm_config, labelnames, per_engine_labelvalues
            )
        except Exception:
            logger.exception("KV checksum metrics could not be created; left out.")
            return
        if metrics is not None:
            self.kv_checksum_metrics = metrics

    @_wrap(KVConnectorProm, "observe")
    def prom_observe(
        original: Callable, self: Any, data: Any, engine_idx: int = 0
    ) -> None:
        """Target: KVConnectorProm.observe. Why: the connector's own parser
        must never see the "kv_checksum" key. How: record it, pass the rest on
        only if non-empty; an error while recording drops the checksum
        counters of this logger with one error log. Without the key (checksums
        off) an exact pass-through. Upstream: a separate SchedulerStats field."""
        ours, rest = split_stats(data)
        if rest is None:
            return original(self, data, engine_idx)
        metrics = getattr(self, "kv_checksum_metrics", None)
        if metrics is not None:
            try:
                metrics.observe(ours, engine_idx)
            except Exception:
                _disable_after_error(self, "kv_checksum_metrics", "metrics")
        if rest:
            original(self, rest, engine_idx)

    @_wrap(KVConnectorLogging, "observe")
    def logging_observe(original: Callable, self: Any, data: Any) -> None:
        """Target: KVConnectorLogging.observe. Why and how: as for
        KVConnectorProm.observe, minus the recording. Upstream: as there."""
        _, rest = split_stats(data)
        if rest is None:
            return original(self, data)
        if rest:
            original(self, rest)


# ----------------------------------------------------------------------
# Containment hooks (R138)
# ----------------------------------------------------------------------

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
    from vllm.distributed.kv_transfer.kv_checksum.containment import (
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

    def free(request_id: str) -> None:
        original_free(request_id)
        if containment:
            containment.release(request_id)

    def pop_blocks_for_free(request_id: str) -> Any:
        blocks = original_pop(request_id)
        if containment:
            containment.release(request_id)
        return blocks

    for child in _offload_children(scheduler.connector):
        side = child.__dict__.get("_kv_checksum_offload")
        if side is not None:  # R138: no store from a quarantine start on
            side.quarantine = containment.start
    coordinator.cache_blocks = cache_blocks
    coordinator.free = free
    coordinator.pop_blocks_for_free = pop_blocks_for_free
    scheduler.kv_checksum_containment = containment
    kcs.on_failed_load = on_failed_load


# ----------------------------------------------------------------------
# Mamba state splits (R44): attached to each layer's MambaSpec
# ----------------------------------------------------------------------


def _mamba1_splits(layer: Any, tp_size: int, dim_first: bool) -> Any:
    return mamba_splits.mamba1_state_splits(tp_size, layer.intermediate_size, dim_first)


def _mamba2_splits(layer: Any, tp_size: int, dim_first: bool) -> Any:
    """vLLM pads one group to TP groups (`layer.n_groups` is the padded count)
    and then builds conv1d as a plain ColumnParallelLinear: the checkpoint's
    group count was 1."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    one_group = tp_size > 1 and not isinstance(layer.conv1d, MergedColumnParallelLinear)
    return mamba_splits.mamba2_state_splits(
        tp_size,
        layer.intermediate_size,
        1 if one_group else layer.n_groups,
        layer.num_heads,
        layer.ssm_state_size,
        dim_first,
    )


def _gdn_splits(layer: Any, tp_size: int, dim_first: bool) -> Any:
    return mamba_splits.gdn_state_splits(
        tp_size,
        layer.num_k_heads,
        layer.num_v_heads,
        layer.head_k_dim,
        layer.head_v_dim,
        dim_first,
    )


# (module, class, layer -> splits): the layers R44 names.
_MAMBA_SPLIT_LAYERS = (
    ("vllm.model_executor.layers.mamba.mamba_mixer", "MambaMixer", _mamba1_splits),
    ("vllm.model_executor.layers.mamba.mamba_mixer2", "MambaMixer2", _mamba2_splits),
    (
        "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
        "QwenGatedDeltaNetAttention",
        _gdn_splits,
    ),
    (
        "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn",
        "OlmoHybridGatedDeltaNetAttention",
        _gdn_splits,
    ),
)


def _install_mamba_split_hooks() -> None:
    import importlib

    for module_name, class_name, calculator in _MAMBA_SPLIT_LAYERS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception:  # a layer this vLLM build lacks: nothing to describe
            logger.debug("KV checksums: no %s.%s", module_name, class_name)
            continue
        _wrap_mamba_spec(cls, calculator)


def _wrap_mamba_spec(cls: type, calculator: Callable[[Any, int, bool], Any]) -> None:
    @_wrap(cls, "get_kv_cache_spec")
    def get_kv_cache_spec(original: Callable, self: Any, vllm_config: Any) -> Any:
        """R44. Target: get_kv_cache_spec of MambaMixer, MambaMixer2 and the
        Qwen and Olmo GDN layers (inherited from MambaBase).

        Why: the worker numbers split Mamba rows globally and the scheduler
        must know a group is comparable across TP sizes (R85); vLLM 0.33.0's
        MambaSpec has no `state_splits` field.
        How: after the original, the calculator's result (None for sizes TP
        does not divide) is set on the returned spec as an instance
        attribute, which survives pickling to the engine core and its deep
        copies into group specs. Disabled: the original's spec untouched;
        an error leaves the spec without splits (equal-TP comparison only).
        Upstream: `MambaSpec.state_splits` (default None) filled from a
        `MambaBase.get_state_splits()` (default None) in get_kv_cache_spec.
        """
        spec = original(self, vllm_config)
        if spec is None or not _enabled(vllm_config, "get_kv_cache_spec"):
            return spec
        try:
            from vllm.model_executor.layers.mamba.mamba_utils import (
                is_conv_state_dim_first,
            )

            tp_size = vllm_config.parallel_config.tensor_parallel_size
            splits = calculator(self, tp_size, is_conv_state_dim_first())
            mamba_splits.attach_state_splits(spec, splits)
        except Exception:
            logger.exception(
                "KV checksums: no TP splits for %s; its Mamba state verifies "
                "at equal TP only.",
                type(self).__name__,
            )
        return spec
