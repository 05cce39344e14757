# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The consumer's side of checksums in the scheduler: loads into this engine.

A P/D load is noted when its request arrives (R69); when it starts, the blocks
it writes are registered (R70) and, once it finished and every worker
reported, compared with the producer's payload (R72). A load of offloaded KV
goes to `KVChecksumOffloadLoads` instead (R119-R121), also for a noted request
whose load does not come from the producer (a MultiConnector whose offload
child, listed first, loads its prefix from host memory). Under fail-closed a load
that did not verify must fail (R4).
"""

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumBlocks,
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import select_blocks
from vllm.distributed.kv_transfer.kv_checksum.engine.transfers import (
    PendingReceive,
    PendingTransfer,
    TransferSetup,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.loads import (
    KVChecksumOffloadLoads,
    PendingOffloadLoad,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    KVChecksumPayload,
    KVChecksumPayloadLimits,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
    UnverifiedReason,
    verify_load,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

P2P_SOURCE = "p2p"

# hit_sources(request, num_external_tokens) -> names of the sources of the hit
HitSourcesFn = Callable[[Any, int], set[str]]


class StepHitSources:
    """A starting load's hit sources (R119): the answer vLLM's prefix-cache
    stats got from the connector for the same request and token count in this
    step, else the connector's own. OffloadingConnector's answer walks every
    loaded key in Python, the largest scheduler-side cost per host load."""

    def __init__(self, ask: HitSourcesFn) -> None:
        self.ask = ask
        self.answers: dict[tuple[str, int], set[str]] = {}

    def note(self, request_id: str, num_tokens: int, sources: Iterable[Any]) -> None:
        """The connector's answer to vLLM for a load starting in this step."""
        self.answers[(request_id, num_tokens)] = {
            getattr(s, "value", s) for s in sources
        }

    def __call__(self, request: Any, num_tokens: int) -> set[str]:
        answer = self.answers.pop((request.request_id, num_tokens), None)
        return self.ask(request, num_tokens) if answer is None else answer

    def end_step(self) -> None:
        """Answers no check took leave with their step."""
        self.answers.clear()


