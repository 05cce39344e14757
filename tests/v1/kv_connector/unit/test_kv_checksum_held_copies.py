# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Issue 30 (R55, R142): SimpleCPUOffloadConnector's copy hand-offs wait for
the step's checksum work.

vLLM 0.33.0's SimpleCPUOffloadWorker hands each load and store batch to a
copy thread (`DmaCopyBackend.launch_copy` puts it on the thread's queue);
while that thread is in `cuMemcpyBatchAsync`, every device call of the
engine thread waits (2026-12-05 on an H200: 5-6 ms a call beside a copy,
0.1-0.5 ms alone). With checksums on, a step whose loads start after the
forward keeps its hand-offs back until the checksum work after the forward
is queued. Here on vLLM's real ActiveKVConnector, SimpleCPUOffloadConnector,
SimpleCPUOffloadWorker and DmaCopyBackend, whose queue (no thread, no CUDA)
shows when each batch was handed off.
"""

import queue
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.v1.kv_connector.unit.kv_checksum_helpers import (
    empty_scheduler_output,
    make_active_connector,
    make_kv_cache_config,
    make_kv_caches,
    make_vllm_config,
    rank0_groups,
)
from vllm.distributed.kv_transfer.kv_checksum import wiring
from vllm.distributed.kv_transfer.kv_checksum.config import ENABLE_KEY
from vllm.distributed.kv_transfer.kv_checksum.offload.held_calls import HeldCalls

pytestmark = [pytest.mark.cpu]

SIMPLE_EXTRA = {"cpu_bytes_to_use": 1 << 22, "num_cpu_blocks": 64}
NUM_CPU_BLOCKS = 64


def test_held_calls_keep_order_until_released() -> None:
    """Not held, a call goes through at once; held, calls are kept and made
    in their order at `release`, which stops holding. Bugs caught (each
    tried): the kept calls made in reverse; `release` leaving the hold on
    (the next step's hand-offs then wait a whole step)."""
    made: list[tuple[Any, ...]] = []
    held = HeldCalls(lambda *args, **kw: made.append((*args, kw)))
    held.arm()
    held(1)
    assert made == [(1, {})]
    held.hold()
    held(2, is_store=False)
    held(3, is_store=True)
    assert made == [(1, {})]
    held.release()
    assert made == [(1, {}), (2, {"is_store": False}), (3, {"is_store": True})]
    held(4)
    assert made[-1] == (4, {})
    held.release()  # nothing kept: nothing made
    assert len(made) == 4


def test_held_calls_make_every_kept_call_when_one_fails() -> None:
    """A kept hand-off that raises does not keep the later ones back (each
    is another batch, whose requests would wait forever); the first error
    is raised after. Bug caught (tried): stopping at the first error."""
    made: list[int] = []

    def call(n: int) -> None:
        made.append(n)
        if n == 1:
            raise RuntimeError("queue closed")

    held = HeldCalls(call)
    held.arm()
    held.hold()
    for n in range(3):
        held(n)
    with pytest.raises(RuntimeError, match="queue closed"):
        held.release()
    assert made == [0, 1, 2] and not held.holding


def test_held_calls_hold_nothing_until_armed() -> None:
    """Only the code sure to release a hold arms it: before, `hold` keeps
    nothing. Bug caught (tried): holding unarmed (a connector whose
    ActiveKVConnector never armed it would keep its copies forever)."""
    made: list[int] = []
    held = HeldCalls(made.append)
    held.hold()
    held(1)
    assert made == [1] and not held.holding


def _fake_register_kv_caches(self: Any, kv_caches: dict[str, torch.Tensor]) -> None:
    """SimpleCPUOffloadWorker.register_kv_caches without CUDA: host tensors
    per layer and a real DmaCopyBackend whose copy queue nothing drains."""
    from vllm.v1.simple_kv_offload.copy_backend import DmaCopyBackend

    self.gpu_kv_caches = kv_caches
    self.num_cpu_blocks = NUM_CPU_BLOCKS
    self.cpu_kv_caches = {
        name: torch.zeros(
            (NUM_CPU_BLOCKS, cache.numel() * cache.element_size() // cache.shape[0]),
            dtype=torch.uint8,
        )
        for name, cache in kv_caches.items()
    }
    backend = DmaCopyBackend()
    backend._queue = queue.SimpleQueue()
    backend._load_params = "load params"  # type: ignore[assignment]
    backend._store_params = "store params"  # type: ignore[assignment]
    self._backend = backend
    self._store_compute_done = SimpleNamespace(record=lambda stream: None)


def install_simple_worker(monkeypatch: Any) -> None:
    """The plugin's hooks, one rank, and SimpleCPUOffloadWorker's cache
    registration without CUDA (`_fake_register_kv_caches`)."""
    from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

    wiring.install()
    rank0_groups(monkeypatch)
    monkeypatch.setattr(
        SimpleCPUOffloadWorker, "register_kv_caches", _fake_register_kv_caches
    )


def build_simple_active(model_dir: str, enabled: bool, monkeypatch: Any) -> Any:
    """A real ActiveKVConnector over vLLM's SimpleCPUOffloadConnector (worker
    role, checksums on or off), its connector and copy backend; after
    `install_simple_worker`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    extra = {**SIMPLE_EXTRA, ENABLE_KEY: True} if enabled else dict(SIMPLE_EXTRA)
    vllm_config = make_vllm_config(
        model_dir, kv_connector="SimpleCPUOffloadConnector", extra_config=extra
    )
    kv_cache_config = make_kv_cache_config(vllm_config)
    caches = make_kv_caches(kv_cache_config, seed=7)
    connector = KVConnectorFactory.create_connector(
        vllm_config, KVConnectorRole.WORKER, kv_cache_config
    )
    active = make_active_connector(
        vllm_config, kv_cache_config, connector, caches, monkeypatch
    )
    backend = connector.worker_handler._backend
    return SimpleNamespace(active=active, connector=connector, backend=backend)


@pytest.fixture
def simple_active(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, cuda_stream_stubs: Any
) -> Any:
    """Builds a real ActiveKVConnector over vLLM's SimpleCPUOffloadConnector
    (worker role, checksums on or off) and its copy backend."""
    install_simple_worker(monkeypatch)

    def build(enabled: bool) -> SimpleNamespace:
        return build_simple_active(model_dir, enabled, monkeypatch)

    return build


def _step_output(sync_loads: bool) -> Any:
    """A SchedulerOutput (vLLM's class) whose connector metadata loads CPU
    block 4 into GPU block 3 and stores GPU block 5 (position 0 of group 0,
    its entry to write) into CPU block 6."""
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    output = empty_scheduler_output(sync_loads)
    output.kv_connector_metadata = SimpleCPUOffloadMetadata(
        load_event=0,
        load_gpu_blocks=[3],
        load_cpu_blocks=[4],
        load_event_to_reqs={0: ["r"]},
        store_event=0,
        store_gpu_blocks=[5],
        store_cpu_blocks=[6],
    )
    output.kv_connector_metadata.kv_checksum_store_runs = [(0, 0, [5], [b"h" * 32])]
    return output


def _handed_off(backend: Any) -> list[bool]:
    """The batches on the copy queue, in order (is_store of each), drained."""
    flags = []
    while not backend._queue.empty():
        flags.append(backend._queue.get_nowait()[3])
    return flags


def _run_step(env: Any, sync_loads: bool) -> dict[str, int]:
    """pre_forward, then post_forward, as Model Runner V2 calls them (the
    batch given, so loads start after the forward unless sync); returns how
    many batches were on the copy queue at each checksum call."""
    seen: dict[str, int] = {}
    active, backend = env.active, env.backend
    input_batch = SimpleNamespace(idx_mapping=None, req_ids=["r"], num_tokens=1)
    active.pre_forward(_step_output(sync_loads), input_batch)
    seen["after pre_forward"] = backend._queue.qsize()
    worker = active.kv_checksum_worker
    if worker is not None:
        for name in ("save_block_checksums", "queue_block_checksums", "post_forward"):
            _spy(
                worker,
                name,
                lambda name=name: seen.setdefault(name, backend._queue.qsize()),
            )
        _spy(
            worker.launcher,
            "launch",
            lambda: seen.setdefault("launch", backend._queue.qsize()),
        )
    active.finish_forward()
    active.post_forward(set())
    return seen


def _spy(owner: Any, name: str, note: Any) -> None:
    """`owner.name` calls `note()` first (on the instance)."""
    real = getattr(owner, name)

    def spy(*args: Any, **kw: Any) -> Any:
        note()
        return real(*args, **kw)

    setattr(owner, name, spy)


def _step_with_vllm_raising(env: Any) -> None:
    """`_run_step` (loads after the forward) with vLLM's own post_forward
    raising from the connector's get_finished; the error reaches the caller."""

    def broken(finished_req_ids: set[str]) -> Any:
        raise RuntimeError("transfer results")

    env.connector.get_finished = broken
    with pytest.raises(RuntimeError, match="transfer results"):
        _run_step(env, sync_loads=False)


def test_hand_offs_wait_for_the_steps_checksum_work(simple_active: Any) -> None:
    """Loads after the forward: the store's and the load's entry moves are
    queued and the checksum worker's post_forward makes them in its one
    launch sequence with nothing handed to the copy thread yet; when
    post_forward returns, the load batch then the store batch are on its
    queue (vLLM's order). Bugs caught (each tried): the hold never taken
    (both batches queued before the checksum work); the hand-offs released
    right after vLLM's post_forward, before the checksum worker's."""
    env = simple_active(True)
    assert env.active._kv_checksum_held_copies
    seen = _run_step(env, sync_loads=False)
    assert seen == {
        "after pre_forward": 0,
        "queue_block_checksums": 0,
        "post_forward": 0,
        "launch": 0,
    }
    assert _handed_off(env.backend) == [False, True]


def _entries_at_hand_offs(env: Any) -> list[tuple[bool, int, int]]:
    """Spies the backend's real hand-off under the hold: per batch handed
    off (vLLM passes `is_store` by keyword), (is_store, the block table's
    entry of GPU block 3, host slot 6's entry) at that moment. Host slot 4
    starts at 444: the entry the load brings back."""
    worker_side = env.connector._kv_checksum_simple_offload_worker
    slots = worker_side.entries.entries
    table = env.active.kv_checksum_worker.block_table.tensor
    slots[4] = 444
    (held,) = env.active._kv_checksum_held_copies
    real = held.call
    seen: list[tuple[bool, int, int]] = []

    def hand_off(*args: Any, **kw: Any) -> Any:
        seen.append((kw["is_store"], int(table[3]), int(slots[6])))
        return real(*args, **kw)

    held.call = hand_off
    return seen


def _entry_of_block_5(
    simple_active: Any, sync_loads: bool
) -> tuple[int, list[tuple[bool, int, int]]]:
    """One step, its loads after the forward (the copies held, the entry
    moves in the pass) or synchronous (nothing held, each move made where
    vLLM calls the connector): GPU block 5's entry in the table, and
    `_entries_at_hand_offs`."""
    env = simple_active(True)
    seen = _entries_at_hand_offs(env)
    _run_step(env, sync_loads=sync_loads)
    return int(env.active.kv_checksum_worker.block_table.tensor[5]), seen


def test_entry_moves_in_the_pass_are_made_before_the_hand_offs(
    simple_active: Any,
) -> None:
    """Issue 30, R118: with the entry moves made by the checksum pass (loads
    after the forward), when the load batch is handed off its block's entry
    is back in the table (444, from host slot 4), and when the store batch
    is, the stored block's new entry is in its host slot 6; that entry is
    the one the store's own save writes (synchronous loads: nothing held, the
    block table's `save`, another code path) and not 0. Bugs caught (each
    tried): the copies made before the entry writes (slot 6 keeps 0); the
    launcher's restores left out (block 3 keeps 0 at the load's hand-off)."""
    entry, seen = _entry_of_block_5(simple_active, sync_loads=False)
    own_entry, own_seen = _entry_of_block_5(simple_active, sync_loads=True)
    assert entry == own_entry != 0
    assert seen == [(False, 444, entry), (True, 444, entry)]
    assert own_seen[-1] == (True, 444, entry)


def test_entry_moves_in_the_pass_make_one_upload_a_step(
    simple_active: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, R142: a step that loads and stores makes one pinned upload for
    all its checksum device work with the moves in the pass (its restore,
    its store's entry write and copy). Bug caught (tried): the restore made
    on its own in start_load_kv (two uploads)."""
    from tests.v1.kv_connector.unit.test_kv_checksum_simple_offload import (
        count_uploads,
    )

    uploads = count_uploads(monkeypatch)
    env = simple_active(True)
    _run_step(env, sync_loads=False)
    assert uploads[0] == 1


def test_queued_moves_made_when_vllms_post_forward_raises(
    simple_active: Any,
) -> None:
    """R118, R134: whatever keeps the checksum pass from running (here vLLM's
    own post_forward raising), the queued entry moves are made before the held
    batches are handed off: a store copy never leaves without its entry in
    its slot. Bug caught (tried): no flush before the release (slot 6 still
    0 when the store batch goes)."""
    env = simple_active(True)
    seen = _entries_at_hand_offs(env)
    _step_with_vllm_raising(env)
    entry = int(env.active.kv_checksum_worker.block_table.tensor[5])
    assert entry != 0
    assert seen == [(False, 444, entry), (True, 444, entry)]


def _store_only(env: Any) -> tuple[int, int]:
    """One step, loads after the forward, that stores GPU block 5 into CPU
    block 6 and loads nothing; vLLM's worker reports no store complete in
    its output. Returns host slot 6's entry and GPU block 5's table entry
    after the step."""
    output = _step_output(sync_loads=False)
    meta = output.kv_connector_metadata
    meta.load_cpu_blocks, meta.load_gpu_blocks, meta.load_event_to_reqs = [], [], {}
    env.connector.worker_handler._completed_store_events = {}
    input_batch = SimpleNamespace(idx_mapping=None, req_ids=["r"], num_tokens=1)
    env.active.pre_forward(output, input_batch)
    env.active.finish_forward()
    env.active.post_forward(set())
    slots = env.connector._kv_checksum_simple_offload_worker.entries.entries
    table = env.active.kv_checksum_worker.block_table.tensor
    return int(slots[6]), int(table[5])


def test_a_store_only_step_makes_its_entries_in_that_step(
    simple_active: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, R118: a step that stores and loads nothing, with no store
    reported complete yet, still makes its store's entries before it
    returns, in one upload: host slot 6 holds the entry GPU block 5 gets.
    Bug caught (tried): the step's queued moves left for a later launch
    (slot 6 still 0, no upload)."""
    from tests.v1.kv_connector.unit.test_kv_checksum_simple_offload import (
        count_uploads,
    )

    uploads = count_uploads(monkeypatch)
    env = simple_active(True)
    slot, entry = _store_only(env)
    assert slot == entry != 0
    assert uploads[0] == 1


def test_a_worker_turned_off_holds_no_more(simple_active: Any) -> None:
    """R134: once an error turned a worker's checksums off, its copies are
    handed off where vLLM hands them off again (nothing queued for a pass
    that no longer runs). Bug caught (tried): the hold left armed (the
    store's entry queued in a worker nobody flushes, every step)."""
    from vllm.distributed.kv_transfer.kv_checksum.wiring import worker as wiring_worker

    env = simple_active(True)
    (held,) = env.active._kv_checksum_held_copies
    worker = env.active.kv_checksum_worker
    wiring_worker._disable_worker(env.active, "kv_checksum_worker", "test")
    assert not held.armed
    _run_step(env, sync_loads=False)
    assert not worker.queued.due()


def test_sync_loads_are_handed_off_at_once(simple_active: Any) -> None:
    """With sync loads vLLM starts them before the forward, which needs
    them: nothing is held (the load batch is on the queue when pre_forward
    returns). Bug caught (tried): holding on every start_load_kv (the
    forward would then read blocks not loaded yet)."""
    env = simple_active(True)
    seen = _run_step(env, sync_loads=True)
    assert seen["after pre_forward"] == 1
    assert _handed_off(env.backend) == [False, True]


def test_hand_offs_made_when_vllms_post_forward_raises(simple_active: Any) -> None:
    """Whatever raises inside post_forward, the held batches are still
    handed off (their requests would otherwise wait forever). Bug caught
    (tried): the release not in a `finally`."""
    env = simple_active(True)
    _step_with_vllm_raising(env)
    assert _handed_off(env.backend) == [False, True]
    assert not any(h.holding for h in env.active._kv_checksum_held_copies)


def test_a_hold_nobody_releases_is_never_taken(simple_active: Any) -> None:
    """A connector whose ActiveKVConnector did not arm its hold (its
    __init__ hook failed after the connector got checksum state) hands its
    batches off where vLLM does: none is kept for a release that would never
    come. Bug caught (tried): holding unarmed (both batches stay kept)."""
    env = simple_active(True)
    (held,) = env.active._kv_checksum_held_copies
    env.active._kv_checksum_held_copies = ()
    held.armed = False
    _run_step(env, sync_loads=False)
    assert _handed_off(env.backend) == [False, True]
    assert not held.holding


def test_R1_checksums_off_copy_backend_untouched(simple_active: Any) -> None:
    """R1: with checksums off, nothing is set on the backend or the
    connectors, and each batch is handed off where vLLM hands it off (the
    load in start_load_kv, the store in wait_for_save)."""
    env = simple_active(False)
    assert env.active.kv_checksum_worker is None
    assert env.active._kv_checksum_held_copies == ()
    assert "launch_copy" not in vars(env.backend)
    assert not any(k.startswith("_kv_checksum") for k in vars(env.connector))
    from vllm.v1.simple_kv_offload.copy_backend import DmaCopyBackend

    queued: list[int] = []
    launch_copy = DmaCopyBackend.launch_copy

    def spy(self: Any, *args: Any, **kw: Any) -> None:
        launch_copy(self, *args, **kw)
        queued.append(self._queue.qsize())

    env.backend.launch_copy = spy.__get__(env.backend)
    _run_step(env, sync_loads=False)
    assert queued == [1, 2]
    assert _handed_off(env.backend) == [False, True]


def test_held_copies_of_a_multi_connectors_children() -> None:
    """R142, issue 30: `held_copies`, the holds the ActiveKVConnector hook
    arms and releases, finds those of a MultiConnector's
    SimpleCPUOffloadConnector children (vLLM's class), and only theirs; a
    child without checksum state (the disk backend) has none. Bug caught
    (tried): only the top connector looked at (a MultiConnector's holds
    never armed, so never taken)."""
    from vllm.distributed.kv_transfer.kv_checksum.wiring import simple_cpu_offload
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
        SimpleCPUOffloadConnector,
    )

    with_hold = object.__new__(SimpleCPUOffloadConnector)
    held = HeldCalls(print)
    with_hold._kv_checksum_held_copies = held  # type: ignore[attr-defined]
    without = object.__new__(SimpleCPUOffloadConnector)
    other = SimpleNamespace(_kv_checksum_held_copies=HeldCalls(print))
    multi = SimpleNamespace(_connectors=[other, with_hold, without])
    assert simple_cpu_offload.held_copies(multi) == (held,)
    assert simple_cpu_offload.held_copies(with_hold) == (held,)
    assert simple_cpu_offload.held_copies(without) == ()
