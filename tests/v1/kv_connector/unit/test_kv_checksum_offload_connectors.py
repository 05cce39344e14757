# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checksums on vLLM 0.33.0's CPU offload tier (R139 with R116-R121, R131).

The scheduler side is vLLM's real Scheduler and OffloadingConnector (alone
and under MultiConnector with NixlConnector); the worker side is the
plugin's `OffloadWorkerSide` over real checksum workers, with transfers
simulated on CPU (`kv_checksum_offload_sim`): vLLM's CPU offloading worker
needs CUDA streams, so its copies themselves run on the GPU only
(examples/offload/kv_checksum_offload_gpu.py).
"""

import random
from collections import Counter
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    make_request,
    register_plugin,
)
from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
    CallRecorder,
    OffloadSimEngine,
    assert_every_load_verified,
    check_side_error_turns_off_the_tier,
    offload_metadata,
    reload_after_drop,
    run_shared_prefixes,
    verdicts,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig
from vllm.distributed.kv_transfer.kv_checksum.offload.host_faults import (
    HOST_FAULT_KEY,
    HostFaultConfig,
    HostFaultInjector,
    read_host_fault_config,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.offloading import (
    HostCopyDropper,
    HostEntryTable,
    failed_keys,
    host_slots,
)

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.usefixtures("cuda_stream_stubs"),
    pytest.mark.kv_checksum_capability("offloading"),
]

BS = 16
OFFLOAD_EXTRA = {"cpu_bytes_to_use": 1 << 22}


class Spec:
    """A GPU or CPU LoadStoreSpec stand-in (block ids, group sizes, indices)."""

    def __init__(
        self,
        block_ids: Sequence[int],
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        self.block_ids = np.asarray(block_ids, dtype=np.int32)
        if group_sizes is not None:
            self.group_sizes = list(group_sizes)
            self.block_indices = list(block_indices or [0] * len(group_sizes))


def reference_slots(gpu: Spec, cpu_ids: Sequence[int], bpc: int) -> list[int]:
    """Per block, the way vLLM's CPU worker walks chunks: one block at a time."""
    slots, chunk_offset = [], 0
    for size, start in zip(gpu.group_sizes, gpu.block_indices):
        if not size:
            continue
        chunk, sub = chunk_offset, start % bpc
        for _ in range(size):
            slots.append(int(cpu_ids[chunk]) * bpc + sub)
            sub += 1
            if sub == bpc:
                chunk, sub = chunk + 1, 0
        chunk_offset = chunk + (1 if sub else 0)
    return slots


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_R118_host_slots_match_per_block_reference(bpc: int) -> None:
    """Each GPU block's host slot, also for chunks of several blocks and
    groups starting mid-chunk. Bug caught: ignoring `block_indices % bpc`
    (the skipped sub-blocks) or not advancing chunks between groups."""
    rng = random.Random(bpc)
    for _ in range(50):
        sizes = [rng.randrange(0, 7) for _ in range(rng.randrange(1, 4))]
        starts = [rng.randrange(0, 9) for _ in sizes]
        gpu = Spec(range(sum(sizes)), sizes, starts)
        n_chunks = sum(-(-(s % bpc + n) // bpc) for n, s in zip(sizes, starts) if n)
        cpu_ids = rng.sample(range(100), n_chunks)
        got = host_slots(gpu, np.asarray(cpu_ids, dtype=np.int64), bpc)
        assert got.tolist() == reference_slots(gpu, cpu_ids, bpc)


def _store(entries: HostEntryTable, transfers: list) -> None:
    """A step's stores as the worker makes them: the entry copy of the
    transfers, applied as a block table save applies one (that save is
    tested in test_R118_a_save_copies_its_entries_to_host_slots)."""
    copy = entries.copy_to_slots(*entries.indices(transfers))
    copy.dest[torch.as_tensor(copy.slots)] = entries.block_table[
        torch.as_tensor(copy.block_ids)
    ]


def test_R117_entries_move_with_the_host_copy() -> None:
    """A store moves block entries to the host slots, a load writes them back
    at the new GPU block ids. Bug caught: restoring from the GPU ids' own
    slots (a load into other blocks than were stored)."""
    table = torch.arange(10, dtype=torch.int64) * 7 + 1
    entries = HostEntryTable(table, num_chunks=8, blocks_per_chunk=2)
    _store(entries, [(Spec([2, 3, 4], [3], [1]), Spec([5, 6]))])
    before = table.clone()
    table.zero_()
    entries.restore([(Spec([7, 8, 9], [3], [1]), Spec([5, 6]))])
    assert table[[7, 8, 9]].tolist() == before[[2, 3, 4]].tolist()
    assert table[:7].tolist() == [0] * 7


def test_R117_one_step_of_several_transfers_moves_every_entry() -> None:
    """A step's stores and loads move together (one copy each): every block
    keeps its own entry. Bug caught: offsetting the second transfer's slots
    by the first one's (entries of one request landing on another's)."""
    table = torch.arange(12, dtype=torch.int64) * 5 + 3
    entries = HostEntryTable(table, num_chunks=8, blocks_per_chunk=2)
    stores = [
        (Spec([1, 2], [2], [0]), Spec([4])),
        (Spec([5, 6, 7], [3], [1]), Spec([0, 6])),
    ]
    _store(entries, stores)
    before = table.clone()
    table.zero_()
    entries.restore([(Spec([9, 10, 11], [3], [1]), Spec([0, 6]))])
    entries.restore([(Spec([3, 4], [2], [0]), Spec([4]))])
    assert table[[3, 4]].tolist() == before[[1, 2]].tolist()
    assert table[[9, 10, 11]].tolist() == before[[5, 6, 7]].tolist()


@pytest.mark.parametrize("ids, slots", [([4], [0, 1, 2]), ([4, 5, 6], [1])])
def test_R117_an_entry_move_of_unequal_lengths_moves_nothing(
    ids: list[int], slots: list[int]
) -> None:
    """A restore whose block ids and slots differ in length raises before
    any entry moves (the caller's guard then turns the tier off, R134).
    Bug caught: packing the move by assigning rows alone, which broadcasts a
    single block id over every slot (one block given three slots' entries)
    or a single slot over every block."""
    table = torch.arange(8, dtype=torch.int64) * 3 + 1
    entries = HostEntryTable(table, num_chunks=4, blocks_per_chunk=1)
    entries.entries[:] = torch.arange(4, dtype=torch.int64) + 100
    before = table.clone()
    with pytest.raises(ValueError, match="entry move"):
        entries.restore_ids(ids, slots)
    assert torch.equal(table, before)


def test_R118_a_store_copy_of_unequal_lengths_is_never_made() -> None:
    """A store's copy to host slots whose block ids and slots differ in
    length raises when it is made, before any save folds or packs it. Bug
    caught: the check only where a move is packed (`move_indices`), which
    the fold's simple case never calls: it sets the tags' slot row from the
    copy's slots, one slot broadcast over three blocks."""
    table = torch.zeros(8, dtype=torch.int64)
    entries = HostEntryTable(table, num_chunks=4, blocks_per_chunk=1)
    with pytest.raises(ValueError, match="entry move of 3 blocks to 1 slots"):
        entries.copy_to_slots([4, 5, 6], [1])


def test_R121_failed_keys_are_the_mismatched_positions() -> None:
    """Only keys overlapping a mismatched block of their group are bad.
    Bug caught: dropping every key of the load or matching other groups."""
    ranges = [(0, 16, "a0"), (16, 32, "b0"), (32, 48, "c0"), (16, 32, "b1")]
    group = {"a0": 0, "b0": 0, "c0": 0, "b1": 1}.__getitem__
    assert failed_keys(ranges, {0: [1]}, {0: 16, 1: 16}, group) == {"b0"}
    assert failed_keys(ranges, {1: [1]}, {0: 16, 1: 16}, group) == {"b1"}
    assert failed_keys(ranges, {0: [0, 2]}, {0: 16}, group) == {"a0", "c0"}


@pytest.mark.kv_checksum_capability("plugin")
def test_R121_dropper_frees_a_copy_once_its_load_completed() -> None:
    """On vLLM's CPUOffloadingManager, through the wiring's removal of a host
    copy: a referenced bad copy is hidden, then
    freed (lookup MISS, chunk reusable) when its load completes. Bug caught:
    freeing a chunk a load still reads, or never freeing it."""
    from vllm.distributed.kv_transfer.kv_checksum.wiring import (
        offloading as wiring_offloading,
    )
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=4)
    ctx = ReqContext(req_id="r", kv_transfer_params=None)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
    manager.prepare_store(keys, ctx)
    manager.complete_store(keys, ctx)
    manager.prepare_load(keys[:1], ctx)  # the load holds keys[0]
    sched = SimpleNamespace(
        manager=manager, config=SimpleNamespace(kv_group_configs=[]), _req_status={}
    )
    try_remove = wiring_offloading._offload_scheduler_side(sched).try_remove
    dropper = HostCopyDropper()
    dropper.add(keys[:1])
    dropper.drop_ready(try_remove)
    assert dropper.hides(keys[0]) and manager._policy.get(keys[0]) is not None
    manager.complete_load(keys[:1], ctx)
    dropper.drop_ready(try_remove)
    assert not dropper.hides(keys[0]) and dropper.dropped == 1
    assert manager.lookup(keys[0], ctx) == LookupResult.MISS
    assert manager.lookup(keys[1], ctx) == LookupResult.HIT
    assert manager._get_num_free_chunks() == 3


def test_R131_host_fault_config_and_decisions() -> None:
    """Bad settings are start-up errors; decisions equal on every worker."""

    class Config:
        kv_connector_extra_config: dict

    config = Config()
    config.kv_connector_extra_config = {}
    assert read_host_fault_config(config) is None
    for bad in ({"rate": 2}, {"rate": 0.5, "kinds": ["zero"]}, {"rate": 1, "x": 1}):
        config.kv_connector_extra_config = {HOST_FAULT_KEY: bad}
        with pytest.raises(ValueError):
            read_host_fault_config(config)
    injector = HostFaultInjector(HostFaultConfig(1.0), first_worker=True)
    other = HostFaultInjector(HostFaultConfig(1.0), first_worker=False)
    assert injector.decide("r", 3, 0, 8) == other.decide("r", 3, 0, 8)
    never = HostFaultInjector(HostFaultConfig(0.0), first_worker=True)
    assert never.decide("r", 3, 0, 8) is None


def test_R131_rate_one_decides_every_load() -> None:
    """R131: at rate 1.0 every load gets an injection of a configured kind at
    the load's chunk (the positive control of the decision test above).
    Bug this fails: a decide() that never injects."""
    for kinds in (("host_bit_flip",), ("host_other_block",)):
        injector = HostFaultInjector(HostFaultConfig(1.0, kinds), first_worker=True)
        for i in range(20):
            decision = injector.decide(f"r{i}", 3, 0, 8)
            assert decision is not None and decision.kind == kinds[0]
            assert decision.chunk_id == 3


@pytest.mark.parametrize("kind", ["host_bit_flip", "host_other_block"])
def test_R131_host_faults_change_the_host_copy(kind: str) -> None:
    """A bit flip changes exactly one bit of the chosen sub-block; another
    block's bytes replace the chunk with the source chunk's."""
    torch.manual_seed(0)
    host = [torch.randint(0, 255, (8, 64), dtype=torch.uint8) for _ in range(2)]
    before = [t.clone() for t in host]
    injector = HostFaultInjector(HostFaultConfig(1.0, (kind,)), first_worker=True)
    injection = injector.corrupt("r", 3, 1, 2, host)
    assert injection is not None and injection.kind == kind
    if kind == "host_bit_flip":
        diff = (host[0] ^ before[0]).numpy()
        assert np.count_nonzero(diff) == 1 and np.flatnonzero(diff)[0] // 64 == 3
        assert np.flatnonzero(diff)[0] % 64 >= 32  # sub-block 1 of 2
        assert torch.equal(host[1], before[1])
    else:
        source = injection.source_chunk_id
        assert source is not None and source != 3
        for t, b in zip(host, before):
            assert torch.equal(t[3], b[source])


# ----------------------------------------------------------------------
# The real Scheduler and OffloadingConnector
# ----------------------------------------------------------------------


def offload_side(multi: bool = False, **kw: Any) -> SideConfig:
    if not multi:
        return SideConfig(
            num_blocks=24,
            connector="OffloadingConnector",
            connector_extra=dict(OFFLOAD_EXTRA),
            **kw,
        )
    return SideConfig(
        num_blocks=24,
        connector="MultiConnector",
        connector_extra={
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": dict(OFFLOAD_EXTRA),
                },
            ]
        },
        **kw,
    )


