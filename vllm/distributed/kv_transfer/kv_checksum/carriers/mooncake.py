# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mooncake P2P as a CONNECTOR carrier of checksums (R110-R115).

The router sends a request to producer and consumer at once; the consumer
pulls, and the only message after the KV is written is the producer's
transfer response, so the payload rides on it:

* producer scheduler: an `outbox.ChecksumOutbox` keeps the bytes of
  a request about to be sent and hands them to the next connector metadata as
  `kv_checksums` (R111);
* producer worker: `SendChecksums` keeps them per transfer id; the response
  to a pull carries, for the requests sent successfully, the field
  `kv_checksums` (`SendChecksums.response_field`: a msgpack map, consumer
  request id -> bytes) (R112);
* consumer worker: the field decodes as raw msgpack (omitted when empty,
  ignored by peers without it, R113); `ReceivedChecksums` keeps the first
  copy of each loaded request's bytes before the load is marked finished and
  hands them over with its finished_recving (R114).

Only Mooncake P2P: the Mooncake store connector declares no carrier (R115).
"""

import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def mooncake_carrier(request: Any, receiving: bool) -> KVChecksumCarrier | None:
    """R110: CONNECTOR for producer requests with a transfer id and for loads."""
    params = request.kv_transfer_params or {}
    remote_decode = bool(params.get("do_remote_decode"))
    if receiving:
        return None if remote_decode else KVChecksumCarrier.CONNECTOR
    if remote_decode and params.get("transfer_id"):
        return KVChecksumCarrier.CONNECTOR
    return None


# Bytes a map entry may add to its checksums: key (a request id) and headers.
_ENTRY_OVERHEAD = 1024
# The checksums of a response, decoded only after their length is checked.
_SUMS_DECODER = msgspec.msgpack.Decoder(dict[str, bytes])


@dataclass
class SendChecksums:
    """Producer worker: payloads by transfer id, until the send finishes.

    Written by the engine's main thread, read on the sender loop.
    """

    by_transfer: dict[str, bytes] = field(default_factory=dict)
    transfer_of: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self,
        payloads: Mapping[str, bytes] | None,
        reqs_to_send: Mapping[str, tuple[str, Any]],
    ) -> None:
        """R112: keep each shipped payload under its request's transfer id."""
        with self.lock:
            for req_id, data in (payloads or {}).items():
                entry = reqs_to_send.get(req_id)
                if entry is not None:
                    self.by_transfer[entry[0]] = data
                    self.transfer_of[req_id] = entry[0]

    def for_response(
        self, ok_reqs: Iterable[str], pull: Mapping[str, Any]
    ) -> dict[str, bytes]:
        """Consumer request id -> bytes for the requests sent successfully."""
        out: dict[str, bytes] = {}
        with self.lock:
            for d_req_id in ok_reqs:
                entry = pull.get(d_req_id)
                data = None if entry is None else self.by_transfer.get(entry[0])
                if data is not None:
                    out[d_req_id] = data
        return out

    def response_field(
        self, ok_reqs: Iterable[str], pull: Mapping[str, Any]
    ) -> msgspec.Raw | None:
        """R112: the response's `kv_checksums`, a msgpack map of the requests
        sent successfully; None when none has checksums: the field keeps its
        default, which is left out of the message (an empty Raw would not be,
        and would encode as nothing)."""
        sums = self.for_response(ok_reqs, pull)
        return msgspec.Raw(msgspec.msgpack.encode(sums)) if sums else None

    def evict(self, req_ids: Iterable[str]) -> None:
        with self.lock:
            for req_id in req_ids:
                transfer_id = self.transfer_of.pop(req_id, None)
                if transfer_id is not None:
                    self.by_transfer.pop(transfer_id, None)


@dataclass
class ReceivedChecksums:
    """Consumer worker: first copy of each loading request's checksums."""

    max_bytes: int
    by_request: dict[str, bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def keep(self, response: Any, loading: Collection[str]) -> None:
        """R114 (receiver loop, before the load is marked finished): keep
        the bytes of requests this response completes; malformed or
        oversized values are left out (the load stays unverified).

        `loading` are the requests of this pull that vLLM will report
        finished (a pull with no local blocks never is, so its bytes would
        never be taken). The raw value is decoded only when it fits their
        limits: memory and work stay bounded by `max_bytes` per distinct such
        load (a request id repeated in `ok_reqs` counts once).
        """
        raw = getattr(response, "kv_checksums", None)
        if not isinstance(raw, msgspec.Raw) or not len(raw):
            return
        ids = [
            req_id
            for req_id in dict.fromkeys(getattr(response, "ok_reqs", None) or ())
            if req_id in loading
        ]
        # Per entry: the bytes, their bin header and a request id.
        budget = len(ids) * (self.max_bytes + _ENTRY_OVERHEAD)
        if not ids:
            return
        if len(raw) > budget:
            logger.warning(
                "KV checksums of a Mooncake response skipped: %d bytes exceed "
                "the budget of %d bytes for its %d loading requests; those "
                "loads end unverified.",
                len(raw),
                budget,
                len(ids),
            )
            return
        try:
            sums = _SUMS_DECODER.decode(raw)
        except (msgspec.MsgspecError, RecursionError, OverflowError):
            return
        with self.lock:
            for req_id in ids:
                data = sums.get(req_id)
                if data is not None and len(data) <= self.max_bytes:
                    self.by_request.setdefault(req_id, data)

    def take(self, finished: Iterable[str], failed: Iterable[str]) -> dict[str, bytes]:
        """Bytes of the loads finished now; failed loads drop theirs."""
        with self.lock:
            taken = {
                r: self.by_request.pop(r) for r in finished if r in self.by_request
            }
            for req_id in failed:
                taken.pop(req_id, None)
        return taken
