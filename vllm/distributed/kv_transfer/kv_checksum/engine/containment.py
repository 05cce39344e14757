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

The quarantine is vLLM's own mark, `KVCacheManager.stop_caching(request,
first bad token)` (`Request.max_cacheable_tokens`): no block holding a token
at or after it enters the prefix cache or an offload tier, those already
cached lose their hashes at once, and vLLM drops the mark when it frees the
request's blocks unfinished (a recomputed or resumed request computes its KV
anew). This module computes the position and sets the mark
(`attach_containment`, called by vLLM's Scheduler, and by the plugin's
wiring with its emulation of the mark on vLLM 0.33.0); the request holds
the mark, so nothing here outlives it. Tiers that already hold copies of the
request's blocks (the CPU offload tier) are told through the checksum
scheduler's `contained_listeners`.
"""

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

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

# vLLM's mark on a request (`KVCacheManager.stop_caching`): at most this many
# leading tokens of its KV may be cached or offloaded.
MARK_ATTR = "max_cacheable_tokens"

# stop_caching(request id, first token not to cache) -> the request's limit
# now (the lowest of its marks), or None when vLLM does not hold the request.
StopCachingFn = Callable[[str, int], "int | None"]
# limit_of(request id) -> the request's limit, or None.
LimitFn = Callable[[str], "int | None"]
# contained(request id, group -> first quarantined block position): a tier
# holding copies of the request's blocks drops those from the position on.
ContainedFn = Callable[[str, Mapping[int, int]], None]

__all__ = [
    "KVChecksumContainment",
    "attach_containment",
    "quarantine_token",
    "first_bad_positions",
    "quarantine_start",
    "quarantined_block_ids",
    "count_quarantined",
]


def first_bad_positions(
    verdict: KVChecksumVerdict, blocks: KVChecksumBlocks, fail_closed: bool
) -> dict[int, int]:
    """Group id -> first bad block position of a load's verdict.

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
    """Group id -> first quarantined block position, for every group: the
    block holding `quarantine_token` and every later one. Empty if nothing is
    bad (or no bad group has a known block size)."""
    token = quarantine_token(first_bad, block_sizes, state_groups, loaded_starts)
    return {} if token is None else starts_of(token, block_sizes)


def starts_of(token: int, block_sizes: Mapping[int, int]) -> dict[int, int]:
    """Group id -> position of the block holding `token`."""
    return {g: token // size for g, size in block_sizes.items()}


def quarantine_token(
    first_bad: Mapping[int, int],
    block_sizes: Mapping[int, int],
    state_groups: Collection[int] = (),
    loaded_starts: Mapping[int, int] | None = None,
) -> int | None:
    """The first bad token: the earliest token of any group's first bad
    block; None if nothing is bad (or no bad group has a known block size).

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
    return min(tokens) if tokens else None


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
    """Sets vLLM's "do not cache" mark on the requests whose loads failed
    (R138), and answers from which positions a request is quarantined.

    `on_failed_load` is the checksum scheduler's callback for every load that
    did not verify. `stop_caching` / `limit_of` set and read the mark on the
    request vLLM holds; without them (no vLLM, e.g. unit tests) the marks are
    kept here and `release` forgets one.
    """

    def __init__(
        self,
        block_sizes: Mapping[int, int],
        fail_closed: bool,
        stats: KVChecksumStats | None = None,
        state_groups: Collection[int] = (),
        stop_caching: StopCachingFn | None = None,
        limit_of: LimitFn | None = None,
        listeners: list[ContainedFn] | None = None,
    ) -> None:
        self.block_sizes = dict(block_sizes)
        self.state_groups = frozenset(state_groups)
        self.fail_closed = fail_closed
        self.stats = stats if stats is not None else KVChecksumStats()
        self.listeners = listeners if listeners is not None else []
        self._limits: dict[str, int] = {}
        self._stop_caching = stop_caching or self._stop_caching_here
        self._limit_of = limit_of or self._limits.get

    def _stop_caching_here(self, req_id: str, token: int) -> int:
        limit = min(token, self._limits.get(req_id, token))
        self._limits[req_id] = limit
        return limit

    def __bool__(self) -> bool:
        """Whether marks are kept here (never when vLLM holds them)."""
        return bool(self._limits)

    def __contains__(self, req_id: object) -> bool:
        return isinstance(req_id, str) and self._limit_of(req_id) is not None

    def on_failed_load(
        self, req_id: str, verdict: KVChecksumVerdict, blocks: KVChecksumBlocks
    ) -> dict[int, int]:
        """Quarantine a load that did not verify; returns group -> first
        quarantined position (empty: nothing to contain)."""
        first_bad = first_bad_positions(verdict, blocks, self.fail_closed)
        loaded = {g: int(first) for g, (first, _) in blocks.groups.items()}
        token = quarantine_token(first_bad, self.block_sizes, self.state_groups, loaded)
        if token is None:
            return {}
        limit = self._stop_caching(req_id, token)
        if limit is None:
            return {}  # vLLM no longer holds the request
        start = starts_of(limit, self.block_sizes)
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
        for contained in self.listeners:
            contained(req_id, start)
        return start

    def start(self, req_id: str) -> dict[int, int] | None:
        """Group -> first quarantined position of a request, or None."""
        limit = self._limit_of(req_id)
        return None if limit is None else starts_of(limit, self.block_sizes)

    def release(self, req_id: str) -> None:
        """Forget a request's mark kept here (vLLM drops its own)."""
        self._limits.pop(req_id, None)

    def request_ids(self) -> list[str]:
        """The requests whose marks are kept here (R141)."""
        return list(self._limits)


def attach_containment(
    kcs: Any,
    kv_cache_config: Any,
    requests: Mapping[str, Any],
    stop_caching: Callable[[Any, int], None],
) -> KVChecksumContainment | None:
    """Contain the failed loads of a checksum scheduler (R138): build the
    containment over the engine's KV cache groups and hand it every load that
    did not verify. `requests`: the Scheduler's requests by id;
    `stop_caching(request, num_tokens)`: `KVCacheManager.stop_caching`.
    Errors inside are logged and never reach vLLM."""
    from vllm.v1.kv_cache_interface import MambaSpec

    def mark(req_id: str, num_tokens: int) -> int | None:
        request = requests.get(req_id)
        if request is None:
            return None
        stop_caching(request, num_tokens)
        return getattr(request, MARK_ATTR, None)

    def limit_of(req_id: str) -> int | None:
        return getattr(requests.get(req_id), MARK_ATTR, None)

    groups = kv_cache_config.kv_cache_groups
    containment = KVChecksumContainment(
        {g: group.kv_cache_spec.block_size for g, group in enumerate(groups)},
        kcs.fail_closed,
        kcs.stats,
        state_groups=[
            g
            for g, group in enumerate(groups)
            if isinstance(group.kv_cache_spec, MambaSpec)
        ],
        stop_caching=mark,
        limit_of=limit_of,
        listeners=kcs.contained_listeners,
    )

    def on_failed_load(
        req_id: str, verdict: KVChecksumVerdict, blocks: KVChecksumBlocks
    ) -> None:
        try:
            containment.on_failed_load(req_id, verdict, blocks)
        except Exception:
            logger.exception("KV checksum containment failed for request %s", req_id)

    kcs.on_failed_load = on_failed_load
    return containment