def test_R118_store_runs_carry_the_request_hashes(model_dir: str) -> None:
    """Each store job's runs: its GPU blocks and the request's block hashes
    at their positions. Bug caught: hashes off by one position."""
    engine = OffloadSimEngine(model_dir, offload_side(), "runs")
    prompt = list(range(100, 100 + 4 * BS + 1))
    request = make_request("a", prompt, max_tokens=1, block_size=BS)
    engine.add(request)
    output = engine.step()
    meta = offload_metadata(output.kv_connector_metadata)
    runs = meta.kv_checksum_store_runs
    assert set(runs) == set(meta.store_jobs)
    for job_id, job in meta.store_jobs.items():
        ((group, start, ids, hashes),) = runs[job_id]
        assert group == 0 and ids == job.src_spec.block_ids.tolist()
        assert hashes == list(request.block_hashes[start : start + len(ids)])


def test_R139_offload_loads_verified_end_to_end(model_dir: str) -> None:
    """Loads back from host memory are all verified: entries saved with the
    store, restored at the load's GPU blocks. Bugs caught (each tried): no
    entry restore on load (every load a mismatch); hash runs shifted by one
    position (mismatch); host source not declared (loads never checked)."""
    engine = OffloadSimEngine(model_dir, offload_side(), "e2e")
    run_shared_prefixes(engine, 30)
    assert engine.num_loads >= 20
    assert_every_load_verified(engine)


