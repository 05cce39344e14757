# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Containment across the offload tiers (R138 with R139, R121).

The issue-32 scenario on vLLM 0.33.0's real Scheduler and offload connectors
(transfers simulated on CPU, `kv_checksum_offload_sim`): request A loads a
prefix from host memory whose first block is corrupted (fail-open: A runs on
it), computes its suffix over that bad KV, a clean copy of the prefix comes
back to the host, then request B with A's prompt arrives. B must compute A's
suffix itself: no block A computed from its quarantine start on may reach a
host tier and come back to B as "verified".
"""

import random
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_helpers import make_request
from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
    OffloadSimEngine,
    SimpleOffloadSimEngine,
    offload_metadata,
    verdicts,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig
from vllm.distributed.kv_transfer.kv_checksum.offload.host_faults import HOST_FAULT_KEY

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.usefixtures("cuda_stream_stubs"),
    pytest.mark.kv_checksum_capability("containment"),
]

BS = 16
PREFIX_BLOCKS = 4
SUFFIX_BLOCKS = 3
OFFLOAD_EXTRA = {"cpu_bytes_to_use": 1 << 22}
SIMPLE_EXTRA = {"cpu_bytes_to_use": 1 << 22, "num_cpu_blocks": 64}
FAULTS = {HOST_FAULT_KEY: {"rate": 1.0, "kinds": ["host_bit_flip"]}}


def side_config(connector: str, multi: bool, lazy: bool = False) -> SideConfig:
    """A fail-open consumer with host faults on (switched off per phase)."""
    if connector == "offload":
        name, extra = "OffloadingConnector", {**OFFLOAD_EXTRA, **FAULTS}
    else:
        name = "SimpleCPUOffloadConnector"
        extra = {**SIMPLE_EXTRA, "lazy_offload": lazy, **FAULTS}
    if not multi:
        return SideConfig(num_blocks=24, connector=name, connector_extra=extra)
    return SideConfig(
        num_blocks=24,
        connector="MultiConnector",
        connector_extra={
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {
                    "kv_connector": name,
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                },
            ]
        },
    )


def make_engine(model_dir: str, connector: str, multi: bool, lazy: bool) -> Any:
    side = side_config(connector, multi, lazy)
    name = f"contain-{connector}-{multi}-{lazy}"
    if connector == "offload":
        return OffloadSimEngine(model_dir, side, name)
    return SimpleOffloadSimEngine(model_dir, side, name)


def set_faults(engine: Any, on: bool) -> None:
    """Host faults on every load (on) or none (off), on every worker."""
    for side in engine.sides:
        assert side is not None
        if on:
            side.injector = side._kv_checksum_saved_injector
        else:
            side._kv_checksum_saved_injector = side.injector
            side.injector = None


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 200) for _ in range(count)]


def run(engine: Any, req_id: str, prompt: list[int]) -> None:
    engine.add(make_request(req_id, prompt, max_tokens=2, block_size=BS))
    engine.run(req_id, max_steps=60)


def evict_from_gpu(engine: Any, rng: random.Random, tag: str) -> None:
    """Fill the 24 GPU blocks with unrelated prompts, so later requests find
    nothing of the scenario's prompts in the GPU prefix cache."""
    for i in range(4):
        run(engine, f"{tag}{i}", tokens(rng, 6 * BS + 1))


def run_scenario(engine: Any, seed: int = 0) -> dict[str, int]:
    """The issue-32 scenario; returns what B computed and how its load ended."""
    rng = random.Random(seed)
    prefix = tokens(rng, PREFIX_BLOCKS * BS)
    suffix = tokens(rng, SUFFIX_BLOCKS * BS)
    set_faults(engine, False)
    run(engine, "p", prefix + tokens(rng, BS + 1))  # the prefix goes to host
    evict_from_gpu(engine, rng, "e")
    set_faults(engine, True)
    loads = dict(verdicts(engine))
    run(engine, "a", prefix + suffix + [7])  # host fault on A's prefix load
    after_a = verdicts(engine)
    assert after_a.get("mismatch", 0) == loads.get("mismatch", 0) + 1, after_a
    set_faults(engine, False)
    run(engine, "c", prefix + tokens(rng, BS + 1))  # a clean copy comes back
    evict_from_gpu(engine, rng, "f")
    before_b = dict(verdicts(engine))
    run(engine, "b", prefix + suffix + [7])
    after_b = verdicts(engine)
    return {
        "b_computed": engine.scheduled_tokens("b"),
        "b_mismatch": after_b.get("mismatch", 0) - before_b.get("mismatch", 0),
        "b_verified": after_b.get("verified", 0) - before_b.get("verified", 0),
    }


