# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on NIXL push: the connector's carrier methods, its scheduler's
build_connector_meta and its worker (R103-R109); the logic is in
carriers/nixl_push.py.

Hooks (target; why; how; the upstream change that lets it go):

NixlPushConnector (class methods)
    Why: the push carrier (R103, R104)
    How: `kv_checksum_carrier`, `send_kv_checksums` (outbox),
    `register_kv_checksum_worker`
    Upstream: NixlPushConnector carrying checksums itself
NixlPushConnectorScheduler.build_connector_meta
    Why: kept payloads travel with their finished blocks
    How: after the original, `push_finished_kv_checksums` from the outbox
    Upstream: a `kv_checksums` field on NixlConnectorMetadata
NixlPushConnectorWorker.start_load_kv
    Why: payloads reach the writer before their blocks; consumers ask for checksum
    notifs
    How: before the original, store payloads, advertise in registrations
    Upstream: as above
NixlPushConnectorWorker._do_start_push_kv, the agent's make_prepped_xfer (instance)
    Why: WRITEs carry the checksum notif when the consumer asked
    How: a thread-local set around the original
    Upstream: the checksum notif form in the push worker
NixlPushConnectorWorker._pending_completion_notifs (instance)
    Why: checksum notifs become plain completion notifs; their bytes are kept
    How: its class becomes a Queue subclass
    Upstream: as above
NixlPushConnectorWorker.get_transfer_results
    Why: finished loads report bytes; sent requests drop payloads
    How: after the original
    Upstream: as above
"""

import contextlib
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.carriers import nixl_push
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    _disable_after_error,
    _guard,
    _outbox,
    _payload_byte_limit,
    _wrap,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def install_nixl_push() -> None:
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
        outbox = _outbox(sched)
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
            with _guard(self, "_kv_checksum_outbox", "build_connector_meta"):
                shipped = outbox.ship(meta.push_finished_blocks)
                if shipped:
                    meta.push_finished_kv_checksums = shipped
        return meta

    @_wrap(NixlPushConnectorWorker, "start_load_kv")
    def start_load_kv(original: Callable, self: Any, metadata: Any) -> Any:
        """R105: payloads reach the writer before the blocks they go with;
        the consumer's registrations ask for checksum notifs."""
        store = self.__dict__.get("_kv_checksum_push")
        if store is not None:
            with _guard(
                self, "_kv_checksum_push", "start_load_kv", _disable_push_worker
            ):
                store.add(getattr(metadata, "push_finished_kv_checksums", None))
                nixl_push.advertise(metadata.push_registrations)
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
        with _guard(
            self, "_kv_checksum_push", "get_transfer_results", _disable_push_worker
        ):
            store.evict(results.finished_sending)
            notifs = self._pending_completion_notifs
            if isinstance(notifs, nixl_push.ChecksumNotifQueue):
                taken = notifs.take(
                    results.finished_recving, list(self._recving_metadata)
                )
                if taken:
                    results.kv_checksums = {**taken, **(results.kv_checksums or {})}
        return results


def _disable_push_worker(worker: Any, attr: str, where: str) -> None:
    """Checksums off on a push worker after an error: its notif queue stops
    keeping bytes nobody will take."""
    _disable_after_error(worker, attr, where)
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
