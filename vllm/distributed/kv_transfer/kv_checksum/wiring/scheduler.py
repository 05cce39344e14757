# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on the engine's Scheduler (R10 a-f, R73); the logic is in
engine/scheduler.py. Each hook makes one call of `KVChecksumScheduler`
(`create_kv_checksum_scheduler`, `on_new_request`, `note_load_start`,
`schedule_step`, `verify_step`, `finish_request`), the same call the in-tree
series makes at that place in vLLM's Scheduler, under the guard of
engine/guard.py.

Hooks (target; why; how; the upstream change that lets it go):

Scheduler.__init__
    Why: one checksum scheduler per engine (None when disabled)
    How: after the original; also attaches the offload tiers and containment
    Upstream: the Scheduler constructing it next to its connector
Scheduler.add_request
    Why: note consumers before the connector clears `do_remote_prefill`
    How: after the original
    Upstream: a call next to the connector's on_new_request
connector update_state_after_alloc (instance)
    Why: the one call that sees every load start
    How: instance wrapper noting (request, blocks, tokens)
    Upstream: the Scheduler reporting load starts
connector get_external_cache_hit_sources (instance)
    Why: vLLM's stats already asked for a starting load's sources this step
    How: instance wrapper keeping the answer until the step ends
    Upstream: the Scheduler handing the load's sources with the load
Scheduler._update_after_schedule
    Why: token counts are final only after it
    How: after the original; `kv_checksum_scheduled` on the output
    Upstream: a field filled by the Scheduler
Scheduler.update_from_output
    Why: verify loads before rescheduling; fail-closed joins `failed_recving`
    How: before the original
    Upstream: a checksum step before the per-request loop
Scheduler._connector_finished
    Why: the producer's payload travels with the request
    How: after the original
    Upstream: the Scheduler calling the checksum scheduler there
