# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's CPU offload tier on CPU: the real OffloadingConnector or
SimpleCPUOffloadConnector scheduler side (alone or under MultiConnector), real
checksum workers, simulated transfers.

`OffloadSimEngine` extends `SimEngine` (real Scheduler with the plugin's
hooks, CPU KV caches, one `KVChecksumWorker` per rank). Its workers each get
the plugin's `OffloadWorkerSide` over a stand-in for vLLM's CPU offloading
worker (the real one needs CUDA streams): host tensors [chunks, bytes per
chunk] per layer, into which each step's store jobs copy GPU blocks and from
which load jobs copy them back, at the places vLLM's worker does: loads
before the forward (after `start_loads`, as `start_load_kv`), stores after it
(after `save_stores`, as `wait_for_save`). Finished async loads and completed
jobs are reported in the same step's KVConnectorOutput, with the P/D pulls
the test reported finished (`finish_load`: a MultiConnector's NIXL child,
whose KV the test copies itself). With `hooks=True`
the worker sides run inside the real connector class's worker hooks (and
their last-resort guard, R134) on an instance without __init__.
"""

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    iter_engine_core_outputs,
    make_kv_connector_output,
    make_model_runner_output,
    make_request,
    native_kv_checksums,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig, SimEngine
from vllm.distributed.kv_transfer.kv_checksum.offload.host_faults import (
    create_host_fault_injector,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.offloading import (
    OffloadWorkerSide,
    host_slots,
)

# SimpleCPUOffloadConnector's modules (held copies, its worker side) are
# imported where its simulation is built: a vLLM with the in-tree series has
# no commit for that connector yet, and the OffloadingConnector simulation
# runs there without them.


def _no_copy(*args: Any, **kwargs: Any) -> None:
    """The sim's copy hand-off: its copies are made by the sim itself."""


class _Namespace:
    """A plain attribute holder standing in for vLLM objects."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


def metadata_of(metadata: Any, kind: type) -> Any:
    """A step's connector metadata of `kind` (also inside MultiConnector's)."""
    for meta in (metadata, *getattr(metadata, "metadata", ())):
        if isinstance(meta, kind):
            return meta
    return None


def connector_of(connector: Any, kind: type) -> Any:
    """The scheduler's connector of `kind` (itself or a MultiConnector child)."""
    for child in (connector, *getattr(connector, "_connectors", ())):
        if isinstance(child, kind):
            return child
    raise AssertionError(f"no {kind.__name__}")


def offload_metadata(metadata: Any) -> Any:
    """The OffloadingConnectorMetadata of a step."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )

    return metadata_of(metadata, OffloadingConnectorMetadata)


def offloading_connector(connector: Any) -> Any:
    """The scheduler's OffloadingConnector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    return connector_of(connector, OffloadingConnector)