def test_R139_without_entries_every_load_mismatches(model_dir: str) -> None:
    """The control: the same run without restoring entries on load (the
    block table keeps whatever the GPU block held before) makes loads fail,
    so the end-to-end test can fail."""
    engine = OffloadSimEngine(model_dir, offload_side(), "noentries")
    for side in engine.sides:
        assert side is not None
        side.entries.restore = lambda *args: None  # type: ignore[method-assign]
    run_shared_prefixes(engine, 18)
    counts = verdicts(engine)
    assert engine.num_loads > 0 and counts.get("mismatch", 0) > 0, counts


@pytest.mark.parametrize("after_forward", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("kind", ["host_bit_flip", "host_other_block"])
def test_R121_host_fault_is_caught_and_the_copy_dropped(
    model_dir: str, kind: str, after_forward: bool
) -> None:
    """A corrupted host copy: the load mismatches, fail-closed fails it, the
    bad copies leave the CPU tier (no later request loads them) and the
    request is recomputed; also with loads started after the forward
    through the real hooks (Model Runner V2). Bug caught: on_kv_checksum_
    failure not dropping (the next request of the prefix loads the bad copy
    again)."""
    faults = {"rate": 1.0, "kinds": [kind]}
    side = offload_side(fail_closed=True, policy="recompute")
    side.connector_extra = {**OFFLOAD_EXTRA, HOST_FAULT_KEY: faults}
    engine = OffloadSimEngine(
        model_dir,
        side,
        f"fault-{kind}-{after_forward}",
        hooks=after_forward,
        after_forward=after_forward,
    )
    run_shared_prefixes(engine, 12)
    counts = verdicts(engine)
    offload = engine.offload.__dict__["_kv_checksum_offload"]
    assert counts.get("mismatch", 0) > 0, counts
    assert counts.get("verified", 0) == 0, counts
    assert offload.dropper.dropped >= counts["mismatch"]
    assert not offload.dropper.pending
    for req_id, final in engine.final.items():
        assert final.finish_reason is not None, req_id


def test_R121_a_dropped_copy_is_not_loaded_again(model_dir: str) -> None:
    """After a failed check the bad host copy is gone: the recomputed
    request offloads a good one, and the next request of the same prefix
    loads that and verifies. Bug caught (tried): on_kv_checksum_failure not
    dropping the copy (vLLM then keeps the bad chunk, skips re-storing the
    key, and the next load mismatches again)."""
    faults = {"rate": 1.0, "kinds": ["host_other_block"]}
    side = offload_side(fail_closed=True, policy="recompute")
    side.connector_extra = {**OFFLOAD_EXTRA, HOST_FAULT_KEY: faults}
    engine = OffloadSimEngine(model_dir, side, "dropped")
    prompts = run_shared_prefixes(engine, 7)  # request 6 reloads prefix 0
    assert verdicts(engine) == {"mismatch": 1}
    offload = engine.offload.__dict__["_kv_checksum_offload"]
    assert offload.dropper.dropped > 0
    reload_after_drop(engine, prompts, BS)


def test_R1_checksums_off_nothing_attached(model_dir: str) -> None:
    """Checksums off: no state on the connector, no runs on the metadata,
    vLLM's manager lookup untouched."""
    engine = OffloadSimEngine(model_dir, offload_side(enabled=False), "off")
    manager = engine.offload.connector_scheduler.manager
    assert "lookup" not in manager.__dict__
    assert "_kv_checksum_offload" not in engine.offload.__dict__
    run_shared_prefixes(engine, 8)
    for output in engine.history:
        meta = offload_metadata(output.kv_connector_metadata)
        assert meta is None or not hasattr(meta, "kv_checksum_store_runs")
    assert engine.checksums is None
    assert engine.offload.get_kv_checksum_sources(None) == set()


def test_R139_multi_connector_offload_loads_verified(model_dir: str) -> None:
    """MultiConnector(NixlConnector, OffloadingConnector): offload loads are
    checked through the Offloading child (host source) and verified."""
    engine = OffloadSimEngine(model_dir, offload_side(multi=True), "multi")
    run_shared_prefixes(engine, 18)
    assert engine.num_loads > 0
    assert_every_load_verified(engine)


def test_R139_multi_connector_pd_load_takes_the_nixl_path(model_dir: str) -> None:
    """Under the same MultiConnector a P/D request (do_remote_prefill) is a
    P/D receive with the NIXL kv_transfer_params carrier, not an offload
    load: each load is verified by its own path."""
    from tests.v1.kv_connector.unit.kv_checksum_helpers import (
        consumer_kv_transfer_params,
    )
    from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
        KVChecksumCarrier,
    )

    engine = OffloadSimEngine(model_dir, offload_side(multi=True), "multi-pd")
    prompt = list(range(100, 100 + 3 * BS + 1))
    params = consumer_kv_transfer_params(
        "remote-a", remote_block_ids=[1, 2, 3], remote_engine_id="p0"
    )
    engine.add(
        make_request(
            "pd", prompt, max_tokens=1, kv_transfer_params=params, block_size=BS
        )
    )
    engine.scheduler.schedule()
    kcs = engine.checksums
    assert "pd" in kcs.consumer._recvs and "pd" not in kcs.offload.pending
    assert kcs.consumer._recvs["pd"].carrier == KVChecksumCarrier.KV_TRANSFER_PARAMS
    request = engine.scheduler.requests["pd"]
    assert engine.scheduler.connector.get_kv_checksum_sources(request) == set()


