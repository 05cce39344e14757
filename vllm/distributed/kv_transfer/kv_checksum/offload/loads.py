# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's loads of offloaded KV, checked against stored entries.

A load whose every hit source is one the connector declares as storing block
checksums (R119) is registered when it starts, collects each worker's report
and, when it finishes, is compared with the entries that came back with the KV
(R120); a failure is handed to the connector so it drops the bad copies (R121).
`KVChecksumScheduler` owns one of these next to its P/D bookkeeping and logs
and counts the verdicts of both alike.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.entries import (
    BlockTagCache,
    verify_offloaded_load,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumVerdict,
    KVChecksumWorkerReport,
    WorkerKey,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# Tags kept for loads of offloaded KV (R116): a request's prefix loaded again
# from host memory is not hashed again. About 100 bytes a tag.
TAG_CACHE_LIMIT = 1 << 16

# checksum_sources(request) -> hit sources whose loads carry stored checksums
ChecksumSourcesFn = Callable[[Any], set[str]]
# on_failure(request, mismatches) -> None: a checked offload load failed (R121)
FailureFn = Callable[[Any, dict[int, list[int]]], None]


def no_sources(request: Any) -> set[str]:
    return set()


def ignore_failure(request: Any, mismatches: dict[int, list[int]]) -> None:
    return None


@dataclass
class PendingOffloadLoad:
    """A started load of offloaded KV waiting for every worker's report."""

    blocks: KVChecksumBlocks
    request: Any
    reports: dict[WorkerKey, KVChecksumWorkerReport] = field(default_factory=dict)


class KVChecksumOffloadLoads:
    """Registry and verification of offload loads (R119-R121)."""

    def __init__(
        self,
        num_workers: int,
        block_sizes: Mapping[int, int],
        hash_block_size: int | None,
        checksum_sources: ChecksumSourcesFn = no_sources,
        on_failure: FailureFn = ignore_failure,
    ) -> None:
        self.num_workers = num_workers
        self.block_sizes = dict(block_sizes)
        self.hash_block_size = hash_block_size
        self.checksum_sources = checksum_sources
        self.on_failure = on_failure
        self.pending: dict[str, PendingOffloadLoad] = {}
        self.tags = BlockTagCache(TAG_CACHE_LIMIT)
        # Sources no longer checked: a worker's offload side failed (R134).
        self.off_sources: set[str] = set()

    def is_checked(self, request: Any, hit_sources: set[str]) -> bool:
        """Whether every source of the load stores checksums (R119) and none
        was turned off."""
        return (
            bool(hit_sources)
            and not hit_sources & self.off_sources
            and hit_sources <= set(self.checksum_sources(request))
        )

    def stop_sources(self, worker: WorkerKey, sources: Iterable[str]) -> bool:
        """A worker's offload side failed (R134): loads from `sources` are no
        longer registered or verified, as with checksums off, and the loads in
        flight are dropped without a verdict. Returns whether any was new."""
        new = set(sources) - self.off_sources
        if not new:
            return False
        self.off_sources |= new
        dropped = len(self.pending)
        self.pending.clear()
        logger.error(
            "KV checksums: the offload tier's checksums are off on worker "
            "(pp rank %d, tp rank %d) after an error there: loads from %s are "
            "no longer verified (fail-closed included), as with checksums off; "
            "P/D transfers are still checked; %d offload loads in flight "
            "dropped unverified.",
            worker[0],
            worker[1],
            ", ".join(sorted(new)),
            dropped,
        )
        return True

    def add(self, request: Any, blocks: KVChecksumBlocks) -> None:
        self.pending[request.request_id] = PendingOffloadLoad(blocks, request)

    def verify(self, load: PendingOffloadLoad) -> KVChecksumVerdict:
        """Each worker's loaded blocks against the entries that came back (R120)."""
        return verify_offloaded_load(
            load.reports,
            load.blocks,
            self.num_workers,
            load.request.block_hashes,
            self.block_sizes,
            self.hash_block_size,
            tags_of=self.tags,
        )

    def report_failure(
        self, req_id: str, load: PendingOffloadLoad, verdict: KVChecksumVerdict
    ) -> None:
        """Tell the connector, in both modes, so it drops bad copies (R121)."""
        try:
            self.on_failure(load.request, dict(verdict.mismatches))
        except Exception:
            logger.exception("on_kv_checksum_failure failed for request %s", req_id)
