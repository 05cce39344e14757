# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on the worker side: Model Runner V2, ActiveKVConnector, the output
aggregator, and the V1 runner's refusal (R10 g, h, j; R12); the logic is in
engine/worker.py.

Hooks (target; why; how; the upstream change that lets it go):

GPUModelRunner.initialize_kv_cache (V2)
    Why: the checksum worker needs the KVCacheConfig
    How: a context variable for the call
    Upstream: get_kv_connector(vllm_config, kv_caches, kv_cache_config)
ActiveKVConnector.__init__, pre_forward, post_forward
    Why: create the worker (and fault injector), bind each step, checksum after the
    forward
    How: after the original
    Upstream: ActiveKVConnector owning a checksum worker
ActiveKVConnector.post_forward (also)
    Why: a SimpleCPUOffloadConnector's copy hand-offs are held while the
    step's checksum work is queued (wiring/simple_cpu_offload.py)
    How: released in a `finally` after the rest of the hook, once the entry
    moves queued for the checksum pass are made (if the pass did not run)
    Upstream: a connector hook run before the step's copies are handed off
connector get_transfer_results (instance)
    Why: keep the transfer results for post_forward
    How: instance wrapper
    Upstream: as above
KVOutputAggregator.aggregate
    Why: the scheduler needs every worker's record
    How: concatenate records onto the aggregate
    Upstream: the aggregator concatenating `kv_checksums`
VllmConfig._get_v1_model_runner_unsupported_features
    Why: Model Runner V1 refuses checksums
    How: add "KV checksums" when enabled
    Upstream: the same entry in vLLM's list
