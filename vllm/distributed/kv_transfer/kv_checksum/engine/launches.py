# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The device work of one worker step: rows in, checksums out, no host sync.

All rows of a step are built on the host, copied to the device once, and each
group pass's plan is queued on the compute stream (R48); the results are
copied to pinned host memory on a side stream with an event to wait on (R55),
or, with `ZERO_COPY_RESULTS` and a device that allows it, written there by a
kernel queued on the compute stream (no copy engine).
"""

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition import kernels
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import (
    RowSegment,
    pack_segments,
    segment_rows,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
from vllm.distributed.kv_transfer.kv_checksum.engine.block_table import (
    BlockChecksumTable,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.plans import (
    ChecksumPlan,
    GroupPlans,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.records import (
    KVChecksumPendingRecord,
    PassResult,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

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
        self._side_stream: torch.cuda.Stream | None = None
        # Zero-copy results: pinned buffers the device may still be writing,
        # held until their events completed so no allocation reuses them.
        self.zero_copy = False
        self._in_flight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()

    def enable_zero_copy(self) -> bool:
        """At start-up, with `ZERO_COPY_RESULTS`: write a known buffer into
        pinned host memory with the copy kernel and use that path for every
        step if it arrived intact; otherwise (no CUDA, Triton refusing a host
        pointer, wrong words) keep the side-stream copy. Waits on the device
        once, here, never in a step."""
        if not kernels.ZERO_COPY_RESULTS or self.topology.device.type != "cuda":
            return False
        try:
            expected = np.arange(1, 2049, dtype=np.int64) * 0x9E3779B9
            src = torch.from_numpy(expected).to(self.topology.device)
            dst = torch.zeros(expected.size, dtype=torch.int64, pin_memory=True)
            with torch.cuda.device(self.topology.device):
                kernels.copy_words(src, dst)
                event = torch.cuda.Event()
                event.record()
                event.synchronize()
            self.zero_copy = bool(np.array_equal(dst.numpy(), expected))
        except Exception as error:
            logger.warning(
                "KV checksums: zero-copy results unavailable (%r); "
                "copying them on a side stream.",
                error,
            )
            self.zero_copy = False
        return self.zero_copy

    def launch(
        self,
        recvs: Requests,
        loads: Requests,
        sends: Requests,
        checks: Requests = (),
    ) -> list[PassResult]:
        """Build all rows, copy them once to the device and queue every launch.

        P/D receives and sends are checksummed per chunk (R135), offloaded-KV
        loads and prefix-hit checks per block with their stored entries
        (R117, R140).
        """
        passes: list[tuple[GroupPlans, str, tuple, np.ndarray, np.ndarray]] = []
        parts: list[np.ndarray] = []
        for requests, kind in (
            (recvs, "recv"),
            (loads, "load"),
            (list(checks), "check"),
            (sends, "send"),
        ):
            if not requests:
                continue
            for plans in self.groups.values():
                req_ids, starts, counts, rows = segment_rows(
                    requests, plans.group_id, plans.block_size
                )
                if req_ids:
                    passes.append((plans, kind, req_ids, starts, counts))
                    parts.append(rows)
        if not passes:
            return []
        # Each pass's output and, where its group keeps entries, the stored
        # entries it reads: zeroed segments of the one upload (issue 30: no
        # device allocation per pass, one contiguous run to copy back).
        plan_of: list[ChecksumPlan] = []
        reserve: list[int] = []
        for (plans, kind, *_), part in zip(passes, parts):
            plan: ChecksumPlan = getattr(plans, "load" if kind == "check" else kind)
            plan_of.append(plan)
            n = part.shape[1]
            reserve.append(n * plan.width)
            reserve.append(n if plans.group_id in self.table.read_groups(kind) else 0)
        on_device = self.topology.device.type != "cpu"
        host_rows: list[torch.Tensor] = []

        def pinned_zeros(shape: tuple[int, int]) -> np.ndarray:
            host_rows.append(
                torch.zeros(shape, dtype=torch.int64, pin_memory=on_device)
            )
            return host_rows[0].numpy()

        _, columns = pack_segments(parts, pinned_zeros, reserve)
        rows_dev = self._to_device(host_rows[0])
        scratch = rows_dev[0]
        results = []
        for i, ((plans, _, req_ids, starts, counts), part) in enumerate(
            zip(passes, parts)
        ):
            plan = plan_of[i]
            column, n = columns[i], part.shape[1]
            at = columns[len(passes) + 2 * i]
            out = scratch[at : at + n * plan.width].view(n, plan.width)
            plan.run(rows_dev[:, column : column + n], out)
            if plan.chunks > 1:
                # One row per chunk, in position order (R135).
                out = out.view(n * plan.chunks, len(plan.replica_keys))
                starts, counts = starts * plan.chunks, counts * plan.chunks
            segment = RowSegment(plans.group_id, column, req_ids, starts, counts)
            result = PassResult(segment, plan.replica_keys, out)
            if reserve[2 * i + 1]:
                assert self.table.tensor is not None
                at = columns[len(passes) + 2 * i + 1]
                result.stored_device = torch.index_select(
                    self.table.tensor,
                    0,
                    rows_dev[0, column : column + n],
                    out=scratch[at : at + n],
                )
            results.append(result)
        return results

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One non-blocking host-to-device copy of all rows, from pinned memory."""
        device = self.topology.device
        if device.type == "cpu":
            return host
        return host.to(device, non_blocking=True)

    def copy_to_host(self, pending: KVChecksumPendingRecord) -> None:
        """Copy every result of the step to one pinned host buffer, on a side
        stream (or by the zero-copy kernel, `enable_zero_copy`); record an
        event. One buffer and one copy per step, whatever the passes: the
        run of the upload that holds them all, or their concatenation."""
        if not pending.results:
            return
        parts: list[torch.Tensor] = []
        for result in pending.results:
            parts.append(result.device)
            if result.stored_device is not None:
                parts.append(result.stored_device)
        flat, offsets = _one_run(parts)
        if self.zero_copy:
            host, event = self._write_to_host(flat)
        else:
            host, event = self._copy_on_side_stream(flat)
        views = iter(
            host[at : at + part.numel()].view(part.shape)
            for at, part in zip(offsets, parts)
        )
        for result in pending.results:
            result.host = next(views)
            if result.stored_device is not None:
                result.stored_host = next(views)
        pending.event = event

    def _copy_on_side_stream(
        self, flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """`flat` copied to one pinned buffer on the side stream, after the
        compute stream's work so far; the event follows."""
        on_device = self.topology.device.type != "cpu"
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream())
        if on_device:
            # Allocated on the compute stream, read here: not reused before.
            flat.record_stream(side)
        with torch.cuda.stream(side):
            host = torch.empty(flat.numel(), dtype=torch.int64, pin_memory=on_device)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return host, event

    def _write_to_host(
        self, flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """`flat` written to one pinned buffer by one copy kernel on the
        compute stream after the checksum kernels (no copy engine, so no
        queueing behind offload stores); the event follows it."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()  # its buffer's last device write is done
        on_device = self.topology.device.type != "cpu"
        host = torch.empty(flat.numel(), dtype=torch.int64, pin_memory=on_device)
        kernels.copy_words(flat, host)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((event, host))
        return host, event


def _one_run(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """A 1-D tensor holding every part and each part's offset in it: the run
    of their common buffer from the first to the last when they are
    contiguous int64 pieces of one storage in order (a launch's segments),
    else their concatenation."""
    first = parts[0]
    base = first.untyped_storage().data_ptr()
    offsets: list[int] = []
    end = first.data_ptr()
    for part in parts:
        if (
            part.dtype != torch.int64
            or not part.is_contiguous()
            or part.untyped_storage().data_ptr() != base
            or part.data_ptr() < end
        ):
            cat = torch.cat([p.reshape(-1) for p in parts])
            sizes = [p.numel() for p in parts]
            return cat, [sum(sizes[:i]) for i in range(len(sizes))]
        offsets.append((part.data_ptr() - first.data_ptr()) // 8)
        end = part.data_ptr() + 8 * part.numel()
    total = (end - first.data_ptr()) // 8
    run = first.as_strided((total,), (1,), first.storage_offset())
    return run, offsets
