# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A P/D simulation on CPU: real vLLM schedulers, real checksum workers, CPU KV.

`SimEngine` is one vLLM 0.33.0 instance: a real `Scheduler` (with the plugin's
hooks) plus one `KVChecksumWorker` per simulated (pp_rank, tp_rank), each over
its own CPU KV caches made by vLLM's `allocate_kv_cache`. A step runs what the
engine core and the model runner would: schedule, "forward" (write the KV of
the scheduled tokens), the workers' checksum calls, `update_from_output`.

The KV of a token is a fixed function of (token id, position, layer, global
head, the engine's `kv_salt`), so a producer and a consumer computing the same
prompt with the same salt hold the same KV. `transfer` moves a request's KV
from producer blocks into the consumer's blocks by token position (any TP, PP,
block size and KV cache groups on either side), and `apply_fault` can inject
the faults of R131 on the way.

Knobs for the scheduler tests (all on `SideConfig`):

* `groups`: "full" (one full-attention group), "both" (group 0 full
  attention over the odd layers, group 1 sliding window over the even layers;
  see `kv_checksum_helpers.group_layer_indices`) or "mla" (one MLA latent
  cache per layer, the same bytes on every TP rank: `write_global` writes
  every replica, `read_global` reads the first).
* `kv_salt`: mixed into the KV this engine computes itself, so locally
  computed KV differs from another engine's (as decode-computed KV is not
  bit-identical to the producer's prefill, R88); transferred KV is copied as is.
* `uncovered_groups`: the checksum workers are built without these groups'
  caches, so every worker skips them as "layer ... has no KV cache on this
  worker" (R34) while the simulated forward still writes them.
* `silent_workers`: (pp_rank, tp_rank) of workers whose checksum records never
  reach the scheduler (a lost or late report, R80/R82).
* `max_num_batched_tokens`: a small token budget makes prefills chunked.
"""

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    NUM_KV_HEADS,
    GroupsKind,
    KVChecksumTestConnector,
    iter_engine_core_outputs,
    make_kv_cache_config,
    make_kv_caches,
    make_kv_connector_output,
    make_model_runner_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    register_plugin,
)
from vllm.distributed.kv_transfer.kv_checksum.config import FAULT_INJECTION_KEY
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import KVChecksumWorker
from vllm.distributed.kv_transfer.kv_checksum.faults.injector import (
    Injection,
    KVFaultInjector,
    create_fault_injector,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

CARRIER_CONNECTOR_NAME = "KVChecksumCarrierTestConnector"


class KVChecksumCarrierTestConnector(KVChecksumTestConnector):
    """The test connector declaring the kv_transfer_params carrier (R97)."""

    _cache_hit_source = CacheHitSource.P2P

    def kv_checksum_carrier(
        self, request: Any, receiving: bool
    ) -> KVChecksumCarrier | None:
        return KVChecksumCarrier.KV_TRANSFER_PARAMS


WHOLE_PROMPT_CONNECTOR_NAME = "KVChecksumWholePromptTestConnector"


class KVChecksumWholePromptTestConnector(KVChecksumCarrierTestConnector):
    """The carrier test connector loading the whole prompt, as NIXL pull does
    in vLLM 0.33.0 without a prefill backoff: vLLM then recomputes the last
    prompt token after the load (`_update_waiting_for_remote_kv`). The base
    test connector loads all but the last token."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False


OFFLOAD_CONNECTOR_NAME = "KVChecksumOffloadTestConnector"
OFFLOAD_TOKENS_KEY = "test_offload_tokens"


