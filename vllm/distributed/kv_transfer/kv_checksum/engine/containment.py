# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Containment of loads that failed verification (R138).

A load that did not verify must not spread: its bad blocks, and every later
block of the request, never serve another request through the prefix cache.

- Fail-open: the request still runs on its loaded KV (the operator's choice),
  but its blocks from the first bad position on are kept out of the prefix
  cache for as long as the request holds them.
- Fail-closed: the request fails through vLLM's load-failure path ("recompute"
  frees the blocks and recomputes the prompt, "fail" ends the request); until
  its blocks are freed they are kept out of the prefix cache the same way.
- A load that ends unverified is contained like a mismatch under fail-closed
  (from its first loaded position); under fail-open it is cached as vLLM
  caches it without checksums.

Quarantine starts at the first bad *token* over all groups: the block holding
that token in every KV cache group, and all later blocks of the group. A
group whose own loaded blocks verified is included because the request's
later blocks in it are computed over the bad KV of the other group, and vLLM
may hold several blocks with one hash, so a lookup that found clean copies of
the bad group's blocks elsewhere could otherwise continue into them.

This module is plain bookkeeping: group ids, block positions and sizes. The
wiring (`wiring._attach_containment`) applies it to vLLM's KV cache
manager: it evicts the hashes of quarantined blocks through vLLM's own
`BlockPool.evict_blocks` right after vLLM caches them, before any other request
can look them up, and releases the request when vLLM frees its blocks.
"""

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.metrics import KVChecksumStats
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "KVChecksumContainment",
    "first_bad_positions",
    "quarantine_start",
    "quarantined_block_ids",
    "count_quarantined",
]


def first_bad_positions(
    verdict: KVChecksumVerdict, blocks: KVChecksumBlocks, fail_closed: bool
) -> dict[int, int]:
    """group id -> first bad block position of a load's verdict.

    A mismatch: each mismatching group's first reported position. An
    unverified load under fail-closed: each loaded group's first position (the
    whole load is suspect). Otherwise (verified, or unverified fail-open):
    nothing.
    """
    if verdict.status == KVChecksumStatus.MISMATCH:
        return {g: min(p) for g, p in verdict.mismatches.items() if len(p)}
    if verdict.status == KVChecksumStatus.UNVERIFIED and fail_closed:
        return {g: int(start) for g, (start, _) in blocks.groups.items()}
    return {}


def quarantine_start(
    first_bad: Mapping[int, int],
    block_sizes: Mapping[int, int],
    state_groups: Collection[int] = (),
    loaded_starts: Mapping[int, int] | None = None,
) -> dict[int, int]:
    """group id -> first quarantined block position, for every group.

    The first bad token is the earliest token of any group's first bad block;
    every group is quarantined from the block holding that token on. Empty if
    nothing is bad (or no bad group has a known block size).

    `state_groups` (Mamba) hold one running-state block per request, recorded
    at position 0 whatever the load's range: they set the start only when no
    other group is bad, and then from the other groups' first loaded position
    (`loaded_starts`), so a load after a local prefix hit never quarantines
    the shared hit blocks before it.
    """

    def tokens_of(positions: Mapping[int, int]) -> list[int]:
        return [
            p * block_sizes[g]
            for g, p in positions.items()
            if g in block_sizes and g not in state_groups
        ]

    tokens = tokens_of(first_bad)
    if not tokens and any(g in state_groups for g in first_bad):
        tokens = tokens_of(loaded_starts or {})
    if not tokens:
        tokens = [p * block_sizes[g] for g, p in first_bad.items() if g in block_sizes]
    if not tokens:
        return {}
    token = min(tokens)
    return {g: token // size for g, size in block_sizes.items()}


def count_quarantined(blocks: KVChecksumBlocks, start: Mapping[int, int]) -> int:
    """Loaded blocks of `blocks` at or after their group's quarantine start."""
    total = 0
    for group_id, (first, ids) in blocks.groups.items():
        q = start.get(group_id)
        if q is not None:
            total += max(0, len(ids) - max(0, q - int(first)))
    return total


def quarantined_block_ids(
    block_ids: Sequence[Sequence[int]] | Sequence[np.ndarray],
    start: Mapping[int, int],
    null_block_id: int = 0,
) -> np.ndarray:
    """Block ids of a request's block table (per group, position order) at or
    after each group's quarantine start, null blocks left out."""
    parts = [
        np.asarray(block_ids[g][q:], dtype=np.int64)
        for g, q in sorted(start.items())
        if g < len(block_ids)
    ]
    if not parts:
        return np.empty(0, dtype=np.int64)
    ids = np.concatenate(parts)
    return ids[ids != null_block_id]


def _describe(start: Mapping[int, int]) -> str:
    return "; ".join(
        f"group {g} from block position {p}" for g, p in sorted(start.items())
    )


class KVChecksumContainment:
    """Which requests' blocks are quarantined, and from which positions (R138).

    `on_failed_load` is the checksum scheduler's callback for every load that
    did not verify; `start` answers the wiring's question after vLLM caches a
    request's blocks; `release` forgets a request once vLLM freed its blocks
    (a recomputed or resumed request computes its KV anew and is cached as
    usual).
    """

    def __init__(
        self,
        block_sizes: Mapping[int, int],
        fail_closed: bool,
        stats: KVChecksumStats | None = None,
        state_groups: Collection[int] = (),
    ) -> None:
        self.block_sizes = dict(block_sizes)
        self.state_groups = frozenset(state_groups)
        self.fail_closed = fail_closed
        self.stats = stats if stats is not None else KVChecksumStats()
        self._quarantined: dict[str, dict[int, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._quarantined)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._quarantined

    def on_failed_load(
        self, req_id: str, verdict: KVChecksumVerdict, blocks: KVChecksumBlocks
    ) -> dict[int, int]:
        """Quarantine a load that did not verify; returns group -> first
        quarantined position (empty: nothing to contain)."""
        first_bad = first_bad_positions(verdict, blocks, self.fail_closed)
        loaded = {g: int(first) for g, (first, _) in blocks.groups.items()}
        start = quarantine_start(first_bad, self.block_sizes, self.state_groups, loaded)
        if not start:
            return {}
        previous = self._quarantined.get(req_id)
        if previous is not None:  # keep the earlier start of each group
            start = {g: min(p, previous.get(g, p)) for g, p in start.items()}
        self._quarantined[req_id] = start
        count = count_quarantined(blocks, start)
        self.stats.record_quarantined(count)
        # The mismatch itself is the error (R96); this says what became of it.
        log = (
            logger.info if verdict.status == KVChecksumStatus.MISMATCH else logger.debug
        )
        log(
            "KV checksums: quarantined %d loaded blocks of request %s (%s): "
            "kept out of the prefix cache.",
            count,
            req_id,
            _describe(start),
        )
        return dict(start)

    def start(self, req_id: str) -> dict[int, int] | None:
        """group -> first quarantined position of a request, or None."""
        return self._quarantined.get(req_id)

    def release(self, req_id: str) -> None:
        """Forget a request whose blocks vLLM freed."""
        self._quarantined.pop(req_id, None)

    def request_ids(self) -> list[str]:
        """The quarantined requests (R141: state released when vLLM frees them)."""
        return list(self._quarantined)