class _OffloadSimBase(SimEngine):
    """The parts of a step both offload simulations share: the forward, the
    workers' checksum records and handing the step's output to vLLM."""

    offload: Any
    # Worker sides called through the real connector hooks (`_bare_connector`).
    hooks: bool = False
    # Loads finish one step after the step that started them (copied then,
    # reported done, with their jobs, in the next step's output), as a P/D
    # pull; off: done in the same step.
    delay_loads: bool = False
    # As Model Runner V2: start_load_kv (given the step's scheduler output)
    # and the load copies after the forward, unless the step has sync loads.
    after_forward: bool = False
    _held_loads: tuple[set[str], list[Any]] = (set(), [])

    def _loads_after_forward(self, output: Any) -> bool:
        """Whether this step starts its loads after the forward."""
        return self.after_forward and not output.has_sync_kv_loads

    def _start_load_kv(self, output: Any, meta: Any) -> None:
        """Each worker's start_load_kv: through the real hook (given the
        scheduler output as V2 passes it, with `after_forward`), or the
        worker side called directly."""
        if meta is None:
            return
        for side, bare in zip(self.sides, self.bare):
            if bare is not None:
                bare._connector_metadata = meta
                kwargs = {"scheduler_output": output} if self.after_forward else {}
                type(bare).start_load_kv(bare, None, **kwargs)
            elif side is not None:
                side.start_loads(meta)

    def _finished_loads(
        self, finished: set[str], jobs: list[Any]
    ) -> tuple[set[str], list[Any]]:
        """This step's finished loads and their jobs (`delay_loads`: the
        previous step's, this step's held for the next)."""
        if not self.delay_loads:
            return finished, jobs
        held, self._held_loads = self._held_loads, (finished, jobs)
        return held

    def _take_pulls(self) -> set[str]:
        """P/D pulls the test reported finished (`finish_load`): loads of a
        MultiConnector's P/D child, whose copies the test makes itself."""
        pulls, self._finish_next = self._finish_next, set()
        return pulls

    def _block_bytes(self, cache: torch.Tensor) -> int:
        return cache.numel() * cache.element_size() // self.side.num_blocks

    def _forward(self, output: Any) -> None:
        """Write the tokens every scheduled request computes this step."""
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens
            start = end - num_tokens
            tokens = np.asarray(request.all_token_ids[start:end])
            self.write_tokens(self.block_ids(req_id), tokens, np.arange(start, end))

    def _records(self, finished: set[str], output: Any) -> list[Any]:
        records = []
        for worker in self.workers:
            pending = worker.checksum.post_forward(
                finished, set(), None, output.finished_req_ids
            )
            if pending is not None:
                records.append(pending)
        # As ActiveKVConnector.post_forward: an offload side's "tier off"
        # record rides on the worker's output (R134).
        for worker, bare in zip(self.workers, self.bare):
            records += self._off_records(worker, bare)
        return records

    @staticmethod
    def _off_records(worker: Any, bare: Any) -> list[Any]:
        """A worker's pending "tier off" record: the plugin keeps it by
        checksum worker; vLLM with the series asks the connector (a side
        turns off only inside the real hooks, on `bare`)."""
        if native_kv_checksums():
            return [] if bare is None else bare.take_kv_checksum_records()
        from vllm.distributed.kv_transfer.kv_checksum.wiring.offloading import (
            take_offload_off_records,
        )

        return take_offload_off_records(worker.checksum)

    def _bare_connector(self, attr: str, side: Any) -> Any:
        """With `hooks`: an instance of the real connector class, without
        __init__, whose vLLM worker does nothing and whose checksum side is
        `side`, so that the worker side runs inside the real hooks and their
        last-resort guard (R134)."""
        if not self.hooks or side is None:
            return None
        bare = object.__new__(type(self.offload))
        bare.connector_worker = bare.worker_handler = CallRecorder([], "vllm")
        # vLLM with the series: the connector asks its worker whether the
        # copy hand-offs are held (never, in the sim's vLLM worker).
        bare.worker_handler.hand_offs_held = False
        bare._vllm_config = self.offload._vllm_config
        setattr(bare, attr, side)
        return bare

    def _worker_meta(self, meta: Any) -> Any:
        """`meta` of the offload connector, as MultiConnector wraps it."""
        multi = getattr(self.scheduler.connector, "_connectors", None)
        if multi is None:
            return meta
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
            MultiKVConnectorWorkerMetadata,
        )

        return MultiKVConnectorWorkerMetadata(
            metadata=tuple(meta if c is self.offload else None for c in multi)
        )

    def _finish(self, output: Any, kv_output: Any, records: list[Any]) -> Any:
        kv_output.kv_checksums = records or None
        model_output = make_model_runner_output(
            output, scheduler=self.scheduler, kv_connector_output=kv_output
        )
        engine_outputs = self.scheduler.update_from_output(output, model_output)
        for out in iter_engine_core_outputs(engine_outputs):
            if out.finish_reason is not None:
                self.final[out.request_id] = out
        return output


