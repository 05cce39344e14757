# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A worker's step record, on its way from the device to the scheduler.

The launches of a step leave their results on the device; a side stream
copies them to pinned host memory, and `KVChecksumPendingRecord.finalize()`
waits for that copy only when the record is read (R55).
"""

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumGroup,
    KVChecksumRecord,
    ReplicaKey,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import RowSegment


@dataclass
class PassResult:
    """Device output of one (pass, group) and the host copy it lands in."""

    segment: RowSegment
    replica_keys: tuple[ReplicaKey, ...]
    device: torch.Tensor
    # Offset of the values in the record's host buffer, in int64 words.
    host_at: int | None = None
    # Loads: the stored block entries of the loaded blocks (R117), per row.
    stored_device: torch.Tensor | None = None
    stored_at: int | None = None


@dataclass
class KVChecksumPendingRecord:
    """A step's record whose values are still on their way to host memory (R55)."""

    pp_rank: int
    tp_rank: int
    req_ids: tuple[str, ...]
    results: list[PassResult]
    skipped_groups: tuple[int, ...]
    fingerprints: dict[int, int]
    received: dict[str, bytes]
    # The pinned host buffer every result's values land in, and its event.
    host: torch.Tensor | None = None
    event: object | None = None
    # Side-stream copies: the device run being copied, held until the copy
    # is waited for (instead of the allocator's record_stream).
    device_run: torch.Tensor | None = field(default=None, repr=False)
    # give_back(event): once waited for and read, the launcher reuses the
    # event (issue 30: no event created or destroyed a step).
    give_back: Callable[[Any], None] | None = field(default=None, repr=False)
    _record: KVChecksumRecord | None = field(default=None, repr=False)

    def __reduce__(self) -> tuple:
        """Serialized for the scheduler as the finished host record (R55)."""
        return (_same, (self.finalize(),))

    def finalize(self) -> KVChecksumRecord:
        """Wait for the side-stream copy and build the host record (idempotent)."""
        if self._record is not None:
            return self._record
        if self.event is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
        self.device_run = None  # the copy is done: the allocator may reuse it
        checksums: dict[str, dict[int, KVChecksumGroup]] = {r: {} for r in self.req_ids}
        words = None if self.host is None else self.host.numpy().view(np.uint64)
        for result in self.results:
            assert words is not None and result.host_at is not None
            values = _words(words, result.host_at, result.device.shape)
            stored = None
            if result.stored_at is not None:
                assert result.stored_device is not None
                stored = _words(words, result.stored_at, result.stored_device.shape)
            seg = result.segment
            for req_id, start, begin, end in _segment_rows(seg):
                checksums[req_id][seg.group_id] = KVChecksumGroup(
                    start=start,
                    replica_keys=result.replica_keys,
                    values=values[begin:end].copy(),
                    stored=None if stored is None else stored[begin:end].copy(),
                )
        self._record = KVChecksumRecord(
            pp_rank=self.pp_rank,
            tp_rank=self.tp_rank,
            checksums=checksums,
            skipped_groups=self.skipped_groups,
            fingerprints=dict(self.fingerprints),
            received=dict(self.received),
        )
        self.results = []
        self.host = None
        if self.give_back is not None and self.event is not None:
            # Waited for, values copied out: the event is free for another
            # step.
            self.give_back(self.event)
        self.event, self.give_back = None, None
        return self._record


def _words(words: np.ndarray, at: int, shape: tuple[int, ...]) -> np.ndarray:
    """The host values of a device result of `shape` at offset `at`."""
    return words[at : at + math.prod(shape)].reshape(shape)


def _segment_rows(seg: RowSegment) -> Iterator[tuple[str, int, int, int]]:
    """(request, start position, first row, end row) of each request of a
    segment; plain ints read once a segment, no NumPy scalars (issue 30)."""
    end = 0
    for req_id, start, count in zip(
        seg.req_ids, seg.starts.tolist(), seg.counts.tolist()
    ):
        begin, end = end, end + count
        yield req_id, start, begin, end


def _same(record: KVChecksumRecord) -> KVChecksumRecord:
    return record


def finalize_records(items: Iterable[object] | None) -> list[KVChecksumRecord]:
    """Host records of pending or finished records, in order."""
    records = []
    for item in items or ():
        if isinstance(item, KVChecksumPendingRecord):
            records.append(item.finalize())
        elif isinstance(item, KVChecksumRecord):
            records.append(item)
    return records