def bare_offloading_connector(calls: list[str]) -> tuple[Any, Any]:
    """vLLM's OffloadingConnector without __init__: its worker records calls
    into `calls`; its metadata has one store job, also to flush."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    connector = object.__new__(OffloadingConnector)
    connector.connector_worker = CallRecorder(calls, "vllm")
    meta = OffloadingConnectorMetadata(
        load_jobs={},
        store_jobs={7: TransferJob("r", Spec([1]), Spec([2]))},
        jobs_to_flush={7},
    )
    connector._connector_metadata = meta
    return connector, meta


@pytest.mark.parametrize("enabled", [False, True])
def test_R1_R118_worker_hooks_on_the_real_connector_class(enabled: bool) -> None:
    """The worker-side wrappers of OffloadingConnector (vLLM's class): with no
    checksum state an exact pass-through to the original (R1); with it, the
    entries move before the original submits loads, and this step's (and
    flushed) stores save theirs (R118). Bug caught: saving flushed stores
    after the original popped them from the metadata."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    calls: list[str] = []
    connector, meta = bare_offloading_connector(calls)
    if enabled:
        connector._kv_checksum_offload_worker = CallRecorder(calls, "side")
    before = dict(connector.__dict__)
    OffloadingConnector.handle_preemptions(connector, meta)
    OffloadingConnector.start_load_kv(connector, None)
    OffloadingConnector.wait_for_save(connector)
    vllm_calls = [
        "vllm.handle_preemptions",
        "vllm.start_kv_transfers",
        "vllm.prepare_store_kv",
    ]
    if not enabled:
        assert calls == vllm_calls
    else:
        assert calls == [
            "side.save_stores",
            vllm_calls[0],
            "side.start_loads",
            vllm_calls[1],
            "side.save_step_stores",
            vllm_calls[2],
        ]
    assert connector.__dict__ == before


