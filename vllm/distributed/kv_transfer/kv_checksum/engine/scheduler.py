# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler side: which blocks to checksum, what to send, and the verdicts.

`KVChecksumScheduler` is the only place that sees every worker's record. On a
producer it registers a request's prompt blocks in the step that finishes the
prompt and, when the request finishes, sums the workers' parts into the payload
the carrier moves. On a consumer it registers the blocks a load writes in the
step the load starts and verifies them once every worker reported (SPEC 9-13);
loads of offloaded KV go to its `KVChecksumOffloadLoads` (SPEC 18), whose
verdicts it logs and counts like the P/D ones.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumBlocks,
    KVChecksumCarrier,
    KVChecksumRecord,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import (
    SchedulerGroup,
    first_held_position,
    select_blocks,
    sliding_window_transfer_blocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.metrics import KVChecksumStats
from vllm.distributed.kv_transfer.kv_checksum.hybrid.splits import is_tp_comparable
from vllm.distributed.kv_transfer.kv_checksum.offload.loads import (
    ChecksumSourcesFn,
    FailureFn,
    KVChecksumOffloadLoads,
    PendingOffloadLoad,
    ignore_failure,
    no_sources,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    KVChecksumPayload,
    KVChecksumPayloadLimits,
    max_valid_payload_bytes,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
    KVChecksumStatus,
    KVChecksumVerdict,
    KVChecksumWorkerReport,
    UnverifiedReason,
    WorkerKey,
    build_producer_payload,
    verify_load,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "KVChecksumBlocks",
    "KVChecksumPayload",
    "KVChecksumScheduled",
    "KVChecksumScheduler",
]

P2P_SOURCE = "p2p"

# carrier(request, receiving) -> how the connector moves checksums, or None
CarrierFn = Callable[[Any, bool], KVChecksumCarrier | None]
# hit_sources(request, num_external_tokens) -> names of the sources of the hit
HitSourcesFn = Callable[[Any, int], set[str]]
# on_failed_load(request id, verdict, loaded blocks) -> None: any load that did
# not verify, P/D or offload, in both modes (R138 containment)
FailedLoadFn = Callable[[str, KVChecksumVerdict, KVChecksumBlocks], None]


@dataclass
class _PendingTransfer:
    """A send or receive waiting for every worker's report."""

    blocks: KVChecksumBlocks
    reports: dict[WorkerKey, KVChecksumWorkerReport] = field(default_factory=dict)


@dataclass
class _PendingReceive(_PendingTransfer):
    carrier: KVChecksumCarrier = KVChecksumCarrier.KV_TRANSFER_PARAMS
    expected: KVChecksumPayload | None = None
    expected_error: UnverifiedReason | None = None
    decode_error: str = ""


class KVChecksumScheduler:
    """Per-request checksum bookkeeping and verification in the scheduler."""

    def __init__(
        self,
        groups: Mapping[int, SchedulerGroup],
        num_workers: int,
        tp_size: int,
        fail_closed: bool,
        carrier: CarrierFn,
        hit_sources: HitSourcesFn,
        limits: KVChecksumPayloadLimits | None = None,
        checksum_sources: ChecksumSourcesFn = no_sources,
        on_failure: FailureFn = ignore_failure,
        hash_block_size: int | None = None,
    ) -> None:
        self.groups = dict(groups)
        self.num_workers = num_workers
        self.tp_size = tp_size
        self.fail_closed = fail_closed
        self.carrier = carrier
        self.hit_sources = hit_sources
        self.on_failed_load: FailedLoadFn | None = None
        self.limits = limits or KVChecksumPayloadLimits(max_groups=len(self.groups))
        self.group_infos = {
            g: KVChecksumGroupInfo(
                block_size=s.block_size,
                is_mamba=s.mamba_spec_blocks is not None,
                tp_comparable=s.tp_comparable,
            )
            for g, s in groups.items()
        }
        self.offload = KVChecksumOffloadLoads(
            num_workers,
            {g: s.block_size for g, s in groups.items()},
            hash_block_size,
            checksum_sources,
            on_failure,
        )
        self.stats = KVChecksumStats()
        self._noted: set[str] = set()
        # Producer requests (do_remote_decode), in arrival order (R142).
        self._producers: dict[str, None] = {}
        self._sends: dict[str, _PendingTransfer] = {}
        self._recvs: dict[str, _PendingReceive] = {}
        self._outgoing: dict[str, bytes] = {}
        self._step = KVChecksumScheduled()
        self._warned: set[str] = set()
        # Workers whose checksums their last-resort guard turned off (R134).
        self.disabled_workers: set[WorkerKey] = set()
        # Request ids of per-request state kept next to this one (R141).
        self.tracked_sources: list[Callable[[], Iterable[str]]] = []

    @classmethod
    def create(
        cls,
        kv_cache_config: Any,
        num_workers: int,
        tp_size: int,
        fail_closed: bool,
        carrier: CarrierFn,
        hit_sources: HitSourcesFn,
        max_model_len: int,
        max_payload_bytes: int | None,
        checksum_sources: ChecksumSourcesFn = no_sources,
        on_failure: FailureFn = ignore_failure,
        hash_block_size: int | None = None,
    ) -> "KVChecksumScheduler":
        """Build from vLLM's KVCacheConfig (transfer groups only)."""
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        groups: dict[int, SchedulerGroup] = {}
        for group_id in kv_cache_config.transfer_group_ids:
            spec = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
            window = 0
            if isinstance(spec, SlidingWindowSpec):
                window = sliding_window_transfer_blocks(
                    spec.sliding_window, spec.block_size
                )
            if isinstance(spec, MambaSpec):  # R67, R85
                groups[group_id] = SchedulerGroup(
                    spec.block_size,
                    mamba_spec_blocks=spec.num_speculative_blocks,
                    tp_comparable=is_tp_comparable(spec),
                )
                continue
            groups[group_id] = SchedulerGroup(spec.block_size, window)
        # Positions are capped per group by its own block size (R129), so a
        # producer with smaller blocks than ours is still accepted.
        num_groups = len(kv_cache_config.kv_cache_groups)
        if max_payload_bytes is None:  # R129: derived from our own sizes
            max_payload_bytes = max_valid_payload_bytes(max_model_len, num_groups)
        limits = KVChecksumPayloadLimits(
            max_encoded_bytes=max_payload_bytes,
            max_groups=num_groups,
            max_model_len=max_model_len,
        )
        return cls(
            groups,
            num_workers,
            tp_size,
            fail_closed,
            carrier,
            hit_sources,
            limits,
            checksum_sources,
            on_failure,
            hash_block_size,
        )

    # ------------------------------------------------------------------
    # Registration
    # ------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Note a consumer request before its connector starts the load (R69)."""
        if self.disabled_workers:
            return
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._producers[request.request_id] = None
        if params.get("do_remote_prefill") and not params.get("do_remote_decode"):
            self._noted.add(request.request_id)

    def add_sends(
        self,
        num_scheduled_tokens: Mapping[str, int],
        requests: Mapping[str, Any],
        kv_cache_manager: Any,
    ) -> None:
        """`add_send` for this step's scheduled producer requests only, so a
        step of other requests loops over none of them (R68, R142)."""
        for req_id in [r for r in self._producers if r in num_scheduled_tokens]:
            self.add_send(
                requests[req_id], num_scheduled_tokens[req_id], kv_cache_manager
            )

    def add_send(
        self, request: Any, num_scheduled_tokens: int, kv_cache_manager: Any
    ) -> None:
        """Register a producer's prompt in the step that finishes it (R68)."""
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or self.disabled_workers:
            return
        computed = request.num_computed_tokens
        prompt = request.num_prompt_tokens
        if not computed - num_scheduled_tokens < prompt <= computed:
            return
        if self.carrier(request, False) is None:
            return
        blocks = kv_cache_manager.get_blocks(request.request_id).blocks
        selected = select_blocks(blocks, self.groups, 0, computed)
        self._sends[request.request_id] = _PendingTransfer(selected)
        self._step.reqs_to_send[request.request_id] = selected

    def add_recv(
        self, request: Any, blocks: Any, num_local_computed_tokens: int
    ) -> None:
        """Register the blocks a starting load writes (R70, R119)."""
        req_id = request.request_id
        if self.disabled_workers:
            return
        if req_id not in self._noted:
            self._add_offload_load(request, blocks, num_local_computed_tokens)
            return
        self._noted.discard(req_id)
        num_external = request.num_computed_tokens - num_local_computed_tokens
        if num_external <= 0:
            return
        if set(self.hit_sources(request, num_external)) != {P2P_SOURCE}:
            return
        carrier = self.carrier(request, True)
        if carrier is None:
            return
        selected = self._loaded_blocks(request, blocks, num_local_computed_tokens)
        pending = _PendingReceive(selected, carrier=carrier)
        if carrier == KVChecksumCarrier.KV_TRANSFER_PARAMS:
            params = request.kv_transfer_params or {}
            self._expect(pending, params.get(KV_TRANSFER_PARAMS_KEY))
        self._recvs[req_id] = pending
        self._step.reqs_to_recv[req_id] = selected

    def _add_offload_load(
        self, request: Any, blocks: Any, num_local_computed_tokens: int
    ) -> None:
        """A load whose every hit source stores checksums is checked (R119)."""
        num_external = request.num_computed_tokens - num_local_computed_tokens
        if num_external <= 0:
            return
        if not self.offload.is_checked(
            request, set(self.hit_sources(request, num_external))
        ):
            return
        selected = self._loaded_blocks(request, blocks, num_local_computed_tokens)
        self.offload.add(request, selected)
        self._step.reqs_to_load[request.request_id] = selected

    def _loaded_blocks(
        self, request: Any, blocks: Any, num_local_computed_tokens: int
    ) -> KVChecksumBlocks:
        """The blocks a starting load writes: its tokens past the local hit (R64)."""
        return select_blocks(
            blocks.blocks,
            self.groups,
            num_local_computed_tokens,
            request.num_computed_tokens,
        )

    def build_checksum_meta(self) -> KVChecksumScheduled | None:
        """This step's blocks for the workers, then reset (R71)."""
        step, self._step = self._step, KVChecksumScheduled()
        return None if step.is_empty() else step

    # ------------------------------------------------------------------
    # Reports and verification
    # ------------------------------------------------------------------

    def update_from_output(
        self,
        records: Iterable[KVChecksumRecord] | None,
        finished_recving: Iterable[str] | None,
        skip_req_ids: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
    ) -> set[str]:
        """Store reports, verify finished loads; return loads that must fail (R72).

        Loads in `skip_req_ids` (reported failed) or writing a block of
        `invalid_block_ids` are known bad and not compared (R73).
        """
        records = list(records or ())
        for record in records:
            if record.disabled:
                self._worker_disabled((record.pp_rank, record.tp_rank))
        for record in records:
            if not self.disabled_workers:
                self._store(record)
        skip = set(skip_req_ids)
        invalid = np.fromiter(invalid_block_ids, dtype=np.int64)
        failing: set[str] = set()
        for req_id in finished_recving or ():
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

    def _worker_disabled(self, key: WorkerKey) -> None:
        """A worker's checksums are off (R134): from now on nothing is
        registered or verified, as with checksums off, and the checks in
        flight are dropped without a verdict (never failed)."""
        if key in self.disabled_workers:
            return
        self.disabled_workers.add(key)
        dropped = len(self._sends) + len(self._recvs) + len(self.offload.pending)
        self._noted.clear()
        self._producers.clear()
        self._sends.clear()
        self._recvs.clear()
        self.offload.pending.clear()
        self._step = KVChecksumScheduled()
        self.stats.record_worker_disabled()
        logger.error(
            "KV checksums disabled on worker (pp rank %d, tp rank %d) after an "
            "error there: this engine no longer checksums or verifies KV "
            "transfers and loads (fail-closed included), as with checksums "
            "off; %d checks in flight dropped unverified.",
            key[0],
            key[1],
            dropped,
        )

    def _internal_error(self, req_id: str) -> bool:
        """Log and count a verification that raised; fail it if fail-closed."""
        logger.exception("Verifying the KV checksums of request %s failed", req_id)
        verdict = KVChecksumVerdict(
            KVChecksumStatus.UNVERIFIED,
            reasons=[(UnverifiedReason.INTERNAL_ERROR, "see the error log")],
        )
        self.stats.record_verdict(verdict)
        return self.fail_closed

    def _check_offload_load(self, req_id: str, load: PendingOffloadLoad) -> bool:
        """Verify an offload load (R120); tell the connector of a failure (R121).

        Returns whether the load must fail (fail-closed and not verified).
        """
        verdict = self.offload.verify(load)
        self._log_verdict(req_id, verdict, load.blocks)
        self.stats.record_verdict(verdict)
        if verdict.status == KVChecksumStatus.VERIFIED:
            return False
        self.offload.report_failure(req_id, load, verdict)
        if self.on_failed_load is not None:
            self.on_failed_load(req_id, verdict, load.blocks)
        return self.fail_closed

    def _store(self, record: KVChecksumRecord) -> None:
        key = (record.pp_rank, record.tp_rank)
        for req_id in record.checksums:
            pending: _PendingTransfer | PendingOffloadLoad | None = (
                self._sends.get(req_id)
                or self._recvs.get(req_id)
                or self.offload.pending.get(req_id)
            )
            report = KVChecksumWorkerReport.from_record(record, req_id)
            if pending is not None and report is not None:
                pending.reports[key] = report
        for req_id, data in record.received.items():
            recv = self._recvs.get(req_id)
            if (
                recv is not None
                and recv.carrier == KVChecksumCarrier.CONNECTOR
                and recv.expected is None
                and recv.expected_error is None
            ):
                self._expect(recv, data)

    def _expect(self, pending: _PendingReceive, value: object) -> None:
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

    def _verify(self, req_id: str, pending: _PendingReceive) -> KVChecksumVerdict:
        verdict = verify_load(
            pending.expected,
            pending.expected_error,
            pending.reports,
            pending.blocks,
            self.num_workers,
            self.tp_size,
            self.group_infos,
            pending.decode_error,
        )
        if verdict.tp_incomparable_groups:
            self._warn_once(
                "Mamba state without TP splits differs between TP sizes: its "
                "groups are left out of KV checksum verification."
            )
        self._log_verdict(req_id, verdict, pending.blocks)
        self.stats.record_verdict(verdict)
        if verdict.status != KVChecksumStatus.VERIFIED and self.on_failed_load:
            self.on_failed_load(req_id, verdict, pending.blocks)
        return verdict

    def _log_verdict(
        self, req_id: str, verdict: KVChecksumVerdict, blocks: KVChecksumBlocks
    ) -> None:
        """R96: an error per mismatch, a warning once per fixed reason; the
        loaded block ids of a mismatch at DEBUG, to tell its cause."""
        if verdict.status == KVChecksumStatus.MISMATCH:
            groups = "; ".join(
                f"group {g} block positions {positions}"
                for g, positions in sorted(verdict.mismatches.items())
            )
            logger.error("KV checksum mismatch for request %s: %s", req_id, groups)
            logger.debug(
                "KV checksum mismatch details, request %s: loaded blocks "
                "(group: first position, block ids) %s",
                req_id,
                {
                    g: (int(f), np.asarray(i).tolist())
                    for g, (f, i) in blocks.groups.items()
                },
            )
            return
        if verdict.status == KVChecksumStatus.VERIFIED:
            logger.debug("KV checksums verified for request %s.", req_id)
            return
        for reason, _ in verdict.reasons:
            self._warn_once(f"KV checksums not verified: {reason.value}.")
        details = "; ".join(f"{r.value} ({d})" for r, d in verdict.reasons)
        logger.debug("KV checksums not verified for request %s: %s", req_id, details)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

    # ------------------------------------------------------------------
    # Finishing
    # ------------------------------------------------------------------

    def request_finished(
        self,
        request: Any,
        kv_transfer_params: dict[str, Any] | None,
        kv_cache_manager: Any = None,
    ) -> dict[str, Any] | None:
        """Drop the request's state; a finished producer builds its payload (R74).

        Returns the kv_transfer_params to hand back, with "kv_checksums" added
        for KV_TRANSFER_PARAMS carriers; CONNECTOR bytes are kept for
        `take_kv_checksums_to_send`. With the `kv_cache_manager`, positions
        whose blocks vLLM freed since the prompt was checksummed (the start of
        a sliding window) are left out of the payload.
        """
        req_id = request.request_id
        self._noted.discard(req_id)
        self._producers.pop(req_id, None)
        self._recvs.pop(req_id, None)
        self.offload.pending.pop(req_id, None)
        send = self._sends.pop(req_id, None)
        if send is None or not _finished_normally(request):
            return kv_transfer_params
        payload = build_producer_payload(
            send.reports, send.blocks, self.num_workers, self.tp_size, self.group_infos
        )
        if not isinstance(payload, str) and kv_cache_manager is not None:
            held = kv_cache_manager.get_blocks(req_id).blocks
            payload.groups = _held_groups(payload, send.blocks, held, self.group_infos)
        if isinstance(payload, str):
            self._warn_once(f"KV checksums not sent: {_reason_kind(payload)}.")
            logger.debug("KV checksums not sent for request %s: %s", req_id, payload)
            self.stats.record_not_sent(_reason_kind(payload))
            return kv_transfer_params
        carrier = self.carrier(request, False)
        if carrier == KVChecksumCarrier.KV_TRANSFER_PARAMS:
            if kv_transfer_params is None:
                return None
            self.stats.record_sent()
            return {**kv_transfer_params, KV_TRANSFER_PARAMS_KEY: payload.to_base64()}
        if carrier == KVChecksumCarrier.CONNECTOR:
            self.stats.record_sent()
            self._outgoing[req_id] = payload.to_bytes()
        return kv_transfer_params

    def take_kv_checksums_to_send(self, req_id: str) -> bytes | None:
        """The CONNECTOR-carried bytes of a finished producer request, once."""
        return self._outgoing.pop(req_id, None)

    def tracked_request_ids(self) -> set[str]:
        """Ids of the requests holding per-request checksum state on this
        engine's scheduler side, here and in `tracked_sources` (R141)."""
        ids = self._noted.union(
            self._producers, self._sends, self._recvs, self._outgoing
        )
        ids.update(self.offload.pending)
        for source in self.tracked_sources:
            ids.update(source())
        return ids


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


def _writes_any(
    pending: _PendingTransfer | PendingOffloadLoad, block_ids: np.ndarray
) -> bool:
    """Whether a load wrote any of `block_ids`."""
    if block_ids.size == 0:
        return False
    return any(
        bool(np.isin(ids, block_ids).any()) for _, ids in pending.blocks.groups.values()
    )


def _finished_normally(request: Any) -> bool:
    """Stop or length: only those producers' KV is used by a consumer (R74)."""
    from vllm.v1.request import RequestStatus

    return request.status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
    )


def _reason_kind(detail: str) -> str:
    """The fixed reason of a not-sent detail from `build_producer_payload`."""
    if detail.endswith("workers reported"):
        return UnverifiedReason.NOT_ALL_WORKERS.value
    return UnverifiedReason.OTHER_BLOCKS.value
