# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Operator fault injection into loaded KV (R131).

Unit tests run `KVFaultInjector` on the per-layer CPU caches vLLM 0.33.0's
`allocate_kv_cache` builds (several layouts, kernel block splits) and compare
every byte before and after, locating changes with vLLM's own indexing
(`[block * kernel_blocks + k, head, token, C]`), not the injector's view.
End-to-end tests configure `kv_checksum_fault_injection` on a simulated
consumer (`kv_checksum_pd`, which calls the same `corrupt_loads` the wiring's
post_forward hook calls) and check that every injection is reported as a
mismatch at exactly the injected block positions.
"""

import logging
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    layer_name,
    make_active_env,
    make_kv_cache_config,
    make_kv_caches,
    rank0_groups,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    CARRIER_CONNECTOR_NAME,
    SideConfig,
    SimEngine,
    capture_verdicts,
    consume,
    produce,
    register_carrier_connector,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_checksum import plugin
from vllm.distributed.kv_transfer.kv_checksum.config import (
    ENABLE_KEY,
    FAULT_INJECTION_KEY,
    HOST_FAULT_KEY,
    HOST_FAULT_KINDS,
    FaultInjectionConfig,
    read_fault_injection,
    read_flags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.worker import (
    create_kv_checksum_worker,
)
from vllm.distributed.kv_transfer.kv_checksum.faults.injector import (
    FAULT_KINDS,
    Injection,
    KVFaultInjector,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

NUM_BLOCKS = 32
GROUP0 = [layer_name(i) for i in (1, 3)]  # groups="both": odd layers, full attn
GROUP1 = [layer_name(i) for i in (0, 2)]  # even layers, sliding window
GROUP_LAYERS = {0: GROUP0, 1: GROUP1}
LOAD = KVChecksumBlocks(
    num_tokens=70,
    groups={0: (0, np.array([5, 9, 2, 17, 11])), 1: (2, np.array([7, 4, 30]))},
)
LOADED_IDS = {5, 9, 2, 17, 11, 7, 4, 30}


def make_caches(
    layout: KVCacheLayout = KVCacheLayout.LBHNC, kernel_block_size: int | None = None
) -> dict[str, torch.Tensor]:
    config = make_kv_cache_config(groups="both", num_blocks=NUM_BLOCKS)
    return make_kv_caches(config, layout, kernel_block_size, seed=3)


def snapshot(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: cache.view(torch.uint8).clone() for name, cache in caches.items()}


def changed_blocks(before: dict[str, torch.Tensor], caches: dict[str, torch.Tensor]):
    """{layer: sorted block ids with any changed byte} (vLLM's row = block * k + i)."""
    out = {}
    for name, cache in caches.items():
        now = cache.view(torch.uint8)
        kernel_blocks = now.shape[0] // NUM_BLOCKS
        rows = torch.nonzero((now != before[name]).flatten(1).any(1)).flatten()
        blocks = sorted({int(r) // kernel_blocks for r in rows})
        if blocks:
            out[name] = blocks
    return out


def block_bytes(cache: torch.Tensor, block: int) -> torch.Tensor:
    """All bytes of one block of one layer, by vLLM's row numbering."""
    data = cache.view(torch.uint8)
    k = data.shape[0] // NUM_BLOCKS
    return data[block * k : (block + 1) * k].clone()


def injector(kind: str, seed: int = 0, tp_rank: int = 0, pp_rank: int = 0):
    return KVFaultInjector(1.0, [kind], seed, tp_rank=tp_rank, pp_rank=pp_rank)


def corrupt(inj: KVFaultInjector, caches, req_id: str = "req-0", load=LOAD):
    return inj.corrupt(req_id, load, caches, GROUP_LAYERS, NUM_BLOCKS)


LAYOUTS = [
    (KVCacheLayout.LBHNC, None),
    (KVCacheLayout.LBHNC, 8),
    (KVCacheLayout.LBNHC, 4),
    (KVCacheLayout.BLHNC, None),
    (KVCacheLayout.LHBNC, None),
]


# --------------------------------------------------------------------------
# Each kind changes exactly the intended bytes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout,kernel_block_size", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_flip_one_bit_first_token_first_head(layout, kernel_block_size, seed):
    """R131 bit_flip: exactly one bit of one byte changes, in the first token
    slot and first head of the chosen block of the group's first layer, on
    worker (pp 0, tp 0) only. Catches flips in the wrong block or layout
    position (e.g. a slot past the load, which checksums ignore)."""
    caches = make_caches(layout, kernel_block_size)
    before = snapshot(caches)
    inj = corrupt(injector("bit_flip", seed), caches)
    assert inj is not None and inj.kind == "bit_flip"
    name = GROUP_LAYERS[inj.group_id][0]
    assert inj.layers == (name,)
    assert changed_blocks(before, caches) == {name: [inj.block_id]}
    now = caches[name].view(torch.uint8)
    k = now.shape[0] // NUM_BLOCKS
    diff = torch.nonzero(now != before[name])
    assert diff.tolist() == [[inj.block_id * k, 0, 0, inj.byte % now.shape[-1]]]
    xor = int(now[tuple(diff[0])]) ^ int(before[name][tuple(diff[0])])
    assert xor == 1 << inj.bit
    start, ids = LOAD.groups[inj.group_id]
    assert ids[inj.position - start] == inj.block_id


@pytest.mark.parametrize("tp_rank,pp_rank", [(1, 0), (0, 1), (3, 2)])
def test_bit_flip_only_on_first_worker(tp_rank, pp_rank):
    """R131 bit_flip: other workers take the same decision but change
    nothing, so exactly one bit of the engine's KV flips. Catches a flip
    repeated on every TP rank (several bits; replicas all corrupted)."""
    caches = make_caches()
    before = snapshot(caches)
    inj = corrupt(injector("bit_flip", tp_rank=tp_rank, pp_rank=pp_rank), caches)
    first = injector("bit_flip").decide("req-0", LOAD, NUM_BLOCKS)
    assert inj is not None and inj.layers == ()
    assert inj == first
    assert changed_blocks(before, caches) == {}


@pytest.mark.parametrize("layout,kernel_block_size", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_zero_block_every_layer_of_group(layout, kernel_block_size, seed):
    """R131 zero_block: the chosen block is all zeros in every layer of the
    chosen group; no other block and no other group's layer changes. Catches
    zeroing the wrong block id or another group's layers."""
    caches = make_caches(layout, kernel_block_size)
    before = snapshot(caches)
    inj = corrupt(injector("zero_block", seed), caches)
    assert inj is not None and inj.kind == "zero_block"
    layers = GROUP_LAYERS[inj.group_id]
    assert set(inj.layers) == set(layers)
    assert changed_blocks(before, caches) == {n: [inj.block_id] for n in layers}
    for name in layers:
        assert not block_bytes(caches[name], inj.block_id).any()


@pytest.mark.parametrize("layout,kernel_block_size", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_blocks_exchanges_two_loaded_blocks(layout, kernel_block_size, seed):
    """R131 swap_blocks: the chosen block and another loaded position of the
    same group exchange their bytes in every layer of the group, nothing else
    changes. Catches a one-way copy or a partner outside the load."""
    caches = make_caches(layout, kernel_block_size)
    before = snapshot(caches)
    old = {n: {b: block_bytes(c, b) for b in LOADED_IDS} for n, c in caches.items()}
    inj = corrupt(injector("swap_blocks", seed), caches)
    assert inj is not None and inj.kind == "swap_blocks"
    start, ids = LOAD.groups[inj.group_id]
    assert inj.other_position is not None and inj.other_position != inj.position
    assert start <= inj.other_position < start + len(ids)
    other = int(ids[inj.other_position - start])
    assert inj.source_block_id == other
    layers = GROUP_LAYERS[inj.group_id]
    pair = sorted([inj.block_id, other])
    assert changed_blocks(before, caches) == {n: pair for n in layers}
    for name in layers:
        assert torch.equal(block_bytes(caches[name], inj.block_id), old[name][other])
        assert torch.equal(block_bytes(caches[name], other), old[name][inj.block_id])
    assert inj.positions == tuple(sorted((inj.position, inj.other_position)))


def test_swap_one_block_falls_back_to_zero():
    """R131: a group with one loaded block has nothing to swap with; the
    injection becomes zero_block (and says so). Catches a swap with itself,
    which changes nothing and would "prove" a fault undetected."""
    load = KVChecksumBlocks(num_tokens=10, groups={0: (0, np.array([6]))})
    caches = make_caches()
    before = snapshot(caches)
    inj = corrupt(injector("swap_blocks"), caches, load=load)
    assert inj is not None and inj.kind == "zero_block" and inj.block_id == 6
    assert changed_blocks(before, caches) == {n: [6] for n in GROUP0}


@pytest.mark.parametrize("layout,kernel_block_size", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stale_block_copies_a_block_outside_the_load(layout, kernel_block_size, seed):
    """R131 stale_block: the chosen block takes the bytes of another block id
    of the cache that is neither part of the load (any group) nor the null
    block, in every layer of the group. Catches a "stale" source that is a
    loaded block (a swap in disguise) or the block itself (no change)."""
    caches = make_caches(layout, kernel_block_size)
    before = snapshot(caches)
    inj = corrupt(injector("stale_block", seed), caches)
    assert inj is not None and inj.kind == "stale_block"
    source = inj.source_block_id
    assert source is not None and source not in LOADED_IDS and source != 0
    layers = GROUP_LAYERS[inj.group_id]
    assert changed_blocks(before, caches) == {n: [inj.block_id] for n in layers}
    for name in layers:
        block = block_bytes(caches[name], inj.block_id)
        assert torch.equal(block, block_bytes(caches[name], source))


def _copy_block(caches, layers, src: int, dst: int) -> None:
    """Give block `dst` the bytes of block `src` in `layers` (vLLM's rows)."""
    for name in layers:
        data = caches[name].view(torch.uint8)
        k = data.shape[0] // NUM_BLOCKS
        data[dst * k : (dst + 1) * k] = data[src * k : (src + 1) * k]


@pytest.mark.parametrize("same", [True, False])
def test_stale_copy_of_equal_bytes_is_logged_without_effect(caplog, same):
    """R131: a stale_block whose source already held the block's bytes (a
    freed copy of the same prompt's block) changes nothing; the injector says
    so after the injecting call, once. Bugs caught: such an injection counted
    as a fault the checksums missed (the soak's one "unreported" injection of
    2026-12-01e), and a "no effect" line for a copy that did change the KV
    (it would hide a missed fault from the drivers)."""
    caches = make_caches()
    inj = injector("stale_block", 1)
    decision = inj.decide("req-0", LOAD, NUM_BLOCKS)
    assert decision is not None and decision.source_block_id is not None
    if same:
        layers = GROUP_LAYERS[decision.group_id]
        _copy_block(caches, layers, decision.source_block_id, decision.block_id)
    before = snapshot(caches)
    with caplog.at_level(logging.WARNING):
        applied = corrupt(inj, caches)
        assert applied is not None
        assert applied.source_block_id == decision.source_block_id
        assert "had no effect" not in caplog.text
        reported = inj.report_no_effect()
        assert inj.report_no_effect() == []
    assert (changed_blocks(before, caches) == {}) is same
    assert [d.req_id for d in reported] == (["req-0"] if same else [])
    line = "fault injection had no effect: stale_block into request req-0 "
    assert (line in caplog.text) is same


def test_kv_sharing_alias_corrupted_once():
    """R131: two layers sharing one cache (KV sharing) are swapped once, not
    twice (which would undo the swap). Catches a per-layer-name loop."""
    cache = make_caches()[GROUP0[0]]
    caches = {"model.layers.1.attn": cache, "model.layers.3.attn": cache}
    before = snapshot(caches)
    load = KVChecksumBlocks(num_tokens=40, groups={0: (0, np.array([5, 9, 2]))})
    inj = KVFaultInjector(1.0, ["swap_blocks"], 0).corrupt(
        "req-0", load, caches, {0: list(caches)}, NUM_BLOCKS
    )
    assert inj is not None and inj.kind == "swap_blocks" and len(inj.layers) == 1
    assert inj.source_block_id is not None
    pair = sorted([inj.block_id, inj.source_block_id])
    assert changed_blocks(before, caches) == {n: pair for n in caches}


# --------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------


def test_decision_identical_across_workers_and_deterministic():
    """R131: the decision depends only on (seed, request id, load), so every
    worker of an engine corrupts the same block without communicating, and a
    rerun injects the same faults. Catches decisions seeded per process
    (Python's salted hash) or per rank."""
    ranks = [(tp, pp) for tp in range(4) for pp in range(2)]
    for i in range(50):
        req_id = f"cmpl-{i}"
        decisions = {
            KVFaultInjector(0.5, FAULT_KINDS, 7, tp, pp).decide(
                req_id, LOAD, NUM_BLOCKS
            )
            for tp, pp in ranks
        }
        assert len(decisions) == 1
    a = [
        KVFaultInjector(0.5, FAULT_KINDS, 7).decide(f"r{i}", LOAD, 32)
        for i in range(50)
    ]
    b = [
        KVFaultInjector(0.5, FAULT_KINDS, 8).decide(f"r{i}", LOAD, 32)
        for i in range(50)
    ]
    assert a != b  # the seed matters


def test_rate_zero_never_one_always():
    """R131: rate 0 never injects, rate 1 always does, and a rate in between
    injects about that fraction; every configured kind occurs, no other.
    Catches an off-by-one comparison (rate 0 injecting) or a stuck kind."""
    ids = [f"req-{i}" for i in range(2000)]
    never = KVFaultInjector(0.0, FAULT_KINDS, 0)
    always = KVFaultInjector(1.0, FAULT_KINDS, 0)
    assert all(never.decide(r, LOAD, NUM_BLOCKS) is None for r in ids)
    decided = [always.decide(r, LOAD, NUM_BLOCKS) for r in ids]
    assert all(d is not None for d in decided)
    assert {d.kind for d in decided if d is not None} == set(FAULT_KINDS)
    some = KVFaultInjector(0.25, FAULT_KINDS, 0)
    hits = sum(some.decide(r, LOAD, NUM_BLOCKS) is not None for r in ids)
    assert 0.2 < hits / len(ids) < 0.3
    two = KVFaultInjector(1.0, ["zero_block", "bit_flip"], 0)
    assert {two.decide(r, LOAD, NUM_BLOCKS).kind for r in ids[:200]} == {  # type: ignore[union-attr]
        "zero_block",
        "bit_flip",
    }


def test_decision_covers_groups_and_positions():
    """R131: over many requests every group and every loaded position of it
    is chosen; skipped groups never are. Catches an injector that always hits
    the first block (proving nothing about the others)."""
    inj = KVFaultInjector(1.0, ["zero_block"], 0)
    seen = {
        (d.group_id, d.position)
        for r in range(400)
        if (d := inj.decide(f"r{r}", LOAD, 32))
    }
    expected = {
        (g, s + i) for g, (s, ids) in LOAD.groups.items() for i in range(len(ids))
    }
    assert seen == expected
    only1 = {inj.decide(f"r{r}", LOAD, 32, skip_groups=[0]).group_id for r in range(50)}  # type: ignore[union-attr]
    assert only1 == {1}
    empty = KVChecksumBlocks(
        num_tokens=0, groups={0: (0, np.array([], dtype=np.int64))}
    )
    assert inj.decide("r", empty, 32) is None


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


def transfer_config(value: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        kv_connector_extra_config={FAULT_INJECTION_KEY: value},
    )


def test_config_parsing():
    """R131: absent/None is off; a dict gets defaults (all kinds, seed 0)."""
    assert read_fault_injection(None) is None
    assert read_fault_injection(transfer_config(None)) is None
    assert read_fault_injection(transfer_config({"rate": 1})) == FaultInjectionConfig(
        1.0, FAULT_KINDS, 0
    )
    parsed = read_fault_injection(
        transfer_config({"rate": 0.5, "kinds": ["swap_blocks"], "seed": 3})
    )
    assert parsed == FaultInjectionConfig(0.5, ("swap_blocks",), 3)
    assert read_flags(transfer_config({"rate": 0.1})).fault_injection is not None


@pytest.mark.parametrize(
    "value",
    [
        0.5,
        {},
        {"rate": -0.1},
        {"rate": 1.5},
        {"rate": float("nan")},
        {"rate": True},
        {"rate": "0.5"},
        {"rate": 0.5, "kinds": []},
        {"rate": 0.5, "kinds": "bit_flip"},
        {"rate": 0.5, "kinds": ["bit_flip", "melt"]},
        {"rate": 0.5, "seed": 1.5},
        {"rate": 0.5, "seed": False},
        {"rate": 0.5, "rates": 1},
    ],
)
def test_invalid_config_is_startup_error(value):
    """R131: an invalid setting is a start-up ValueError (also from
    read_flags, which every process calls), never silently off. Catches a
    typo'd config that leaves the operator believing faults are injected."""
    with pytest.raises(ValueError, match=FAULT_INJECTION_KEY):
        read_fault_injection(transfer_config(value))
    with pytest.raises(ValueError, match=FAULT_INJECTION_KEY):
        read_flags(transfer_config(value))


@pytest.mark.parametrize(
    "value", [0.5, {"rate": 2}, {"rate": 0.5, "kinds": ["bit_flip"]}]
)
def test_invalid_host_fault_setting_is_startup_error_r131(value):
    """R131, R8: an invalid `kv_checksum_host_fault_injection` fails
    read_flags, which every process calls at start-up, as the loaded-KV
    setting does; a valid one is read. Bug this fails: checking the host
    setting only when an offload connector attaches (checksums then switch
    off with an error log instead of failing the start)."""
    config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={HOST_FAULT_KEY: value},
    )
    with pytest.raises(ValueError, match=HOST_FAULT_KEY):
        read_flags(config)
    config.kv_connector_extra_config = {HOST_FAULT_KEY: {"rate": 1}}
    assert read_flags(config).host_fault_injection == FaultInjectionConfig(
        1.0, HOST_FAULT_KINDS, 0
    )


# --------------------------------------------------------------------------
# End to end: every injected fault is detected at its position
# --------------------------------------------------------------------------


def prompt(i: int, length: int = 70) -> list[int]:
    """Distinct prompts (no prefix-cache hits between requests)."""
    return [1000 + 100 * i + t for t in range(length)]


SIDES: dict[str, dict[str, Any]] = {
    "tp1": dict(tp=1, pp=1, block_size=16),
    "tp2pp2-hybrid": dict(tp=2, pp=2, block_size=16, groups="both"),
    "tp4-replicated-bs8": dict(tp=4, pp=1, block_size=8),
    # MLA latent caches, the same bytes on every TP rank (issue 29).
    "tp2-mla": dict(tp=2, pp=1, block_size=16, groups="mla"),
    "tp2pp2-mla": dict(tp=2, pp=2, block_size=16, groups="mla"),
}


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_injection_detected_at_its_position(model_dir, kind, side, caplog):
    """R131 end to end: with rate 1, each consumer load gets one fault of the
    configured kind from every worker's injector (same decision on all), the
    injection is logged once with request, group and position, and the load's
    verdict is a mismatch at exactly the injected positions of that group.
    Catches injection after the checksums ran (verified verdict), workers
    disagreeing on the block, or faults checksums cannot see; for MLA, an
    injector that could not address a latent cache (one head slot per layer,
    replicated on every rank)."""
    shape = SIDES[side]
    producer = SimEngine(model_dir, SideConfig(**shape), "producer")
    consumer = SimEngine(
        model_dir,
        SideConfig(**shape, fault_injection={"rate": 1.0, "kinds": [kind], "seed": 5}),
        "consumer",
    )
    verdicts = capture_verdicts(consumer)
    caplog.set_level(logging.WARNING)
    for i in range(2):
        params = produce(producer, f"p-{i}", prompt(i))
        consume(consumer, producer, f"c-{i}", prompt(i), params)
    assert set(verdicts) == {"c-0", "c-1"}
    workers = len(consumer.workers)
    assert len(consumer.injections) == 2 * workers
    for req_id, verdict in verdicts.items():
        mine = [inj for inj in consumer.injections if inj.req_id == req_id]
        decisions = {_decision(inj) for inj in mine}
        assert len(decisions) == 1, "workers disagree on the injection"
        inj = mine[0]
        assert inj.kind == kind
        assert any(m.layers for m in mine), "no worker changed any KV"
        assert verdict.status == KVChecksumStatus.MISMATCH
        assert verdict.mismatches == {inj.group_id: list(inj.positions)}
        line = (
            f"KV checksum fault injection: {kind} into request {req_id} "
            f"group {inj.group_id} block position {inj.position}."
        )
        assert [r.getMessage() for r in caplog.records].count(line) == 1


def _decision(inj: Injection) -> tuple:
    return (
        inj.kind,
        inj.group_id,
        inj.position,
        inj.other_position,
        inj.source_block_id,
    )


def test_rate_zero_end_to_end_verifies(model_dir):
    """R131: a configured injector with rate 0 never touches KV: loads verify.
    Catches a wiring that corrupts whenever the injector exists."""
    producer = SimEngine(model_dir, SideConfig(), "producer")
    consumer = SimEngine(
        model_dir, SideConfig(fault_injection={"rate": 0.0}), "consumer"
    )
    verdicts = capture_verdicts(consumer)
    params = produce(producer, "p-0", prompt(0))
    consume(consumer, producer, "c-0", prompt(0), params)
    assert consumer.injections == []
    assert verdicts["c-0"].status == KVChecksumStatus.VERIFIED


def test_failed_and_aborted_loads_untouched():
    """R131: loads reported failed, and requests finished in the same step,
    are never corrupted (their blocks may already belong to another request).
    Catches injection into blocks the worker does not checksum."""

    class Worker:
        kv_caches = make_caches()
        skipped_groups = ()
        topology = type("T", (), {"num_blocks": NUM_BLOCKS})()
        asked: list[list[str]] = []

        def pending_load_blocks(self, req_ids):
            self.asked.append(list(req_ids))
            return {r: LOAD for r in req_ids}

        def group_layer_names(self):
            return GROUP_LAYERS

    worker = Worker()
    inj = KVFaultInjector(1.0, ["zero_block"], 0)
    done = inj.corrupt_loads(worker, ["a", "b", "c"], ["b"], {"c"})
    assert worker.asked == [["a"]]
    assert [d.req_id for d in done] == ["a"]
    assert inj.corrupt_loads(worker, None, None) == []


# --------------------------------------------------------------------------
# The wiring: Model Runner V2's ActiveKVConnector
# --------------------------------------------------------------------------


def make_active(model_dir: str, monkeypatch: pytest.MonkeyPatch, extra: dict) -> Any:
    """A real ActiveKVConnector (wiring hooks installed) of a single worker whose
    connector reports load "load" finished at the first post_forward."""
    plugin.register()
    register_carrier_connector()
    rank0_groups(monkeypatch)
    return make_active_env(
        model_dir,
        CARRIER_CONNECTOR_NAME,
        extra,
        monkeypatch,
        KVConnectorTransferResults(finished_recving={"load"}),
    )


def test_wiring_injects_before_checksums(model_dir, monkeypatch):
    """R131 wiring: with `kv_checksum_fault_injection` set, the
    ActiveKVConnector holds an injector and its post_forward corrupts the
    finished load before the checksum worker runs, so the record sent to the
    scheduler is the checksum of the corrupted KV (differing from the pristine
    one at the injected position only). Catches an injector never created, or
    one running after the checksums (every fault would pass as verified)."""
    setting = {"rate": 1.0, "kinds": ["zero_block"], "seed": 1}
    env = make_active(
        model_dir, monkeypatch, {ENABLE_KEY: True, FAULT_INJECTION_KEY: setting}
    )
    active = env.active
    assert active.kv_checksum_fault_injector is not None
    blocks = KVChecksumBlocks(num_tokens=40, groups={0: (0, np.array([4, 6, 8]))})
    scheduled = KVChecksumScheduled(reqs_to_recv={"load": blocks})
    pristine = snapshot(env.caches)
    output = env.empty_output
    output.kv_checksum_scheduled = scheduled
    active.pre_forward(output)
    active.finish_forward()
    (pending,) = active.post_forward(set()).kv_checksums
    got = pending.finalize().checksums["load"][0].values

    def direct_values() -> np.ndarray:
        worker = create_kv_checksum_worker(
            env.vllm_config,
            env.kv_cache_config,
            env.caches,
            torch.device("cpu"),
            tp_rank=0,
            pp_rank=0,
        )
        assert worker is not None
        worker.bind(scheduled)
        pending = worker.post_forward({"load"})
        assert pending is not None
        return pending.finalize().checksums["load"][0].values

    np.testing.assert_array_equal(got, direct_values())  # after the injection
    num_blocks = env.kv_cache_config.num_blocks
    inj = active.kv_checksum_fault_injector.decide("load", blocks, num_blocks)
    for name, cache in env.caches.items():
        cache.view(torch.uint8).copy_(pristine[name])
    clean = direct_values()
    differs = sorted({int(i) for i in np.nonzero((got != clean).any(axis=1))[0]})
    assert differs == [inj.position]


@pytest.mark.parametrize("enabled", [True, False])
def test_wiring_without_setting_has_no_injector(model_dir, monkeypatch, enabled):
    """R131: off unless configured: no injector without the setting, and none
    when checksums are disabled even with it (nothing would verify). Catches
    an injector corrupting KV of engines that never asked for it."""
    extra: dict[str, Any] = {ENABLE_KEY: enabled}
    if not enabled:
        extra[FAULT_INJECTION_KEY] = {"rate": 1.0}
    env = make_active(model_dir, monkeypatch, extra)
    assert env.active.kv_checksum_fault_injector is None