"""

from collections.abc import Callable
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_checksum.config import kv_checksum_enabled
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumRecord,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (
    create_kv_checksum_worker,
)
from vllm.distributed.kv_transfer.kv_checksum.faults.injector import (
    create_fault_injector,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    _disable_after_error,
    _enabled,
    _guard,
    _kv_cache_config,
    _wrap,
    offloading,
    simple_cpu_offload,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def install_worker_hooks() -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.worker.gpu import kv_connector as gpu_kv_connector
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    active = gpu_kv_connector.ActiveKVConnector
    # Read when checksums are off: class defaults, nothing set on instances.
    active.kv_checksum_worker = None  # type: ignore[attr-defined]
    active.kv_checksum_fault_injector = None  # type: ignore[attr-defined]
    active._kv_checksum_results = None  # type: ignore[attr-defined]
    active._kv_checksum_disabled = None  # type: ignore[attr-defined]
    active._kv_checksum_held_copies = ()  # type: ignore[attr-defined]

    @_wrap(GPUModelRunner, "initialize_kv_cache")
    def initialize_kv_cache(
        original: Callable, self: Any, kv_cache_config: Any, *args: Any, **kw: Any
    ) -> None:
        """R10 (g). Target: GPUModelRunner.initialize_kv_cache (V2 runner).

        Why: 0.33.0 does not pass the KVCacheConfig to get_kv_connector, and
        the checksum worker needs it.
        How: a context variable holds it for the duration of the call.
        Upstream: get_kv_connector(vllm_config, kv_caches, kv_cache_config).
        """
        token = _kv_cache_config.set(kv_cache_config)
        try:
            original(self, kv_cache_config, *args, **kw)
        finally:
            _kv_cache_config.reset(token)

    @_wrap(active, "__init__")
    def init(original: Callable, self: Any, vllm_config: Any, kv_caches: Any) -> None:
        """R10 (g). Target: ActiveKVConnector.__init__.

        Why: the worker-side connector wrapper is where each step's connector
        calls happen; it holds the checksum worker (and the fault injector,
        R131, when configured).
        How: after the original, create both; an instance wrapper keeps the
        connector's last transfer results for post_forward. Disabled: nothing
        is set (class defaults None); an error while creating them leaves
        checksums off for this worker with one error log (R134).
        Upstream: ActiveKVConnector owning a checksum worker.
        """
        original(self, vllm_config, kv_caches)
        if _kv_cache_config.get() is None or not _enabled(
            vllm_config, "ActiveKVConnector"
        ):
            return
        with _guard(self, "kv_checksum_worker", "ActiveKVConnector", _disable_worker):
            worker = _create_worker(vllm_config, kv_caches)
            if worker is None:
                return
            topology = worker.topology
            injector = create_fault_injector(
                vllm_config, topology.tp_rank, topology.pp_rank
            )
            self.kv_connector.register_kv_checksum_worker(worker)
            _remember_transfer_results(self)
            held = simple_cpu_offload.held_copies(self.kv_connector)
            self._kv_checksum_held_copies = held
            for copies in held:  # post_forward releases them from now on
                copies.arm()
            self.kv_checksum_fault_injector = injector
            self.kv_checksum_worker = worker

    @_wrap(active, "pre_forward")
    def pre_forward(
        original: Callable, self: Any, scheduler_output: Any, *args: Any, **kw: Any
    ) -> None:
        """R10 (g). Target: ActiveKVConnector.pre_forward.

        Why: workers must know the step's blocks, no-forward steps included.
        How: `bind(scheduler_output.kv_checksum_scheduled)` after the original.
        Upstream: the same call inside pre_forward.
        """
        original(self, scheduler_output, *args, **kw)
        worker = getattr(self, "kv_checksum_worker", None)
        if worker is None or self._disabled:
            return
        with _guard(self, "kv_checksum_worker", "pre_forward", _disable_worker):
            worker.bind(getattr(scheduler_output, "kv_checksum_scheduled", None))

    @_wrap(active, "post_forward")
    def post_forward(
        original: Callable, self: Any, finished_req_ids: set[str], *args: Any, **kw: Any
    ) -> Any:
        """R10 (g). Target: ActiveKVConnector.post_forward.

        Why: after the forward wrote a prompt's KV and the connector reported
        finished loads, before any later forward writes those blocks (R49).
        How: after the original, the worker checksums on the compute stream and
        its pending record goes on the KVConnectorOutput; configured fault
        injection (R131) corrupts finished loads (and, kind "prefix_hit",
        checked prefix-hit blocks, R140) just before. After an error
        turned this worker's checksums off, its next output carries one
        "checksums disabled" record instead; after one in an offload
        connector's worker side, one "offload tier off" record too (R134).
        A SimpleCPUOffloadConnector's held copy hand-offs are made last,
        whatever happened before, after the entry moves queued for the
        checksum pass (issue 30).
        Upstream: the same call inside post_forward.
        """
        held = self._kv_checksum_held_copies
        if not held:
            return _checksum_after_forward(
                original, self, finished_req_ids, *args, **kw
            )
        try:
            return _checksum_after_forward(
                original, self, finished_req_ids, *args, **kw
            )
        finally:
            _flush_queued_entries(self)
            for copies in held:
                copies.release()

    @_wrap(KVOutputAggregator, "aggregate")
    def aggregate(
        original: Callable, self: Any, outputs: list, output_rank: int = 0
    ) -> Any:
        """R10 (h). Target: KVOutputAggregator.aggregate (multiprocess).

        Why: the scheduler needs every TP and PP worker's record; vLLM keeps
        only the output rank's KVConnectorOutput.
        How: concatenate the records of every worker and salvaged output onto
        the aggregated output (read before the original, which drops the
        salvaged outputs; instance attributes only, so nothing is looked up,
        let alone created, on stand-in objects). Without records (checksums
        off) the original's result is returned untouched.
        Upstream: the aggregator concatenating `kv_checksums`.
        """
        records = _records_of(
            [
                *_instance_attribute(self, "_salvaged_outputs", ()),
                *(_instance_attribute(o, "kv_connector_output") for o in outputs),
            ]
        )
        result = original(self, outputs, output_rank)
        if records and result is not None and result.kv_connector_output is not None:
            result.kv_connector_output.kv_checksums = records
        return result


def _checksum_after_forward(
    original: Callable, self: Any, finished_req_ids: set[str], *args: Any, **kw: Any
) -> Any:
    """The post_forward hook's work: the original, then the checksums."""
    output = original(self, finished_req_ids, *args, **kw)
    worker = getattr(self, "kv_checksum_worker", None)
    if worker is None:
        return _with_disabled_record(self, output)
    results, self._kv_checksum_results = self._kv_checksum_results, None
    if output is None or results is None:
        return output
    try:
        injector = self.kv_checksum_fault_injector
        if injector is not None:  # R131: corrupt finished loads first
            injector.corrupt_loads(
                worker,
                results.finished_recving,
                results.failed_recving,
                finished_req_ids,
            )
            injector.corrupt_hits(worker)  # R140: hit blocks before checks
        pending = worker.post_forward(
            results.finished_recving,
            results.failed_recving,
            getattr(results, "kv_checksums", None),
            finished_req_ids,
        )
    except Exception:
        _disable_worker(self, "kv_checksum_worker", "post_forward")
        return _with_disabled_record(self, output)
    records = [pending] if pending is not None else []
    records += offloading.take_offload_off_records(worker)  # R134
    if records:
        output.kv_checksums = records
    return output