@pytest.mark.kv_checksum_capability("plugin")
def test_R121_manager_lookup_hides_bad_copies(model_dir: str) -> None:
    """While a bad copy waits for removal, an instance wrapper on vLLM's
    CPUOffloadingManager.lookup answers MISS for it and the original for
    other keys; before and after, lookups are vLLM's own method. Bugs caught:
    a bad copy its load still holds hit by the next request; the wrapper left
    on for good (issue 30: one more Python call per block of every lookup)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    engine = OffloadSimEngine(model_dir, offload_side(), "lookup")
    run_shared_prefixes(engine, 1)
    offload = engine.offload.__dict__["_kv_checksum_offload"]
    manager = engine.offload.connector_scheduler.manager
    ctx = ReqContext(req_id="x", kv_transfer_params=None)
    key, other = list(manager._policy.chunks)[:2]
    assert "lookup" not in manager.__dict__
    assert manager.lookup.__func__ is CPUOffloadingManager.lookup
    assert manager.lookup(key, ctx) == LookupResult.HIT
    offload.dropper.add([key])
    assert manager.lookup(key, ctx) == LookupResult.MISS
    assert manager.lookup(other, ctx) == LookupResult.HIT
    offload.dropper.add([other])
    # A stand-in removal: `other` still held by a load, `key` no longer
    # pending (the stand-in leaves the chunk, so vLLM's lookup still hits it).
    offload.dropper.drop_ready(lambda k: False if k == other else None)
    assert manager.lookup(other, ctx) == LookupResult.MISS
    assert manager.lookup(key, ctx) == LookupResult.HIT
    offload.dropper.drop_ready(lambda k: None)
    assert "lookup" not in manager.__dict__
    assert manager.lookup(other, ctx) == LookupResult.HIT


@pytest.mark.kv_checksum_capability("plugin")
def test_R142_manager_lookup_wrapper_imports_nothing_per_call(model_dir: str) -> None:
    """R142: vLLM calls the manager's lookup once per block of every request
    it schedules (128 calls for a 2K-token prefix): the wrapper runs no import
    statement per call (about 1.7 us each, 8x the original lookup) and still
    answers as vLLM's for every key. Fails on an import inside the wrapper."""
    import builtins

    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    engine = OffloadSimEngine(model_dir, offload_side(), "lookup-imports")
    run_shared_prefixes(engine, 1)
    manager = engine.offload.connector_scheduler.manager
    ctx = ReqContext(req_id="x", kv_transfer_params=None)
    stored = list(manager._policy.chunks)
    # A bad copy of another key waits for removal: the wrapper is on.
    engine.offload.__dict__["_kv_checksum_offload"].dropper.add([b"bad" * 12])
    assert "lookup" in manager.__dict__
    keys = stored + [bytes(36 + i) for i in range(128)]
    imports: list[str] = []
    real_import = builtins.__import__

    def counting_import(name: str, *args: Any, **kw: Any) -> Any:
        imports.append(name)
        return real_import(name, *args, **kw)

    builtins.__import__ = counting_import
    try:
        answers = [manager.lookup(key, ctx) for key in keys]
    finally:
        builtins.__import__ = real_import
    assert imports == []
    assert answers == [LookupResult.HIT] * len(stored) + [LookupResult.MISS] * 128