"""

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.engine.consumer import HitSourcesFn
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    create_kv_checksum_scheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.outbox import ChecksumOutbox
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    OUTBOX_ATTR,
    _enabled,
    _guard,
    _wrap,
    prefix_cache,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring.containment import (
    _attach_containment,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring.offloading import (
    _attach_offload_schedulers,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring.simple_cpu_offload import (
    _attach_simple_offload_schedulers,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def _hit_sources_of(scheduler: Any) -> HitSourcesFn:
    """Target: the scheduler's connector instance's
    get_external_cache_hit_sources (checksums on only).

    Why: R119 needs each starting load's sources; vLLM already asks the
    connector for them when it records prefix-cache stats (log_stats on, the
    `vllm serve` default), in the same schedule() that starts the load.
    How: an instance attribute that calls the bound method and hands its
    answer to the checksum scheduler (`note_hit_sources`, kept until the
    step's `schedule_step`), nothing once checksums are off; vLLM's calls
    always reach the connector. Returns the connector's own answer as names.
    Upstream: the Scheduler asking once and handing the answer to the
    checksum scheduler (`Scheduler._external_cache_hit_sources`).
    """
    connector = scheduler.connector
    ask = connector.get_external_cache_hit_sources

    def remember(request: Any, num_external_tokens: int) -> Any:
        sources = ask(request, num_external_tokens)
        kcs = getattr(scheduler, "kv_checksum_scheduler", None)
        if kcs is not None:
            with _guard(scheduler, "kv_checksum_scheduler", "hit sources"):
                kcs.note_hit_sources(request, num_external_tokens, sources)
        return sources

    connector.get_external_cache_hit_sources = remember
    return lambda request, tokens: {
        getattr(s, "value", s) for s in ask(request, tokens)
    }


def install_scheduler_hooks() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    # Read when checksums are off: class defaults, nothing set on instances.
    Scheduler.kv_checksum_scheduler = None  # type: ignore[attr-defined]

    @_wrap(Scheduler, "__init__")
    def init(original: Callable, self: Any, *args: Any, **kwargs: Any) -> None:
        """R10 (a). Target: Scheduler.__init__ (also AsyncScheduler's).

        Why: one checksum scheduler per engine, None when disabled.
        How: created after vLLM's init, with the connector's carrier, hit
        sources, stored-checksum sources and failure callback (R119, R121);
        the connector's update_state_after_alloc gets an instance wrapper
        noting loads as they start (R10 d). Disabled: nothing is set (the
        class default None answers). Invalid flags raise (R8); any other
        error leaves checksums off for this engine with one error log.
        Upstream: the Scheduler constructing it next to its connector.
        """
        original(self, *args, **kwargs)
        if self.connector is None or not _enabled(self.vllm_config, "Scheduler"):
            return
        with _guard(self, "kv_checksum_scheduler", "Scheduler.__init__"):
            kcs = create_kv_checksum_scheduler(
                self.vllm_config,
                self.kv_cache_config,
                self.connector,
                _hit_sources_of(self),
                getattr(self, "hash_block_size", None),
            )
            entries_written = prefix_cache.entries_written_of(self)  # R140
            _attach_offload_schedulers(self.connector, entries_written)
            _attach_simple_offload_schedulers(self.connector, entries_written)
            _attach_containment(self, kcs)
            prefix_cache.attach(self, kcs)  # R140, R147
            kcs.tracked_sources.append(lambda: _outbox_request_ids(self.connector))
            _note_starting_loads(self)
            self.kv_checksum_scheduler = kcs

    @_wrap(Scheduler, "add_request")
    def add_request(original: Callable, self: Any, request: Any) -> None:
        """R10 (b). Target: Scheduler.add_request.

        Why: connectors clear `do_remote_prefill` when the load starts, so a
        consumer request must be noted on arrival (R69).
        How: `on_new_request` after vLLM's add_request.
        Upstream: a call next to the connector's on_new_request.
        """
        original(self, request)
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if kcs is None:
            return
        with _guard(self, "kv_checksum_scheduler", "add_request"):
            kcs.on_new_request(request)

    @_wrap(Scheduler, "_update_after_schedule")
    def update_after_schedule(original: Callable, self: Any, output: Any) -> None:
        """R10 (c, d). Target: Scheduler._update_after_schedule.

        Why: only after it are `num_computed_tokens` final for the step, both
        for loads started in this schedule() and for prompts it finishes.
        How: `schedule_step` (the loads started, the scheduled producer
        requests) fills `kv_checksum_scheduled` on the SchedulerOutput.
        Upstream: a `kv_checksum_scheduled` field filled by the Scheduler.
        """
        original(self, output)
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if kcs is None:
            return
        with _guard(self, "kv_checksum_scheduler", "Scheduler._update_after_schedule"):
            output.kv_checksum_scheduled = kcs.schedule_step(
                output.num_scheduled_tokens, self.requests, self.kv_cache_manager
            )
            prefix_cache.schedule(self, output)  # R140's step, and R147's

    @_wrap(Scheduler, "update_from_output")
    def update_from_output(
        original: Callable, self: Any, scheduler_output: Any, model_output: Any
    ) -> Any:
        """R10 (e), R73. Target: Scheduler.update_from_output.

        Why: a load must be verified before the request is rescheduled, and
        records must be stored before the per-request loop finishes producers.
        How: before the original, `verify_step` stores records and verifies
        the finished loads (skipping loads reported failed, already failed or
        hit by invalid blocks); fail-closed failures are added to
        `failed_recving`, so vLLM's own `_handle_failed_recving` and
        kv_load_failure_policy decide (R4).
        If checksum code raises, one error log and checksums off for this
        engine; vLLM's update_from_output then runs unchanged (R134).
        Upstream: a checksum step between vLLM's failure handling and its
        per-request loop.
        """
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if kcs is None:
            return original(self, scheduler_output, model_output)
        with _guard(self, "kv_checksum_scheduler", "Scheduler.update_from_output"):
            kcs.verify_step(
                model_output.kv_connector_output, self.failed_recving_kv_req_ids
            )
            prefix_cache.verify(self, scheduler_output, model_output)  # R140
        return original(self, scheduler_output, model_output)

    @_wrap(Scheduler, "_connector_finished")
    def connector_finished(
        original: Callable, self: Any, request: Any
    ) -> tuple[bool, Any]:
        """R10 (f). Target: Scheduler._connector_finished.

        Why: a finished producer's payload travels with what the connector
        returns (kv_transfer_params) or in the connector's own messages.
        How: after the original, `finish_request` adds "kv_checksums" to the
        returned params (leaving out blocks vLLM has freed since the prompt
        was checksummed); CONNECTOR bytes go to `send_kv_checksums`. On an
        error, vLLM's own result is returned (R134).
        Upstream: the Scheduler calling the checksum scheduler there.
        """
        result = original(self, request)
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if kcs is None:
            return result
        with _guard(self, "kv_checksum_scheduler", "Scheduler._connector_finished"):
            delay_free, params = result
            params = kcs.finish_request(
                request, params, self.kv_cache_manager, self.connector.send_kv_checksums
            )
            return delay_free, params
        return result


def _outbox_request_ids(connector: Any) -> list[str]:
    """R141: the requests whose CONNECTOR payloads wait in a connector
    scheduler's outbox (NIXL push, Mooncake; MultiConnector's children)."""
    ids: list[str] = []
    children = getattr(connector, "__dict__", {}).get("_connectors") or [connector]
    for child in children:
        sched = getattr(child, "__dict__", {}).get("connector_scheduler")
        outbox = getattr(sched, "__dict__", {}).get(OUTBOX_ATTR)
        if isinstance(outbox, ChecksumOutbox):
            ids.extend(outbox.pending)
    return ids


def _note_starting_loads(scheduler: Any) -> None:
    """R10 (d). Target: the scheduler's connector instance's
    update_state_after_alloc (also reached from `_drain_deferred_loads`).

    Why: it is the one call that sees every async load start.
    How: an instance attribute wrapping the bound method notes (request,
    blocks, external tokens) for the next `_update_after_schedule`.
    Upstream: the Scheduler reporting load starts to the checksum scheduler.
    """
    connector = scheduler.connector
    original = connector.update_state_after_alloc

    def update_state_after_alloc(request: Any, blocks: Any, num_external: int) -> Any:
        result = original(request, blocks, num_external)
        kcs = scheduler.kv_checksum_scheduler
        if kcs is not None:
            kcs.note_load_start(request, blocks, num_external)
        return result

    connector.update_state_after_alloc = update_state_after_alloc