class OffloadSimEngine(_OffloadSimBase):
    """A SimEngine whose connector is vLLM's OffloadingConnector (CPU backend)."""

    def __init__(
        self,
        model_dir: str,
        side: SideConfig,
        name: str,
        entries: bool = True,
        hooks: bool = False,
        after_forward: bool = False,
    ) -> None:
        super().__init__(model_dir, side, name)
        self.hooks = hooks
        self.after_forward = after_forward
        self.offload = offloading_connector(self.scheduler.connector)
        manager = self.offload.connector_scheduler.manager
        self.num_chunks = manager._num_chunks
        self.blocks_per_chunk = self.offload.connector_scheduler.config.blocks_per_chunk
        self.host: list[dict[str, torch.Tensor]] = []
        self.sides: list[OffloadWorkerSide | None] = []
        for worker in self.workers:
            host = {
                name: torch.zeros(
                    (self.num_chunks, self._block_bytes(cache) * self.blocks_per_chunk),
                    dtype=torch.uint8,
                )
                for name, cache in worker.caches.items()
            }
            self.host.append(host)
            if not side.enabled or not entries:
                self.sides.append(None)
                continue
            connector_worker = _Namespace(
                spec=_Namespace(
                    num_chunks=self.num_chunks,
                    blocks_per_chunk=self.blocks_per_chunk,
                ),
                kv_cache_config=self.scheduler.kv_cache_config,
            )
            injector = create_host_fault_injector(
                self.offload._vllm_config, worker.tp_rank, worker.pp_rank
            )
            tensors = list(host.values())
            self.sides.append(
                OffloadWorkerSide(
                    worker.checksum, connector_worker, injector, lambda t=tensors: t
                )
            )
        self.bare = [
            self._bare_connector("_kv_checksum_offload_worker", s) for s in self.sides
        ]
        self.num_loads = 0
        self.num_stores = 0

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, bytes] byte view of one layer's cache, no copy."""
        return cache.view(torch.uint8).reshape(self.side.num_blocks, -1)

    def _copy(self, job: Any, to_host: bool) -> None:
        """vLLM's CPU worker: GPU blocks <-> host sub-blocks, every layer."""
        gpu_spec = job.src_spec if to_host else job.dst_spec
        cpu_spec = job.dst_spec if to_host else job.src_spec
        cpu_ids = np.asarray(cpu_spec.block_ids, dtype=np.int64)
        slots = host_slots(gpu_spec, cpu_ids, self.blocks_per_chunk)
        gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        for worker, host in zip(self.workers, self.host):
            for name, cache in worker.caches.items():
                blocks = self._blocks(cache)
                sub = host[name].view(self.num_chunks * self.blocks_per_chunk, -1)
                if to_host:
                    sub[torch.from_numpy(slots)] = blocks[torch.from_numpy(gpu_ids)]
                else:
                    blocks[torch.from_numpy(gpu_ids)] = sub[torch.from_numpy(slots)]

    def step(self) -> Any:
        """One engine step with offload transfers; returns the SchedulerOutput."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        scheduler = self.scheduler
        output = scheduler.schedule()
        self.history.append(output)
        meta = offload_metadata(output.kv_connector_metadata)
        scheduled = getattr(output, "kv_checksum_scheduled", None)
        for worker in self.workers:
            worker.checksum.bind(scheduled)
        load_jobs = dict(meta.load_jobs) if meta is not None else {}
        store_jobs = dict(meta.store_jobs) if meta is not None else {}
        if not self._loads_after_forward(output):
            self._start_loads(output, meta, load_jobs)
            self._forward(output)
        else:
            self._forward(output)
            self._start_loads(output, meta, load_jobs)
        for side, bare in zip(self.sides, self.bare):
            if bare is not None and meta is not None:
                type(bare).wait_for_save(bare)
            elif side is not None and meta is not None:
                side.save_step_stores(meta)
        for job in store_jobs.values():
            self._copy(job, to_host=True)
            self.num_stores += 1
        finished, loaded = self._finished_loads(
            {job.req_id for job in load_jobs.values() if not job.sync},
            list(load_jobs),
        )
        finished = finished | self._take_pulls()
        records = self._records(finished, output)
        kv_output = make_kv_connector_output(finished_recving=finished)
        completed = {j: len(self.workers) for j in (*loaded, *store_jobs)}
        kv_output.kv_connector_worker_meta = self._worker_meta(
            OffloadingWorkerMetadata(completed_jobs=completed)
        )
        return self._finish(output, kv_output, records)

    def _start_loads(self, output: Any, meta: Any, load_jobs: dict) -> None:
        """Each worker's start_load_kv, then the load jobs' copies."""
        self._start_load_kv(output, meta)
        for job in load_jobs.values():
            self._copy(job, to_host=False)
            self.num_loads += 1


# ----------------------------------------------------------------------
# SimpleCPUOffloadConnector
# ----------------------------------------------------------------------


def simple_offload_metadata(metadata: Any) -> Any:
    """The SimpleCPUOffloadMetadata of a step."""
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    return metadata_of(metadata, SimpleCPUOffloadMetadata)


def simple_offload_connector(connector: Any) -> Any:
    """The scheduler's SimpleCPUOffloadConnector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
        SimpleCPUOffloadConnector,
    )

    return connector_of(connector, SimpleCPUOffloadConnector)


