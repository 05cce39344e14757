# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verifying a load of offloaded KV against the block checksums stored with it.

A connector that offloads KV may offload, with each block, the worker's
checksum entry of that block (sum of its partial checksums XOR a tag of the
block's hash, R116-R118). When it loads the block back, each worker checksums
the loaded KV again and captures the entry that came back; a position is bad
when the two disagree on any worker (R120). Pure functions over plain inputs.
"""

from collections.abc import Callable, Mapping, Sequence
from itertools import filterfalse

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    block_checksum_tags,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
    KVChecksumWorkerReport,
    UnverifiedReason,
    WorkerKey,
    completeness_detail,
    other_blocks_detail,
)

# tags(block hashes, fingerprint) -> uint64 tag per hash (R116)
TagsFn = Callable[[Sequence[bytes], int], np.ndarray]


class BlockTagCache:
    """`block_checksum_tags` remembered per (fingerprint, block hash) (R116, R142).

    Every request hitting a shared prefix has the same blocks checked, and a
    tag is a pure function of its fingerprint and hash, so only hashes not
    seen before are hashed: no SHA-256 per hit block per request; a run of
    hashes asked for before is one lookup of the whole run, not one per hash.
    Bounded: at most `limit` tags and `limit` rows of runs are kept; a call
    that would pass a bound forgets all of it first. No Python loop per block.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.run_rows = 0
        self._tags: dict[int, dict[bytes, int]] = {}
        self._runs: dict[tuple[int, tuple[bytes, ...]], np.ndarray] = {}

    def __call__(self, block_hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
        """The tags of `block_hashes`, equal to `block_checksum_tags`'."""
        if len(block_hashes) > self.limit:
            return block_checksum_tags(block_hashes, fingerprint)
        run = (fingerprint, tuple(block_hashes))
        tags = self._runs.get(run)
        if tags is None:
            tags = self._tags_of(block_hashes, fingerprint)
            self._keep_run(run, tags)
        return tags.copy()  # the caller's to change

    def _tags_of(self, block_hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
        """The tags from those kept per hash, hashing the ones not kept."""
        tags = self._tags.setdefault(fingerprint, {})
        missing = list(dict.fromkeys(filterfalse(tags.__contains__, block_hashes)))
        if missing:
            if self.size + len(missing) > self.limit:
                self._forget()
                tags = self._tags.setdefault(fingerprint, {})
                missing = list(dict.fromkeys(block_hashes))
            values = block_checksum_tags(missing, fingerprint).tolist()
            tags.update(zip(missing, values))
            self.size += len(missing)
        return np.fromiter(
            map(tags.__getitem__, block_hashes),
            dtype=np.uint64,
            count=len(block_hashes),
        )

    def _keep_run(self, run: tuple[int, tuple[bytes, ...]], tags: np.ndarray) -> None:
        """Remember a run's tags, forgetting every run first at the bound."""
        if self.run_rows + len(tags) > self.limit:
            self._runs.clear()
            self.run_rows = 0
        self._runs[run] = tags
        self.run_rows += len(tags)

    def _forget(self) -> None:
        """Forget every tag and run (a run is kept no longer than its tags)."""
        self._tags.clear()
        self._runs.clear()
        self.size = self.run_rows = 0


def position_hashes(
    block_hashes: Sequence[bytes],
    start: int,
    count: int,
    block_size: int,
    hash_block_size: int | None,
) -> list[bytes] | None:
    """The request's hash at the last token of each position, None if missing.

    Position p of a group with block size bs holds hash blocks up to
    (p + 1) * bs / hash_block_size; its identity is that last hash (R120).
    """
    per_block = block_size // (hash_block_size or block_size)
    first = (start + 1) * per_block - 1
    last = (start + count) * per_block - 1
    if per_block < 1 or (count and last >= len(block_hashes)):
        return None
    return list(block_hashes[first : last + 1 : per_block])


def verify_offloaded_load(
    reports: Mapping[WorkerKey, KVChecksumWorkerReport],
    scheduled: KVChecksumBlocks,
    num_workers: int,
    block_hashes: Sequence[bytes],
    block_sizes: Mapping[int, int],
    hash_block_size: int | None,
    tags_of: TagsFn = block_checksum_tags,
) -> KVChecksumVerdict:
    """Compares each worker's loaded-block checksums with the stored entries.

    Groups no worker stored entries for are not compared; a load with no
    compared group and no other reason is verified (R120). Bad positions are
    the union over workers. `tags_of` computes the tags (e.g. a
    `BlockTagCache`).
    """
    verdict = KVChecksumVerdict(KVChecksumStatus.UNVERIFIED)
    detail = completeness_detail(len(reports), num_workers)
    if detail is not None:
        verdict.reasons.append((UnverifiedReason.NOT_ALL_WORKERS, detail))
        return verdict
    for group_id in sorted(scheduled.groups):
        start, block_ids = scheduled.groups[group_id]
        entries = {
            key: report.groups[group_id]
            for key, report in reports.items()
            if group_id in report.groups and report.groups[group_id].stored is not None
        }
        if not entries:
            continue
        detail = other_blocks_detail(reports, group_id, start, len(block_ids))
        if detail is not None:
            reason = UnverifiedReason.OTHER_BLOCKS
            verdict.reasons.append((reason, f"group {group_id}: {detail}"))
            continue
        hashes = position_hashes(
            block_hashes, start, len(block_ids), block_sizes[group_id], hash_block_size
        )
        if hashes is None:
            reason = UnverifiedReason.OTHER_BLOCKS
            detail = "the request has no block hash for a loaded position"
            verdict.reasons.append((reason, f"group {group_id}: {detail}"))
            continue
        bad = np.zeros(len(block_ids), dtype=bool)
        # TP ranks of one PP stage share a fingerprint: hash once per value.
        tags_by_fingerprint: dict[int, np.ndarray] = {}
        for key, entry in entries.items():
            fingerprint = reports[key].fingerprints.get(group_id, 0)
            tags = tags_by_fingerprint.get(fingerprint)
            if tags is None:
                tags = tags_of(hashes, fingerprint)
                tags_by_fingerprint[fingerprint] = tags
            # integer reductions wrap modulo 2^64 without a warning
            sums = entry.values.sum(axis=1, dtype=np.uint64)
            assert entry.stored is not None
            bad |= (sums ^ tags) != entry.stored.astype(np.uint64, copy=False)
        verdict.compared_groups.append(group_id)
        if bad.any():
            verdict.mismatches[group_id] = (start + np.flatnonzero(bad)).tolist()
    if verdict.mismatches:
        verdict.status = KVChecksumStatus.MISMATCH
    elif not verdict.reasons:
        verdict.status = KVChecksumStatus.VERIFIED
    return verdict