def test_R117_worker_registration_skips_other_backends() -> None:
    """register_kv_checksum_worker on vLLM's OffloadingConnector class: a
    backend other than the CPU one gets no entry table (its loads are not
    declared either), and nothing is registered with the checksum worker."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    calls: list[str] = []
    connector = object.__new__(OffloadingConnector)
    connector.connector_worker = type("W", (), {"spec": object()})()
    OffloadingConnector.register_kv_checksum_worker(connector, CallRecorder(calls, "w"))
    assert "_kv_checksum_offload_worker" not in connector.__dict__
    assert calls == []


class _FailingSide:
    """A worker side whose every call raises; its checksum worker records."""

    def __init__(self, calls: list[str]) -> None:
        self.checksum_worker = CallRecorder(calls, "worker")

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kw: Any) -> None:
            raise RuntimeError(f"side.{name} failed")

        return fail


@pytest.mark.parametrize(
    "hook", ["handle_preemptions", "start_load_kv", "wait_for_save"]
)
def test_R134_worker_side_error_stops_stored_entries(hook: str) -> None:
    """R134 on vLLM's OffloadingConnector: an error in the worker side's
    entry moves disables it, vLLM's method still runs, and the checksum
    worker stops comparing loads with stored entries (its block table is no
    longer kept, so no host load is compared with stale entries; the scheduler
    is told to stop checking the tier: see the fail-closed test below).

    Bug this fails: disabling only the connector's side (every later host
    load then mismatches, and good host copies are dropped)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    register_plugin()
    calls: list[str] = []
    connector, meta = bare_offloading_connector(calls)
    connector._kv_checksum_offload_worker = _FailingSide(calls)
    args = {"handle_preemptions": (meta,), "start_load_kv": (None,)}.get(hook, ())
    getattr(OffloadingConnector, hook)(connector, *args)
    assert connector._kv_checksum_offload_worker is None
    assert calls[0] == "worker.stop_stored_entries"
    assert calls[1].startswith("vllm.")


