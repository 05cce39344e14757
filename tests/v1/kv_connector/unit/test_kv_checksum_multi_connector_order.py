# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""P/D and offload under one MultiConnector, in both child orders (R101, R119-R121).

vLLM 0.33.0's MultiConnector hands a request's load to the first child that
reports new matched tokens. With NixlConnector first, a P/D request
(do_remote_prefill) is always pulled from the producer; with
OffloadingConnector first, a P/D request whose prefix sits in host memory is
loaded from there instead, and the NIXL child only frees the producer's
blocks. Either way the load that happened must be judged: a P/D pull against
the producer's checksums, a host load against the entries stored with it.

The engine is vLLM's real Scheduler and connectors (OffloadingConnector
both ways round, SimpleCPUOffloadConnector listed first) with the CPU offload
simulation (`kv_checksum_offload_sim`); a P/D pull is simulated by copying a
producer's KV into the load's blocks and reporting the load finished.
"""

import random
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_helpers import make_request
from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
    OffloadSimEngine,
    SimpleOffloadSimEngine,
    metadata_of,
    verdicts,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    Fault,
    SideConfig,
    SimEngine,
    apply_fault,
    per_group,
    produce,
    transfer,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.host_faults import HOST_FAULT_KEY
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

BS = 16
PREFIX_BLOCKS = 4
OFFLOAD_EXTRA = {
    "cpu_bytes_to_use": 1 << 22,
    HOST_FAULT_KEY: {"rate": 1.0, "kinds": ["host_bit_flip"]},
}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
OFFLOAD = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": OFFLOAD_EXTRA,
}
SIMPLE = {
    "kv_connector": "SimpleCPUOffloadConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {**OFFLOAD_EXTRA, "num_cpu_blocks": 64},
}
ORDERS = {
    "offload-first": [OFFLOAD, NIXL],
    "nixl-first": [NIXL, OFFLOAD],
    "simple-offload-first": [SIMPLE, NIXL],
}
# (fail_closed, kv_load_failure_policy): the policy matters only fail-closed.
POLICIES = {
    "fail-open": (False, "fail"),
    "closed-fail": (True, "fail"),
    "closed-recompute": (True, "recompute"),
}


def make_engine(model_dir: str, order: str, policy: str) -> Any:
    """An OffloadSimEngine (SimpleOffloadSimEngine for SimpleCPUOffload)."""
    fail_closed, load_policy = POLICIES[policy]
    side = SideConfig(
        num_blocks=24,
        connector="MultiConnector",
        connector_extra={"connectors": ORDERS[order]},
        fail_closed=fail_closed,
        policy=load_policy,
    )
    sim = SimpleOffloadSimEngine if order.startswith("simple") else OffloadSimEngine
    engine = sim(model_dir, side, f"order-{order}-{policy}")
    set_host_faults(engine, False)
    return engine


def set_host_faults(engine: Any, on: bool) -> None:
    """Corrupt the first block of every host load (on) or of none (off)."""
    for side in engine.sides:
        assert side is not None
        saved = side.__dict__.setdefault("_test_injector", side.injector)
        side.injector = saved if on else None


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 200) for _ in range(count)]


def run(engine: Any, req_id: str, prompt: list[int]) -> None:
    """A request without kv_transfer_params, run to its end."""
    engine.add(make_request(req_id, prompt, max_tokens=2, block_size=BS))
    engine.run(req_id, max_steps=60)


def to_host_then_evict(
    engine: Any, rng: random.Random, prefixes: list[list[int]]
) -> None:
    """Each prefix computed (and stored to host memory), then pushed out of
    the 24 GPU blocks by unrelated prompts."""
    for i, prefix in enumerate(prefixes):
        run(engine, f"store{i}", prefix + tokens(rng, BS + 1))
    for i in range(4):
        run(engine, f"evict{i}", tokens(rng, 6 * BS + 1))


def run_pd(
    engine: Any,
    producer: SimEngine,
    req_id: str,
    prompt: list[int],
    corrupt: bool,
) -> bool:
    """A P/D request of `prompt`, with the producer's returned
    kv_transfer_params (its checksums included). If the NIXL child pulls it,
    the producer's KV is copied into the pulled blocks (`corrupt`: one bit of
    the first pulled block flipped after the copy) and the pull reported
    finished; a host load runs as the simulation runs it. Returns whether
    the first load was a pull."""
    params = produce(producer, f"remote-{req_id}", prompt)
    assert params.get("kv_checksums"), params
    engine.add(
        make_request(
            req_id, prompt, max_tokens=2, kv_transfer_params=params, block_size=BS
        )
    )
    output = engine.step()
    # The NIXL child's own record of the step: a pull into local blocks, or
    # (another child loads) none and only the producer's blocks freed.
    nixl = metadata_of(output.kv_connector_metadata, NixlConnectorMetadata)
    pull = nixl.reqs_to_recv.get(req_id) if nixl is not None else None
    pulled = pull is not None and any(per_group(pull.local_block_ids))
    if pulled:
        request = engine.scheduler.requests[req_id]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        local = pull.local_num_computed_blocks[0] * BS
        positions = list(range(local, request.num_computed_tokens))
        blocks = engine.block_ids(req_id)
        remote = per_group(params["remote_block_ids"])
        copied = transfer(producer, remote, engine, blocks, positions)
        if corrupt:
            apply_fault(engine, blocks[0], copied[0], Fault("bit_flip"))
        engine.finish_load(req_id)
    engine.run(req_id, max_steps=60)
    return pulled


def expect_outcome(engine: Any, policy: str, req_id: str) -> None:
    """How a request whose load mismatched ends: served anyway (fail-open),
    failed (fail-closed, policy "fail") or recomputed from its first bad
    block on (fail-closed, policy "recompute")."""
    final = engine.final[req_id]
    if policy == "closed-fail":
        assert final.finish_reason == FinishReason.ERROR, req_id
        return
    assert final.finish_reason == FinishReason.LENGTH, req_id
    computed = engine.scheduled_tokens(req_id)
    if policy == "closed-recompute":
        # The bad block is the first loaded one: everything from there is
        # computed here (at least the whole prefix).
        assert computed >= PREFIX_BLOCKS * BS, (req_id, computed)
    else:
        assert computed < PREFIX_BLOCKS * BS, (req_id, computed)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize(
    "order",
    [
        pytest.param(
            order,
            marks=[pytest.mark.kv_checksum_capability("simple_cpu_offload")]
            if order.startswith("simple")
            else [],
        )
        for order in ORDERS
    ],
)
def test_R119_R101_every_load_judged_in_either_child_order(
    model_dir: str, order: str, policy: str
) -> None:
    """MultiConnector(OffloadingConnector, NixlConnector) and the reverse,
    fail-open and fail-closed (policies "fail" and "recompute"): four
    requests over four prefixes stored in host memory and evicted from the
    GPU. With the first loaded block corrupted, a plain request and a P/D
    request each end in exactly one mismatch (offload first: the P/D
    request's prefix is loaded from host memory; NIXL first: it is pulled
    from the producer), and end as the policy says; without faults, a plain
    and a P/D request are each verified.

    Bug caught (issue 75, item 4; offload first): a P/D request noted on
    arrival whose prefix the offload child loads has sources {host}, not
    {p2p}, and was registered neither as a P/D pull nor as a host load: no
    verdict at all, the corrupted block served even fail-closed. Bug caught
    (NIXL first): judging every noted request as a load of stored entries
    (the P/D pull, source {p2p}, then gets no verdict)."""
    rng = random.Random(75)
    engine = make_engine(model_dir, order, policy)
    producer = SimEngine(model_dir, SideConfig(num_blocks=64), f"prod-{order}-{policy}")
    prefixes = [tokens(rng, PREFIX_BLOCKS * BS) for _ in range(4)]
    to_host_then_evict(engine, rng, prefixes)
    offload_first = order != "nixl-first"

    # NIXL first, fail-closed "recompute": the failed pull's recompute
    # loads the prefix from host memory (corrupted too): one more mismatch.
    reload = not offload_first and policy == "closed-recompute"

    set_host_faults(engine, True)
    before = dict(verdicts(engine))
    run(engine, "plain-bad", prefixes[0] + tokens(rng, BS + 1))
    loads = engine.num_loads
    pulled = run_pd(engine, producer, "pd-bad", prefixes[1] + tokens(rng, BS + 1), True)
    assert pulled != offload_first
    assert engine.num_loads - loads == int(offload_first or reload)
    after = verdicts(engine)
    mismatches = 2 + int(reload)
    assert after.get("mismatch", 0) == before.get("mismatch", 0) + mismatches, after
    assert after.get("verified", 0) == before.get("verified", 0), after
    assert after.get("unverified", 0) == 0, after
    for req_id in ("plain-bad", "pd-bad"):
        expect_outcome(engine, policy, req_id)

    set_host_faults(engine, False)
    before = dict(after)
    run(engine, "plain-ok", prefixes[2] + tokens(rng, BS + 1))
    loads = engine.num_loads
    pulled = run_pd(engine, producer, "pd-ok", prefixes[3] + tokens(rng, BS + 1), False)
    assert pulled != offload_first
    assert engine.num_loads - loads == int(offload_first)
    after = verdicts(engine)
    assert after.get("verified", 0) == before.get("verified", 0) + 2, after
    assert after.get("mismatch", 0) == before.get("mismatch", 0), after
    for req_id in ("plain-ok", "pd-ok"):
        assert engine.final[req_id].finish_reason == FinishReason.LENGTH
