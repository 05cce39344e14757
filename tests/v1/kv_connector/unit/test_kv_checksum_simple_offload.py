# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checksums on vLLM 0.33.0's SimpleCPUOffloadConnector (R139, R116-R121, R131).

The scheduler side is vLLM's real Scheduler and SimpleCPUOffloadConnector
(eager and lazy mode); the worker side is the plugin's
`SimpleOffloadWorkerSide` over real checksum workers, with the DMA copies of
vLLM's SimpleCPUOffloadWorker simulated on CPU (`kv_checksum_offload_sim`):
they need CUDA, so the real worker runs on the GPU only
(examples/offload/kv_checksum_offload_gpu.py --connector simple).
"""

from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    empty_scheduler_output,
    make_request,
)
from tests.v1.kv_connector.unit.kv_checksum_offload_sim import (
    CallRecorder,
    SimpleOffloadSimEngine,
    assert_every_load_verified,
    check_side_error_turns_off_the_tier,
    loads_beside_stores,
    reload_after_drop,
    run_shared_prefixes,
    simple_offload_metadata,
    spy_entry_moves,
    verdicts,
)
from tests.v1.kv_connector.unit.kv_checksum_pd import SideConfig
from vllm.distributed.kv_transfer.kv_checksum import wiring
from vllm.distributed.kv_transfer.kv_checksum.offload.held_calls import HeldCalls
from vllm.distributed.kv_transfer.kv_checksum.offload.host_faults import HOST_FAULT_KEY
from vllm.distributed.kv_transfer.kv_checksum.offload.simple_cpu_offload import (
    SimpleOffloadSchedulerSide,
    block_places,
    store_runs,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    simple_cpu_offload as wiring_simple,
)

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

BS = 16
SIMPLE_EXTRA = {"cpu_bytes_to_use": 1 << 22, "num_cpu_blocks": 64}


def key(hash_byte: int, group: int) -> bytes:
    """A block cache key: a 32-byte hash and the 4-byte big-endian group."""
    return bytes([hash_byte]) * 32 + group.to_bytes(4, "big")


def test_R117_block_places_from_cache_keys() -> None:
    """Position = covered tokens / block size - 1 of the block's group; a
    block not cached, or cached under a hash ending inside it, has no place.
    Bug caught (tried): position = tokens // size (one past the block), so
    every entry is tagged and weighted for the next position. A group id this
    worker does not know has no place either (never an IndexError)."""
    keys = [
        (key(1, 0), 16),
        (key(2, 1), 96),
        (None, None),
        (key(3, 0), 40),
        (key(4, 0), 48),
        (key(5, 7), 32),
    ]
    places = block_places(keys, [16, 32])
    assert places.groups.tolist() == [0, 1, -1, 0, 0, 7]
    assert places.positions.tolist() == [0, 2, -1, -1, 2, -1]
    assert places.hashes == [
        bytes([1]) * 32,
        bytes([2]) * 32,
        b"",
        b"",
        bytes([4]) * 32,
        b"",
    ]


def _reference_place(
    cache_key: bytes | None, covered: int | None, sizes: list[int]
) -> tuple[int, int, bytes]:
    """R117 for one block, from its definition: the group is the key's last
    4 bytes (big-endian), the position covered tokens / its group's block
    size - 1 when that divides, the hash the key less those 4 bytes."""
    if cache_key is None or not covered:
        return -1, -1, b""
    group = int.from_bytes(cache_key[-4:], "big")
    if group >= len(sizes) or covered % sizes[group]:
        return group, -1, b""
    return group, covered // sizes[group] - 1, cache_key[:-4]


@pytest.mark.parametrize("seed", range(12))
def test_R117_R142_block_places_of_a_prefill_store_match_the_definition(
    seed: int,
) -> None:
    """R117, R142: a prefill step's stores (hundreds of blocks, read with
    NumPy) get the places of the definition block by block, whatever their
    mix: partial blocks, unknown groups, uncached blocks, a key of another
    length, two keys whose odd lengths add up to two regular ones (those
    last three take the plain pass); and regular keys do take
    the NumPy path. Bugs caught (tried): the group read little-endian, a
    partial block keeping its hash, an unknown group's block placed by group
    0's size, a cached block with 0 covered tokens given a group, the NumPy
    path never taken (every prefill's stores read one by one), keys of
    mixed lengths read whole because their total matched."""
    from vllm.distributed.kv_transfer.kv_checksum.offload import (
        simple_cpu_offload as simple_offload,
    )

    rng = np.random.default_rng(seed)
    sizes = [16, 32, 64][: 1 + seed % 3]
    count = int(rng.integers(simple_offload.VECTOR_PLACES_FROM, 600))
    keys: list[tuple[bytes | None, int | None]] = []
    for _ in range(count):
        group = int(rng.choice([0, 0, 0, 1, 2, 5, 70000]))
        digest = rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
        size = sizes[group] if group < len(sizes) else 16
        covered = size * int(rng.integers(1, 300))
        if rng.random() < 0.05:
            covered += int(rng.integers(1, size))  # ends inside the block
        if rng.random() < 0.01:
            covered = 0
        keys.append((digest + group.to_bytes(4, "big"), covered))
    if seed % 4 == 1:
        keys[int(rng.integers(count))] = (None, None)
    if seed % 4 == 2:
        keys[int(rng.integers(count))] = (bytes(20) + bytes(4), 16)
    if seed % 4 == 3:  # two odd lengths that add up to two regular keys
        keys[1] = (bytes(2) + keys[1][0], keys[1][1])
        keys[-1] = (keys[-1][0][2:], keys[-1][1])
    expected = [_reference_place(k, n, sizes) for k, n in keys]
    places = block_places(keys, sizes)
    assert places.groups.tolist() == [g for g, _, _ in expected]
    assert places.positions.tolist() == [p for _, p, _ in expected]
    assert places.hashes == [h for _, _, h in expected]
    assert places.groups.dtype == places.positions.dtype == np.int64
    joined = simple_offload._places_from_joined_keys(keys, sizes)
    assert (joined is None) == (seed % 4 != 0)


def test_R117_block_keys_read_vllm_blocks_as_their_properties_do() -> None:
    """The wiring reads a block's cache key and covered tokens from vLLM's
    own KVCacheBlock fields in C (issue 30); on real blocks of a real
    BlockPool, cached, cached under a partial hash and not cached, they
    equal what the blocks' public properties return, in the order asked.
    Bug caught (tried): the fields read in the other order."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=BS)
    pool.blocks[1].set_block_hash(key(7, 0), 2 * BS)
    pool.blocks[4].set_block_hash(key(9, 1), BS + 3)  # a partial hash
    ids = [4, 0, 1, 5]
    expected = [
        (pool.blocks[i].block_hash, pool.blocks[i].block_hash_num_tokens) for i in ids
    ]
    assert wiring_simple.block_keys(pool, ids) == expected
    assert expected[0] == (key(9, 1), BS + 3) and expected[1] == (None, None)


def test_R118_store_runs_keep_each_blocks_place() -> None:
    """Each stored block keeps its own group, position and hash whatever the
    store order (lazy mode stores a request's tail first), in store order:
    with every block placed, the ids are the store's own, so its copy to
    host slots rides in the entry write as it is (issue 30). Bugs caught
    (tried): consecutive positions assumed from the first stored block
    (eager mode's order; lazy mode's tail-first order breaks it); the
    blocks sorted by place (the copy no longer lines up)."""
    keys = [
        (key(9, 0), 64),  # position 3
        (key(8, 0), 48),  # 2
        (key(7, 0), 32),  # 1
        (key(5, 1), 16),  # group 1, position 0
        (key(6, 0), 96),  # 5
    ]
    blocks = store_runs([10, 11, 12, 13, 14], block_places(keys, [16, 16]))
    assert blocks.groups.tolist() == [0, 0, 0, 1, 0]
    assert blocks.positions.tolist() == [3, 2, 1, 0, 5]
    assert blocks.block_ids.tolist() == [10, 11, 12, 13, 14]
    assert blocks.hashes.tolist() == [bytes([b]) * 32 for b in (9, 8, 7, 5, 6)]
    assert list(blocks)[:2] == [
        (0, 3, [10], [bytes([9]) * 32]),
        (0, 2, [11], [bytes([8]) * 32]),
    ]


def test_R142_store_blocks_are_parallel_arrays() -> None:
    """R142, R118: the stored blocks go to the workers as parallel arrays
    (group, position, GPU block id, hash) of the placed blocks, in store
    order, each block with its own id and hash; hand-made blocks out of
    order, two groups, gaps and unplaced blocks. Bug caught (tried): block
    ids and hashes taken from every stored block while groups and positions
    are of the placed ones (each entry written for another block's place)."""
    keys = [
        (key(4, 1), 64),  # group 1 (size 32), position 1
        (None, None),
        (key(3, 0), 80),  # group 0 (size 16), position 4
        (key(2, 0), 16),  # 0
        (key(6, 0), 40),  # partial: no place
        (key(1, 1), 32),  # group 1, position 0
        (key(5, 0), 32),  # 1
    ]
    blocks = store_runs([30, 31, 32, 33, 34, 35, 36], block_places(keys, [16, 32]))
    assert blocks.groups.tolist() == [1, 0, 0, 1, 0]
    assert blocks.positions.tolist() == [1, 4, 0, 0, 1]
    assert blocks.block_ids.tolist() == [30, 32, 33, 35, 36]
    assert blocks.hashes.tolist() == [bytes([b]) * 32 for b in (4, 3, 2, 1, 5)]
    assert list(blocks) == [
        (1, 1, [30], [bytes([4]) * 32]),
        (0, 4, [32], [bytes([3]) * 32]),
        (0, 0, [33], [bytes([2]) * 32]),
        (1, 0, [35], [bytes([1]) * 32]),
        (0, 1, [36], [bytes([5]) * 32]),
    ]
    empty = store_runs([1], block_places([(None, None)], [16]))
    assert not len(empty.block_ids) and list(empty) == []


def test_R119_a_load_of_a_copy_without_entry_is_not_declared() -> None:
    """A CPU block stored from a block with no place carries no entry: a load
    reading it is not checked (never a false mismatch); storing the block
    again with a place declares its loads again. Bug caught (tried):
    declaring every load (a stale host slot compared as if it were the
    block's entry)."""
    gpu = {1: (key(1, 0), 16), 2: (key(2, 0), 40)}
    loads = {"a": [7], "b": [8]}
    side = SimpleOffloadSchedulerSide(
        [16],
        lambda ids: [gpu[i] for i in ids],
        lambda ids: [(None, None) for _ in ids],
        loads.get,
        lambda cpu_id: None,
    )
    meta = type("M", (), {})()
    meta.store_gpu_blocks, meta.store_cpu_blocks = [1, 2], [7, 8]
    side.attach(meta)
    assert meta.kv_checksum_store_runs == [(0, 0, [1], [bytes([1]) * 32])]
    request = type("R", (), {"request_id": "a"})()
    assert side.sources(request) == {"host"}
    request.request_id = "b"
    assert side.sources(request) == set()
    gpu[2] = (key(2, 0), 32)
    side.attach(meta)
    assert side.sources(request) == {"host"} and not side.unentried


# ----------------------------------------------------------------------
# The real Scheduler and SimpleCPUOffloadConnector
# ----------------------------------------------------------------------


def simple_side(lazy: bool = False, multi: bool = False, **kw: Any) -> SideConfig:
    extra = {**SIMPLE_EXTRA, "lazy_offload": lazy}
    if not multi:
        return SideConfig(
            num_blocks=24,
            connector="SimpleCPUOffloadConnector",
            connector_extra=extra,
            **kw,
        )
    return SideConfig(
        num_blocks=24,
        connector="MultiConnector",
        connector_extra={
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {
                    "kv_connector": "SimpleCPUOffloadConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                },
            ]
        },
        **kw,
    )


def with_faults(side: SideConfig, kind: str) -> SideConfig:
    faults = {"rate": 1.0, "kinds": [kind]}
    side.connector_extra = {**(side.connector_extra or {}), HOST_FAULT_KEY: faults}
    return side


def scheduler_side(engine: SimpleOffloadSimEngine) -> Any:
    return engine.offload.__dict__["_kv_checksum_simple_offload"]


def assert_no_request_state(engine: SimpleOffloadSimEngine) -> None:
    """Nothing per request is left once every request finished."""
    side = scheduler_side(engine)
    assert not side.dropper.pending and not side.unentried
    assert not engine.checksums.offload.pending
    manager = engine.offload.scheduler_manager
    assert not manager._reqs_to_load and not manager._reqs_to_store


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_R139_simple_offload_loads_verified_end_to_end(
    model_dir: str, lazy: bool
) -> None:
    """Loads back from host memory are all verified, in eager mode and in
    lazy mode (which stores evicted cached GPU blocks, tail first); no
    per-request state is left. Bugs caught (each tried): no entry restore
    on load (mismatch); place position off by one (mismatch); consecutive
    positions assumed from a store's first block (lazy mismatches); host
    table indexed by GPU block id (mismatch); host source not declared
    (never checked)."""
    engine = SimpleOffloadSimEngine(model_dir, simple_side(lazy), f"e2e-{lazy}")
    run_shared_prefixes(engine, 24)
    assert engine.num_loads >= 12 and engine.num_stored_blocks > 0
    assert_every_load_verified(engine)
    assert_no_request_state(engine)


def count_uploads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every pinned upload of the checksum worker's device work (the
    launcher's, the block table's own saves and moves, the host entry
    table's restores): one counter, bumped per upload."""
    from vllm.distributed.kv_transfer.kv_checksum.engine import (
        block_table,
        launches,
    )
    from vllm.distributed.kv_transfer.kv_checksum.offload import offloading

    count = [0]
    for module, name in (
        (launches, "upload_segments"),
        (block_table, "upload_segments"),
        (offloading, "host_to_device"),
    ):
        real = getattr(module, name)

        def counted(*args: Any, _real: Any = real, **kw: Any) -> Any:
            count[0] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(module, name, counted)
    return count


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_R118_entry_moves_ride_in_the_pass_while_copies_are_held(
    model_dir: str, lazy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, R118, R142. As Model Runner V2 runs it with the copy
    hand-offs held (the default), through the real connector hooks: start_load_kv and
    wait_for_save make no save and no restore of their own; the step's
    checksum pass makes every entry move, so a step uploads once per worker
    however many loads, stores and checks it has, and every load still
    verifies, in steps that load and store alike. Bugs caught (each tried):
    the launcher's restores left out (loads mismatch); its copies to slots
    made before the store's entry writes (loads mismatch); the worker's
    "nothing to checksum" return ignoring the queue (moves made a step late:
    loads mismatch); the restore still made alone (two uploads a step)."""
    engine = SimpleOffloadSimEngine(
        model_dir,
        simple_side(lazy),
        f"in-pass-{lazy}",
        hooks=True,
        after_forward=True,
        held=True,
    )
    moves = spy_entry_moves(engine, "restore_ids")
    uploads = count_uploads(monkeypatch)
    real_step = engine.step
    both = [0]

    def step() -> Any:
        before = uploads[0]
        output = real_step()
        assert uploads[0] - before <= len(engine.workers)
        meta = simple_offload_metadata(output.kv_connector_metadata)
        if meta is not None and meta.store_gpu_blocks and meta.load_cpu_blocks:
            both[0] += 1
        return output

    engine.step = step
    prompts = run_shared_prefixes(engine, 12)
    loads_beside_stores(engine, prompts, stagger=True, block_size=BS)
    assert moves == []
    assert engine.num_loads >= 9 and engine.num_stored_blocks > 0 and both[0] > 0
    assert_every_load_verified(engine)
    assert_no_request_state(engine)


def launches_with_delayed_stores(
    model_dir: str, lazy: bool, name: str
) -> tuple[SimpleOffloadSimEngine, int]:
    """A sim run with the moves in the pass and every store reported
    complete a step later (as vLLM's copy thread reports them), through the
    real hooks: shared prefixes, then loads beside stores. Returns the
    engine and worker 0's launches."""
    engine = SimpleOffloadSimEngine(
        model_dir,
        simple_side(lazy),
        name,
        hooks=True,
        after_forward=True,
        held=True,
        delay_stores=True,
    )
    launcher = engine.workers[0].checksum.launcher
    real_launch, launches = launcher.launch, [0]

    def launch(*args: Any, **kw: Any) -> Any:
        launches[0] += 1
        return real_launch(*args, **kw)

    launcher.launch = launch
    prompts = run_shared_prefixes(engine, 12)
    loads_beside_stores(engine, prompts, stagger=True, block_size=BS)
    engine.step()  # the last store reported complete
    return engine, launches[0]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_R118_store_entries_leave_in_their_step_when_stores_report_later(
    model_dir: str, lazy: bool
) -> None:
    """Issue 30, R118, R142. With the moves in the pass and every store
    reported complete a step later (as vLLM's copy thread reports them),
    every load verifies and each store's entries are made in its own step:
    the run launches at least once for every step that stored. Bug caught
    (tried): a store's rows and copies not due until something else is
    (left for a later launch)."""
    engine, launches = launches_with_delayed_stores(model_dir, lazy, f"later-{lazy}")
    assert engine.num_loads >= 9 and engine.num_stored_blocks > 0
    assert_every_load_verified(engine)
    assert_no_request_state(engine)
    storing_steps = sum(
        1
        for output in engine.history
        if (meta := simple_offload_metadata(output.kv_connector_metadata))
        and meta.store_gpu_blocks
    )
    assert launches >= storing_steps > 0


def test_R142_queued_moves_are_taken_together() -> None:
    """Issue 30: `take` returns every queued move (restores, copies, and one
    group's rows of several saves joined into one write, in queue order) and
    empties the queue; empty moves are left out. Bugs caught (tried): a
    restore not made with the step's moves (a load checked against a stale
    entry); a second save's rows dropped when joined."""
    from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
        EntryCopy,
        EntryRestore,
    )
    from vllm.distributed.kv_transfer.kv_checksum.engine import entry_queue
    from vllm.distributed.kv_transfer.kv_checksum.engine.block_table import (
        EntryRows,
    )

    next_id = [0]

    def rows(n: int) -> EntryRows:
        """Rows of `n` blocks not named before (a launch joins them)."""
        ids = np.zeros((3, n), np.int64)
        ids[0] = np.arange(next_id[0], next_id[0] + n)
        next_id[0] += n
        return EntryRows(0, ids, np.zeros((3, n), np.int64))

    def copy(n: int) -> EntryCopy:
        ids = np.arange(n, dtype=np.int64)
        return EntryCopy(ids, ids, torch.zeros(1))

    queue = entry_queue.QueuedEntryMoves()
    assert not queue.due()
    queue.add([], copy(0), EntryRestore(np.array([]), np.array([]), torch.zeros(1)))
    assert not queue.due()  # empty moves queue nothing
    restore = EntryRestore(np.array([1]), np.array([2]), torch.zeros(1))
    queue.add([], None, restore)
    assert queue.due()  # a restore alone
    first, later = rows(3), rows(4)
    queue.add([first], copy(3), None)
    queue.add([later], copy(4), None)
    restores, copies, saves = queue.take()
    assert restores == [restore] and len(copies) == 2
    # One group: joined into one write, in queue order.
    assert len(saves) == 1
    written = saves[0].rows[0]
    assert written.tolist() == first.rows[0].tolist() + later.rows[0].tolist()
    assert not queue.due() and queue.take() == ([], [], [])


def test_R118_lazy_mode_stores_evicted_cached_blocks(model_dir: str) -> None:
    """Lazy mode stores GPU blocks that are cached and free (no request holds
    them any more), in free-queue order; every stored block's run names the
    block's own place, and some stores come tail first. Bug caught (tried):
    consecutive positions assumed from a store's first block, as eager
    stores are (the places of the tail-first stores come out wrong)."""
    engine = SimpleOffloadSimEngine(model_dir, simple_side(lazy=True), "lazy")
    stored: list[tuple[int, int, int]] = []

    def record(meta: Any) -> None:
        pool = engine.scheduler.kv_cache_manager.block_pool
        runs = getattr(meta, "kv_checksum_store_runs", [])
        places = {
            block: (group, start + i)
            for group, start, ids, _ in runs
            for i, block in enumerate(ids)
        }
        for block in meta.store_gpu_blocks:
            b = pool.blocks[block]
            assert b.block_hash is not None
            stored.append((block, *places[block]))
            assert places[block][1] == b.block_hash_num_tokens // BS - 1

    engine.tamper = record
    run_shared_prefixes(engine, 8)
    assert len(stored) >= 8
    assert any(p1 > p2 for (_, _, p1), (_, _, p2) in zip(stored, stored[1:]))


def test_R139_without_entries_every_load_mismatches(model_dir: str) -> None:
    """The control: no entry restore on load (the block table keeps whatever
    the GPU block held before) makes loads fail, so the end-to-end test can
    fail."""
    engine = SimpleOffloadSimEngine(model_dir, simple_side(), "noentries")
    for side in engine.sides:
        assert side is not None
        side.entries.restore_ids = lambda *args: None  # type: ignore[method-assign]
    run_shared_prefixes(engine, 12)
    counts = verdicts(engine)
    assert engine.num_loads > 0 and counts.get("mismatch", 0) > 0, counts


@pytest.mark.parametrize("after_forward", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("kind", ["host_bit_flip", "host_other_block"])
def test_R121_simple_host_fault_is_caught_and_the_copy_dropped(
    model_dir: str, kind: str, after_forward: bool
) -> None:
    """A corrupted host copy: the load mismatches, fail-closed recomputes the
    request, the bad CPU block leaves the CPU prefix cache; also with loads
    started after the forward through the real hooks (Model Runner V2).
    Bug caught (tried): on_kv_checksum_failure not dropping (dropped stays
    0)."""
    side = with_faults(simple_side(fail_closed=True, policy="recompute"), kind)
    engine = SimpleOffloadSimEngine(
        model_dir,
        side,
        f"fault-{kind}-{after_forward}",
        hooks=after_forward,
        after_forward=after_forward,
    )
    run_shared_prefixes(engine, 12)
    counts = verdicts(engine)
    dropper = scheduler_side(engine).dropper
    assert counts.get("mismatch", 0) > 0 and counts.get("verified", 0) == 0, counts
    assert dropper.dropped >= counts["mismatch"]
    for final in engine.final.values():
        assert final.finish_reason is not None
    assert_no_request_state(engine)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_R121_a_dropped_simple_copy_is_not_loaded_again(
    model_dir: str, lazy: bool
) -> None:
    """After a failed check the bad CPU block is gone: the recomputed request
    stores a good copy and the next request of the prefix loads that and
    verifies. Bug caught (tried): on_kv_checksum_failure not dropping (vLLM
    keeps the bad block cached, never re-stores the hash, and the next load
    mismatches again)."""
    side = with_faults(
        simple_side(lazy, fail_closed=True, policy="recompute"), "host_other_block"
    )
    engine = SimpleOffloadSimEngine(model_dir, side, f"dropped-{lazy}")
    prompts = run_shared_prefixes(engine, 7)  # request 6 reloads prefix 0
    assert verdicts(engine) == {"mismatch": 1}
    assert scheduler_side(engine).dropper.dropped > 0
    reload_after_drop(engine, prompts, BS)


@pytest.mark.parametrize("faults", [False, True], ids=["clean", "faults"])
def test_R131_one_load_event_of_several_requests(model_dir: str, faults: bool) -> None:
    """Requests loading in the same event (flat block lists, no request in
    them): clean, each verifies; with host faults, each request's own first
    block is corrupted, and exactly the requests named by the injections
    fail. Bug caught (tried): injecting at the event's first block for
    every request (one corrupted block, several requests blamed)."""
    side = simple_side(fail_closed=True, policy="recompute")
    if faults:
        side = with_faults(side, "host_other_block")
    engine = SimpleOffloadSimEngine(model_dir, side, f"batch-{faults}")
    prompts = run_shared_prefixes(engine, 6)  # fills the CPU tier
    failed: list[str] = []
    offload = scheduler_side(engine)
    original = offload.on_failure

    def on_failure(request: Any, mismatches: dict[int, list[int]]) -> None:
        failed.append(request.request_id)
        original(request, mismatches)

    offload.on_failure = on_failure
    events: list[list[str]] = []

    def record(meta: Any) -> None:
        if meta.load_cpu_blocks:
            events.append(list(meta.load_event_to_reqs[meta.load_event]))

    engine.tamper = record
    batch = [f"b{i}" for i in range(3)]
    for i, req_id in enumerate(batch):
        prompt = prompts[i][:-1] + [11, 11]
        engine.add(make_request(req_id, prompt, max_tokens=1, block_size=BS))
    for _ in range(40):
        if all(r in engine.final for r in batch):
            break
        engine.step()
    assert sorted(events[0]) == batch
    counts = verdicts(engine)
    if not faults:
        assert counts == {"verified": 3} and not failed
        return
    injected = [
        i.req_id for w in engine.sides if w is not None for i in w.injector.injections
    ]
    assert sorted(set(injected)) == batch and sorted(failed) == batch
    assert counts == {"mismatch": 3}
    assert engine.checksums.stats.mismatched_positions == 3


def test_R120_right_block_at_the_wrong_place_mismatches(model_dir: str) -> None:
    """A tier bug that loads another request's valid copy of the same position
    (a CPU block id mix-up) moves that copy's bytes and its own entry: same
    position weights, but the entry's tag names the other block's hash, so
    the load mismatches at that position and only that copy is dropped.
    Bug caught (tried): entries tagged without the block hash (a bytes-only
    checksum, as storage-tier CRCs are): the mixed-up block would verify."""
    engine = SimpleOffloadSimEngine(model_dir, simple_side(), "wrong-place")
    prompts = run_shared_prefixes(engine, 6)
    pool = engine.offload.scheduler_manager.cpu_block_pool
    mixed: list[int] = []

    def mix_up(meta: Any) -> None:
        cpu = meta.load_cpu_blocks
        if not cpu or mixed:
            return
        asked = pool.blocks[cpu[0]]
        other = next(
            b.block_id
            for b in pool.blocks
            if b.block_hash is not None
            and b.block_hash != asked.block_hash
            and b.block_hash_num_tokens == asked.block_hash_num_tokens
        )
        mixed.append(other)
        cpu[0] = other

    engine.tamper = mix_up
    engine.add(make_request("w", prompts[0][:-1] + [7, 7], max_tokens=1, block_size=BS))
    engine.run("w")
    assert mixed
    assert verdicts(engine) == {"mismatch": 1}
    assert engine.checksums.stats.mismatched_positions == 1
    side = scheduler_side(engine)
    assert side.dropper.dropped == 1


def test_R1_simple_checksums_off_nothing_attached(model_dir: str) -> None:
    """Checksums off: no state on the connector, no runs on the metadata, no
    source declared. Bug caught (tried): get_kv_checksum_sources declaring
    the host source without checksum state."""
    engine = SimpleOffloadSimEngine(model_dir, simple_side(enabled=False), "off")
    run_shared_prefixes(engine, 8)
    assert engine.num_loads > 0
    assert "_kv_checksum_simple_offload" not in engine.offload.__dict__
    for output in engine.history:
        meta = simple_offload_metadata(output.kv_connector_metadata)
        assert meta is None or not hasattr(meta, "kv_checksum_store_runs")
    assert engine.checksums is None
    assert engine.offload.get_kv_checksum_sources(None) == set()


def test_R139_multi_connector_simple_offload_loads_verified(model_dir: str) -> None:
    """MultiConnector(NixlConnector, SimpleCPUOffloadConnector): host loads
    are checked through the SimpleCPU child and verified. Bug caught
    (tried): the Scheduler hook looking at the top connector only (the
    child gets no checksum state, its loads are never checked)."""
    engine = SimpleOffloadSimEngine(model_dir, simple_side(multi=True), "multi")
    run_shared_prefixes(engine, 12)
    assert engine.num_loads > 0
    assert_every_load_verified(engine)


@pytest.mark.parametrize("enabled", [False, True])
def test_R1_R118_simple_worker_hooks_on_the_real_class(enabled: bool) -> None:
    """The worker-side wrappers of SimpleCPUOffloadConnector (vLLM's class):
    with no checksum state an exact pass-through (R1); with it, entries move
    before the original submits the load and the store (R118). Bug caught
    (tried): entries saved after vLLM's wait_for_save (its store copy then
    waits on an event recorded before the entries were written)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
        SimpleCPUOffloadConnector,
    )
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    wiring.install()
    calls: list[str] = []
    connector = object.__new__(SimpleCPUOffloadConnector)
    connector.worker_handler = CallRecorder(calls, "vllm")  # type: ignore[assignment]
    connector._connector_metadata = SimpleCPUOffloadMetadata(
        load_event=0, load_gpu_blocks=[3], load_cpu_blocks=[4]
    )
    if enabled:
        connector._kv_checksum_simple_offload_worker = CallRecorder(calls, "side")
    before = dict(connector.__dict__)
    SimpleCPUOffloadConnector.start_load_kv(connector, None)
    SimpleCPUOffloadConnector.wait_for_save(connector)
    vllm_calls = ["vllm.start_load_kv", "vllm.wait_for_save"]
    if not enabled:
        assert calls == vllm_calls
    else:
        assert calls == [
            "side.start_loads",
            vllm_calls[0],
            "side.save_stores",
            vllm_calls[1],
        ]
    assert connector.__dict__ == before


@pytest.mark.parametrize(
    ("given", "sync", "speculative", "config", "expected"),
    [
        (False, False, False, True, False),  # no scheduler output (no forward)
        (True, False, False, True, True),  # V2, async loads: after the forward
        (True, True, False, True, False),  # sync loads: before the forward
        (True, False, True, True, False),  # a drafter's forward still to come
        (True, False, False, False, False),  # no config to tell
    ],
)
def test_R118_copies_held_only_after_the_whole_forward(
    given: bool, sync: bool, speculative: bool, config: bool, expected: bool
) -> None:
    """Issue 30, on vLLM's SimpleCPUOffloadConnector: start_load_kv holds the
    step's copy hand-offs, and has the worker side queue the loads' entry
    moves for the checksum pass, only when Model Runner V2 calls it after
    the forward (its scheduler output given, no sync loads) and no drafter
    forward follows; the original runs either way. Bugs caught (each
    tried): sync loads taken as after the forward (copies held and entries
    moved after a forward that has not run yet); the speculative config
    ignored."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
        SimpleCPUOffloadConnector,
    )

    wiring.install()
    told: list[bool] = []

    class Side:
        def start_loads(self, metadata: Any, in_pass: bool = False) -> None:
            told.append(in_pass)

    calls: list[str] = []
    connector = object.__new__(SimpleCPUOffloadConnector)
    connector.worker_handler = CallRecorder(calls, "vllm")  # type: ignore[assignment]
    connector._connector_metadata = object()  # type: ignore[assignment]
    connector._kv_checksum_simple_offload_worker = Side()
    held = HeldCalls(print)
    held.arm()
    connector._kv_checksum_held_copies = held
    if config:
        spec = object() if speculative else None
        connector._vllm_config = SimpleNamespace(speculative_config=spec)  # type: ignore[assignment]
    kwargs = {"scheduler_output": empty_scheduler_output(sync)} if given else {}
    SimpleCPUOffloadConnector.start_load_kv(connector, None, **kwargs)
    assert told == [expected] and held.holding == expected
    assert calls == ["vllm.start_load_kv"]


def test_R117_simple_worker_side_moves_entries_by_cpu_block() -> None:
    """A store copies the stored GPU blocks' entries to their CPU blocks'
    slots; a load writes them back at the load's GPU ids. Bug caught
    (tried): indexing the host table by GPU block id."""

    class Worker:
        def __init__(self) -> None:
            self.table = torch.arange(10, dtype=torch.int64) * 3 + 1

        def init_block_checksums(self, group_ids: Any) -> torch.Tensor:
            return self.table

        def save_block_checksums(
            self, runs: Any, copy: Any = None, restore: Any = None
        ) -> None:
            # The block table's contract: a restore first, entries copied to
            # the slots after the save (test_R118_a_save_copies_its_entries_
            # to_host_slots, test_R118_a_save_brings_a_loads_entries_back_...).
            if restore is not None:
                ids = torch.as_tensor(restore.block_ids)
                self.table[ids] = restore.source[torch.as_tensor(restore.slots)]
            if copy is not None:
                slots = torch.as_tensor(copy.slots)
                copy.dest[slots] = self.table[torch.as_tensor(copy.block_ids)]

    from vllm.distributed.kv_transfer.kv_checksum.offload.simple_cpu_offload import (
        SimpleOffloadWorkerSide,
    )

    worker = Worker()
    side = SimpleOffloadWorkerSide(worker, [0], num_cpu_blocks=6)
    meta = type("M", (), {})()
    meta.store_gpu_blocks, meta.store_cpu_blocks = [2, 5], [4, 0]
    side.save_stores(meta)
    before = worker.table.clone()
    worker.table.zero_()
    meta.load_gpu_blocks, meta.load_cpu_blocks = [7, 8], [0, 4]
    side.start_loads(meta)
    assert worker.table[[7, 8]].tolist() == before[[5, 2]].tolist()
    assert np.count_nonzero(worker.table.numpy()) == 2


def test_R121_dropped_copy_hidden_at_once_freed_after_its_load() -> None:
    """On vLLM's BlockPool, through the wiring's removal: a bad CPU block a
    load still holds leaves the prefix cache at once (no lookup hits it) and
    returns to the free pool, uncached, when the load releases it; another
    copy stays. Bug caught (tried): freeing the block at once, while the
    load still reads it (the pool could hand it to a store mid-copy)."""
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(8, enable_caching=True, hash_block_size=BS)
    blocks = pool.get_new_blocks(2)
    for i, block in enumerate(blocks):
        pool._insert_block_hash(key(i + 1, 0), block, num_tokens=BS)
    pool.touch(blocks[:1])  # the load's reference
    pool.free_blocks(blocks)  # the stores' references
    manager = SimpleNamespace(
        group_block_sizes=(BS,),
        cpu_block_pool=pool,
        _gpu_block_pool=pool,
        _reqs_to_load={
            "r": SimpleNamespace(
                transfer_meta=SimpleNamespace(cpu_block_ids=[blocks[0].block_id])
            )
        },
        _abandoned_reqs_to_load={},
    )
    side = wiring_simple._simple_offload_scheduler_side(manager)
    request = SimpleNamespace(request_id="r")
    side.on_failure(request, {0: [0]})
    assert side.dropper.dropped == 1 and not side.dropper.pending
    assert pool.cached_block_hash_to_block.get_one_block(key(1, 0)) is None
    assert pool.cached_block_hash_to_block.get_one_block(key(2, 0)) is blocks[1]
    assert blocks[0].ref_cnt == 1
    free = pool.get_num_free_blocks()
    pool.free_blocks(blocks[:1])  # the load completes
    assert pool.get_num_free_blocks() == free + 1 and blocks[0].block_hash is None


@pytest.mark.parametrize("disk", [False, True], ids=["cpu", "disk"])
def test_R117_simple_worker_registration(disk: bool) -> None:
    """register_kv_checksum_worker on vLLM's SimpleCPUOffloadConnector class:
    a CPU handler gets a host entry table of one slot per CPU block over the
    worker's block table (groups: the prefix-cacheable ones) and the host
    fault injector of its config; the disk backend (no CPU tensors) gets
    nothing. Bug caught: sizing the host table by GPU blocks (a CPU block id
    past the GPU count then fails every store)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
        SimpleCPUOffloadConnector,
    )

    wiring.install()
    registered: list[Any] = []

    class Worker:
        topology = SimpleNamespace(tp_rank=0, pp_rank=0)
        table = torch.zeros(8, dtype=torch.int64)

        def init_block_checksums(self, group_ids: Any) -> torch.Tensor:
            registered.append(tuple(group_ids))
            return self.table

    host = {"layer": torch.zeros((20, 4), dtype=torch.int8)}
    connector = object.__new__(SimpleCPUOffloadConnector)
    connector.worker_handler = SimpleNamespace(  # type: ignore[assignment]
        cpu_kv_caches=None if disk else host,
        num_cpu_blocks=20,
        kv_cache_config=SimpleNamespace(prefix_cacheable_group_ids=(0,)),
    )
    extra = {HOST_FAULT_KEY: {"rate": 1.0}}
    connector._vllm_config = SimpleNamespace(  # type: ignore[assignment]
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)
    )
    SimpleCPUOffloadConnector.register_kv_checksum_worker(connector, Worker())
    side = connector.__dict__.get("_kv_checksum_simple_offload_worker")
    if disk:
        assert side is None and registered == []
        return
    assert registered == [(0,)]
    assert side.entries.entries.shape == (20,)
    assert side.entries.block_table is Worker.table
    assert side.injector is not None and side.host_tensors() == [host["layer"]]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_R134_simple_offload_side_error_leaves_fail_closed_loads_running(
    model_dir: str, lazy: bool, vllm_caplog: pytest.LogCaptureFixture
) -> None:
    """R134, R139 (issue 32): TP rank 0's SimpleCPUOffloadConnector worker
    side raises inside the real start_load_kv hook (fail-closed, recompute,
    TP 2). Its output tells the scheduler, which stops checking host loads:
    the later fault-free loads finish normally without recompute (the same
    tokens as an untouched control engine) and without verdict; one error
    log and `disabled_workers` count it.

    Bug this fails (the guard before issue 32, checked by reverting): host
    loads still registered, counted verified on rank 1's entries alone
    while rank 0's KV goes unchecked, with no signal to the operator."""
    side = simple_side(lazy, tp=2, fail_closed=True, policy="recompute")
    check_side_error_turns_off_the_tier(
        lambda name: SimpleOffloadSimEngine(model_dir, side, name, hooks=True),
        "_kv_checksum_simple_offload_worker",
    )
    logs = [r for r in vllm_caplog.records if "offload tier's" in r.msg]
    assert len(logs) == 1
