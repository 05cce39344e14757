# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on the Mooncake P2P connector (R110-R115); the logic is in
carriers/mooncake.py. Not installed if vLLM's Mooncake module cannot be
imported; the Mooncake store connector is left alone (R115).

Hooks (target; why; how; the upstream change that lets it go):

MooncakeConnector (class methods)
    Why: the Mooncake carrier (R110, R111)
    How: as for NIXL push
    Upstream: MooncakeConnector carrying checksums itself
MooncakeConnectorScheduler.build_connector_meta
    Why: ships kept payloads
    How: after the original, `kv_checksums` from the outbox
    Upstream: `kv_checksums` on MooncakeConnectorMetadata
MooncakeConnectorWorker.start_load_kv
    Why: payloads stored before the send is marked ready
    How: before the original
    Upstream: as above
MooncakeConnectorWorker.send_kv_to_decode, `_encoder` (instance)
    Why: the response to a pull carries its requests' checksums
    How: a context variable set around the original; an encoder standing in
    for the worker's that adds the field (`response_type`)
    Upstream: `kv_checksums` on MooncakeXferResponse
MooncakeConnectorWorker.process_pulling_result, `_xfer_resp_decoder` (instance)
    Why: keep received bytes before the load is marked finished
    How: before the original, pulls with local blocks only
    Upstream: as above
MooncakeConnectorWorker.get_transfer_results
    Why: finished loads report bytes; failed and sent drop theirs
    How: after the original
    Upstream: as above
"""

import contextvars
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from vllm.distributed.kv_transfer.kv_checksum.carriers import mooncake
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    _guard,
    _outbox,
    _payload_byte_limit,
    _wrap,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# The request blocks (consumer request id -> (transfer id, blocks)) of the
# pull the current send_kv_to_decode coroutine answers.
CURRENT_PULL: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "kv_checksum_mooncake_pull", default=None
)


def response_type(base: type) -> type:
    """MooncakeXferResponse with `kv_checksums` (R113), omitted when empty.

    The producer encodes a map (consumer request id -> bytes). The consumer
    decodes the field as raw msgpack, neither parsed nor copied, so that a
    malformed or huge value never fails the decode of the response (and with
    it the pull) nor builds objects: `ReceivedChecksums.keep` checks its
    length against the consumer's own limit, then decodes it.
    """

    class MooncakeXferResponseWithChecksums(base, omit_defaults=True):  # type: ignore[misc, valid-type, call-arg]
        kv_checksums: msgspec.Raw = msgspec.Raw()

    return MooncakeXferResponseWithChecksums


class ChecksumResponseEncoder:
    """Producer worker: encodes transfer responses with their checksums.

    Stands in for the worker's msgpack encoder; anything but a response with
    successfully sent requests inside a pull (`CURRENT_PULL`) is encoded
    unchanged.
    """

    def __init__(
        self, inner: Any, base: type, extended: type, store: mooncake.SendChecksums
    ) -> None:
        self.inner = inner
        self.base = base
        self.extended = extended
        self.store = store

    def encode(self, obj: Any) -> bytes:
        pull = CURRENT_PULL.get()
        ok_reqs = getattr(obj, "ok_reqs", None)
        if pull is not None and type(obj) is self.base and ok_reqs:
            sums = self.store.response_field(ok_reqs, pull)
            if sums is not None:
                fields = msgspec.structs.asdict(obj)  # type: ignore[arg-type]
                obj = self.extended(**fields, kv_checksums=sums)
        return self.inner.encode(obj)


def install_mooncake() -> None:
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
        outbox = _outbox(sched)
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
            with _guard(self, "_kv_checksum_outbox", "build_connector_meta"):
                shipped = outbox.ship(meta.reqs_to_send)
                if shipped:
                    meta.kv_checksums = shipped
        return meta

    @_wrap(mc.MooncakeConnectorWorker, "start_load_kv")
    def start_load_kv(original: Callable, self: Any, metadata: Any) -> Any:
        """R112: payloads are stored before the send is marked ready."""
        send = self.__dict__.get("_kv_checksum_send")
        if send is not None:
            with _guard(self, "_kv_checksum_send", "start_load_kv"):
                send.add(getattr(metadata, "kv_checksums", None), metadata.reqs_to_send)
        return original(self, metadata)

    @_wrap(mc.MooncakeConnectorWorker, "send_kv_to_decode")
    async def send_kv_to_decode(
        original: Callable, self: Any, identity: Any, sock: Any, meta: Any
    ) -> Any:
        """R112: responses to this pull may carry its requests' checksums."""
        if self.__dict__.get("_kv_checksum_send") is None:
            return await original(self, identity, sock, meta)
        token = CURRENT_PULL.set(meta.req_blocks)
        try:
            return await original(self, identity, sock, meta)
        finally:
            CURRENT_PULL.reset(token)

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
        with _guard(self, "_kv_checksum_received", "get_transfer_results"):
            self._kv_checksum_send.evict(results.finished_sending)
            taken = received.take(results.finished_recving, results.failed_recving)
            if taken:
                results.kv_checksums = {**taken, **(results.kv_checksums or {})}
        return results


def _attach_mooncake_worker(worker: Any, vllm_config: Any, base: type) -> None:
    """With checksums on only: the payload stores, the response encoder that
    adds checksums and the decoder that reads them (R112-R114)."""
    if worker is None or "_kv_checksum_send" in worker.__dict__:
        return
    max_bytes = _payload_byte_limit(vllm_config)
    extended = response_type(base)
    send = mooncake.SendChecksums()
    worker._encoder = ChecksumResponseEncoder(worker._encoder, base, extended, send)
    worker._xfer_resp_decoder = msgspec.msgpack.Decoder(extended)
    worker._kv_checksum_received = mooncake.ReceivedChecksums(max_bytes)
    worker._kv_checksum_send = send
