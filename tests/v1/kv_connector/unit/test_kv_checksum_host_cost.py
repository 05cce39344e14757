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
