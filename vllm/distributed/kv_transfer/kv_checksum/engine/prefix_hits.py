# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verifying local prefix-cache hits against the entries recorded at caching (R140).

When vLLM caches a full block, the entry of the offload tier (R116-R118: the
block's checksum XOR the tag of its hash and the model fingerprint) is written
by the workers after the forward that computed it. A request that hits cached
blocks has them checksummed again in the step it first runs on them and is
compared with those entries like a load of offloaded KV (R120): a "load" from
the local prefix cache. Plain bookkeeping over block ids; no vLLM objects.
"""

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.entries import (
    BlockTagCache,
    position_hashes,
    verify_offloaded_load,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.loads import PendingOffloadLoad
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
    UnverifiedReason,
)

# A hit check travels in records under the request id, this marker and the
# check's number, apart from the request's own loads of the same step: a
# request restarted while its check is in flight can hit again before that
# check's step reports, and each check is judged on its own step's reports.
HIT_KEY_SUFFIX = "#kv-checksum-prefix-hit"

# (group id, first position, block ids, the request's hash at each block's end)
SaveRun = tuple[int, int, np.ndarray, list[bytes]]


def hit_key(req_id: str, number: int) -> str:
    """The record key of a request's prefix-hit check `number`."""
    return f"{req_id}{HIT_KEY_SUFFIX}{number}"


def hit_request_id(key: str) -> str:
    """The request id of a prefix-hit check's record key."""
    return key.rpartition(HIT_KEY_SUFFIX)[0]


def _position_runs(
    positions: np.ndarray, block_ids: np.ndarray
) -> Sequence[tuple[np.ndarray, np.ndarray]]:
    """(positions, block ids) of each stretch of consecutive positions, which
    are strictly increasing; one run without a gap (the usual case) is found
    without a pass over them."""
    if int(positions[-1]) - int(positions[0]) == positions.size - 1:
        return ((positions, block_ids),)
    breaks = np.flatnonzero(positions[1:] - positions[:-1] != 1) + 1
    return list(zip(np.split(positions, breaks), np.split(block_ids, breaks)))


@dataclass
class PrefixHitStep:
    """What the workers do for prefix hits in one step."""

    saves: list[SaveRun] = field(default_factory=list)
    checks: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    # every hit registered this step, checked or not (no entry)
    keys: list[str] = field(default_factory=list)


@dataclass
class PendingPrefixHit(PendingOffloadLoad):
    """A request's hit check; `unchecked` hit blocks had no entry; `attempt`
    is the request's preemption count when its hit was checked (a request
    preempted since then no longer runs on the checked blocks)."""

    unchecked: int = 0
    attempt: int = 0
    # Each checked block's generation at the check (`still_cached`).
    generations: np.ndarray | None = None

    def judge(self, verdict: KVChecksumVerdict) -> KVChecksumVerdict:
        """The check's verdict from the comparison of its checked blocks: a
        hit with blocks without an entry is unverified, never mismatched."""
        if verdict.status == KVChecksumStatus.VERIFIED and (
            self.unchecked or not verdict.compared_groups
        ):
            verdict.status = KVChecksumStatus.UNVERIFIED
            detail = f"{self.unchecked} hit blocks have no entry"
            verdict.reasons.append((UnverifiedReason.OTHER_BLOCKS, detail))
        return verdict


class KVChecksumPrefixHits:
    """Entries of cached blocks and the pending checks of prefix hits (R140).

    State is bounded by the cached blocks: an entry lives while its block is
    reachable in the prefix cache under the entry's hash key.
    """

    def __init__(
        self,
        num_blocks: int,
        group_id: int,
        block_size: int,
        hash_block_size: int | None,
        num_workers: int,
    ) -> None:
        self.group_id = group_id
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.num_workers = num_workers
        self.has_entry = np.zeros(num_blocks, dtype=bool)
        # Entries the workers were asked to write in an earlier step (handed
        # over by `take_step`): an offload store of such a block copies the
        # entry instead of checksumming the block again (issue 30).
        self.entry_handed = np.zeros(num_blocks, dtype=bool)
        # block id -> the prefix-cache key the entry was recorded under
        self.entry_keys: dict[int, Hashable] = {}
        self.pending: dict[str, PendingPrefixHit] = {}
        self._num_checks = 0  # numbers the checks' record keys
        self._step = PrefixHitStep()
        # Tags of hit blocks: a shared prefix is hashed once, not per hit.
        self.tags = BlockTagCache(num_blocks)
        # Per block, bumped whenever it enters or leaves the prefix cache: a
        # checked block whose generation is unchanged is still the block
        # that was checked.
        self.generation = np.zeros(num_blocks, dtype=np.int64)

    @property
    def num_entries(self) -> int:
        return len(self.entry_keys)

    def on_cached(
        self,
        request: Any,
        positions: np.ndarray,
        block_ids: np.ndarray,
        keys: Sequence[Hashable],
    ) -> None:
        """Record the entries of blocks vLLM just cached at `positions`
        (strictly increasing, as vLLM caches them)."""
        if positions.size == 0:
            return
        self.entry_handed[block_ids] = False  # written again from this step
        self.generation[block_ids] += 1
        for pos, ids in _position_runs(positions, block_ids):
            hashes = position_hashes(
                request.block_hashes,
                int(pos[0]),
                len(pos),
                self.block_size,
                self.hash_block_size,
            )
            if hashes is None:
                continue
            self._step.saves.append((self.group_id, int(pos[0]), ids, hashes))
            self.has_entry[ids] = True
        self.entry_keys.update(zip(block_ids.tolist(), keys))

    def on_evicted(self, block_ids: list[int]) -> None:
        """Drop the entries of blocks no prefix-cache key reaches any more
        (evicted by vLLM), all of one call of vLLM's at once (R142)."""
        if not block_ids:
            return
        entry_keys = self.entry_keys
        for block_id in block_ids:
            entry_keys.pop(block_id, None)
        index = np.array(block_ids, dtype=np.intp)  # converted once for both
        self.has_entry[index] = False
        self.entry_handed[index] = False
        self.generation[index] += 1

    def clear(self) -> None:
        """The prefix cache was reset: every entry is gone."""
        self.entry_keys.clear()
        self.has_entry[:] = False
        self.entry_handed[:] = False
        self.generation += 1

    def release(self) -> None:
        """Verification stopped: every entry, pending check and the step's
        saves and checks are dropped (R141)."""
        self.clear()
        self.pending.clear()
        self._step = PrefixHitStep()

    def add_hits(self, request: Any, block_ids: np.ndarray, attempt: int) -> None:
        """Check the request's hit blocks (positions 0..) in this step;
        `attempt`: the request's preemption count now.

        The leading blocks with entries are checked; a hit without any entry is
        reported unverified (never mismatched, R140).
        """
        if block_ids.size == 0:
            return
        with_entry = self.has_entry[block_ids]
        count = int(block_ids.size)
        if not with_entry.all():
            count = int(with_entry.argmin())  # the first block without one
        blocks = KVChecksumBlocks(
            count * self.block_size, {self.group_id: (0, block_ids[:count])}
        )
        load = PendingPrefixHit(
            blocks,
            request,
            unchecked=int(block_ids.size) - count,
            attempt=attempt,
            generations=self.generation[block_ids[:count]],
        )
        self._num_checks += 1
        key = hit_key(request.request_id, self._num_checks)
        self.pending[key] = load
        self._step.keys.append(key)
        if count:
            self._step.checks[key] = blocks

    def add_check(self, load: PendingPrefixHit, check: bool) -> str:
        """Register a check built elsewhere (an external load, R147) in this
        step, its blocks checksummed if `check`; returns its record key."""
        self._num_checks += 1
        key = hit_key(load.request.request_id, self._num_checks)
        self.pending[key] = load
        self._step.keys.append(key)
        group = load.blocks.groups.get(self.group_id)
        if group is not None:
            load.generations = self.generation[np.asarray(group[1], dtype=np.int64)]
        if check:
            self._step.checks[key] = load.blocks
        return key

    def skip_saves(self, block_ids: np.ndarray) -> None:
        """This step writes no entry of `block_ids` from their KV: their
        entries are brought back from elsewhere (an external load, R147).
        One pass per save run, not per block."""
        if not block_ids.size or not self._step.saves:
            return
        saves: list[SaveRun] = []
        for group_id, start, ids, hashes in self._step.saves:
            keep = ~np.isin(ids, block_ids)
            if keep.all():
                saves.append((group_id, start, ids, hashes))
                continue
            positions = start + np.flatnonzero(keep)
            for pos, kept in _position_runs(positions, ids[keep]) if keep.any() else ():
                first = int(pos[0]) - start
                run_hashes = hashes[first : first + len(pos)]
                saves.append((group_id, int(pos[0]), kept, run_hashes))
        self._step.saves = saves

    def take_step(self) -> PrefixHitStep:
        """This step's saves and checks for the workers, then reset."""
        step, self._step = self._step, PrefixHitStep()
        for _, _, ids, _ in step.saves:
            # Not for a block evicted since it was recorded (no entry now).
            self.entry_handed[ids] = self.has_entry[ids]
        return step

    def entries_written(self, groups: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
        """Per block, whether the workers already hold its entry: recorded
        and handed over in an earlier step, and the block not evicted since.

        Such an entry was taken from the KV as computed, so a copy of the
        block made later (an offload store) is checked against it, not
        against a checksum of whatever the block holds by then.
        """
        # A handed-over entry is dropped with its block (`on_evicted`,
        # `clear`) and re-recorded on caching (`on_cached`): no `has_entry`
        # test needed here.
        return self.entry_handed[block_ids] & (groups == self.group_id)

    def verify(self, key: str) -> tuple[PendingPrefixHit, KVChecksumVerdict] | None:
        """The verdict of one pending check, now that its step's reports are in."""
        load = self.pending.pop(key, None)
        if load is None:
            return None
        verdict = verify_offloaded_load(
            load.reports,
            load.blocks,
            self.num_workers,
            load.request.block_hashes,
            {self.group_id: self.block_size},
            self.hash_block_size,
            self.tags,
        )
        return load, load.judge(verdict)

    def bad_blocks(
        self, load: PendingOffloadLoad, verdict: KVChecksumVerdict
    ) -> list[tuple[int, int]]:
        """(position, block id) of the mismatched blocks of a check, in
        position order."""
        start, ids = load.blocks.groups[self.group_id]
        positions = np.unique(
            np.asarray(verdict.mismatches.get(self.group_id, ()), dtype=np.int64)
        )
        block_ids = np.asarray(ids)[positions - start]
        return list(zip(positions.tolist(), block_ids.tolist()))

    def still_cached(
        self, load: PendingOffloadLoad, bad: list[tuple[int, int]]
    ) -> set[int]:
        """Those of a check's bad (position, block id) whose block has not left
        or re-entered the prefix cache since the check: still the block
        that was checked (a block freed since may be another request's)."""
        generations = getattr(load, "generations", None)
        if generations is None:
            return {block_id for _, block_id in bad}
        start, _ = load.blocks.groups[self.group_id]
        return {
            block_id
            for position, block_id in bad
            if self.generation[block_id] == generations[position - start]
        }

    def request_ids(self) -> list[str]:
        """The requests whose checks wait for their step's reports (R141)."""
        return [load.request.request_id for load in self.pending.values()]


_block_id = attrgetter("block_id")
_block_hash = attrgetter("block_hash")


class PrefixHitEntryListener:
    """Keeps the entries in step with the prefix cache: full blocks cached
    get an entry, blocks no key reaches lose theirs, a reset drops all.

    The listener interface of the block pool (`BlockPoolListener` of the
    in-tree series, called by vLLM's pool there); on vLLM 0.33.0 the plugin's
    block-pool hooks make the same calls. `live()` is False once
    verification stopped; `on_error(where)` turns it off after an error.
    """

    def __init__(
        self,
        hits: KVChecksumPrefixHits,
        live: Callable[[], bool],
        on_error: Callable[[str], None],
    ) -> None:
        self.hits = hits
        self.live = live
        self.on_error = on_error

    def on_blocks_cached(
        self,
        request: Any,
        blocks: Sequence[Any],
        positions: Sequence[int],
        kv_cache_group_id: int,
        block_size: int,
    ) -> None:
        """Record the entries of full blocks vLLM just cached (positions
        strictly increasing), read with C-level maps (R142)."""
        if not blocks or kv_cache_group_id != self.hits.group_id or not self.live():
            return
        try:
            ids = np.fromiter(map(_block_id, blocks), dtype=np.int64, count=len(blocks))
            keys = list(map(_block_hash, blocks))
            self.hits.on_cached(
                request, np.asarray(positions, dtype=np.int64), ids, keys
            )
        except Exception:
            self.on_error("recording entries")

    def on_blocks_uncached(self, block_ids: Sequence[int]) -> None:
        """Drop the entries of blocks that lost every prefix-cache key."""
        entry_keys = self.hits.entry_keys
        if not entry_keys or not self.live():
            return
        try:
            gone = [block_id for block_id in block_ids if block_id in entry_keys]
            if gone:
                self.hits.on_evicted(gone)
        except Exception:
            self.on_error("dropping entries")

    def on_prefix_cache_reset(self) -> None:
        """The prefix cache was reset: every entry is gone."""
        if not self.live():
            return
        try:
            self.hits.clear()
        except Exception:
            self.on_error("resetting entries")