def offload_tier_off_logs(caplog: pytest.LogCaptureFixture) -> list[Any]:
    return [r for r in caplog.records if "offload tier's checksums are off" in r.msg]


@pytest.mark.parametrize(
    "multi, policy", [(False, "fail"), (False, "recompute"), (True, "recompute")]
)
def test_R134_offload_side_error_leaves_fail_closed_loads_running(
    model_dir: str, multi: bool, policy: str, vllm_caplog: pytest.LogCaptureFixture
) -> None:
    """R134, R139 (issue 32): TP rank 0's offload worker side raises inside
    the real start_load_kv hook (fail-closed, TP 2). Its output tells the
    scheduler, which stops checking host loads: the later fault-free loads
    finish normally (none failed, none recomputed: the same tokens as an
    untouched control engine), with no verdict; one error log and
    `disabled_workers` count it. Only the offload tier goes off: P/D loads
    under MultiConnector are still registered.

    Bug this fails (the guard before issue 32, checked by reverting): the
    side only stops its stored entries and the scheduler keeps registering
    host loads; R120 then compares only the other rank's entries and counts
    each load verified (6 more "verified" here), vouching for rank 0's KV
    that nothing checked, with no signal to the operator. A scheduler that
    kept expecting rank 0's entries would instead fail every load
    fail-closed (the tokens and finish checks)."""
    side = offload_side(multi, tp=2, fail_closed=True, policy=policy)
    engine = check_side_error_turns_off_the_tier(
        lambda name: OffloadSimEngine(model_dir, side, name, hooks=True),
        "_kv_checksum_offload_worker",
    )
    kcs = engine.checksums
    assert len(offload_tier_off_logs(vllm_caplog)) == 1
    if multi:
        from tests.v1.kv_connector.unit.kv_checksum_helpers import (
            consumer_kv_transfer_params,
        )

        params = consumer_kv_transfer_params(
            "remote-a", remote_block_ids=[1, 2, 3], remote_engine_id="p0"
        )
        prompt = list(range(100, 100 + 3 * BS + 1))
        engine.add(
            make_request(
                "pd", prompt, max_tokens=1, kv_transfer_params=params, block_size=BS
            )
        )
        engine.scheduler.schedule()
        assert "pd" in kcs.consumer._recvs


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted"])
def test_R134_offload_side_error_drops_the_loads_in_flight(
    model_dir: str, corrupt: bool, vllm_caplog: pytest.LogCaptureFixture
) -> None:
    """R134, R139, R141: TP rank 0's offload worker side raises inside the
    real start_load_kv hook of the step that starts a host load (fail-closed,
    policy "fail"). The load was registered in that step's schedule; the
    tier-off record in the step's output drops it: no verdict, the request
    neither failed nor recomputed, the connector not told of a failure (no
    host copy dropped), no state kept, and the error line counts one load in
    flight. `corrupted`: the host copy of rank 1 is another chunk's
    (host_other_block), and the load is still not judged, as with checksums
    off (the guide's "offload tier's checksums are off" line).

    Bug caught: switching the tier off keeps the pending loads
    (`offload/loads.py` `stop_sources` without `pending.clear()`): the load
    is then judged without rank 0's entries, counted "verified" on rank 1's
    alone (`clean`), or failed fail-closed on them (`corrupted`)."""
    from vllm.v1.engine import FinishReason

    side = offload_side(tp=2, fail_closed=True, policy="fail")
    if corrupt:
        faults = {"rate": 1.0, "kinds": ["host_other_block"]}
        side.connector_extra = {**OFFLOAD_EXTRA, HOST_FAULT_KEY: faults}
    engine = OffloadSimEngine(model_dir, side, f"in-flight-{corrupt}", hooks=True)
    prompts = run_shared_prefixes(engine, 6)  # six prefixes stored, none loaded
    assert engine.num_loads == 0
    kcs = engine.checksums
    rank0 = engine.sides[0]
    assert rank0 is not None
    start_loads = rank0.start_loads
    in_flight: list[str] = []

    def broken(metadata: Any, after_forward: bool = False) -> None:
        if metadata.load_jobs:  # the step that starts the host load
            in_flight.extend(kcs.offload.pending)
            raise RuntimeError("injected into the offload worker side")
        start_loads(metadata, after_forward)

    rank0.start_loads = broken  # type: ignore[method-assign]
    prompt = prompts[0][: 4 * BS] + [7] * (BS + 1)  # prefix 0 from host memory
    engine.add(make_request("load", prompt, max_tokens=2, block_size=BS))
    final = engine.run("load")
    assert in_flight == ["load"] and engine.num_loads == 1
    assert final.finish_reason == FinishReason.LENGTH
    assert engine.scheduled_tokens("load") < len(prompt)  # loaded, not recomputed
    assert verdicts(engine) == {}
    offload = engine.offload.__dict__["_kv_checksum_offload"]
    assert offload.dropper.dropped == 0
    assert kcs.offload.off_sources == {"host"}
    assert "load" not in kcs.tracked_request_ids()
    (line,) = offload_tier_off_logs(vllm_caplog)
    assert "1 offload loads in flight dropped unverified" in line.getMessage()


