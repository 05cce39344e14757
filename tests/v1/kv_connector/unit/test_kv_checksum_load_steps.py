# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A verified load costs no extra engine step (R72, R73, R142; issue 30 item 3).

Real vLLM schedulers with the plugin's hooks on CPU (`SimEngine` and the
offload simulations): the number of steps from the step whose output reports
a load finished to the first step that schedules the request's tokens is the
same with checksums off, on fail-open and on fail-closed, for a P/D pull load
(kv_transfer_params carrier, as NIXL pull), and for loads of vLLM's
OffloadingConnector and SimpleCPUOffloadConnector (eager and lazy).
"""

import random
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
    OffloadSimEngine,
    SimpleOffloadSimEngine,
    offload_metadata,
    run_shared_prefixes,
    run_together,
    simple_offload_metadata,
    verdicts,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    CARRIER_CONNECTOR_NAME,
    WHOLE_PROMPT_CONNECTOR_NAME,
    SideConfig,
    SimEngine,
    consume,
    produce,
)
from tests.v1.kv_connector.unit.test_kv_checksum_offload_connectors import (
    offload_side,
)
from tests.v1.kv_connector.unit.test_kv_checksum_simple_offload import simple_side

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

# (checksums enabled, fail-closed)
MODES = [(False, False), (True, False), (True, True)]


def pd_cases(test: Any) -> Any:
    """P/D step tests: both pull connectors, sync and async scheduler."""
    by_scheduler = pytest.mark.parametrize(
        "async_scheduler", [False, True], ids=["sync", "async"]
    )
    by_connector = pytest.mark.parametrize(
        "connector", [WHOLE_PROMPT_CONNECTOR_NAME, CARRIER_CONNECTOR_NAME]
    )
    return by_scheduler(by_connector(test))


PROMPT = [(7 * i + 11) % 997 + 3 for i in range(50)]


def _wait_after_finish(history: list[Any], finished_step: int, req_id: str) -> int:
    """Steps after `finished_step` until one schedules `req_id`'s tokens."""
    for index in range(finished_step + 1, len(history)):
        if history[index].num_scheduled_tokens.get(req_id):
            return index - finished_step
    raise AssertionError(f"{req_id} never scheduled after its load")


def _pd_wait(
    model_dir: str, connector: str, async_scheduler: bool, mode: tuple[bool, bool]
) -> tuple[int, str]:
    """Steps from a P/D load's finish to its first compute; its finish reason."""
    producer = SimEngine(model_dir, SideConfig(connector=connector), "P")
    enabled, fail_closed = mode
    side = SideConfig(
        connector=connector,
        enabled=enabled,
        fail_closed=fail_closed,
        async_scheduler=async_scheduler,
    )
    consumer = SimEngine(model_dir, side, "C")
    params = produce(producer, "r", PROMPT)
    start = len(consumer.history)
    result = consume(consumer, producer, "r", PROMPT, params)
    # consume(): step `start` starts the load, step `start + 1` reports it done.
    return _wait_after_finish(consumer.history, start + 1, "r"), result.finish_reason


@pd_cases
def test_R142_pd_load_runs_as_soon_as_without_checksums(
    model_dir: str, connector: str, async_scheduler: bool
) -> None:
    """R72, R73, R142: a verified P/D pull load is computed in the step after
    the one reporting it finished, as with checksums off, fail-open and
    fail-closed (verification runs in that step's update_from_output).
    Bugs caught: verification deferred until the worker's records of a later
    step arrive, or a verified load held back one step before rescheduling."""
    waits = {
        mode: _pd_wait(model_dir, connector, async_scheduler, mode) for mode in MODES
    }
    off = waits[(False, False)]
    assert off[0] >= 1
    assert waits == {mode: off for mode in MODES}, waits


def _offload_waits(engine: Any) -> list[int]:
    """Per asynchronous offload load: steps from its finish to its compute."""
    waits = []
    for index, output in enumerate(engine.history):
        meta = offload_metadata(output.kv_connector_metadata)
        if meta is None:
            continue
        for job in meta.load_jobs.values():
            if not job.sync:
                waits.append(_wait_after_finish(engine.history, index, job.req_id))
    return waits


def _simple_waits(engine: Any) -> list[int]:
    """Per SimpleCPUOffloadConnector load: steps from its finish to compute."""
    waits = []
    for index, output in enumerate(engine.history):
        meta = simple_offload_metadata(output.kv_connector_metadata)
        if meta is None or not meta.load_cpu_blocks:
            continue
        for req_id in meta.load_event_to_reqs.get(meta.load_event, ()):
            waits.append(_wait_after_finish(engine.history, index, req_id))
    return waits


