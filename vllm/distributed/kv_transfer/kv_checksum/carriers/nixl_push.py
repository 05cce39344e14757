# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push as a CONNECTOR carrier of checksums (R103-R109).

In push mode the producer WRITEs into the consumer's blocks and nothing comes
back through kv_transfer_params, so the payload rides on the WRITE's
completion notif, which NIXL delivers after the data:

* producer scheduler: an `outbox.ChecksumOutbox` keeps the bytes of a request
  whose finished blocks are about to be pushed and hands them to the next
  connector metadata next to those blocks (R104);
* producer worker: `PushSendStore` keeps them until the request is evicted;
  the WRITE of a request whose consumer advertised checksums carries
  `encode_checksum_notif(...)` instead of the plain "id:tp_size" (R105, R106);
* consumer worker: `ChecksumNotifQueue` turns a checksum notif back into the
  plain form before vLLM's completion accounting sees it, keeping the first
  copy of the bytes for `get_transfer_results` (R107).

The consumer advertises that it reads checksum notifs in its registration
(`REGISTRATION_KEY`): a producer only sends the checksum form to a consumer
that asked for it, so engines with checksums off (or without the package) on
either side keep exchanging plain notifs (see `wants_checksum_notif`).

Nothing here imports vLLM's NIXL modules; NixlPushConnector's scheduler and
worker call these pieces (the plugin's wiring module on vLLM 0.33.0).
"""

import queue
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

KV_CHECKSUM_NOTIF_PREFIX = b"KV_CHECKSUM:"
# Key a consumer adds to its push registration: it reads checksum notifs.
REGISTRATION_KEY = "kv_checksum_notif"
REGISTRATION_VERSION = 1
# A checksum notif's body: the checksums element is kept raw (not decoded, not
# copied) until its length is checked, so a peer's notif never builds objects.
_NOTIF_DECODER = msgspec.msgpack.Decoder(tuple[str, int, msgspec.Raw])
_BYTES_DECODER = msgspec.msgpack.Decoder(bytes)


def nixl_push_carrier(request: Any, receiving: bool) -> KVChecksumCarrier | None:
    """R103: CONNECTOR for producer requests and loads.

    A load whose request still has `do_remote_decode` set is bidirectional,
    which push mode refuses at start-up; it gets None like in pull (R102).
    """
    params = request.kv_transfer_params or {}
    if receiving == bool(params.get("do_remote_decode")):
        return None
    return KVChecksumCarrier.CONNECTOR


@dataclass
class PushSendStore:
    """Producer worker: payloads per request, until the request is evicted.

    Written by the engine's main thread, read by the writer thread.
    """

    by_request: dict[str, bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, payloads: Mapping[str, bytes] | None) -> None:
        if payloads:
            with self.lock:
                self.by_request.update(payloads)

    def get(self, req_id: str) -> bytes | None:
        with self.lock:
            return self.by_request.get(req_id)

    def evict(self, req_ids: Iterable[str]) -> None:
        with self.lock:
            for req_id in req_ids:
                self.by_request.pop(req_id, None)


class PushWriteContext(threading.local):
    """The checksums of the push the current (writer) thread is starting.

    Set around one request's WRITE submission; `notif_for` then replaces the
    plain completion notif of each WRITE with the checksum form (R105).
    """

    data: bytes | None = None

    def notif_for(self, notif_msg: Any) -> Any:
        if self.data is None or not isinstance(notif_msg, bytes):
            return notif_msg
        notif = checksum_notif_for(notif_msg, self.data)
        return notif_msg if notif is None else notif


PUSH_WRITE = PushWriteContext()


def advertise(registrations: Mapping[str, Any] | None) -> None:
    """Consumer worker: ask producers for checksum notifs (REGISTRATION_KEY)."""
    for registration in (registrations or {}).values():
        if isinstance(registration, dict):
            registration[REGISTRATION_KEY] = REGISTRATION_VERSION


def wants_checksum_notif(registration: Any) -> bool:
    """Whether a consumer's push registration asked for checksum notifs."""
    return isinstance(registration, Mapping) and (
        registration.get(REGISTRATION_KEY) == REGISTRATION_VERSION
    )


def encode_checksum_notif(remote_request_id: str, tp_size: int, data: bytes) -> bytes:
    """R105: prefix + msgpack([remote_request_id, tp_size, checksums])."""
    body = msgspec.msgpack.encode([remote_request_id, int(tp_size), bytes(data)])
    return KV_CHECKSUM_NOTIF_PREFIX + body


def checksum_notif_for(plain: bytes, data: bytes) -> bytes | None:
    """The checksum form of vLLM's plain "remote_request_id:tp_size" notif.

    None when `plain` is not of that form (the caller then sends it as is).
    """
    try:
        req_id, tp_size = bytes(plain).decode("utf-8").rsplit(":", 1)
        return encode_checksum_notif(req_id, int(tp_size), data)
    except (UnicodeDecodeError, ValueError):
        return None


def decode_checksum_notif(notif: bytes, max_bytes: int) -> tuple[str, int, bytes]:
    """Parse a checksum notif; ValueError when its id and TP size do not
    decode (R107: the notif is then dropped, like a lost one).

    Checksums that are not bytes or longer than `max_bytes` (the consumer's
    payload limit) come back empty: the load completes but stays unverified.
    Work and memory are bounded by the notif's length and `max_bytes`.
    """
    if not notif.startswith(KV_CHECKSUM_NOTIF_PREFIX):
        raise ValueError("not a checksum notif")
    body = memoryview(notif)[len(KV_CHECKSUM_NOTIF_PREFIX) :]
    try:
        req_id, tp_size, raw = _NOTIF_DECODER.decode(body)
    except (msgspec.MsgspecError, RecursionError, OverflowError) as e:
        raise ValueError(f"undecodable checksum notif: {e}") from e
    if tp_size < 1:
        raise ValueError("malformed checksum notif")
    data = b""
    # A bin header is at most 5 bytes: a longer element holds too many.
    if len(raw) <= max_bytes + 5:
        try:
            data = _BYTES_DECODER.decode(raw)
        except msgspec.MsgspecError:
            data = b""
    return req_id, tp_size, (data if len(data) <= max_bytes else b"")


class ChecksumNotifQueue(queue.Queue):
    """Consumer worker: the queue of completion notifs, reading checksums.

    `put` (on the writer thread) turns a checksum notif into vLLM's plain
    "id:tp_size" form, so one completion accounting applies to both forms,
    and keeps the first copy of its checksums per request (R106, R107). An
    undecodable checksum notif is logged and dropped, like a lost notif.
    `attach` installs it on an existing queue, keeping what it holds.
    """

    kv_checksum_received: dict[str, bytes]
    kv_checksum_lock: threading.Lock
    kv_checksum_max_bytes: int

    @classmethod
    def attach(cls, existing: queue.Queue, max_bytes: int) -> "ChecksumNotifQueue":
        existing.kv_checksum_received = {}  # type: ignore[attr-defined]
        existing.kv_checksum_lock = threading.Lock()  # type: ignore[attr-defined]
        existing.kv_checksum_max_bytes = max_bytes  # type: ignore[attr-defined]
        existing.__class__ = cls
        assert isinstance(existing, cls)
        return existing

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, bytes) and item.startswith(KV_CHECKSUM_NOTIF_PREFIX):
            try:
                req_id, tp_size, data = decode_checksum_notif(
                    item, self.kv_checksum_max_bytes
                )
            except ValueError as e:
                logger.warning("KV checksum notif dropped: %s.", e)
                return
            if data:
                with self.kv_checksum_lock:
                    self.kv_checksum_received.setdefault(req_id, data)
            item = f"{req_id}:{tp_size}".encode()
        super().put(item, block, timeout)

    def stop_keeping(self) -> None:
        """Checksums turned off on this worker: turn later checksum notifs
        into plain ones without keeping their bytes (nobody takes them)."""
        with self.kv_checksum_lock:
            self.kv_checksum_max_bytes = -1
            self.kv_checksum_received.clear()

    def take(self, finished: Iterable[str], live: Iterable[str]) -> dict[str, bytes]:
        """Checksums of the loads finished now; drop those of unknown loads.

        `live` are the requests still loading: their bytes stay until their
        own completion (R107: they live as long as the receive metadata).
        """
        keep = set(live)
        with self.kv_checksum_lock:
            received = self.kv_checksum_received
            taken = {r: received.pop(r) for r in finished if r in received}
            for req_id in [r for r in received if r not in keep]:
                del received[req_id]
        return taken