class KVChecksumOffloadTestConnector(KVChecksumTestConnector):
    """A test connector loading offloaded KV from host memory (R116-R121).

    A request whose kv_transfer_params hold ``test_offload_tokens`` = n gets
    its first n tokens as an asynchronous load from the host tier (hit source
    "host"); the test moves the KV and the stored block entries and reports
    the load finished. It declares "host" as a stored-checksum source and
    records every `on_kv_checksum_failure` call.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures: list[tuple[str, dict[int, list[int]]]] = []
        self.checksum_worker: Any = None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        count = int(params.get(OFFLOAD_TOKENS_KEY) or 0) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get(OFFLOAD_TOKENS_KEY):
            return
        if num_external_tokens > 0:
            self.start_load(request, blocks, num_external_tokens)
        params[OFFLOAD_TOKENS_KEY] = 0

    def get_kv_checksum_sources(self, request: Any) -> set[str]:
        return {CacheHitSource.HOST.value}

    def on_kv_checksum_failure(
        self, request: Any, mismatches: dict[int, list[int]]
    ) -> None:
        self.failures.append((request.request_id, dict(mismatches)))

    def register_kv_checksum_worker(self, worker: Any) -> None:
        self.checksum_worker = worker


def register_carrier_connector() -> None:
    for name, cls in (
        (CARRIER_CONNECTOR_NAME, "KVChecksumCarrierTestConnector"),
        (WHOLE_PROMPT_CONNECTOR_NAME, "KVChecksumWholePromptTestConnector"),
        (OFFLOAD_CONNECTOR_NAME, "KVChecksumOffloadTestConnector"),
    ):
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, __name__, cls)


def kv_bytes(
    token_ids: np.ndarray,
    positions: np.ndarray,
    layer: int,
    head: int,
    cell: int,
    salt: int = 0,
) -> np.ndarray:
    """The KV cell bytes of (token, position) for one layer and global head."""
    t = token_ids.astype(np.int64)[:, None]
    p = positions.astype(np.int64)[:, None]
    c = np.arange(cell, dtype=np.int64)[None, :]
    mixed = t * 131 + p * 31 + layer * 17 + head * 7 + c * 13 + (c * t) % 251
    mixed = mixed + salt * (c + 1) * 57
    return (mixed % 256).astype(np.uint8)


@dataclasses.dataclass
class SideConfig:
    """One instance's shape and checksum settings (knobs: module docstring)."""

    tp: int = 1
    pp: int = 1
    block_size: int = 16
    num_blocks: int = 96
    layout: KVCacheLayout = KVCacheLayout.LBHNC
    kernel_block_size: int | None = None
    enabled: bool = True
    fail_closed: bool = False
    policy: str = "fail"
    async_scheduler: bool = False
    connector: str = CARRIER_CONNECTOR_NAME
    groups: GroupsKind = "full"
    kv_salt: int = 0
    uncovered_groups: tuple[int, ...] = ()
    silent_workers: tuple[tuple[int, int], ...] = ()
    # The scheduler's log_stats (make_stats returns None without it).
    log_stats: bool = False
    # kv_connector_extra_config["kv_checksum_fault_injection"] (R131): each
    # worker corrupts finished loads before checksumming them, as in wiring.
    fault_injection: dict[str, Any] | None = None
    # Token budget of a step (None: max_model_len); smaller ones chunk prefills.
    max_num_batched_tokens: int | None = None
    # max_model_len (None: the harness default, 1024 tokens).
    max_model_len: int | None = None
    # More kv_connector_extra_config (e.g. a real connector's own settings).
    connector_extra: dict[str, Any] | None = None
    # The scheduler's max_num_seqs (None: the harness default, 16).
    max_num_seqs: int | None = None
    # kv_role: "kv_consumer" makes vLLM's own preemptions deliver in-flight
    # output (`requires_kv_delivery` is the producer role), as offload
    # connectors do.
    kv_role: str = "kv_both"

    def describe(self) -> str:
        return f"TP{self.tp}/PP{self.pp}/bs{self.block_size}"


@dataclasses.dataclass
class SimWorker:
    pp_rank: int
    tp_rank: int
    caches: dict[str, torch.Tensor]
    checksum: KVChecksumWorker
    # layer name -> (layer number, first global head held, KV cache group id)
    layers: dict[str, tuple[int, int, int]]
    injector: KVFaultInjector | None = None


def per_group(block_ids: Any) -> list[list[int]]:
    """Block ids per KV cache group (a flat list is one group's)."""
    ids = list(block_ids)
    if ids and not isinstance(ids[0], (list, tuple, np.ndarray)):
        return [[int(b) for b in ids]]
    return [[int(b) for b in group] for group in ids]


