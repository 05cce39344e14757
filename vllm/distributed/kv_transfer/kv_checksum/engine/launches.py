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
        on_device = self.topology.device.type != "cpu"
        host_rows: list[torch.Tensor] = []

        def pinned_zeros(shape: tuple[int, int]) -> np.ndarray:
            host_rows.append(
                torch.zeros(shape, dtype=torch.int64, pin_memory=on_device)
            )
            return host_rows[0].numpy()

        _, columns = pack_segments(parts, pinned_zeros)
        rows_dev = self._to_device(host_rows[0])
        results = []
        for (plans, kind, req_ids, starts, counts), part, column in zip(
            passes, parts, columns
        ):
            plan: ChecksumPlan = getattr(plans, "load" if kind == "check" else kind)
            n = part.shape[1]
            out = torch.zeros(
                (n, plan.width), dtype=torch.int64, device=rows_dev.device
            )
            plan.run(rows_dev[:, column : column + n], out)
            if plan.chunks > 1:
                # One row per chunk, in position order (R135).
                out = out.view(n * plan.chunks, len(plan.replica_keys))
                starts, counts = starts * plan.chunks, counts * plan.chunks
            segment = RowSegment(plans.group_id, column, req_ids, starts, counts)
            result = PassResult(segment, plan.replica_keys, out)
            if plans.group_id in self.table.read_groups(kind):
                assert self.table.tensor is not None
                result.stored_device = self.table.tensor[
                    rows_dev[0, column : column + n]
                ]
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
        event. One buffer and one copy per step, whatever the passes."""
        if not pending.results:
            return
        parts: list[torch.Tensor] = []
        for result in pending.results:
            parts.append(result.device.reshape(-1))
            if result.stored_device is not None:
                parts.append(result.stored_device.reshape(-1))
        if self.zero_copy:
            host, event = self._write_to_host(parts)
        else:
            host, event = self._copy_on_side_stream(parts)
        offset = 0
        for result in pending.results:
            size = result.device.numel()
            result.host = host[offset : offset + size].view(result.device.shape)
            offset += size
            if result.stored_device is not None:
                size = result.stored_device.numel()
                stored = host[offset : offset + size]
                result.stored_host = stored.view(result.stored_device.shape)
                offset += size
        pending.event = event

    def _copy_on_side_stream(
        self, parts: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The parts joined on the side stream, after the compute stream's
        work so far, and copied to one pinned buffer; the event follows."""
        on_device = self.topology.device.type != "cpu"
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flat = torch.cat(parts)
            host = torch.empty(flat.numel(), dtype=torch.int64, pin_memory=on_device)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return host, event

    def _write_to_host(
        self, parts: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The parts written to one pinned buffer by one copy kernel on the
        compute stream after the checksum kernels (no copy engine, so no
        queueing behind offload stores); the event follows it."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()  # its buffer's last device write is done
        flat = torch.cat(parts)
        on_device = self.topology.device.type != "cpu"
        host = torch.empty(flat.numel(), dtype=torch.int64, pin_memory=on_device)
        kernels.copy_words(flat, host)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((event, host))
        return host, event