class SimpleOffloadSimEngine(_OffloadSimBase):
    """A SimEngine whose connector is vLLM's SimpleCPUOffloadConnector.

    The scheduler side is vLLM's own (eager or lazy mode); each worker gets
    the plugin's `SimpleOffloadWorkerSide` over host tensors [CPU blocks,
    bytes per block] per layer, standing in for vLLM's SimpleCPUOffloadWorker
    (its DMA copies need CUDA). Per step, as vLLM's worker: the load event's
    copy after `start_loads` (start_load_kv), the forward, then the store
    event's copy after `save_stores` (wait_for_save); both events complete in
    the same step (loads as finished_recving of the event's requests, stores
    as SimpleCPUOffloadWorkerMetadata counts). `tamper(meta)`, when set, may
    change a step's metadata before the workers see it (a tier bug).
    `after_forward`: as Model Runner V2 without sync loads, start_load_kv
    (given the step's scheduler output) and the load copy come after the
    forward.
    """

    def __init__(
        self,
        model_dir: str,
        side: SideConfig,
        name: str,
        entries: bool = True,
        hooks: bool = False,
        after_forward: bool = False,
        held: bool = False,
        delay_stores: bool = False,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_checksum.offload.simple_cpu_offload import (  # noqa: E501
            SimpleOffloadWorkerSide,
        )

        super().__init__(model_dir, side, name)
        self.hooks = hooks
        self.after_forward = after_forward
        self.offload = simple_offload_connector(self.scheduler.connector)
        manager = self.offload.scheduler_manager
        self.num_cpu_blocks = manager.num_cpu_blocks
        self.host: list[dict[str, torch.Tensor]] = []
        self.sides: list[SimpleOffloadWorkerSide | None] = []
        self.tamper: Callable[[Any], None] | None = None
        groups = self.scheduler.kv_cache_config.prefix_cacheable_group_ids
        for worker in self.workers:
            host = {
                name: torch.zeros(
                    (self.num_cpu_blocks, self._block_bytes(cache)), dtype=torch.uint8
                )
                for name, cache in worker.caches.items()
            }
            self.host.append(host)
            if not side.enabled or not entries:
                self.sides.append(None)
                continue
            injector = create_host_fault_injector(
                self.offload._vllm_config, worker.tp_rank, worker.pp_rank
            )
            tensors = list(host.values())
            self.sides.append(
                SimpleOffloadWorkerSide(
                    worker.checksum,
                    groups,
                    self.num_cpu_blocks,
                    injector,
                    lambda t=tensors: t,
                )
            )
        self.bare = [
            self._bare_connector("_kv_checksum_simple_offload_worker", s)
            for s in self.sides
        ]
        # With `held` (and `hooks`): each worker's copy hand-offs held from
        # an after-forward start_load_kv to the end of the step's checksum
        # pass, as the ActiveKVConnector hooks arm and release them (the
        # sim's copies are made where vLLM would hand them off: what the
        # hold changes here is where the entry moves are made).
        self.held: list[Any] = []
        if held:  # the plugin's hold (vLLM with the series: the connector's)
            from vllm.distributed.kv_transfer.kv_checksum.offload.held_calls import (
                HeldCalls,
            )

            self.held = [HeldCalls(_no_copy) for _ in self.bare]
        for bare, calls in zip(self.bare, self.held):
            calls.arm()
            if bare is not None:
                bare._kv_checksum_held_copies = calls
        # With `delay_stores`, a store event is reported complete in the next
        # step's output (vLLM's copy thread finishes it after the step).
        self.delay_stores = delay_stores
        self._pending_stores: list[int] = []
        self.num_loads = 0
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0

    def _copy(self, gpu_ids: list[int], cpu_ids: list[int], to_host: bool) -> None:
        gpu = torch.as_tensor(gpu_ids, dtype=torch.int64)
        cpu = torch.as_tensor(cpu_ids, dtype=torch.int64)
        for worker, host in zip(self.workers, self.host):
            for name, cache in worker.caches.items():
                blocks = cache.view(torch.uint8).reshape(self.side.num_blocks, -1)
                if to_host:
                    host[name][cpu] = blocks[gpu]
                else:
                    blocks[gpu] = host[name][cpu]

    def step(self) -> Any:
        """One engine step with offload transfers; returns the SchedulerOutput."""
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        scheduler = self.scheduler
        output = scheduler.schedule()
        self.history.append(output)
        meta = simple_offload_metadata(output.kv_connector_metadata)
        if meta is not None and self.tamper is not None:
            self.tamper(meta)
        scheduled = getattr(output, "kv_checksum_scheduled", None)
        for worker in self.workers:
            worker.checksum.bind(scheduled)
        if not self._loads_after_forward(output):
            finished = self._start_loads(output, meta)
            self._forward(output)
        else:
            self._forward(output)
            finished = self._start_loads(output, meta)
        stored = meta is not None and bool(meta.store_gpu_blocks)
        for side, bare in zip(self.sides, self.bare):
            if bare is not None and meta is not None:
                type(bare).wait_for_save(bare)
            elif side is not None and stored:
                side.save_stores(meta)
        if stored:
            self._copy(meta.store_gpu_blocks, meta.store_cpu_blocks, to_host=True)
            self.num_stored_blocks += len(meta.store_gpu_blocks)
        finished, _ = self._finished_loads(finished, [])
        finished = finished | self._take_pulls()
        records = self._records(finished, output)
        completed = self._completed_stores(meta.store_event if stored else None)
        if self.held:
            # As the post_forward hook, before the held copies go: the moves
            # the pass did not make, if any.
            for worker in self.workers:
                worker.checksum.flush_queued_entries()
        for calls in self.held:
            calls.release()
        kv_output = make_kv_connector_output(finished_recving=finished)
        if completed:
            kv_output.kv_connector_worker_meta = self._worker_meta(
                SimpleCPUOffloadWorkerMetadata(
                    completed_store_events=dict.fromkeys(completed, len(self.workers))
                )
            )
        return self._finish(output, kv_output, records)

    def _completed_stores(self, event: int | None) -> list[int]:
        """The store events this step's output reports complete: its own
        (`event`), or with `delay_stores` the previous step's."""
        mine = [] if event is None else [event]
        if not self.delay_stores:
            return mine
        done, self._pending_stores = self._pending_stores, mine
        return done

    def _start_loads(self, output: Any, meta: Any) -> set[str]:
        """Each worker's start_load_kv, then the load event's copy; returns
        the requests whose load it finished."""
        self._start_load_kv(output, meta)
        if meta is None or not meta.load_cpu_blocks:
            return set()
        self._copy(meta.load_gpu_blocks, meta.load_cpu_blocks, to_host=False)
        self.num_loads += 1
        self.num_loaded_blocks += len(meta.load_cpu_blocks)
        return set(meta.load_event_to_reqs.get(meta.load_event, ()))


def spy_entry_moves(engine: Any, restore: str) -> list[tuple[str, bool]]:
    """Worker 0's entry moves as they happen: ("save", whether a load's
    restore rode along) per save, ("restore", True) per restore on its own
    (its host table's method `restore`: `restore_ids` or `restore`)."""
    moves: list[tuple[str, bool]] = []
    worker, side = engine.workers[0], engine.sides[0]
    assert side is not None
    real_save = worker.checksum.save_block_checksums
    real_restore = getattr(side.entries, restore)

    def save(*args: Any) -> None:
        moves.append(("save", len(args) > 2 and args[2] is not None))
        real_save(*args)

    def restore_alone(*args: Any) -> None:
        moves.append(("restore", True))
        real_restore(*args)

    worker.checksum.save_block_checksums = save
    setattr(side.entries, restore, restore_alone)
    return moves


def loads_beside_stores(
    engine: Any, prompts: list[list[int]], stagger: bool, block_size: int = 16
) -> None:
    """Three times: a new prompt's prefill beside a request that loads a
    prefix of `prompts` from host memory, so that a step stores the new
    blocks while the load starts (`stagger`: the prefill one step ahead, for
    a tier that stores a block the step after computing it)."""
    rng = random.Random(5)
    for i in range(3):
        fresh = [rng.randrange(3, 200) for _ in range(4 * block_size + 1)]
        engine.add(
            make_request(f"fresh{i}", fresh, max_tokens=3, block_size=block_size)
        )
        if stagger:
            engine.step()
        tail = [rng.randrange(3, 200) for _ in range(block_size + 1)]
        prefix = prompts[i][: 4 * block_size]
        engine.add(
            make_request(f"load{i}", prefix + tail, max_tokens=3, block_size=block_size)
        )
        engine.run(f"load{i}")
        engine.run(f"fresh{i}")


def shared_prefix_prompts(
    count: int, num_prefixes: int = 6, seed: int = 0, block_size: int = 16
) -> list[list[int]]:
    """Prompts over shared 4-block prefixes, round-robin, each with its own
    tail of one block and one token."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 200) for _ in range(4 * block_size)]
        for _ in range(num_prefixes)
    ]
    return [
        prefixes[i % num_prefixes]
        + [rng.randrange(3, 200) for _ in range(block_size + 1)]
        for i in range(count)
    ]


def run_shared_prefixes(
    engine: SimEngine,
    count: int,
    num_prefixes: int = 6,
    seed: int = 0,
    block_size: int = 16,
) -> list[list[int]]:
    """Requests over shared 4-block prefixes, round-robin, one at a time: each
    prefix is evicted from the 24 GPU blocks before it is used again."""
    prompts = shared_prefix_prompts(count, num_prefixes, seed, block_size)
    for i, prompt in enumerate(prompts):
        req_id = f"r{seed}-{i}"
        engine.add(make_request(req_id, prompt, max_tokens=2, block_size=block_size))
        engine.run(req_id)
    return prompts


def run_together(engine: SimEngine, prefixes: list[list[int]], tag: str) -> None:
    """Requests over `prefixes` (17 random tokens after each) added at once,
    stepped until all finished."""
    rng = random.Random(tag)
    req_ids = []
    for i, prefix in enumerate(prefixes):
        req_id = f"{tag}-{i}"
        tail = [rng.randrange(3, 200) for _ in range(17)]
        engine.add(make_request(req_id, prefix + tail, max_tokens=3, block_size=16))
        req_ids.append(req_id)
    for _ in range(40):
        if all(r in engine.final for r in req_ids):
            return
        engine.step()
    raise AssertionError(f"{tag}: not all requests finished")


def verdicts(engine: SimEngine) -> dict[str, int]:
    """The engine's load verdict counts."""
    return dict(engine.checksums.stats.loads)


def assert_every_load_verified(engine: SimEngine) -> dict[str, int]:
    """Every load of the engine verified: no mismatch, none unverified.
    Returns the verdict counts."""
    counts = verdicts(engine)
    assert counts.get("verified", 0) == engine.num_loads, counts
    assert counts.get("mismatch", 0) == 0 and counts.get("unverified", 0) == 0
    return counts


class CallRecorder:
    """Records calls by name, in order: a stand-in for a connector's worker
    (vLLM's) or for the package's worker side."""

    def __init__(self, calls: list[str], prefix: str) -> None:
        self.calls, self.prefix = calls, prefix

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: self.calls.append(f"{self.prefix}.{name}")


def reload_after_drop(
    engine: SimEngine, prompts: list[list[int]], block_size: int = 16
) -> None:
    """After `run_shared_prefixes(engine, 7)` dropped prefix 0's bad host
    copy: faults off, prefix 0 evicted from the GPU again, then reloaded. The
    recompute stored a fresh copy, so the reload verifies and the one
    mismatch stays the only one (R121)."""
    for worker_side in engine.sides:
        assert worker_side is not None
        worker_side.injector = None  # no more faults
    for i in range(1, 6):  # evict prefix 0 from the GPU again
        engine.add(
            make_request(
                f"x{i}", prompts[i][:-1] + [9, 9], max_tokens=1, block_size=block_size
            )
        )
        engine.run(f"x{i}")
    loads = engine.num_loads
    engine.add(
        make_request(
            "again", prompts[0][:-1] + [5, 5], max_tokens=1, block_size=block_size
        )
    )
    engine.run("again")
    assert engine.num_loads > loads
    assert verdicts(engine).get("mismatch") == 1, verdicts(engine)
    assert verdicts(engine).get("verified", 0) >= 1


def check_side_error_turns_off_the_tier(
    make_engine: Callable[[str], Any], attr: str
) -> Any:
    """R134 on an offload tier: a control engine checks its host loads; an
    engine whose TP rank 0 side raises then computes the same tokens (no
    failure, no recompute), gives later host loads no verdict, turns off only
    that tier ("host") once, and keeps rank 1's side. Returns the engine."""
    control = make_engine("guard-control")
    _, control_tokens = run_after_side_error(control, trip=False)
    assert verdicts(control)["verified"] == control.num_loads  # checked
    engine = make_engine("guard")
    before, tokens = run_after_side_error(engine, trip=True)
    assert tokens == control_tokens
    kcs = engine.checksums
    assert verdicts(engine) == before
    assert kcs.offload.off_sources == {"host"} and not kcs.offload.pending
    assert kcs.stats.disabled_workers == 1 and not kcs.disabled_workers
    assert engine.bare[0].__dict__[attr] is None
    assert engine.bare[1].__dict__[attr] is not None
    return engine


def run_after_side_error(engine: Any, trip: bool) -> tuple[dict[str, int], list[int]]:
    """Shared-prefix requests on an engine built with `hooks=True`, then (with
    `trip`) an exception from TP rank 0's offload worker side inside the real
    `start_load_kv` hook, then fault-free requests whose prefixes come back
    from host memory. Asserts every request finished normally (no failed
    load under policy "fail"). Returns the verdicts before the trip and the
    tokens each later request computed (more than a control's: a recompute)."""
    from vllm.v1.engine import FinishReason

    run_shared_prefixes(engine, 8)
    before = verdicts(engine)
    assert before.get("verified", 0) >= 2, before

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected into the offload worker side")

    if trip:
        engine.sides[0].start_loads = broken  # type: ignore[union-attr, method-assign]
    loads = engine.num_loads
    prompts = run_shared_prefixes(engine, 12, seed=1)
    assert engine.num_loads >= loads + 6
    for req_id, final in engine.final.items():
        assert final.finish_reason == FinishReason.LENGTH, req_id
    return before, [
        engine.scheduled_tokens(f"r1-{i}") - len(p) for i, p in enumerate(prompts)
    ]