class SimEngine:
    """A real vLLM scheduler with simulated workers holding CPU KV caches."""

    def __init__(self, model_dir: str, side: SideConfig, name: str) -> None:
        register_plugin()
        register_carrier_connector()
        self.side = side
        extra: dict[str, Any] = {"test_engine_name": name}
        if side.enabled:
            extra["enable_kv_checksum"] = True
            extra["kv_checksum_fail_closed"] = side.fail_closed
        if side.fault_injection is not None:
            extra[FAULT_INJECTION_KEY] = side.fault_injection
        extra.update(side.connector_extra or {})
        self.vllm_config = make_vllm_config(
            model_dir,
            block_size=side.block_size,
            num_blocks=side.num_blocks,
            groups=side.groups,
            tp_size=side.tp,
            pp_size=side.pp,
            kv_connector=side.connector,
            kv_role=side.kv_role,
            extra_config=extra,
            kv_load_failure_policy=side.policy,  # type: ignore[arg-type]
            max_num_batched_tokens=side.max_num_batched_tokens,
            **(
                {}
                if side.max_model_len is None
                else {"max_model_len": side.max_model_len}
            ),
            **(
                {} if side.max_num_seqs is None else {"max_num_seqs": side.max_num_seqs}
            ),
        )
        self.scheduler = make_scheduler(
            self.vllm_config,
            make_kv_cache_config(self.vllm_config),
            async_scheduler=side.async_scheduler,
            log_stats=side.log_stats,
        )
        self.null_block = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        self.workers = [
            self._make_worker(pp_rank, tp_rank)
            for pp_rank in range(side.pp)
            for tp_rank in range(side.tp)
        ]
        self.silent_workers = set(side.silent_workers)
        self.heads_per_rank = max(1, NUM_KV_HEADS // side.tp)
        self.final: dict[str, Any] = {}
        self.tokens: dict[str, list[int]] = {}  # request id -> output tokens
        self.step_tokens = False
        self.loads: dict[str, Any] = {}  # request id -> RecordedLoad, started
        # Every SchedulerOutput, in step order (kv_checksum_scheduled included).
        self.history: list[Any] = []
        # Fault injections of every worker (R131), in step order.
        self.injections: list[Injection] = []
        # SchedulerStats the steps returned (with log_stats), in step order.
        self.scheduler_stats: list[Any] = []
        self._finish_next: set[str] = set()
        self._fail_next: set[str] = set()
        # A connector's worker side, if a test drives one: called with each
        # SchedulerOutput before the step's KV writes (loads) and after them
        # (saves).
        self.before_writes: Callable[[Any], None] | None = None
        self.after_writes: Callable[[Any], None] | None = None

    @property
    def checksums(self) -> Any:
        return self.scheduler.kv_checksum_scheduler

    def _make_worker(self, pp_rank: int, tp_rank: int) -> SimWorker:
        side = self.side
        config = make_kv_cache_config(self.vllm_config, pp_rank=pp_rank)
        caches = make_kv_caches(
            config, side.layout, side.kernel_block_size, seed=pp_rank * 8 + tp_rank
        )
        topology = WorkerTopology(
            tp_rank=tp_rank,
            tp_size=side.tp,
            pp_rank=pp_rank,
            num_blocks=side.num_blocks,
            uniform_model_kv_heads=NUM_KV_HEADS,
            device=torch.device("cpu"),
        )
        heads = caches[next(iter(caches))].shape[1] if caches else 1
        replicas = max(1, side.tp // NUM_KV_HEADS)
        first_head = (tp_rank // replicas) * heads
        if side.groups == "mla":  # every rank holds the whole latent (head 0)
            first_head = 0
        layers = {
            name: (int(name.split(".")[2]), first_head, group_id)
            for group_id, group in enumerate(config.kv_cache_groups)
            for name in group.layer_names
        }
        covered = {
            name: cache
            for name, cache in caches.items()
            if layers[name][2] not in side.uncovered_groups
        }
        worker = KVChecksumWorker(config, covered, topology)
        injector = create_fault_injector(self.vllm_config, tp_rank, pp_rank)
        return SimWorker(pp_rank, tp_rank, caches, worker, layers, injector)

    def block_ids(self, req_id: str) -> list[list[int]]:
        """The request's block ids per KV cache group (null blocks included)."""
        return per_group(self.scheduler.kv_cache_manager.get_block_ids(req_id))

    def recv_blocks(self, req_id: str) -> KVChecksumBlocks | None:
        """The blocks the scheduler asked workers to checksum for a load of `req_id`."""
        return self._scheduled(req_id, "reqs_to_recv")

    def sent_blocks(self, req_id: str) -> KVChecksumBlocks | None:
        """The blocks the scheduler asked workers to checksum for sending `req_id`."""
        return self._scheduled(req_id, "reqs_to_send")

    def _scheduled(self, req_id: str, kind: str) -> KVChecksumBlocks | None:
        found = None
        for output in self.history:
            scheduled = getattr(output, "kv_checksum_scheduled", None)
            if scheduled is not None and req_id in getattr(scheduled, kind):
                found = getattr(scheduled, kind)[req_id]
        return found

    # ------------------------------------------------------------------
    # KV access by token position
    # ------------------------------------------------------------------

    def _cell_index(self, cache: torch.Tensor, block: int, slot: int) -> tuple:
        per_kernel = cache.shape[2]
        split = self.side.block_size // per_kernel
        return block * split + slot // per_kernel, slot % per_kernel

    def write_tokens(
        self,
        block_ids: Sequence[Sequence[int]],
        token_ids: np.ndarray,
        positions: np.ndarray,
    ) -> None:
        """The "forward": write the KV of tokens at `positions` into their blocks.

        `block_ids` holds the request's blocks per group; positions in a null
        block (out of a sliding window) are not written.
        """
        bs = self.side.block_size
        for worker in self.workers:
            for name, (layer, first_head, group) in worker.layers.items():
                ids = block_ids[group]
                cache = worker.caches[name].view(torch.uint8)
                cell = cache.shape[-1]
                for h in range(cache.shape[1]):
                    data = kv_bytes(
                        token_ids,
                        positions,
                        layer,
                        first_head + h,
                        cell,
                        self.side.kv_salt,
                    )
                    for i, pos in enumerate(positions):
                        block = ids[pos // bs]
                        if block == self.null_block:
                            continue
                        row, slot = self._cell_index(cache, block, int(pos % bs))
                        cache[row, h, slot] = torch.from_numpy(data[i])

    def read_global(
        self, block_ids: Sequence[int], positions: Iterable[int], group: int = 0
    ) -> dict[tuple[int, int], np.ndarray]:
        """KV per (layer, global head) of `group`: [positions, cell bytes]."""
        bs = self.side.block_size
        out: dict[tuple[int, int], np.ndarray] = {}
        positions = list(positions)
        for cache, h, key in self._group_heads(group):
            rows = []
            for pos in positions:
                row, slot = self._cell_index(cache, block_ids[pos // bs], pos % bs)
                rows.append(cache[row, h, slot].numpy().copy())
            out.setdefault(key, np.stack(rows))
        return out

    def write_global(
        self,
        block_ids: Sequence[int],
        positions: list[int],
        data: dict[tuple[int, int], np.ndarray],
        group: int = 0,
    ) -> None:
        """Write KV per (layer, global head) of `group` into every worker holding it."""
        bs = self.side.block_size
        for cache, h, key in self._group_heads(group):
            for i, pos in enumerate(positions):
                row, slot = self._cell_index(cache, block_ids[pos // bs], pos % bs)
                cache[row, h, slot] = torch.from_numpy(data[key][i])

    def _group_heads(self, group: int) -> Iterable[tuple[torch.Tensor, int, tuple]]:
        """(byte view of a cache, local head, (layer, global head)) of `group`
        on every worker."""
        for worker in self.workers:
            for name, (layer, first_head, layer_group) in worker.layers.items():
                if layer_group == group:
                    cache = worker.caches[name].view(torch.uint8)
                    for h in range(cache.shape[1]):
                        yield cache, h, (layer, first_head + h)

    # ------------------------------------------------------------------
    # Steps
    # ------------------------------------------------------------------

    def add(self, request: Any) -> None:
        self.scheduler.add_request(request)

    def finish_load(self, req_id: str, failed: bool = False) -> None:
        """Report a started load finished (or failed) in the next step."""
        (self._fail_next if failed else self._finish_next).add(req_id)

    def step(self) -> Any:
        """One engine step; returns the SchedulerOutput."""
        output, model_output = self.forward()
        self.update(output, model_output)
        return output

    def forward(self) -> tuple[Any, Any]:
        """Schedule a step and run its forward (KV writes, checksum work); its
        output goes to the scheduler in `update` (later, under async
        scheduling: see `run_pipelined`). With `step_tokens` each sampled
        token is 1000 + the step's index: an output token names its step."""
        scheduler = self.scheduler
        output = scheduler.schedule()
        self.history.append(output)
        for load in getattr(scheduler.connector, "started_loads", ()):
            self.loads.setdefault(load.request_id, load)
        if self.before_writes is not None:
            self.before_writes(output)
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            end = request.num_computed_tokens
            start = end - num_tokens
            known = request.all_token_ids[start:end]
            # Async scheduling: a decode's input token is not known yet here.
            tokens = np.asarray(known + [0] * (num_tokens - len(known)))
            self.write_tokens(self.block_ids(req_id), tokens, np.arange(start, end))
        if self.after_writes is not None:
            self.after_writes(output)
        finished = self._finish_next | self._fail_next
        failed = set(self._fail_next)
        self._finish_next, self._fail_next = set(), set()
        records = []
        scheduled = getattr(output, "kv_checksum_scheduled", None)
        for worker in self.workers:
            worker.checksum.bind(scheduled)
            if worker.injector is not None:  # as the wiring's post_forward hook
                self.injections += worker.injector.corrupt_loads(
                    worker.checksum, finished, failed, output.finished_req_ids
                )
                self.injections += worker.injector.corrupt_hits(worker.checksum)
            pending = worker.checksum.post_forward(
                finished, failed, None, output.finished_req_ids
            )
            silent = (worker.pp_rank, worker.tp_rank) in self.silent_workers
            if pending is not None and not silent:
                records.append(pending)
        kv_output = make_kv_connector_output(
            finished_recving=finished - failed, failed_recving=failed
        )
        kv_output.kv_checksums = records or None  # type: ignore[attr-defined]
        model_output = make_model_runner_output(
            output,
            scheduler=scheduler,
            kv_connector_output=kv_output,
            **(
                {"default_token": 1000 + len(self.history) - 1}
                if self.step_tokens
                else {}
            ),
        )
        return output, model_output

    def update(self, output: Any, model_output: Any) -> None:
        """The scheduler takes a step's model output."""
        engine_outputs = self.scheduler.update_from_output(output, model_output)
        for outputs in (engine_outputs or {}).values():
            if outputs.scheduler_stats is not None:  # log_stats: to the loggers
                self.scheduler_stats.append(outputs.scheduler_stats)
        for out in iter_engine_core_outputs(engine_outputs):
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.final[out.request_id] = out

    def run_pipelined(self, req_id: str, max_steps: int = 40) -> list[int]:
        """Step as vLLM's engine does with async scheduling: step N + 1 is
        scheduled before step N's output reaches the scheduler. Returns the
        request's output tokens."""
        in_flight: tuple[Any, Any] | None = None
        for _ in range(max_steps):
            if req_id in self.final:
                break
            step = self.forward()
            if in_flight is not None:
                self.update(*in_flight)
            in_flight = step
        if in_flight is not None:
            self.update(*in_flight)
        assert req_id in self.final, f"{req_id} did not finish in {max_steps} steps"
        return self.tokens[req_id]

    def run(self, req_id: str, max_steps: int = 40) -> Any:
        """Step until `req_id` finished; returns its final EngineCoreOutput."""
        for _ in range(max_steps):
            if req_id in self.final:
                return self.final[req_id]
            self.step()
        raise AssertionError(f"{req_id} did not finish in {max_steps} steps")

    def scheduled_tokens(self, req_id: str) -> int:
        """Tokens of `req_id` computed locally (scheduled) so far."""
        return sum(o.num_scheduled_tokens.get(req_id, 0) for o in self.history)


@dataclasses.dataclass
class LoadResult:
    """What happened to one consumer request."""

    request_id: str
    final: Any
    num_loaded_tokens: int
    computed_after_load: int
    # Tokens the request had computed locally (prefix cache hit) at load start.
    num_local_tokens: int = 0
    # The blocks the consumer scheduled for checksumming (None: not checked).
    recv_blocks: KVChecksumBlocks | None = None

    @property
    def finish_reason(self) -> str:
        return str(self.final.finish_reason)


def produce(
    producer: SimEngine,
    req_id: str,
    prompt: list[int],
    extra_params: dict | None = None,
) -> dict[str, Any]:
    """Run a producer request to its end; return its kv_transfer_params."""
    params = {"do_remote_decode": True, **(extra_params or {})}
    producer.add(
        make_request(
            req_id,
            prompt,
            max_tokens=1,
            kv_transfer_params=params,
            block_size=producer.side.block_size,
        )
    )
    final = producer.run(req_id)
    assert final.kv_transfer_params is not None, "producer returned no params"
    return dict(final.kv_transfer_params)


def run_local(
    engine: SimEngine, req_id: str, prompt: list[int], max_tokens: int = 1
) -> Any:
    """Run a request without kv_transfer_params (computed locally, prefix-cached
    when it finishes); returns its final EngineCoreOutput."""
    engine.add(
        make_request(
            req_id, prompt, max_tokens=max_tokens, block_size=engine.side.block_size
        )
    )
    return engine.run(req_id)


FAULT_KINDS = ("bit_flip", "zero_block", "swap_blocks", "stale_block")


@dataclasses.dataclass
class Fault:
    """A corruption of loaded KV (R131); `position` indexes the loaded blocks of
    `group` (0: the first loaded block)."""

    kind: str
    position: int = 0
    other_position: int = 1
    worker: int = 0
    group: int = 0


def apply_fault(
    consumer: SimEngine,
    block_ids: list[int],
    positions: list[int],
    fault: Fault,
    stale: dict[tuple[int, int], np.ndarray] | None = None,
) -> None:
    """Corrupt the consumer's loaded KV of `fault.group` after the transfer.

    `block_ids` are the group's consumer blocks, `positions` its loaded tokens.
    """
    bs = consumer.side.block_size
    group = fault.group
    loaded = sorted({p // bs for p in positions})
    block = loaded[fault.position % len(loaded)]
    in_block = [p for p in positions if p // bs == block]
    if fault.kind == "bit_flip":
        worker = consumer.workers[fault.worker % len(consumer.workers)]
        name = next(n for n, (_, _, g) in worker.layers.items() if g == group)
        cache = worker.caches[name].view(torch.uint8)
        row, slot = consumer._cell_index(cache, block_ids[block], in_block[0] % bs)
        cache[row, 0, slot, 3] ^= 0x10
        return
    data = consumer.read_global(block_ids, in_block, group)
    if fault.kind == "zero_block":
        consumer.write_global(
            block_ids, in_block, {k: np.zeros_like(v) for k, v in data.items()}, group
        )
    elif fault.kind == "swap_blocks":
        other = loaded[fault.other_position % len(loaded)]
        if other == block:
            other = loaded[(loaded.index(block) + 1) % len(loaded)]
        other_pos = [p for p in positions if p // bs == other]
        n = min(len(in_block), len(other_pos))
        other_data = consumer.read_global(block_ids, other_pos[:n], group)
        mine = {k: v[:n] for k, v in data.items()}
        consumer.write_global(block_ids, in_block[:n], other_data, group)
        consumer.write_global(block_ids, other_pos[:n], mine, group)
    elif fault.kind == "stale_block":
        assert stale is not None, "a stale read needs another request's KV"
        n = len(in_block)
        consumer.write_global(
            block_ids, in_block, {k: v[:n] for k, v in stale.items()}, group
        )
    else:
        raise ValueError(f"unknown fault kind {fault.kind}")


def transferable_positions(
    producer: SimEngine,
    producer_blocks: Sequence[int],
    consumer: SimEngine,
    consumer_blocks: Sequence[int],
    positions: Iterable[int],
) -> list[int]:
    """Token positions held by a real (non-null) block on both sides."""
    bs_p, bs_c = producer.side.block_size, consumer.side.block_size
    return [
        p
        for p in positions
        if p // bs_p < len(producer_blocks)
        and producer_blocks[p // bs_p] != producer.null_block
        and p // bs_c < len(consumer_blocks)
        and consumer_blocks[p // bs_c] != consumer.null_block
    ]


def transfer(
    producer: SimEngine,
    producer_blocks: Sequence[Sequence[int]],
    consumer: SimEngine,
    consumer_blocks: Sequence[Sequence[int]],
    positions: list[int],
) -> list[list[int]]:
    """Copy the KV of token `positions` from producer to consumer blocks, per
    group (blocks given per group); returns the positions copied per group."""
    copied = []
    for group, (theirs, ours) in enumerate(zip(producer_blocks, consumer_blocks)):
        group_positions = transferable_positions(
            producer, theirs, consumer, ours, positions
        )
        consumer.write_global(
            ours,
            group_positions,
            producer.read_global(theirs, group_positions, group),
            group,
        )
        copied.append(group_positions)
    return copied


def consume(
    consumer: SimEngine,
    producer: SimEngine,
    req_id: str,
    prompt: list[int],
    params: dict[str, Any],
    fault: Fault | None = None,
    stale_params: dict[str, Any] | None = None,
    max_tokens: int = 2,
) -> LoadResult:
    """Run a consumer request whose prompt KV is loaded from the producer.

    The load starts, `transfer` copies the producer's blocks (params
    "remote_block_ids") into the consumer's, `fault` (if any) corrupts them,
    the load is reported finished, and the request runs to its end.
    """
    consumer.add(
        make_request(
            req_id,
            prompt,
            max_tokens=max_tokens,
            kv_transfer_params=params,
            block_size=consumer.side.block_size,
        )
    )
    consumer.step()
    load = consumer.loads[req_id]
    request = consumer.scheduler.requests[req_id]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    end = request.num_computed_tokens
    local = end - load.num_external_tokens
    positions = list(range(local, end))
    blocks = per_group(load.block_ids)
    remote = per_group(params["remote_block_ids"])
    copied = transfer(producer, remote, consumer, blocks, positions)
    if fault is not None:
        group = fault.group
        stale = None
        if stale_params is not None:
            bs = consumer.side.block_size
            loaded = sorted({p // bs for p in copied[group]})
            block = loaded[fault.position % len(loaded)]
            in_block = [p for p in copied[group] if p // bs == block]
            stale = producer.read_global(
                per_group(stale_params["remote_block_ids"])[group], in_block, group
            )
        apply_fault(consumer, blocks[group], copied[group], fault, stale)
    consumer.finish_load(req_id)
    consumer.step()
    computed = request.num_computed_tokens
    final = consumer.run(req_id)
    return LoadResult(
        req_id,
        final,
        len(positions),
        computed,
        num_local_tokens=local,
        recv_blocks=consumer.recv_blocks(req_id),
    )


# ----------------------------------------------------------------------
# Helpers of the CONNECTOR-carrier tests (NIXL push, Mooncake)
# ----------------------------------------------------------------------


def on_verdicts(kcs: Any, record: Callable[[str, Any], None]) -> None:
    """`record(request id, verdict)` for every P/D verdict the checksum
    scheduler `kcs` reaches (a spy on its `_verify`)."""
    original = kcs.consumer._verify

    def verify(req_id: str, pending: Any) -> Any:
        verdict = original(req_id, pending)
        record(req_id, verdict)
        return verdict

    kcs.consumer._verify = verify


def capture_verdicts(engine: SimEngine) -> dict[str, Any]:
    """Every P/D verdict the engine's checksum scheduler reaches, by request."""
    verdicts: dict[str, Any] = {}
    on_verdicts(engine.checksums, verdicts.__setitem__)
    return verdicts


def deliver_next(engine: SimEngine, received: dict[str, bytes]) -> None:
    """The next step's rank-0 checksum worker reports `received` (R99)."""
    worker = engine.workers[0].checksum
    original = worker.post_forward

    def post_forward(finished: Any, failed: Any, _: Any, done: Any) -> Any:
        worker.post_forward = original
        return original(finished, failed, received, done)

    worker.post_forward = post_forward


def package_state(engine: SimEngine, connector_scheduler: Any) -> int:
    """Entries in the package's per-request dictionaries of one engine: its
    checksum scheduler's and the carrier outbox on `connector_scheduler`."""
    kcs = engine.checksums
    outbox = connector_scheduler.__dict__.get("_kv_checksum_outbox")
    total = (
        len(kcs.consumer._noted)
        + len(kcs.producer._sends)
        + len(kcs.consumer._recvs)
        + len(kcs.offload.pending)
    )
    total += len(kcs.producer._outgoing) + len(kcs.producer._producers)
    return total + (len(outbox.pending) if outbox is not None else 0)