@pytest.mark.parametrize("enabled", [False, True])
def test_R119_load_sources_read_once_per_load_with_stats(
    model_dir: str, enabled: bool
) -> None:
    """R119, issue 30 (host work per load): with vLLM's prefix-cache stats on
    (log_stats, the `vllm serve` default), the connector answers a starting
    host load's sources once per load, for vLLM's stats, with checksums off
    and on alike: the checksum scheduler reuses that answer, every load still
    verifies, and no answer is kept past its step. Bugs caught (tried): the
    checksum scheduler asking the connector again (two answers per load), and
    the kept answers never cleared."""
    engine = OffloadSimEngine(
        model_dir, offload_side(enabled=enabled, log_stats=True), f"src-{enabled}"
    )
    inner = engine.offload.connector_scheduler
    answer = inner.get_external_cache_hit_sources
    asked: list[str] = []

    def counting(request: Any, num_external_tokens: int) -> Any:
        asked.append(request.request_id)
        return answer(request, num_external_tokens)

    inner.get_external_cache_hit_sources = counting
    # With log_stats, make_stats drains the verdict counts every step.
    loads: Counter[str] = Counter()
    if enabled:
        stats = engine.checksums.stats
        drain = stats.take

        def take() -> Any:
            taken = drain()
            loads.update(taken.loads)
            return taken

        stats.take = take  # type: ignore[method-assign]
    run_shared_prefixes(engine, 18)
    assert engine.num_loads >= 10
    assert len(asked) == engine.num_loads
    if enabled:
        loads.update(engine.checksums.stats.loads)
        assert loads == {"verified": engine.num_loads}
        # An answer no load takes (a load not checked) leaves with its step.
        kept = engine.checksums.hit_sources.answers
        engine.checksums.note_hit_sources(SimpleNamespace(request_id="other"), 0, [])
        assert list(kept) == [("other", 0)]
        engine.step()
        assert kept == {}