def a_stores(engine: Any) -> int:
    """Store jobs OffloadingConnector issued for request A (from the step
    metadata the workers got, not from the package)."""
    count = 0
    for output in engine.history:
        meta = offload_metadata(output.kv_connector_metadata)
        if meta is not None:
            count += sum(1 for job in meta.store_jobs.values() if job.req_id == "a")
    return count


# SimpleCPUOffloadConnector's cases need that connector's capability too.
_SIMPLE = pytest.mark.kv_checksum_capability("simple_cpu_offload")
CASES = [
    pytest.param("offload", False, False, id="offload"),
    pytest.param("offload", True, False, id="multi-offload"),
    pytest.param("simple", False, False, id="simple-eager", marks=_SIMPLE),
    pytest.param("simple", False, True, id="simple-lazy", marks=_SIMPLE),
    pytest.param("simple", True, False, id="multi-simple", marks=_SIMPLE),
]


@pytest.mark.parametrize(("connector", "multi", "lazy"), CASES)
def test_R138_bad_derived_suffix_never_served_from_host(
    model_dir: str, connector: str, multi: bool, lazy: bool
) -> None:
    """B (A's prompt, after a clean prefix copy came back) computes A's
    suffix itself: it never loads the blocks A computed over its corrupted
    prefix. Bug caught (issue 32, reproduced for OffloadingConnector by
    removing the store filter): the connector stores A's quarantined suffix
    under A's block hashes with fresh entries, so B loads it as "verified"
    and computes only its last token."""
    engine = make_engine(model_dir, connector, multi, lazy)
    result = run_scenario(engine)
    assert result["b_computed"] >= SUFFIX_BLOCKS * BS, result
    if connector == "offload":
        assert a_stores(engine) == 0


def test_R138_control_without_the_fault_b_loads_the_suffix(model_dir: str) -> None:
    """The control: the same run with no host fault on A's load lets B load
    A's suffix from host memory (so the test above can fail)."""
    engine = make_engine(model_dir, "offload", False, False)
    set_faults(engine, False)
    engine.sides[0]._kv_checksum_saved_injector = None
    for side in engine.sides:
        side._kv_checksum_saved_injector = None
    rng = random.Random(0)
    prefix = tokens(rng, PREFIX_BLOCKS * BS)
    suffix = tokens(rng, SUFFIX_BLOCKS * BS)
    run(engine, "a", prefix + suffix + [7])
    evict_from_gpu(engine, rng, "e")
    run(engine, "b", prefix + suffix + [7])
    assert engine.scheduled_tokens("b") < SUFFIX_BLOCKS * BS
    assert verdicts(engine).get("mismatch", 0) == 0


# ----------------------------------------------------------------------
# Removing a bad host copy from CPUOffloadingManager (R121)
# ----------------------------------------------------------------------