def test_R142_offload_loads_run_as_soon_as_without_checksums(model_dir: str) -> None:
    """R119, R120, R142: every OffloadingConnector load is computed as many
    steps after it finished as with checksums off, fail-open and fail-closed.
    Bug caught: an offload load's verdict (or its entries) awaited one step
    later than the load's finish, delaying the request."""
    waits = {}
    for enabled, fail_closed in MODES:
        side = offload_side(enabled=enabled, fail_closed=fail_closed)
        engine = OffloadSimEngine(model_dir, side, f"steps-{enabled}-{fail_closed}")
        run_shared_prefixes(engine, 14)
        waits[(enabled, fail_closed)] = _offload_waits(engine)
    off = waits[(False, False)]
    assert len(off) >= 6
    assert waits == {mode: off for mode in MODES}, waits


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_R142_simple_offload_loads_run_as_soon_as_without_checksums(
    model_dir: str, lazy: bool
) -> None:
    """R119, R120, R142: every SimpleCPUOffloadConnector load is computed as
    many steps after it finished as with checksums off, fail-open and
    fail-closed. Bug caught: a verdict awaited one step after the load's
    finish, delaying the request."""
    waits = {}
    for enabled, fail_closed in MODES:
        side = simple_side(lazy, enabled=enabled, fail_closed=fail_closed)
        engine = SimpleOffloadSimEngine(model_dir, side, f"steps-{lazy}-{enabled}")
        run_shared_prefixes(engine, 14)
        waits[(enabled, fail_closed)] = _simple_waits(engine)
    off = waits[(False, False)]
    assert len(off) >= 6
    assert waits == {mode: off for mode in MODES}, waits


# 8 requests at once, each loading a 128-block (2,048-token) prefix back from
# host memory: the shape of the 8B prefix-reuse benchmark (issue: +56 ms TTFT).
LONG_BLOCKS = 128
LONG_REQUESTS = 8


def _long_side(connector: str, enabled: bool) -> SideConfig:
    host_blocks = 2 * LONG_REQUESTS * (LONG_BLOCKS + 4)
    extra: dict[str, Any] = {"cpu_bytes_to_use": host_blocks * (32 << 10)}
    if connector == "SimpleCPUOffloadConnector":
        extra["num_cpu_blocks"] = host_blocks
    return SideConfig(
        num_blocks=LONG_REQUESTS * (LONG_BLOCKS + 4) + 16,
        connector=connector,
        connector_extra=extra,
        enabled=enabled,
        max_model_len=4096,
        max_num_batched_tokens=LONG_REQUESTS * (LONG_BLOCKS + 2) * 16,
    )


def _schedule(engine: Any) -> list[tuple[dict[str, int], Any]]:
    """Per step: the tokens scheduled per request and the step's offload
    transfers (load and store block counts per request, or per event)."""
    steps = []
    for output in engine.history:
        meta = offload_metadata(output.kv_connector_metadata)
        simple = simple_offload_metadata(output.kv_connector_metadata)
        jobs: Any = None
        if meta is not None:
            jobs = tuple(
                sorted((j.req_id, len(j.src_spec.block_ids)) for j in group.values())
                for group in (meta.load_jobs, meta.store_jobs)
            )
        elif simple is not None:
            jobs = (len(simple.load_gpu_blocks), len(simple.store_gpu_blocks))
        steps.append((dict(output.num_scheduled_tokens), jobs))
    return steps


@pytest.mark.parametrize(
    "connector", ["OffloadingConnector", "SimpleCPUOffloadConnector"]
)
def test_R142_long_offload_loads_and_stores_keep_the_schedule(
    model_dir: str, connector: str
) -> None:
    """R119, R120, R142 at the benchmark's shape: 8 requests store 128-block
    prefixes, 8 others evict them from the GPU, then 8 requests load them
    back at once. With checksums on, every engine step schedules the same
    tokens per request and the same loads and stores as with checksums off
    (no load finishes, no request is scheduled, no store is queued a step
    later), and every load verifies. Bugs caught: a long load's verdict or
    entries awaited in a later step, a store (or its entries) holding back
    the request that wrote the blocks."""
    rng = random.Random(0)
    prefixes = [
        [rng.randrange(3, 200) for _ in range(LONG_BLOCKS * 16)]
        for _ in range(2 * LONG_REQUESTS)
    ]
    kind = (
        OffloadSimEngine
        if connector == "OffloadingConnector"
        else (SimpleOffloadSimEngine)
    )
    schedules = {}
    for enabled in (False, True):
        engine = kind(model_dir, _long_side(connector, enabled), f"long-{enabled}")
        run_together(engine, prefixes[:LONG_REQUESTS], "store")
        run_together(engine, prefixes[LONG_REQUESTS:], "evict")
        loads = engine.num_loads
        run_together(engine, prefixes[:LONG_REQUESTS], "load")
        assert engine.num_loads > loads
        schedules[enabled] = _schedule(engine)
        if enabled:
            counts = verdicts(engine)
            assert counts == {"verified": LONG_REQUESTS}, counts
    assert schedules[True] == schedules[False]


@pd_cases
def test_R142_producer_answers_in_as_many_steps_as_without_checksums(
    model_dir: str, connector: str, async_scheduler: bool
) -> None:
    """R142 (producer side of the TTFT question of issue 30 item 3): a
    producer request returns its kv_transfer_params, with `kv_checksums` when
    on, after as many engine steps as with checksums off. Bug caught: the
    producer holding its response until a later step's record brings the
    prompt's checksums (one engine step more on every P/D request's TTFT)."""
    steps: dict[bool, int] = {}
    for enabled in (False, True):
        side = SideConfig(
            connector=connector, enabled=enabled, async_scheduler=async_scheduler
        )
        producer = SimEngine(model_dir, side, "P")
        start = len(producer.history)
        params = produce(producer, "r", PROMPT)
        assert ("kv_checksums" in params) is enabled
        steps[enabled] = len(producer.history) - start
    assert steps[True] == steps[False] >= 1, steps