def _flush_queued_entries(active: Any) -> None:
    """The offload tier's entry moves the checksum pass did not make (it did
    not run, or raised), made before the held copies go. An error turns the
    worker off (R134); nothing raises into vLLM."""
    worker = active.__dict__.get("kv_checksum_worker")
    if worker is None:
        return
    try:
        worker.flush_queued_entries()
    except Exception:
        _disable_worker(active, "kv_checksum_worker", "post_forward")


def _disable_worker(active: Any, attr: str, where: str) -> None:
    """`_disable_after_error` for an ActiveKVConnector's checksum worker that
    also queues a "checksums disabled" record for its next output, so the
    scheduler stops expecting this worker's records (R134). Held copy
    hand-offs are no longer held from the next step: they served the
    checksum work, and nothing queued for it is made any more."""
    worker = active.__dict__.get(attr)
    _disable_after_error(active, attr, where)
    for held in active._kv_checksum_held_copies:
        held.disarm()
    try:
        active._kv_checksum_disabled = _disabled_record(worker)
    except Exception:
        logger.exception("KV checksums: the scheduler could not be told.")


def _disabled_record(worker: Any) -> KVChecksumRecord:
    """The record telling the scheduler this worker's checksums are off."""
    if worker is not None:
        topology = worker.topology
        return KVChecksumRecord(topology.pp_rank, topology.tp_rank, disabled=True)
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return KVChecksumRecord(
        get_pp_group().rank_in_group, get_tp_group().rank_in_group, disabled=True
    )


def _with_disabled_record(active: Any, output: Any) -> Any:
    """`output` carrying the pending "checksums disabled" record, sent once."""
    record = active._kv_checksum_disabled
    if record is not None and output is not None:
        output.kv_checksums = [record]
        active._kv_checksum_disabled = None
    return output


def _instance_attribute(obj: Any, name: str, default: Any = None) -> Any:
    """`obj.name` if set on the instance itself, else `default`."""
    try:
        return vars(obj).get(name, default)
    except TypeError:  # no __dict__
        return default


def _records_of(kv_outputs: list) -> list:
    """The checksum records of KV connector outputs, in order; [] if none."""
    records: list = []
    for kv_output in kv_outputs:
        value = _instance_attribute(kv_output, "kv_checksums")
        if isinstance(value, list):
            records.extend(value)
    return records


def _create_worker(vllm_config: Any, kv_caches: Any) -> Any:
    """The checksum worker of an engine whose checksums are enabled."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    kv_cache_config = _kv_cache_config.get()
    device = next(
        (c.device for c in kv_caches.values() if c.device.type != "cpu"),
        torch.device("cpu"),
    )
    return create_kv_checksum_worker(
        vllm_config,
        kv_cache_config,
        kv_caches,
        device,
        tp_rank=get_tp_group().rank_in_group,
        pp_rank=get_pp_group().rank_in_group,
    )


def _remember_transfer_results(active: Any) -> None:
    """Keep the connector's last transfer results for `post_forward` (R99)."""
    connector = active.kv_connector
    original = connector.get_transfer_results

    def get_transfer_results(*args: Any, **kwargs: Any) -> Any:
        results = original(*args, **kwargs)
        if active.kv_checksum_worker is not None:
            active._kv_checksum_results = results
        return results

    connector.get_transfer_results = get_transfer_results


def install_config_hooks() -> None:
    from vllm.config import VllmConfig

    @_wrap(VllmConfig, "_get_v1_model_runner_unsupported_features")
    def v1_unsupported(original: Callable, self: Any) -> list[str]:
        """R10 (j), R12. Target: VllmConfig._get_v1_model_runner_unsupported_features.

        Why: the hooks live in Model Runner V2 only.
        How: add "KV checksums" when enabled, so vLLM raises "Model Runner V1
        does not support: KV checksums" at start-up.
        Upstream: the same entry in vLLM's list.
        """
        unsupported = original(self)
        try:
            enabled = kv_checksum_enabled(self)
        except ValueError:
            enabled = False  # the engine refuses to start elsewhere (R8)
        except Exception:
            logger.exception("KV checksums: could not read the configuration.")
            enabled = False
        if enabled:
            unsupported = [*unsupported, "KV checksums"]
        return unsupported
