# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The producer's side of P/D checksums in the scheduler.

A producer request (do_remote_decode) has its prompt blocks registered in the
step that finishes the prompt (R68); when it finishes, the workers' parts are
summed into the payload its carrier moves (R74), in kv_transfer_params or as
bytes the connector sends itself.
"""

import functools
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumBlocks,
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import (
    first_held_position,
    select_blocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.transfers import (
    PendingTransfer,
    TransferSetup,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
    UnverifiedReason,
    build_producer_payload,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

Params = dict[str, Any] | None


class KVChecksumProducer:
    """Registers producer requests' prompts and builds their payloads (R68,
    R74); the scheduler side's producer half."""

    def __init__(self, setup: TransferSetup) -> None:
        self.setup = setup
        self.log = setup.log
        # Producer requests (do_remote_decode), in arrival order (R142).
        self._producers: dict[str, None] = {}
        self._sends: dict[str, PendingTransfer] = {}
        self._outgoing: dict[str, bytes] = {}
        self._step: dict[str, KVChecksumBlocks] = {}

    def request_ids(self) -> set[str]:
        """Requests with producer-side state here (R141)."""
        return set(self._producers).union(self._sends, self._outgoing)

    def note(self, request: Any) -> None:
        """Remember a producer request on arrival (R142)."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._producers[request.request_id] = None

    def add_sends(
        self, scheduled: Mapping[str, int], requests: Mapping[str, Any], manager: Any
    ) -> None:
        """`add_send` for this step's scheduled producer requests only, so a
        step of other requests loops over none of them (R68, R142)."""
        if not self._producers:
            return  # no producer request on this engine (R142)
        for req_id in [r for r in self._producers if r in scheduled]:
            self.add_send(requests[req_id], scheduled[req_id], manager)

    def add_send(
        self, request: Any, num_scheduled_tokens: int, kv_cache_manager: Any
    ) -> None:
        """Register a producer's prompt in the step that finishes it (R68)."""
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return
        computed = request.num_computed_tokens
        prompt = request.num_prompt_tokens
        if not computed - num_scheduled_tokens < prompt <= computed:
            return
        if self.setup.carrier(request, False) is None:
            return
        blocks = kv_cache_manager.get_blocks(request.request_id).blocks
        selected = select_blocks(blocks, self.setup.groups, 0, computed)
        self._sends[request.request_id] = PendingTransfer(selected)
        self._step[request.request_id] = selected

    def take_step(self) -> dict[str, KVChecksumBlocks]:
        """This step's sends for the workers, then reset (R71)."""
        step, self._step = self._step, {}
        return step

    def has_step(self) -> bool:
        """Whether this step registered a send."""
        return bool(self._step)

    def pending(self, req_id: str) -> PendingTransfer | None:
        return self._sends.get(req_id)

    def clear(self) -> int:
        """Drop every producer and send (R134); returns the sends dropped."""
        dropped = len(self._sends)
        self._producers.clear()
        self._sends.clear()
        self._step = {}
        return dropped

    def request_finished(
        self, request: Any, kv_transfer_params: Params, kv_cache_manager: Any
    ) -> Params:
        """Drop the request's state; a finished producer builds its payload (R74).

        Returns the kv_transfer_params with "kv_checksums" added for
        KV_TRANSFER_PARAMS carriers; CONNECTOR bytes are kept for
        `take_kv_checksums_to_send`.
        """
        req_id = request.request_id
        self._producers.pop(req_id, None)
        send = self._sends.pop(req_id, None)
        if send is None or not _finished_normally(request):
            return kv_transfer_params
        setup = self.setup
        infos = setup.group_infos
        payload = build_producer_payload(
            send.reports, send.blocks, setup.num_workers, setup.tp_size, infos
        )
        if (
            not isinstance(payload, str)
            and kv_cache_manager is not None
            and self._may_free_blocks(payload)
        ):
            held = kv_cache_manager.get_blocks(req_id).blocks
            payload.groups = _held_groups(payload, send.blocks, held, infos)
        if isinstance(payload, str):
            self.log.warn_once(f"KV checksums not sent: {_reason_kind(payload)}.")
            logger.debug("KV checksums not sent for request %s: %s", req_id, payload)
            self.log.stats.record_not_sent(_reason_kind(payload))
            return kv_transfer_params
        carrier = self.setup.carrier(request, False)
        if carrier == KVChecksumCarrier.KV_TRANSFER_PARAMS:
            if kv_transfer_params is None:
                return None
            self.log.stats.record_sent()
            return {**kv_transfer_params, KV_TRANSFER_PARAMS_KEY: payload.to_base64()}
        if carrier == KVChecksumCarrier.CONNECTOR:
            self.log.stats.record_sent()
            self._outgoing[req_id] = payload.to_bytes()
        return kv_transfer_params

    def _may_free_blocks(self, payload: KVChecksumPayload) -> bool:
        """Whether a payload group's blocks may have been freed before the
        request finished (R66): not for full attention, which holds them."""
        groups = self.setup.groups
        return not all(groups[g.group_id].holds_all_blocks for g in payload.groups)

    def take_kv_checksums_to_send(self, req_id: str) -> bytes | None:
        """The CONNECTOR-carried bytes of a finished producer request, once."""
        return self._outgoing.pop(req_id, None)


def _held_groups(
    payload: KVChecksumPayload,
    scheduled: KVChecksumBlocks,
    held: Any,
    infos: Mapping[int, KVChecksumGroupInfo],
) -> list:
    """The payload's groups without chunks of blocks freed since they were
    checksummed (R66): a consumer cannot load those, so comparing them would
    be a false mismatch. A group whose last block was freed is left out."""
    groups = []
    for group in payload.groups:
        if infos[group.group_id].is_mamba:
            groups.append(group)  # one running state, held until freed (R67)
            continue
        start, block_ids = scheduled.groups[group.group_id]
        first = first_held_position(held[group.group_id], start, len(block_ids))
        if first is None:
            continue
        cut = (first - start) * infos[group.group_id].chunks_per_block
        cut = min(cut, len(group.values))
        group.start += cut
        group.values = group.values[cut:]
        groups.append(group)
    return groups


def _finished_normally(request: Any) -> bool:
    """Stop or length: only those producers' KV is used by a consumer (R74)."""
    return request.status in _normal_finishes()


@functools.cache
def _normal_finishes() -> tuple[Any, ...]:
    """The stop and length statuses of vLLM, imported on first use and kept,
    not imported again by every finishing request (issue 30)."""
    from vllm.v1.request import RequestStatus

    return (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _reason_kind(detail: str) -> str:
    """The fixed reason of a not-sent detail from `build_producer_payload`."""
    if detail.endswith("workers reported"):
        return UnverifiedReason.NOT_ALL_WORKERS.value
    return UnverifiedReason.OTHER_BLOCKS.value
