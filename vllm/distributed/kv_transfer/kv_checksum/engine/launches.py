# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The device work of one worker step: rows in, checksums out, no host sync.

All rows of a step are built on the host, copied to the device once, and each
group pass's plan is queued on the compute stream (R48); the results are
copied to pinned host memory on a side stream with an event to wait on (R55).
"""

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
    EntryCopy,
    EntryRestore,
    move_indices,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import (
    RowSegment,
    segment_rows,
    upload_segments,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
from vllm.distributed.kv_transfer.kv_checksum.engine.block_table import (
    BlockChecksumTable,
    EntryRows,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.plans import (
    ChecksumPlan,
    GroupPlans,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.records import (
    KVChecksumPendingRecord,
    PassResult,
)

# Waited-for result events kept for reuse; a step takes one.
EVENT_POOL_SIZE = 8

Requests = Sequence[tuple[str, KVChecksumBlocks]]


class ChecksumLauncher:
    """Queues a step's checksum launches and the copy of their results to the
    host, so the engine step never waits on the device (R48, R55)."""

    def __init__(
        self,
        groups: dict[int, GroupPlans],
        topology: WorkerTopology,
        table: BlockChecksumTable,
    ) -> None:
        self.groups = groups
        self.topology = topology
        self.table = table
        # Made at the first copy (`_side_streams`), with the event the side
        # stream waits on (recorded on the compute stream every copy: one
        # event for good, not a new one per `wait_stream`, issue 30).
        self._streams: _SideStreams | None = None
        self._compute_done: Any = None
        # Result events whose record was waited for (`finalize` gives them
        # back, `_give_back`): reused, so a step creates and destroys no
        # event (issue 30). Every pass allocates its pinned upload, device
        # copy and pinned results (R52: no reusable staging pool).
        self._events: deque[Any] = deque(maxlen=EVENT_POOL_SIZE)

    def launch(
        self,
        recvs: Requests,
        loads: Requests,
        sends: Requests,
        checks: Requests = (),
        saves: Sequence[EntryRows] = (),
        restores: Sequence[EntryRestore] = (),
        copies: Sequence[EntryCopy] = (),
    ) -> tuple[list[PassResult], torch.Tensor | None]:
        """Build all rows, copy them once to the device and queue every launch.

        P/D receives and sends are checksummed per chunk (R135), offloaded-KV
        loads and prefix-hit checks per block with their stored entries
        (R117, R140). `saves` are the step's prefix entries (R140): written
        first, from the same upload, so that a hit on a block cached this
        step reads its entry; a group's entry write and its hit checks share
        one launch (issue 30). An offload tier's entry moves ride in the same
        upload: `restores` (a load's entries back from its host slots) before
        anything, `copies` (a store's entries to its slots) after every entry
        write. Returns the results and the one device run holding them
        all, for `copy_to_host` (None without a pass).
        """
        # (group, plan, whether it reads stored entries, req ids, starts, counts)
        passes: list[
            tuple[GroupPlans, ChecksumPlan, bool, tuple, np.ndarray, np.ndarray]
        ] = []
        parts: list[np.ndarray] = []
        checks_at: dict[int, int] = {}  # group id -> index of its check pass
        # Checks first: a save fused with its group's check pass then still
        # runs before every pass that reads stored entries, as unfused saves do.
        for requests, kind in (
            (list(checks), "check"),
            (recvs, "recv"),
            (loads, "load"),
            (sends, "send"),
        ):
            if not requests:
                continue
            plan_kind = "load" if kind == "check" else kind
            for plans in self.groups.values():
                req_ids, starts, counts, rows = segment_rows(
                    requests, plans.group_id, plans.block_size
                )
                if req_ids:
                    reads = plans.group_id in self.table.read_groups(kind)
                    plan = getattr(plans, plan_kind)
                    if kind == "check" and plan.chunks == 1:
                        checks_at[plans.group_id] = len(passes)
                    passes.append((plans, plan, reads, req_ids, starts, counts))
                    parts.append(rows)
        if not passes and not saves and not restores and not copies:
            return [], None
        layout = _Layout(self.groups, passes, parts, saves, checks_at, restores, copies)
        rows_dev, columns = upload_segments(
            layout.parts, self.topology.device, layout.reserve
        )
        scratch = rows_dev[0]
        part_columns = iter(columns[: len(layout.order)])
        tag_columns = columns[len(layout.order) : layout.first_move]
        move_columns = columns[layout.first_move : len(layout.parts)]
        segments = iter(columns[len(layout.parts) :])
        for restore, column in zip(restores, move_columns):
            self.table.restore_from(rows_dev, column, restore)
        results = []
        fused: tuple[EntryRows, int, int] | None = None
        for item, index in layout.order:
            column = next(part_columns)
            if item == "save":
                entry_rows = saves[index]
                n, at = entry_rows.rows.shape[1], next(segments)
                if index in layout.fused_saves:
                    fused = (entry_rows, column, at)  # runs with its check pass
                    continue
                plan = self.groups[entry_rows.group_id].load
                out = scratch[at : at + n * plan.width].view(n, plan.width)
                plan.run(rows_dev[:, column : column + n], out)
                self._write_entries(
                    rows_dev, scratch, out, column, tag_columns[index], entry_rows
                )
                continue
            plans, plan, reads, req_ids, starts, counts = passes[index]
            n = parts[index].shape[1]
            at, stored_at = next(segments), next(segments)
            if fused is not None and index in layout.save_of_pass:
                # One launch: the entry rows, a padding row, the check rows.
                entry_rows, first, out_at = fused
                fused = None
                written = entry_rows.rows.shape[1]
                padded = written + (written & 1)
                both = scratch[out_at : at + n * plan.width]
                both = both.view(padded + n, plan.width)
                plan.run(rows_dev[:, first : column + n], both)
                save_index = layout.save_of_pass[index]
                self._write_entries(
                    rows_dev,
                    scratch,
                    both[:written],
                    first,
                    tag_columns[save_index],
                    entry_rows,
                )
                out = both[padded:]
            else:
                out = scratch[at : at + n * plan.width].view(n, plan.width)
                plan.run(rows_dev[:, column : column + n], out)
            if plan.chunks > 1:
                # One row per chunk, in position order (R135).
                out = out.view(n * plan.chunks, len(plan.replica_keys))
                starts, counts = starts * plan.chunks, counts * plan.chunks
            segment = RowSegment(plans.group_id, column, req_ids, starts, counts)
            result = PassResult(segment, plan.replica_keys, out)
            if reads:
                assert self.table.tensor is not None
                stored = scratch[stored_at : stored_at + n]
                ids = scratch[column : column + n]
                self.table.kernels.move(self.table.tensor, ids, stored)
                result.stored_device = stored
            results.append(result)
        for copy, column in zip(copies, move_columns[len(restores) :]):
            self.table.copy_to(rows_dev, column, copy)
        if not passes:
            return [], None
        first_out = columns[len(layout.parts)]
        run = scratch[first_out : columns[-1] + layout.reserve[-1]]
        return results, run

    def _write_entries(
        self,
        uploaded: torch.Tensor,
        row0: torch.Tensor,
        sums: torch.Tensor,
        column: int,
        tag_column: int,
        entry_rows: EntryRows,
    ) -> None:
        """The table write of `entry_rows`, uploaded at `column`, their tags
        at `tag_column` (both in `row0`, row 0 of `uploaded`), from their
        launch output `sums`; with a destination, into the host slots of the
        tags' row 1 too (`fold_copy`)."""
        count = entry_rows.rows.shape[1]
        end = tag_column + count
        dest = entry_rows.dest
        self.table.write_entries(
            sums,
            row0[tag_column:end],
            row0[column : column + count],
            None if dest is None else uploaded[1, tag_column:end],
            dest,
        )

    def copy_to_host(self, pending: KVChecksumPendingRecord, run: torch.Tensor) -> None:
        """Copy the step's results, `run` from `launch`, to one pinned host
        buffer on a side stream; record an event. One buffer and one copy per
        step, whatever the passes; each result's host values sit where its
        device segment sits in `run` (offsets only: no host tensor views on
        the step, issue 30). The record gives its event back for reuse once
        its reader waited for the copy."""
        host, event = self._copy_on_side_stream(run)
        # Held by the record until its reader waited for the copy, so the
        # allocator cannot hand `run` to the compute stream's next kernels
        # while the side stream reads it (no record_stream).
        pending.device_run = run
        pending.give_back = self._give_back
        base, size = run.data_ptr(), run.element_size()
        for result in pending.results:
            result.host_at = (result.device.data_ptr() - base) // size
            if result.stored_device is not None:
                result.stored_at = (result.stored_device.data_ptr() - base) // size
        pending.host = host
        pending.event = event

    def _give_back(self, event: Any) -> None:
        """A record's event, once its reader waited for the copy and read it
        (any thread: deque appends are atomic)."""
        self._events.append(event)

    def _side_streams(self) -> "_SideStreams":
        """The side copy's streams. On CUDA: a side stream on the worker's own
        device and the accelerator API's C calls for that index
        (`torch.cuda.current_stream` builds its answer through Python device
        lookups, tens of us a call on an H200 host, issue 30); a bare "cuda"
        device is the one current at the first copy. Elsewhere `torch.cuda`'s
        (what vLLM's CPU worker and the CPU tests stub), index None."""
        device = self.topology.device
        if device.type == "cuda":
            index = device.index
            if index is None:
                index = torch.accelerator.current_device_index()
            get = torch.accelerator.current_stream

            def current() -> Any:
                return get(index)

            return _SideStreams(
                torch.cuda.Stream(device=index),
                current,
                torch.accelerator.set_stream,
                index,
            )
        return _SideStreams(
            torch.cuda.Stream(), torch.cuda.current_stream, torch.cuda.set_stream
        )

    def _copy_on_side_stream(
        self, flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """`flat` copied to one new pinned buffer on the side stream, after
        the compute stream's work so far; the event follows. The side stream
        is current for the copy only; then the compute stream is again, and
        the device that was current before (setting a stream selects its
        device). The caller keeps `flat` alive until the event is waited
        for."""
        on_device = self.topology.device.type != "cpu"
        if self._streams is None:
            self._streams = self._side_streams()
            self._compute_done = torch.cuda.Event()
        streams = self._streams
        side, index = streams.side, streams.device_index
        compute = streams.current()
        self._compute_done.record(compute)
        side.wait_event(self._compute_done)
        host = torch.empty(flat.numel(), dtype=torch.int64, pin_memory=on_device)
        previous = None if index is None else torch.accelerator.current_device_index()
        streams.set_current(side)
        try:
            host.copy_(flat, non_blocking=True)
        finally:
            streams.set_current(compute)
            if previous is not None and previous != index:
                torch.accelerator.set_device_index(previous)
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record(side)
        return host, event


@dataclass(frozen=True)
class _SideStreams:
    """The side copy's stream and how it reads and sets the current stream;
    `device_index` is the CUDA device they serve (None off CUDA)."""

    side: Any
    current: Callable[[], Any]
    set_current: Callable[[Any], None]
    device_index: int | None = None


class _Layout:
    """Where a step's row parts and output segments sit in its one upload.

    Items run in `order`: each entry write ("save") just before its
    group's check pass when that pass exists (`save_of_pass`: the two then
    share one launch, their rows and outputs adjacent), else before every
    pass. Parts: each item's rows, then each save's tags, then from
    `first_move` each restore's and each copy's (block ids, slots, 0).
    Reserve: per save its output (rows padded to even), per pass its output
    and stored entries.
    """

    def __init__(
        self,
        groups: dict[int, GroupPlans],
        passes: Sequence[tuple],
        parts: Sequence[np.ndarray],
        saves: Sequence[EntryRows],
        checks_at: dict[int, int],
        restores: Sequence[EntryRestore] = (),
        copies: Sequence[EntryCopy] = (),
    ) -> None:
        self.save_of_pass: dict[int, int] = {}  # check pass index -> save index
        self.order: list[tuple[str, int]] = []
        for k, entry_rows in enumerate(saves):
            at = checks_at.get(entry_rows.group_id)
            if at is not None and at not in self.save_of_pass:
                self.save_of_pass[at] = k
            else:
                self.order.append(("save", k))
        self.fused_saves = set(self.save_of_pass.values())
        for i in range(len(passes)):
            if i in self.save_of_pass:
                self.order.append(("save", self.save_of_pass[i]))
            self.order.append(("pass", i))
        self.parts: list[np.ndarray] = []
        self.reserve: list[int] = []
        for item, index in self.order:
            if item == "save":
                entry_rows = saves[index]
                n = entry_rows.rows.shape[1]
                width = groups[entry_rows.group_id].load.width
                self.parts.append(entry_rows.rows)
                self.reserve.append((n + (n & 1)) * width)
            else:
                _, plan, reads, *_ = passes[index]
                n = parts[index].shape[1]
                self.parts.append(parts[index])
                self.reserve += [n * plan.width, n if reads else 0]
        self.parts += [entry_rows.tags for entry_rows in saves]
        self.first_move = len(self.parts)
        moves: list[EntryRestore | EntryCopy] = [*restores, *copies]
        self.parts += [move_indices(moved) for moved in moves]
