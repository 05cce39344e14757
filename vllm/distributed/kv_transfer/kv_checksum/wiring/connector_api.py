# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on the connector API: records on vLLM's dataclasses, the carrier API
on KVConnectorBase_V1 and NixlPullConnector, and MultiConnector (R9, R10 i,
R97-R102).

Hooks (target; why; how; the upstream change that lets it go):

SchedulerOutput, KVConnectorOutput, KVConnectorTransferResults
    Why: the step's blocks go to workers, records come back, connectors report
    received bytes
    How: class attributes defaulting to None
    Upstream: optional dataclass fields `kv_checksum_scheduled`, `kv_checksums`
KVConnectorOutput.is_empty
    Why: a checksum-only output must not be dropped
    How: not empty while `kv_checksums` holds records
    Upstream: `kv_checksums` listed in is_empty
KVConnectorBase_V1, NixlPullConnector (class methods)
    Why: generic code asks each connector how it carries checksums
    How: defaults added to the base class (never overriding); NIXL pull declares the
    kv_transfer_params carrier
    Upstream: the carrier methods on KVConnectorBase_V1 and in each connector
MultiConnector (class methods), .get_transfer_results, children's
  get_transfer_results (instance)
    Why: the merged results drop the children's received bytes
    How: delegate to the chosen child; collect the children's bytes (checksums on
    only)
    Upstream: MultiConnector merging `kv_checksums` itself
"""

import contextlib
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.carriers import (
    connector_api as connectors,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    _wrap,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def install_records() -> None:
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


def install_connector_api() -> None:
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