@pytest.mark.kv_checksum_capability("plugin")
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_R121_many_drops_keep_the_manager_consistent(policy: str) -> None:
    """Dropping copies one by one (some idle, one held by a load) keeps the
    manager's pool, evictable count and policy in step with an independent
    count, emits one public removal event per dropped copy, and later stores
    fill the whole pool again (evicting only copies still held). Bugs caught:
    no removal event (KV-event consumers keep advertising a dropped copy);
    evictable count not lowered (a later prepare_store over-evicts and
    fails); a held copy freed under its load."""
    from vllm.distributed.kv_transfer.kv_checksum.wiring import offloading as wiring
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    size = 16
    manager = CPUOffloadingManager(size, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="r")
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(size)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None and len(out.keys_to_store) == size
    manager.complete_store(keys, ctx)
    held = keys[0]
    assert manager.prepare_load([held], ctx) is not None
    list(manager.take_events())

    resident = set(keys)
    assert wiring._remove_host_chunk(manager, held) is False  # a load holds it
    dropped = keys[1:size:2]
    for key in dropped:
        assert wiring._remove_host_chunk(manager, key) is True
        resident.discard(key)
        assert wiring._remove_host_chunk(manager, key) is None
    events = list(manager.take_events())
    removed = [k for e in events if e.removed and not e.metadata_only for k in e.keys]
    assert sorted(removed) == sorted(dropped)
    for key in keys:
        found = manager.lookup(key, ctx)
        assert (found == LookupResult.HIT) == (key in resident), key
    assert manager._num_evictable_cache_chunks == len(resident) - 1  # one held
    assert manager._get_num_free_chunks() == size - len(resident)

    manager.complete_load([held], ctx)
    fresh = [make_offload_key(bytes([100 + i]) * 8, 0) for i in range(size - 1)]
    out = manager.prepare_store(fresh, ReqContext(req_id="s"))
    assert out is not None and len(out.keys_to_store) == size - 1
    manager.complete_store(fresh, ReqContext(req_id="s"))
    stored = sum(manager.lookup(k, ctx) == LookupResult.HIT for k in [*keys, *fresh])
    assert stored == size
    assert manager._num_evictable_cache_chunks == size


def quarantine(engine: Any, req_id: str, num_blocks: int, bad: int) -> None:
    """A failed load of `req_id` as the checksum scheduler reports any load
    (a P/D receive or a host load alike): a mismatch at position `bad`."""
    import numpy as np

    from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
        KVChecksumBlocks,
    )
    from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
        KVChecksumStatus,
        KVChecksumVerdict,
    )

    blocks = KVChecksumBlocks(
        num_tokens=num_blocks * BS, groups={0: (0, np.arange(num_blocks))}
    )
    verdict = KVChecksumVerdict(KVChecksumStatus.MISMATCH, {0: [bad]})
    engine.checksums.on_failed_load(req_id, verdict, blocks)


@pytest.mark.parametrize("multi", [False, True], ids=["offload", "multi-offload"])
def test_R138_a_failed_load_of_any_path_stores_nothing_from_its_start(
    model_dir: str, multi: bool
) -> None:
    """A request quarantined from position 2 by a failed load (under
    MultiConnector(NixlConnector, OffloadingConnector) that may be a P/D
    receive) has only its blocks 0-1 stored to host. Bug caught: the store
    filter keyed on the offload connector's own failures only (a failed P/D
    load's blocks reach host memory)."""
    engine = make_engine(model_dir, "offload", multi, False)
    set_faults(engine, False)
    prompt = list(range(300, 300 + 6 * BS + 1))
    engine.add(make_request("a", prompt, max_tokens=2, block_size=BS))
    quarantine(engine, "a", 6, bad=2)
    engine.run("a")
    stored = []
    for output in engine.history:
        meta = offload_metadata(output.kv_connector_metadata)
        for job in meta.store_jobs.values() if meta is not None else ():
            assert job.req_id == "a"
            spec = job.src_spec
            for start, size in zip(spec.block_indices, spec.group_sizes):
                stored.extend(range(int(start), int(start) + int(size)))
    assert sorted(stored) == [0, 1], stored


def test_R138_copies_stored_before_the_verdict_are_dropped(model_dir: str) -> None:
    """A request quarantined after its blocks reached host memory: its host
    copies from the quarantine start on are dropped, the earlier ones kept.
    Bug caught: containment filtering later stores only (copies already on
    the host keep serving later requests)."""
    engine = make_engine(model_dir, "offload", False, False)
    set_faults(engine, False)
    prompt = list(range(500, 500 + 6 * BS + 1))
    engine.add(make_request("a", prompt, max_tokens=8, block_size=BS))
    for _ in range(3):
        engine.step()
    sched = engine.offload.connector_scheduler
    status = sched._req_status["a"]
    keys = status.group_states[0].offload_keys[:6]
    manager = sched.manager
    assert all(manager._policy.get(k) is not None for k in keys)  # on the host
    quarantine(engine, "a", 6, bad=2)
    present = [manager._policy.get(k) is not None for k in keys]
    assert present == [True, True, False, False, False, False]
    engine.run("a")
