# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Proves the CPU harness in kv_checksum_helpers.py against real vLLM 0.33.0.

Every scheduler test runs with the sync ``Scheduler`` and the
``AsyncScheduler``, the latter both alternating schedule/update_from_output
and pipelined one step behind (the engine's batch queue).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import dataclass

import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    DEFAULT_SAMPLED_TOKEN,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    CpuEvent,
    CpuStream,
    KVChecksumTestConnector,
    StepDriver,
    consumer_kv_transfer_params,
    kernel_split_supported,
    layer_name,
    load_failed,
    load_finished,
    make_kv_cache_config,
    make_kv_caches,
    make_kv_connector_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    producer_kv_transfer_params,
    step,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.cpu


@dataclass(frozen=True)
class Mode:
    name: str
    async_scheduling: bool
    # Steps in flight (1: schedule/update alternation; 2: one step behind).
    depth: int


MODES = [
    Mode("sync", async_scheduling=False, depth=1),
    Mode("async", async_scheduling=True, depth=1),
    Mode("async-pipelined", async_scheduling=True, depth=2),
]


@pytest.fixture(params=MODES, ids=lambda mode: mode.name)
def mode(request: pytest.FixtureRequest) -> Mode:
    return request.param


def build(model_dir: str, mode: Mode, **config_kwargs) -> StepDriver:
    vllm_config = make_vllm_config(
        model_dir, async_scheduling=mode.async_scheduling, **config_kwargs
    )
    scheduler = make_scheduler(vllm_config, make_kv_cache_config(vllm_config))
    expected = AsyncScheduler if mode.async_scheduling else Scheduler
    assert type(scheduler) is expected
    assert isinstance(scheduler.connector, KVChecksumTestConnector)
    return StepDriver(scheduler, depth=mode.depth)


def prompt(length: int, start: int = 3) -> list[int]:
    return list(range(start, start + length))


def kv_cache_usage(scheduler: Scheduler) -> float:
    return scheduler.get_kv_cache_usage()


def test_model_dir_holds_only_config_json(model_dir: str) -> None:
    """The model folder has only config.json (no weights, tokenizer or hub
    files), and building a VllmConfig from it writes nothing there."""
    vllm_config = make_vllm_config(model_dir)
    assert os.listdir(model_dir) == ["config.json"]
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["num_hidden_layers"] == NUM_LAYERS
    assert config["num_key_value_heads"] == NUM_KV_HEADS
    assert config["head_dim"] == HEAD_DIM
    assert config["torch_dtype"] == "bfloat16"
    hf_config = vllm_config.model_config.hf_config
    assert hf_config.num_hidden_layers == NUM_LAYERS
    assert vllm_config.model_config.dtype == torch.bfloat16


@pytest.mark.parametrize("groups", ["full", "sliding", "both"])
def test_consumer_waits_for_load_then_completes(
    model_dir: str, mode: Mode, groups: str
) -> None:
    """A do_remote_prefill request waits in WAITING_FOR_REMOTE_KVS (blocks
    allocated, num_computed_tokens = local + external hit, nothing scheduled)
    until the test reports its load finished; it then runs its last prompt
    token and decodes to completion, freeing its blocks."""
    driver = build(model_dir, mode, groups=groups)
    scheduler = driver.scheduler
    connector = scheduler.connector
    tokens = prompt(37)
    request = make_request(
        "c0",
        tokens,
        max_tokens=3,
        kv_transfer_params=consumer_kv_transfer_params("p0", remote_block_ids=[7]),
    )
    scheduler.add_request(request)

    scheduler_output, _ = driver.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert scheduler_output.num_scheduled_tokens == {}
    assert request.num_computed_tokens == len(tokens) - 1
    load = connector.pending_loads["c0"]
    assert load.num_external_tokens == len(tokens) - 1
    assert len(load.block_ids) == len(scheduler.kv_cache_config.kv_cache_groups)
    assert load.kv_transfer_params["remote_request_id"] == "p0"
    assert request.kv_transfer_params["do_remote_prefill"] is False
    assert scheduler_output.kv_connector_metadata.loads == {"c0": load}

    for _ in range(3):  # not reported yet: keeps waiting
        scheduler_output, _ = driver.step()
        assert scheduler_output.num_scheduled_tokens == {}
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    driver.step(kv_connector_output=load_finished("c0"))
    driver.drain()
    assert "c0" not in connector.pending_loads
    scheduler_output, _ = driver.step()
    assert request.status == RequestStatus.RUNNING
    assert scheduler_output.num_scheduled_tokens == {"c0": 1}
    (new_request,) = scheduler_output.scheduled_new_reqs
    assert new_request.num_computed_tokens == len(tokens) - 1

    driver.run_until_finished(["c0"])
    assert driver.finish_reason("c0") == FinishReason.LENGTH
    assert driver.output_token_ids("c0") == [DEFAULT_SAMPLED_TOKEN] * 3
    assert len(connector.started_loads) == 1
    assert "c0" not in scheduler.requests
    assert kv_cache_usage(scheduler) == 0.0


def test_unfinished_prefill_samples_nothing(model_dir: str, mode: Mode) -> None:
    """The emulated model samples nothing for a non-final prefill chunk and
    one token once the prefill is done; the engine emits no output for the
    chunk."""
    driver = build(model_dir, mode, max_num_batched_tokens=32)
    scheduler = driver.scheduler
    scheduler.add_request(make_request("r0", prompt(50), max_tokens=2))
    scheduler_output, _ = driver.step()
    assert scheduler_output.num_scheduled_tokens == {"r0": 32}
    driver.drain()
    assert driver.outputs["r0"] == []
    scheduler_output, _ = driver.step(sampled_token_ids={"r0": [7]})
    assert scheduler_output.num_scheduled_tokens == {"r0": 18}
    driver.drain()
    assert driver.output_token_ids("r0") == [7]
    driver.run_until_finished(["r0"])
    assert driver.output_token_ids("r0") == [7, DEFAULT_SAMPLED_TOKEN]


def test_step_helper_runs_one_engine_step(model_dir: str) -> None:
    """step() runs schedule() -> emulated model -> update_from_output() and
    returns the step's SchedulerOutput and EngineCoreOutputs."""
    vllm_config = make_vllm_config(model_dir)
    scheduler = make_scheduler(vllm_config, make_kv_cache_config(vllm_config))
    scheduler.add_request(make_request("r0", prompt(20), max_tokens=1))
    scheduler_output, engine_core_outputs = step(
        scheduler, sampled_token_ids={"r0": [9]}
    )
    assert scheduler_output.num_scheduled_tokens == {"r0": 20}
    (output,) = engine_core_outputs[0].outputs
    assert output.request_id == "r0"
    assert output.new_token_ids == [9]
    assert output.finish_reason == FinishReason.LENGTH


def test_failed_load_with_fail_policy_errors_request(
    model_dir: str, mode: Mode
) -> None:
    """kv_load_failure_policy="fail": a load reported failed ends the request
    with FINISHED_ERROR (finish reason "error") and frees its blocks."""
    driver = build(model_dir, mode, kv_load_failure_policy="fail")
    scheduler = driver.scheduler
    request = make_request(
        "c0", prompt(40), kv_transfer_params=consumer_kv_transfer_params("p0")
    )
    scheduler.add_request(request)
    driver.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert kv_cache_usage(scheduler) > 0

    driver.step(kv_connector_output=load_failed("c0"))
    driver.drain()
    assert request.status == RequestStatus.FINISHED_ERROR
    assert driver.finish_reason("c0") == FinishReason.ERROR
    assert driver.output_token_ids("c0") == []
    assert "c0" not in scheduler.requests
    assert scheduler.get_num_unfinished_requests() == 0
    assert kv_cache_usage(scheduler) == 0.0


def test_failed_load_with_recompute_policy_recomputes_locally(
    model_dir: str, mode: Mode
) -> None:
    """kv_load_failure_policy="recompute": a failed load resets the request
    (num_computed_tokens 0, blocks freed); on re-admission it finds only its
    local prefix-cache hit, starts no second load, recomputes the rest and
    completes."""
    driver = build(model_dir, mode, kv_load_failure_policy="recompute")
    scheduler = driver.scheduler
    connector = scheduler.connector
    # A finished local request leaves 2 full blocks of the shared prefix cached.
    shared = prompt(32)
    scheduler.add_request(make_request("warm", shared + prompt(16, start=500)))
    driver.run_until_finished(["warm"])

    tokens = shared + prompt(13, start=700)
    request = make_request(
        "c0", tokens, max_tokens=2, kv_transfer_params=consumer_kv_transfer_params("p0")
    )
    scheduler.add_request(request)
    driver.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = connector.started_loads
    assert load.num_external_tokens == len(tokens) - 1 - 32
    assert request.num_computed_tokens == len(tokens) - 1

    driver.step(kv_connector_output=load_failed("c0"))
    driver.drain()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == 0

    scheduler_output, _ = driver.step()
    assert request.status == RequestStatus.RUNNING
    (new_request,) = scheduler_output.scheduled_new_reqs
    assert new_request.num_computed_tokens == 32
    assert scheduler_output.num_scheduled_tokens == {"c0": len(tokens) - 32}
    driver.run_until_finished(["c0"])
    assert driver.finish_reason("c0") == FinishReason.LENGTH
    assert len(driver.output_token_ids("c0")) == 2
    assert len(connector.started_loads) == 1
    assert kv_cache_usage(scheduler) == 0.0


def test_invalid_blocks_with_recompute_policy_keep_valid_prefix(
    model_dir: str, mode: Mode
) -> None:
    """Block-level failure (invalid_block_ids, single-group models only):
    num_computed_tokens is cut back to the first invalid block and the request
    recomputes from there."""
    driver = build(model_dir, mode, kv_load_failure_policy="recompute")
    scheduler = driver.scheduler
    tokens = prompt(50)
    request = make_request(
        "c0", tokens, kv_transfer_params=consumer_kv_transfer_params("p0")
    )
    scheduler.add_request(request)
    driver.step()
    (load,) = scheduler.connector.started_loads
    (block_ids,) = load.block_ids
    driver.step(
        kv_connector_output=make_kv_connector_output(
            finished_recving=["c0"], invalid_block_ids=[block_ids[2]]
        )
    )
    driver.drain()
    assert request.num_computed_tokens == 2 * 16
    scheduler_output, _ = driver.step()
    assert scheduler_output.num_scheduled_tokens == {"c0": len(tokens) - 32}
    driver.run_until_finished(["c0"])
    assert driver.finish_reason("c0") == FinishReason.LENGTH


def test_async_load_start_order(model_dir: str, mode: Mode) -> None:
    """Documents vLLM 0.33.0's order when an async load starts:
    update_state_after_alloc runs while request.num_computed_tokens still
    holds its pre-admission value (0); schedule() sets it to local + external
    tokens afterwards, and the request is not in num_scheduled_tokens."""
    driver = build(model_dir, mode)
    scheduler = driver.scheduler
    seen: list[int] = []
    original = scheduler.connector.update_state_after_alloc

    def spy(request, blocks, num_external_tokens):
        seen.append(request.num_computed_tokens)
        return original(request, blocks, num_external_tokens)

    scheduler.connector.update_state_after_alloc = spy
    request = make_request(
        "c0", prompt(20), kv_transfer_params=consumer_kv_transfer_params("p0")
    )
    scheduler.add_request(request)
    scheduler_output, _ = driver.step()
    assert seen == [0]
    assert request.num_computed_tokens == 19
    assert "c0" not in scheduler_output.num_scheduled_tokens


def test_producer_finish_returns_kv_transfer_params(model_dir: str, mode: Mode) -> None:
    """A do_remote_decode request finishing returns kv_transfer_params for the
    consumer (remote block ids per group, engine and request id); fed to a
    consumer scheduler they drive a load of the remote prompt."""
    driver = build(model_dir, mode)
    scheduler = driver.scheduler
    tokens = prompt(37)
    request = make_request(
        "p0", tokens, max_tokens=1, kv_transfer_params=producer_kv_transfer_params()
    )
    scheduler.add_request(request)
    scheduler_output, _ = driver.step()
    (new_request,) = scheduler_output.scheduled_new_reqs
    block_ids = [list(ids) for ids in new_request.block_ids]
    driver.run_until_finished(["p0"])

    final = driver.final_output("p0")
    assert final is not None and final.finish_reason == FinishReason.LENGTH
    params = final.kv_transfer_params
    assert params is not None
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "producer"
    assert params["remote_request_id"] == "p0"
    assert params["remote_block_ids"] == block_ids
    assert params == scheduler.connector.finished_params["p0"]
    assert kv_cache_usage(scheduler) == 0.0

    consumer = build(model_dir, mode)
    consumer_request = make_request(
        "c0", tokens, max_tokens=2, kv_transfer_params=params
    )
    consumer.scheduler.add_request(consumer_request)
    consumer.step()
    assert consumer_request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    load = consumer.scheduler.connector.pending_loads["c0"]
    assert load.kv_transfer_params["remote_block_ids"] == block_ids
    consumer.step(kv_connector_output=load_finished("c0"))
    consumer.run_until_finished(["c0"])
    assert consumer.finish_reason("c0") == FinishReason.LENGTH


def test_tp_pp_are_config_values_only(model_dir: str) -> None:
    """TP/PP sizes are plain ParallelConfig values: no process starts, the
    scheduler view holds every layer and each PP stage's worker view its own
    layers with the KV heads of one TP rank."""
    vllm_config = make_vllm_config(model_dir, tp_size=2, pp_size=2, groups="both")
    parallel_config = vllm_config.parallel_config
    assert parallel_config.tensor_parallel_size == 2
    assert parallel_config.pipeline_parallel_size == 2
    assert parallel_config.world_size == 4
    scheduler = make_scheduler(vllm_config, make_kv_cache_config(vllm_config))
    assert sorted(
        name
        for group in scheduler.kv_cache_config.kv_cache_groups
        for name in group.layer_names
    ) == sorted(layer_name(i) for i in range(NUM_LAYERS))
    for pp_rank, layers in ((0, [0, 1]), (1, [2, 3])):
        config = make_kv_cache_config(vllm_config, pp_rank=pp_rank)
        names = [n for g in config.kv_cache_groups for n in g.layer_names]
        assert sorted(names) == sorted(layer_name(i) for i in layers)
        for group in config.kv_cache_groups:
            assert group.kv_cache_spec.num_kv_heads == NUM_KV_HEADS // 2
    assert multiprocessing.active_children() == []


# Blocks of the KV cache views tests (small: they compare every byte).
VIEW_BLOCKS = 8


def _layout_cases() -> list[tuple[KVCacheLayout, int | None]]:
    cases: list[tuple[KVCacheLayout, int | None]] = []
    for layout in KVCacheLayout:
        cases.append((layout, None))
        if kernel_split_supported(layout):
            cases.append((layout, 8))
    return cases


@pytest.mark.parametrize("groups", ["full", "both"])
@pytest.mark.parametrize(
    ("layout", "kernel_block_size"),
    _layout_cases(),
    ids=lambda v: v.name if isinstance(v, KVCacheLayout) else f"kernel{v}",
)
def test_make_kv_caches_views(
    layout: KVCacheLayout, kernel_block_size: int | None, groups: str
) -> None:
    """Views have vLLM's [blocks, heads, tokens, 2 * head_dim] shape for every
    layout and kernel split, own distinct bytes per layer (no aliasing, also
    across groups), and hold seeded random bytes."""
    kv_cache_config = make_kv_cache_config(groups=groups, num_blocks=VIEW_BLOCKS)
    caches = make_kv_caches(kv_cache_config, layout, kernel_block_size, seed=1)
    assert sorted(caches) == sorted(layer_name(i) for i in range(NUM_LAYERS))
    ratio = 16 // (kernel_block_size or 16)
    for view in caches.values():
        assert view.dtype == torch.bfloat16
        assert tuple(view.shape) == (
            VIEW_BLOCKS * ratio,
            NUM_KV_HEADS,
            16 // ratio,
            2 * HEAD_DIM,
        )

    raw = {name: view.view(torch.int16).clone() for name, view in caches.items()}
    names = sorted(raw)
    assert all(raw[name].ne(0).any() for name in names)
    for a, b in zip(names, names[1:]):
        assert not torch.equal(raw[a], raw[b])
    again = make_kv_caches(kv_cache_config, layout, kernel_block_size, seed=1)
    other = make_kv_caches(kv_cache_config, layout, kernel_block_size, seed=2)
    for name in names:
        assert torch.equal(again[name].view(torch.int16), raw[name])
        assert not torch.equal(other[name].view(torch.int16), raw[name])

    for i, name in enumerate(names):
        caches[name].view(torch.int16).fill_(i + 1)
    for i, name in enumerate(names):
        assert bool((caches[name].view(torch.int16) == i + 1).all()), name


@pytest.mark.parametrize(
    "layout", [lo for lo in KVCacheLayout if not kernel_split_supported(lo)]
)
def test_kernel_split_rejected_where_vllm_rejects_it(layout: KVCacheLayout) -> None:
    """vLLM refuses kernel blocks for layouts whose blocks are not one dense
    page per layer; make_kv_caches passes its ValueError through."""
    with pytest.raises(ValueError, match="kernel blocks"):
        make_kv_caches(make_kv_cache_config(num_blocks=VIEW_BLOCKS), layout, 8)


def test_alias_groups_overlays_groups_like_vllm() -> None:
    """alias_groups=True places all groups from byte 0, as vLLM does for
    hybrid models: layer j of each group shares its pages."""
    kv_cache_config = make_kv_cache_config(groups="both", num_blocks=VIEW_BLOCKS)
    caches = make_kv_caches(kv_cache_config, alias_groups=True)
    full, sliding = (g.layer_names for g in kv_cache_config.kv_cache_groups)
    for a, b in zip(full, sliding):
        assert caches[a].data_ptr() == caches[b].data_ptr()


def test_cuda_stream_stubs(cuda_stream_stubs) -> None:
    """With cuda_stream_stubs, a side-stream copy ordered by wait_stream, an
    event record and an event wait runs on CPU, via torch.cuda and via
    vllm's current_platform / current_stream helpers alike."""
    import vllm.utils.torch_utils as torch_utils
    from vllm.platforms import current_platform

    main = torch.cuda.current_stream()
    assert main is cuda_stream_stubs.default
    assert torch_utils.current_stream() is main
    side = current_platform.Stream()
    assert isinstance(side, CpuStream)
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.empty_like(src)

    side.wait_stream(main)
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
        assert current_platform.current_stream() is side
        assert torch_utils.current_stream() is side
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    assert torch.cuda.current_stream() is main
    main.wait_event(done)
    assert done.query() and side.query()
    done.synchronize()
    torch.cuda.synchronize()

    assert torch.equal(dst, src)
    assert isinstance(done, CpuEvent)
    assert done.recorded_on == [side]
    assert done.waited_by == [main]
    assert side.waited_streams == [main]
    assert cuda_stream_stubs.created_streams == [side]
    assert cuda_stream_stubs.created_events == [done]


def test_cuda_stream_stubs_leave_nothing_behind() -> None:
    """Outside the fixture torch.cuda and current_platform are untouched."""
    from vllm.platforms import current_platform

    assert torch.cuda.Stream is torch.cuda.streams.Stream
    assert torch.cuda.Event is torch.cuda.streams.Event
    assert "Stream" not in vars(current_platform)
    assert "current_stream" not in vars(current_platform)


@pytest.mark.cuda
def test_cuda_marker_skips_without_cuda() -> None:
    """Tests marked cuda are skipped by conftest when CUDA is unavailable."""
    assert torch.cuda.is_available()
