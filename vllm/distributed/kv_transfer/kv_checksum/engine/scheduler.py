# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler side: which blocks to checksum, what to send, and the verdicts.

`KVChecksumScheduler` is the only place that sees every worker's record. It
composes a producer half (:mod:`.producer`: a request's prompt blocks are
registered in the step that finishes the prompt and, when the request
finishes, the workers' parts are summed into the payload the carrier moves)
and a consumer half (:mod:`.consumer`: the blocks a load writes are registered
in the step the load starts and verified once every worker reported, SPEC
9-13; loads of offloaded KV go to its `KVChecksumOffloadLoads`, SPEC 18). Both
log and count their verdicts through one :mod:`.verdict_log`.
"""

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.config import read_flags
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumRecord,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import (
    SchedulerGroup,
    sliding_window_transfer_blocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.consumer import (
    P2P_SOURCE,
    HitSourcesFn,
    KVChecksumConsumer,
    StepHitSources,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.metrics import (
    KVChecksumStats,
    TrackedRecount,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.producer import (
    KVChecksumProducer,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.records import finalize_records
from vllm.distributed.kv_transfer.kv_checksum.engine.transfers import (
    CarrierFn,
    TransferSetup,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.verdict_log import (
    FailedLoadFn,
    VerdictLog,
)
from vllm.distributed.kv_transfer.kv_checksum.hybrid.splits import is_tp_comparable
from vllm.distributed.kv_transfer.kv_checksum.offload.loads import (
    ChecksumSourcesFn,
    FailureFn,
    KVChecksumOffloadLoads,
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
    KVChecksumWorkerReport,
    WorkerKey,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hit_checks import (
        InvalidBlockRecovery,
        PrefixHitVerifier,
    )

logger = init_logger(__name__)

__all__ = [
    "P2P_SOURCE",
    "KVChecksumBlocks",
    "KVChecksumPayload",
    "KVChecksumScheduled",
    "KVChecksumScheduler",
]


class KVChecksumScheduler:
    """Per-request checksum bookkeeping and verification in the scheduler: a
    facade over its producer and consumer halves and the disabled-worker state."""

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
        self.log = VerdictLog(self.stats)
        setup = TransferSetup(
            self.groups, self.group_infos, num_workers, tp_size, carrier, self.log
        )
        self.producer = KVChecksumProducer(setup)
        self.hit_sources = StepHitSources(hit_sources)
        self.consumer = KVChecksumConsumer(
            setup, fail_closed, self.hit_sources, self.limits, self.offload
        )
        # Workers whose checksums their last-resort guard turned off (R134).
        self.disabled_workers: set[WorkerKey] = set()
        # Told (request id, group -> first quarantined position) when a failed
        # load's request is contained: tiers holding copies drop them (R138).
        self.contained_listeners: list[Callable[[str, Mapping[int, int]], None]] = []
        # Request ids of per-request state kept next to this one (R141).
        self.tracked_sources: list[Callable[[], Iterable[str]]] = []
        # When the R141 gauge recounts `tracked_request_ids` (R142), and the
        # count last sent (the gauge travels only when it changes).
        self.tracked_recount = TrackedRecount()
        self._tracked_sent: int | None = None
        # Loads started in this schedule(): (request, blocks, external tokens),
        # and those the last `schedule_step` registered (for R147's checks).
        self.starting_loads: list[tuple[Any, Any, int]] = []
        self.last_started_loads: list[tuple[Any, Any, int]] = []
        # Prefix-hit verification (R140), set up by `attach_prefix_cache`.
        self.prefix_hits: PrefixHitVerifier | None = None
        # Checksums turned off for this engine by the scheduler's guard.
        self.closed = False

    @property
    def on_failed_load(self) -> FailedLoadFn | None:
        """Containment's callback for loads that did not verify (R138)."""
        return self.log.on_failed_load

    @on_failed_load.setter
    def on_failed_load(self, callback: FailedLoadFn | None) -> None:
        self.log.on_failed_load = callback

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
            _transfer_groups(kv_cache_config),
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
    # The engine's calls, one per place in vLLM's Scheduler (the plugin's
    # hooks and the in-tree series' call sites make the same calls)
    # ------------------------------------------------------------------

    def note_load_start(self, request: Any, blocks: Any, num_external: int) -> None:
        """A connector load starts (`update_state_after_alloc`, deferred loads
        too); registered once the step's token counts are final (R10 d)."""
        if num_external > 0:
            self.starting_loads.append((request, blocks, num_external))

    def note_hit_sources(self, request: Any, num_tokens: int, sources: Any) -> None:
        """The connector's hit sources of a starting load, as vLLM's
        prefix-cache stats asked for them: this step's checks reuse them (R119)."""
        self.hit_sources.note(request.request_id, num_tokens, sources)

    def schedule_step(
        self,
        num_scheduled_tokens: Mapping[str, int],
        requests: Mapping[str, Any],
        kv_cache_manager: Any,
    ) -> KVChecksumScheduled | None:
        """After `_update_after_schedule`: register the loads started and the
        prompts finished in this step; the workers' metadata (R10 c, d)."""
        from vllm.v1.request import RequestStatus

        starting, self.starting_loads = self.starting_loads, []
        self.last_started_loads = starting
        for request, blocks, num_external in starting:
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                local = request.num_computed_tokens - num_external
                self.add_recv(request, blocks, local)
        self.add_sends(num_scheduled_tokens, requests, kv_cache_manager)
        self.hit_sources.end_step()
        return self.build_checksum_meta()

    def verify_step(self, kv_output: Any, failed_req_ids: Iterable[str]) -> None:
        """Before vLLM handles a step's load failures: store the workers'
        records, verify finished loads; fail-closed failures join
        `kv_output.failed_recving`, so vLLM's kv_load_failure_policy decides
        (R10 e, R73, R4). Loads vLLM already failed (`failed_req_ids`) or
        hit by invalid blocks are not compared."""
        records = getattr(kv_output, "kv_checksums", None)
        # Most steps report no finished load and no record (R142).
        if kv_output is None or not (kv_output.finished_recving or records):
            return
        failed = set(kv_output.failed_recving or ())
        failing = self.update_from_output(
            finalize_records(records),
            kv_output.finished_recving,
            skip_req_ids=failed.union(failed_req_ids),
            invalid_block_ids=kv_output.invalid_block_ids,
        )
        if failing:
            kv_output.failed_recving = failed | failing

    def close(self) -> None:
        """The scheduler's guard turned checksums off for this engine: the
        state kept beside this object (prefix-hit entries) stops too (R141)."""
        self.closed = True
        if self.prefix_hits is not None:
            self.prefix_hits.release()

    # Prefix-hit verification (R140): vLLM's Scheduler calls these (the
    # plugin's hooks on vLLM 0.33.0 make the same calls); each is a no-op
    # unless `attach_prefix_cache` set a verifier up.

    def attach_prefix_cache(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        kv_cache_manager: Any,
        set_listener: Callable[[Any], None] | None = None,
    ) -> None:
        """Set prefix-hit verification up (with its flag, or external-load
        verification's, on): its listener follows the block pool's cached
        blocks (`BlockPool.set_listener`, or the plugin's `set_listener`)."""
        from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hit_checks import (
            PrefixHitVerifier,
        )

        verifier = PrefixHitVerifier.create(
            self, vllm_config, kv_cache_config, kv_cache_manager
        )
        if verifier is None:
            return
        if set_listener is None:
            set_listener = kv_cache_manager.block_pool.set_listener
        set_listener(verifier.listener)
        self.prefix_hits = verifier
        self.tracked_sources.append(verifier.request_ids)  # R141

    @property
    def prefix_entries_written(
        self,
    ) -> "Callable[[np.ndarray, np.ndarray], np.ndarray] | None":
        """For an offload tier's stores (issue 30): the mask of the GPU blocks
        whose entries prefix-hit verification already had the workers write
        (their copies carry that entry instead of a new checksum); None
        without prefix-hit verification."""
        verifier = self.prefix_hits
        return None if verifier is None else verifier.entries_written

    def note_local_hit(self, request: Any, num_tokens: int) -> None:
        """At the request's admission, next to vLLM's
        `record_prefix_cache_stats` (after every adjustment of the hit): the
        request's local hit, checked in the step it first runs on it."""
        if self.prefix_hits is not None:
            self.prefix_hits.note_local_hit(request, num_tokens)

    def schedule_prefix_hits(
        self, output: Any, requests: Mapping[str, Any], kv_cache_manager: Any
    ) -> None:
        """After `schedule_step`: the step's entry saves and hit checks join
        `output.kv_checksum_scheduled`."""
        if self.prefix_hits is not None:
            self.prefix_hits.schedule(output, requests, kv_cache_manager)

    def verify_prefix_hits(
        self,
        scheduler_output: Any,
        model_output: Any,
        recovery: "InvalidBlockRecovery",
    ) -> None:
        """After `verify_step`, before vLLM handles invalid blocks: judge the
        step's hit checks; the holders of bad blocks recover through
        `recovery` (the Scheduler's invalid-block recovery)."""
        if self.prefix_hits is not None:
            self.prefix_hits.verify(scheduler_output, model_output, recovery)

    def finish_request(
        self,
        request: Any,
        kv_transfer_params: dict[str, Any] | None,
        kv_cache_manager: Any,
        send: Callable[[Any, bytes], None],
    ) -> dict[str, Any] | None:
        """When the connector finished a request (`_connector_finished`): the
        kv_transfer_params to return, with the payload for KV_TRANSFER_PARAMS
        carriers; CONNECTOR bytes go to `send(request, data)` (R10 f)."""
        params = self.request_finished(request, kv_transfer_params, kv_cache_manager)
        data = self.take_kv_checksums_to_send(request.request_id)
        if data is not None:
            send(request, data)
        return params

    def make_stats(self, engine_empty: bool) -> dict[str, Any] | None:
        """When vLLM makes a step's SchedulerStats (`make_stats`, log_stats
        on): the counts since the last call as a plain dict
        (`KVChecksumStats.to_dict`, for `SchedulerStats.kv_checksum_stats`),
        None when there is nothing new (R130). The number of requests holding
        checksum state goes with them when it changed since it was last sent
        (R141), recounted when `tracked_recount` says (R142);
        `engine_empty`: the engine holds no request after the step."""
        if self.tracked_recount.due(engine_empty):
            tracked = len(self.tracked_request_ids())
            if tracked != self._tracked_sent:
                self.stats.tracked_requests = tracked
                self._tracked_sent = tracked
        if self.stats.is_empty():
            return None
        return self.stats.take().to_dict()

    # ------------------------------------------------------------------
    # Registration
    # ------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Note a producer or consumer request on arrival (R69, R142)."""
        if self.disabled_workers:
            return
        self.producer.note(request)
        self.consumer.note(request)

    def add_sends(
        self,
        num_scheduled_tokens: Mapping[str, int],
        requests: Mapping[str, Any],
        kv_cache_manager: Any,
    ) -> None:
        """Register the prompts this step finishes, of producers only (R68, R142)."""
        if not self.disabled_workers:
            self.producer.add_sends(num_scheduled_tokens, requests, kv_cache_manager)

    def add_recv(
        self, request: Any, blocks: Any, num_local_computed_tokens: int
    ) -> None:
        """Register the blocks a starting load writes (R70, R119)."""
        if not self.disabled_workers:
            self.consumer.add_recv(request, blocks, num_local_computed_tokens)

    def build_checksum_meta(self) -> KVChecksumScheduled | None:
        """This step's blocks for the workers, then reset (R71)."""
        if not (self.producer.has_step() or self.consumer.has_step()):
            return None  # most steps: nothing taken, no record object (R142)
        recvs, loads = self.consumer.take_step()
        return KVChecksumScheduled(
            reqs_to_send=self.producer.take_step(),
            reqs_to_recv=recvs,
            reqs_to_load=loads,
        )

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
            elif self.offload.stop_sources(
                (record.pp_rank, record.tp_rank), record.disabled_sources
            ):
                self.stats.record_worker_disabled()  # R134, offload tier only
        for record in records:
            if not self.disabled_workers:
                self._store(record)
        invalid = np.fromiter(invalid_block_ids, dtype=np.int64)
        return self.consumer.finish_loads(
            finished_recving or (), set(skip_req_ids), invalid
        )

    def _store(self, record: KVChecksumRecord) -> None:
        """A worker's reports to the sends and loads they are for."""
        key = (record.pp_rank, record.tp_rank)
        for req_id in record.checksums:
            pending = self.producer.pending(req_id) or self.consumer.pending(req_id)
            report = KVChecksumWorkerReport.from_record(record, req_id)
            if pending is not None and report is not None:
                pending.reports[key] = report
        self.consumer.store_received(record.received)

    def _worker_disabled(self, key: WorkerKey) -> None:
        """A worker's checksums are off (R134): from now on nothing is
        registered or verified, as with checksums off, and the checks in
        flight are dropped without a verdict (never failed)."""
        if key in self.disabled_workers:
            return
        self.disabled_workers.add(key)
        dropped = self.producer.clear() + self.consumer.clear()
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
        self.consumer.drop(request.request_id)
        return self.producer.request_finished(
            request, kv_transfer_params, kv_cache_manager
        )

    def take_kv_checksums_to_send(self, req_id: str) -> bytes | None:
        """The CONNECTOR-carried bytes of a finished producer request, once."""
        return self.producer.take_kv_checksums_to_send(req_id)

    def tracked_request_ids(self) -> set[str]:
        """Ids of the requests holding per-request checksum state on this
        engine's scheduler side, here and in `tracked_sources` (R141)."""
        ids = self.consumer.request_ids() | self.producer.request_ids()
        ids.update(self.offload.pending)
        for source in self.tracked_sources:
            ids.update(source())
        return ids


def create_kv_checksum_scheduler(
    vllm_config: Any,
    kv_cache_config: Any,
    connector: Any,
    hit_sources: HitSourcesFn,
    hash_block_size: int | None = None,
) -> KVChecksumScheduler:
    """The checksum scheduler of an engine whose checksums are enabled, bound
    to its scheduler-side connector's carrier, checked sources and failure
    callback; `hit_sources(request, tokens)` names a starting load's sources."""
    flags = read_flags(vllm_config.kv_transfer_config)
    parallel = vllm_config.parallel_config
    # The offloaded-KV API (R119, R121) is optional: a connector without it
    # stores no entries and drops no copies.
    checksum_sources: ChecksumSourcesFn = (
        no_sources
        if getattr(connector, "get_kv_checksum_sources", None) is None
        else lambda request: {
            getattr(s, "value", s) for s in connector.get_kv_checksum_sources(request)
        }  # looked up per call, as the connector may replace it
    )
    return KVChecksumScheduler.create(
        kv_cache_config,
        num_workers=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
        tp_size=parallel.tensor_parallel_size,
        fail_closed=flags.fail_closed,
        carrier=connector.kv_checksum_carrier,
        hit_sources=hit_sources,
        max_model_len=vllm_config.model_config.max_model_len,
        max_payload_bytes=flags.max_payload_bytes,
        checksum_sources=checksum_sources,
        on_failure=getattr(connector, "on_kv_checksum_failure", ignore_failure),
        hash_block_size=hash_block_size,
    )


def _transfer_groups(kv_cache_config: Any) -> dict[int, SchedulerGroup]:
    """The scheduler's view of vLLM's transfer groups (R64-R67, R85)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

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
        # Exact types: a subclass may free blocks early (R66).
        holds_all = type(spec) in (FullAttentionSpec, MLAAttentionSpec)
        groups[group_id] = SchedulerGroup(
            spec.block_size, window, holds_all_blocks=holds_all
        )
    return groups