class KVChecksumConsumer:
    """Registers the loads into this engine and verifies them (R69-R73,
    R119-R121); the scheduler side's consumer half."""

    def __init__(
        self,
        setup: TransferSetup,
        fail_closed: bool,
        hit_sources: HitSourcesFn,
        limits: KVChecksumPayloadLimits,
        offload: KVChecksumOffloadLoads,
    ) -> None:
        self.setup = setup
        self.log = setup.log
        self.fail_closed = fail_closed
        self.hit_sources = hit_sources
        self.limits = limits
        self.offload = offload
        self._noted: set[str] = set()
        self._recvs: dict[str, PendingReceive] = {}
        self._step_recvs: dict[str, KVChecksumBlocks] = {}
        self._step_loads: dict[str, KVChecksumBlocks] = {}

    # ------------------------------------------------------------------
    # Registration
    # ------------------------------------------------------------------

    def request_ids(self) -> set[str]:
        """Requests with consumer-side state here (R141)."""
        return self._noted.union(self._recvs)

    def note(self, request: Any) -> None:
        """Note a consumer request before its connector starts the load (R69)."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and not params.get("do_remote_decode"):
            self._noted.add(request.request_id)

    def add_recv(
        self, request: Any, blocks: Any, num_local_computed_tokens: int
    ) -> None:
        """Register the blocks a starting load writes (R70, R119)."""
        req_id = request.request_id
        noted = req_id in self._noted
        self._noted.discard(req_id)
        num_external = request.num_computed_tokens - num_local_computed_tokens
        if num_external <= 0:
            return
        sources = set(self.hit_sources(request, num_external))
        if noted and sources == {P2P_SOURCE}:
            self._add_receive(request, blocks, num_local_computed_tokens)
        else:
            # Not a P/D pull, also for a noted request that a MultiConnector
            # hands to an offload child listed before its P/D child: judged
            # as a load of its own sources (R119).
            self._add_offload_load(request, blocks, num_local_computed_tokens, sources)

    def _add_receive(
        self, request: Any, blocks: Any, num_local_computed_tokens: int
    ) -> None:
        """A P/D pull is checked if its connector carries checksums (R70)."""
        req_id = request.request_id
        carrier = self.setup.carrier(request, True)
        if carrier is None:
            return
        selected = self._loaded_blocks(request, blocks, num_local_computed_tokens)
        pending = PendingReceive(selected, carrier=carrier)
        if carrier == KVChecksumCarrier.KV_TRANSFER_PARAMS:
            params = request.kv_transfer_params or {}
            self._expect(pending, params.get(KV_TRANSFER_PARAMS_KEY))
        self._recvs[req_id] = pending
        self._step_recvs[req_id] = selected

    def _add_offload_load(
        self,
        request: Any,
        blocks: Any,
        num_local_computed_tokens: int,
        sources: set[str],
    ) -> None:
        """A load whose every hit source stores checksums is checked (R119)."""
        if not self.offload.is_checked(request, sources):
            return
        selected = self._loaded_blocks(request, blocks, num_local_computed_tokens)
        self.offload.add(request, selected)
        self._step_loads[request.request_id] = selected

    def _loaded_blocks(
        self, request: Any, blocks: Any, num_local_computed_tokens: int
    ) -> KVChecksumBlocks:
        """The blocks a starting load writes: its tokens past the local hit (R64)."""
        return select_blocks(
            blocks.blocks,
            self.setup.groups,
            num_local_computed_tokens,
            request.num_computed_tokens,
        )

    def take_step(
        self,
    ) -> tuple[dict[str, KVChecksumBlocks], dict[str, KVChecksumBlocks]]:
        """This step's receives and offload loads for the workers, then reset."""
        step = (self._step_recvs, self._step_loads)
        self._step_recvs, self._step_loads = {}, {}
        return step

    def has_step(self) -> bool:
        """Whether this step registered a receive or an offload load."""
        return bool(self._step_recvs or self._step_loads)

    def pending(self, req_id: str) -> PendingReceive | PendingOffloadLoad | None:
        return self._recvs.get(req_id) or self.offload.pending.get(req_id)

    def drop(self, req_id: str) -> None:
        """Forget a finished request's loads."""
        self._noted.discard(req_id)
        self._recvs.pop(req_id, None)
        self.offload.pending.pop(req_id, None)

    def clear(self) -> int:
        """Drop every noted and pending load (R134); returns the loads dropped."""
        dropped = len(self._recvs) + len(self.offload.pending)
        self._noted.clear()
        self._recvs.clear()
        self.offload.pending.clear()
        self._step_recvs, self._step_loads = {}, {}
        return dropped

    # ------------------------------------------------------------------
    # The producer's checksums and verification
    # ------------------------------------------------------------------

    def store_received(self, received: Mapping[str, object]) -> None:
        """CONNECTOR-carried checksums a worker received for our loads (R99)."""
        for req_id, data in received.items():
            recv = self._recvs.get(req_id)
            if (
                recv is not None
                and recv.carrier == KVChecksumCarrier.CONNECTOR
                and recv.expected is None
                and recv.expected_error is None
            ):
                self._expect(recv, data)

    def _expect(self, pending: PendingReceive, value: object) -> None:
        """Decode the producer's checksums; bad input makes the load unverified."""
        if value is None:
            return
        try:
            if isinstance(value, (bytes, bytearray, memoryview)):
                pending.expected = KVChecksumPayload.from_bytes(value, self.limits)
            else:
                pending.expected = KVChecksumPayload.from_base64(value, self.limits)
        except Exception as e:  # decoding raises only ValueError (R79); be total
            pending.expected_error = UnverifiedReason.INVALID_CHECKSUMS
            pending.decode_error = str(e) or type(e).__name__

    def finish_loads(
        self, finished_recving: Iterable[str], skip: set[str], invalid: np.ndarray
    ) -> set[str]:
        """Verify finished loads; return those that must fail (R72, R73)."""
        failing: set[str] = set()
        for req_id in finished_recving:
            try:
                must_fail = self._finish_load(req_id, skip, invalid)
            except Exception:
                # R134: a bug or an input no check foresaw ends this load
                # unverified; it never leaves vLLM's scheduler.
                must_fail = self._internal_error(req_id)
            if must_fail:
                failing.add(req_id)
        return failing

    def _finish_load(self, req_id: str, skip: set[str], invalid: np.ndarray) -> bool:
        """Verify one finished load; returns whether it must fail (R72, R73)."""
        load = self.offload.pending.pop(req_id, None)
        pending = self._recvs.pop(req_id, None)
        must_fail = (
            load is not None
            and req_id not in skip
            and not _writes_any(load, invalid)
            and self._check_offload_load(req_id, load)
        )
        if pending is None or req_id in skip or _writes_any(pending, invalid):
            return must_fail
        verdict = self._verify(req_id, pending)
        if verdict.status != KVChecksumStatus.VERIFIED and self.fail_closed:
            must_fail = True
        return must_fail

    def _internal_error(self, req_id: str) -> bool:
        """Log and count a verification that raised; fail it if fail-closed."""
        logger.exception("Verifying the KV checksums of request %s failed", req_id)
        verdict = KVChecksumVerdict(
            KVChecksumStatus.UNVERIFIED,
            reasons=[(UnverifiedReason.INTERNAL_ERROR, "see the error log")],
        )
        self.log.stats.record_verdict(verdict)
        return self.fail_closed

    def _check_offload_load(self, req_id: str, load: PendingOffloadLoad) -> bool:
        """Verify an offload load (R120); tell the connector of a failure (R121).

        Returns whether the load must fail (fail-closed and not verified).
        """
        verdict = self.offload.verify(load)
        self.log.record(req_id, verdict, load.blocks)
        if verdict.status == KVChecksumStatus.VERIFIED:
            return False
        self.offload.report_failure(req_id, load, verdict)
        self.log.failed(req_id, verdict, load.blocks)
        return self.fail_closed

    def _verify(self, req_id: str, pending: PendingReceive) -> KVChecksumVerdict:
        verdict = verify_load(
            pending.expected,
            pending.expected_error,
            pending.reports,
            pending.blocks,
            self.setup.num_workers,
            self.setup.tp_size,
            self.setup.group_infos,
            pending.decode_error,
        )
        if verdict.tp_incomparable_groups:
            self.log.warn_once(
                "Mamba state without TP splits differs between TP sizes: its "
                "groups are left out of KV checksum verification."
            )
        self.log.record(req_id, verdict, pending.blocks)
        if verdict.status != KVChecksumStatus.VERIFIED:
            self.log.failed(req_id, verdict, pending.blocks)
        return verdict


def _writes_any(
    pending: PendingTransfer | PendingOffloadLoad, block_ids: np.ndarray
) -> bool:
    """Whether a load wrote any of `block_ids`."""
    if block_ids.size == 0:
        return False
    return any(
        bool(np.isin(ids, block_ids).any()) for _, ids in pending.blocks.groups.values()
    )
