# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Steps that load nothing cost (almost) nothing on the host (R142).

Structural checks on real vLLM schedulers with the plugin's hooks on CPU: no
per-request wrapper or loop of the package runs in a decode step unless
there is checksum work (a quarantined request, a producer prompt). They
count calls, never time (CI is a loaded machine).
"""

from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_pd import (
    Fault,
    SideConfig,
    SimEngine,
    consume,
    produce,
    run_local,
)

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

PROMPT = [(11 * i + 5) % 997 + 3 for i in range(40)]


def _wrapped(coordinator: Any) -> bool:
    """Whether the coordinator's cache_blocks is an instance wrapper."""
    return "cache_blocks" in vars(coordinator) and (
        getattr(vars(coordinator)["cache_blocks"], "__self__", None) is not coordinator
    )


@pytest.mark.kv_checksum_capability("plugin")  # the plugin's instance wrapper;
# vLLM with the series caps cache_blocks at the request's own mark instead.
def test_R142_cache_blocks_unwrapped_unless_a_request_is_quarantined(
    model_dir: str,
) -> None:
    """R138, R142: with checksums on, vLLM's own cache_blocks runs (no
    per-request wrapper) until a failed load is quarantined; the wrapper is
    there while it is, and gone once the request's blocks were freed. Bugs
    caught: the containment wrapper called for every request every step
    (wrapped from the start), or left on after the last quarantined request
    was released."""
    producer = SimEngine(model_dir, SideConfig(), "P")
    consumer = SimEngine(model_dir, SideConfig(), "D")
    coordinator = consumer.scheduler.kv_cache_manager.coordinator
    assert not _wrapped(coordinator)
    run_local(consumer, "local", [7] * 20, max_tokens=3)
    assert not _wrapped(coordinator)

    params = produce(producer, "bad", PROMPT)
    seen: list[bool] = []
    original_step = consumer.step

    def step() -> Any:
        output = original_step()
        seen.append(_wrapped(coordinator))
        return output

    consumer.step = step  # type: ignore[method-assign]
    consume(
        consumer, producer, "bad", PROMPT, params, Fault("bit_flip", 1), max_tokens=4
    )
    assert consumer.checksums.stats.loads.get("mismatch") == 1
    assert True in seen, "no wrapper while the failed load was quarantined"
    assert not _wrapped(coordinator), "wrapper left after the request was freed"


def test_R142_add_send_runs_for_producer_requests_only(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R68, R142: `add_send` is called for scheduled producer requests only:
    decode steps of other requests make no call, and a finished producer
    leaves no state. Bug caught: a per-request loop over every scheduled
    request in every step (the call count grows with the batch)."""
    engine = SimEngine(model_dir, SideConfig(), "P")
    kcs = engine.checksums
    calls: list[str] = []
    original = kcs.producer.add_send

    def add_send(request: Any, *args: Any) -> None:
        calls.append(request.request_id)
        original(request, *args)

    monkeypatch.setattr(kcs.producer, "add_send", add_send)
    run_local(engine, "local", PROMPT, max_tokens=6)
    assert calls == []
    params = produce(engine, "prod", [9] * 40)
    assert "kv_checksums" in params
    assert calls and set(calls) == {"prod"}
    assert not kcs.producer._producers


@pytest.mark.parametrize(
    ("groups", "scans"),
    [("full", 0), ("mla", 0), ("sliding", 1), ("both", 1)],
)
def test_R142_finished_producer_scans_held_blocks_only_where_vllm_frees_early(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, groups: str, scans: int
) -> None:
    """R66, R142: a finishing producer looks for blocks freed since its prompt
    was checksummed only when a group can free them (sliding window); full
    attention and MLA hold every block, so the per-block scan is skipped and
    the payload is the same as with it. Bugs caught: the scan skipped for a
    sliding-window group (then its freed chunks are sent, a false mismatch:
    also `test_window_blocks_freed_before_the_transfer_are_not_sent`), or run
    for every group as before (the count)."""
    from vllm.distributed.kv_transfer.kv_checksum.engine import producer

    engine = SimEngine(model_dir, SideConfig(groups=groups), "P")  # type: ignore[arg-type]
    calls: list[str] = []
    original = producer._held_groups

    def held_groups(*args: Any) -> Any:
        calls.append("scan")
        return original(*args)

    monkeypatch.setattr(producer, "_held_groups", held_groups)
    params = produce(engine, "prod", [9] * 80)
    assert "kv_checksums" in params
    assert len(calls) == scans


def _reference_selection(
    blocks: list[Any], begin: int, end: int, window: int
) -> tuple[int, list[int]] | None:
    """R64-R66 by hand: the blocks at positions [begin, end), clipped to the
    last `window` (0: all); leading null blocks dropped; None if none is left
    or a null block follows a held one."""
    positions = list(range(begin, min(end, len(blocks))))
    if window and len(positions) > window:
        positions = positions[-window:]
    while positions and blocks[positions[0]].is_null:
        positions.pop(0)
    if not positions or any(blocks[p].is_null for p in positions):
        return None
    return positions[0], [blocks[p].block_id for p in positions]


def test_R64_select_blocks_equals_a_reference_with_and_without_null_blocks() -> None:
    """R64-R66, R142: `select_blocks` (whose common case, no null block,
    takes one pass since issue 30) picks what a by-hand reference picks, over
    random block lists with none, leading and misplaced null blocks, full and
    sliding-window groups. Bugs caught: the no-null shortcut taken with a
    null block present (a null block checksummed), an empty range reported
    as a group, leading nulls kept."""
    import random

    from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import (
        SchedulerGroup,
        select_blocks,
    )
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    rng = random.Random(30)
    for case in range(400):
        count = rng.randint(0, 12)
        blocks = [KVCacheBlock(block_id=100 + i) for i in range(count)]
        shape = case % 4
        if shape == 1 and count:  # leading nulls (out of a window)
            for i in range(rng.randint(1, count)):
                blocks[i] = KVCacheBlock(block_id=0, is_null=True)
        elif shape == 2 and count > 1:  # a null after a held block
            blocks[rng.randint(1, count - 1)] = KVCacheBlock(block_id=0, is_null=True)
        window = rng.choice([0, 0, 2, 3])
        group = SchedulerGroup(block_size=16, sliding_window_blocks=window)
        first = rng.randint(0, 16 * count + 8)
        end = rng.randint(first, 16 * count + 16)
        selected = select_blocks([blocks], {0: group}, first, end)
        want = _reference_selection(blocks, first // 16, -(-end // 16), window)
        got = selected.groups.get(0)
        if want is None:
            assert got is None, (case, got)
        else:
            assert got is not None, (case, want)
            assert got[0] == want[0] and got[1].tolist() == want[1], (case, got, want)
