# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The connector side of checksums: the carrier API and its adaptations (R97-R102).

`KVChecksumConnectorMixin` holds the scheduler-side methods every connector
gets (defaults: no carrier). NIXL pull declares the kv_transfer_params carrier;
MultiConnector delegates to the sub-connector that loads or sends a request.
The wiring module installs these methods on vLLM's classes.
"""

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)


class KVChecksumConnectorMixin:
    """Defaults of the carrier API on KVConnectorBase_V1 (R98)."""

    def kv_checksum_carrier(
        self, request: Any, receiving: bool
    ) -> KVChecksumCarrier | None:
        """How this connector moves checksums of `request`; None: not at all."""
        return None

    def send_kv_checksums(self, request: Any, checksums: bytes) -> None:
        """Take a CONNECTOR-carried producer payload after request_finished."""
        return None

    def get_kv_checksum_sources(self, request: Any) -> set[str]:
        """Hit sources whose loads have stored block checksums (R119)."""
        return set()

    def on_kv_checksum_failure(
        self, request: Any, mismatches: Mapping[int, list[int]]
    ) -> None:
        """A checked offload load failed; drop bad copies (R121)."""
        return None

    def register_kv_checksum_worker(self, worker: Any) -> None:
        """Receive the worker's checksum worker (R117)."""
        return None


def nixl_pull_carrier(request: Any, receiving: bool) -> KVChecksumCarrier | None:
    """NIXL pull: kv_transfer_params for producer requests and regular loads.

    A bidirectional load (`do_remote_decode` still set) reads blocks whose
    source sent no checksums, so it is neither verified nor unverified (R102).
    """
    params = request.kv_transfer_params or {}
    remote_decode = bool(params.get("do_remote_decode"))
    if receiving == remote_decode:
        return None
    return KVChecksumCarrier.KV_TRANSFER_PARAMS


def multi_carrier(
    sub_connectors: list[Any],
    chosen: int | None,
    request: Any,
    receiving: bool,
) -> KVChecksumCarrier | None:
    """MultiConnector (R101): the loading sub-connector's, or the first non-None."""
    if receiving:
        if chosen is None or not 0 <= chosen < len(sub_connectors):
            return None
        return sub_connectors[chosen].kv_checksum_carrier(request, True)
    for connector in sub_connectors:
        carrier = connector.kv_checksum_carrier(request, False)
        if carrier is not None:
            return carrier
    return None


def chosen_connector(sub_connectors: list[Any], chosen: int | None) -> Any | None:
    """MultiConnector: the sub-connector that loads a request, if any (R101)."""
    if chosen is None or not 0 <= chosen < len(sub_connectors):
        return None
    return sub_connectors[chosen]


def multi_sender(sub_connectors: list[Any], request: Any) -> Any | None:
    """The sub-connector that carries a producer request's checksums (R101)."""
    for connector in sub_connectors:
        if connector.kv_checksum_carrier(request, False) is not None:
            return connector
    return None


def merge_received(
    into: dict[str, bytes], received: Mapping[str, bytes] | None
) -> None:
    """Merge sub-connectors' received checksums; the first copy wins (R99, R101)."""
    for req_id, data in (received or {}).items():
        into.setdefault(req_id, data)
