# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verifying KV a connector loads back from an external cache (R147).

The entries the prefix-hit path records when vLLM caches a full block (R140:
the block's checksum XOR the tag of its hash and the model fingerprint,
R116-R118) are also copied, by block hash, into a bounded table of slots on
each worker that outlives the GPU block. A load no other path verifies (not
a P/D receive, not an offload load with stored entries: R119) is checked in
the step the request first runs on the loaded blocks, like a prefix hit: the
entries of its blocks are moved from their slots back into the block table
and the loaded KV is checksummed against them. Plain bookkeeping; no vLLM
objects.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, TypeGuard

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
    PendingPrefixHit,
    SaveRun,
)
from vllm.distributed.kv_transfer.kv_checksum.offload.entries import (
    position_hashes,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
    UnverifiedReason,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# Bytes an entry takes: its int64 slot on each worker's device, and in the
# scheduler its dict item, owner pointer and the 32-byte hash object (about).
DEVICE_BYTES_PER_ENTRY = 8
HOST_BYTES_PER_ENTRY = 200

# (block ids, slots) of entry moves between the block table and the slots.
EntryMoves = tuple[np.ndarray, np.ndarray]

_EMPTY = np.zeros(0, dtype=np.int64)


class ExternalEntryTable:
    """Slots of entries by block hash, at most `limit`, first in first out.

    A hash keeps the slot of its first entry: connectors store a prefix once
    and load that copy back, so the first computation is the one to compare
    with. A slot reused for another hash leaves its old dict item stale; a
    lookup checks the slot's owner, and the dict is rebuilt from the owners
    when stale items would double it. No Python loop per block (R142).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.slot_of: dict[bytes, int] = {}
        self.owners = np.full(limit, None, dtype=object)
        self.next = 0
        self.count = 0

    def lookup(self, hashes: Sequence[bytes]) -> np.ndarray:
        """The slot of each hash's entry, -1 where there is none."""
        if not hashes:
            return _EMPTY
        slots = np.fromiter(
            map(self.slot_of.get, hashes, repeat(-1)),
            dtype=np.int64,
            count=len(hashes),
        )
        found = np.flatnonzero(slots >= 0)
        if found.size:
            stale = self.owners[slots[found]] != _objects(hashes)[found]
            slots[found[stale]] = -1
        return slots

    def add(self, hashes: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Give a slot to each hash that has none; returns (indices into
        `hashes`, their slots), the entries to copy there. A hash appearing
        twice gets one slot; past the limit the oldest entries go."""
        missing = np.flatnonzero(self.lookup(hashes) < 0)
        if not missing.size:
            return _EMPTY, _EMPTY
        first = dict(zip(_objects(hashes)[missing].tolist(), missing.tolist()))
        keys = list(first)
        index = np.fromiter(first.values(), dtype=np.int64, count=len(first))
        if len(keys) > self.limit:
            keys, index = keys[-self.limit :], index[-self.limit :]
        n = len(keys)
        slots = (self.next + np.arange(n, dtype=np.int64)) % self.limit
        self.next = int((self.next + n) % self.limit)
        self.owners[slots] = _objects(keys)
        self.slot_of.update(zip(keys, slots.tolist()))
        self.count = min(self.count + n, self.limit)
        if len(self.slot_of) > 2 * self.limit:
            self.slot_of = dict(zip(self.owners.tolist(), range(self.limit)))
            self.slot_of.pop(None, None)  # type: ignore[call-overload]
        return index, slots

    def clear(self) -> None:
        self.slot_of.clear()
        self.owners[:] = None
        self.next = self.count = 0


def _objects(values: Sequence[bytes]) -> np.ndarray:
    """A 1-D object array of `values` (NumPy would make bytes a string array)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


@dataclass
class PendingExternalLoad(PendingPrefixHit):
    """A check of an external load: `missing` marks its blocks without an
    entry (compared with whatever the table holds, so their results are
    dropped)."""

    missing: np.ndarray = field(default_factory=lambda: _EMPTY.astype(bool))

    def judge(self, verdict: KVChecksumVerdict) -> KVChecksumVerdict:
        """The load's verdict from the comparison of its blocks (R147): a
        block with no entry is unverified with a reason, never mismatched."""
        missing = int(self.missing.sum())
        if missing == self.missing.size:  # nothing was checked
            verdict = KVChecksumVerdict(KVChecksumStatus.UNVERIFIED)
        elif missing:
            start, _ = next(iter(self.blocks.groups.values()))
            unchecked = start + np.flatnonzero(self.missing)
            for group_id, positions in list(verdict.mismatches.items()):
                kept = np.setdiff1d(np.asarray(positions), unchecked).tolist()
                if kept:
                    verdict.mismatches[group_id] = kept
                else:
                    del verdict.mismatches[group_id]
        if missing:
            detail = f"{missing} of {self.missing.size} loaded blocks"
            verdict.reasons.append((UnverifiedReason.NO_ENTRY, detail))
        if verdict.mismatches:
            verdict.status = KVChecksumStatus.MISMATCH
        elif verdict.reasons or not verdict.compared_groups:
            verdict.status = KVChecksumStatus.UNVERIFIED
            if not verdict.reasons:
                detail = "no loaded group was compared"
                verdict.reasons.append((UnverifiedReason.NO_LOADED_GROUP, detail))
        else:
            verdict.status = KVChecksumStatus.VERIFIED
        return verdict

    def bad_positions(self, verdict: KVChecksumVerdict, fail_closed: bool) -> list:
        """(position, block id) of the blocks the request must not run on:
        the mismatched ones; under fail-closed also those never checked."""
        start, ids = next(iter(self.blocks.groups.values()))
        bad = np.zeros(len(ids), dtype=bool)
        for positions in verdict.mismatches.values():
            bad[np.asarray(positions, dtype=np.int64) - start] = True
        if fail_closed and verdict.status == KVChecksumStatus.UNVERIFIED:
            bad |= self.missing
            if not bad.any():  # unverified for another reason: all of it
                bad[:] = True
        at = np.flatnonzero(bad)
        return list(zip((start + at).tolist(), np.asarray(ids)[at].tolist()))


@dataclass
class ExternalLoad:
    """A started load of full blocks at positions [start, start + count)."""

    request: Any
    start: int
    block_ids: np.ndarray


class KVChecksumExternalLoads:
    """The entry table and the external loads waiting for their check (R147)."""

    def __init__(
        self,
        limit: int,
        group_id: int,
        block_size: int,
        hash_block_size: int | None,
    ) -> None:
        self.table = ExternalEntryTable(limit)
        self.group_id = group_id
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        # request id -> its external load not yet checked
        self.loads: dict[str, ExternalLoad] = {}

    def note(
        self, request: Any, block_ids: Sequence[int], num_local: int, num_external: int
    ) -> None:
        """A starting load of `num_external` tokens after `num_local` local
        ones that no other path verifies; its full blocks are checked."""
        bs = self.block_size
        start = -(-num_local // bs)
        end = (num_local + num_external) // bs
        if end <= start:
            return
        ids = np.asarray(block_ids[start:end], dtype=np.int64)
        self.loads[request.request_id] = ExternalLoad(request, start, ids)

    def loaded_ids(self) -> np.ndarray:
        """Block ids of the loads not yet checked: their entries, taken from
        loaded KV, never join the table."""
        if not self.loads:
            return _EMPTY
        return np.concatenate([load.block_ids for load in self.loads.values()])

    def check(
        self, load: ExternalLoad, block_ids: np.ndarray, computed: int
    ) -> tuple[PendingExternalLoad, EntryMoves] | None:
        """The check of a load whose request runs now on `block_ids` (its
        blocks from the load's start) with `computed` tokens before this
        step, and the entries to restore for it; None if the request no
        longer holds the loaded blocks."""
        count = min(load.block_ids.size, computed // self.block_size - load.start)
        if count <= 0 or not np.array_equal(block_ids[:count], load.block_ids[:count]):
            return None
        ids = load.block_ids[:count]
        hashes = position_hashes(
            load.request.block_hashes,
            load.start,
            count,
            self.block_size,
            self.hash_block_size,
        )
        slots = (
            np.full(count, -1, dtype=np.int64)
            if hashes is None
            else self.table.lookup(hashes)
        )
        found = slots >= 0
        blocks = KVChecksumBlocks(
            (load.start + count) * self.block_size,
            {self.group_id: (load.start, ids)},
        )
        pending = PendingExternalLoad(
            blocks,
            load.request,
            unchecked=int(count - found.sum()),
            attempt=load.request.num_preemptions,
            missing=~found,
        )
        return pending, (ids[found], slots[found])

    def keep(self, saves: Sequence[SaveRun], skip: np.ndarray) -> EntryMoves:
        """Slots for this step's entries of blocks this engine computed (not
        those in `skip`, loaded); returns (block ids, slots) to copy."""
        runs = [run for run in saves if len(run[2])]
        if not runs:
            return _EMPTY, _EMPTY
        ids = np.concatenate([np.asarray(run[2], dtype=np.int64) for run in runs])
        hashes = list(chain.from_iterable(run[3] for run in runs))
        if skip.size:
            kept = np.flatnonzero(~np.isin(ids, skip))
            ids = ids[kept]
            hashes = _objects(hashes)[kept].tolist()
        index, slots = self.table.add(hashes)
        return ids[index], slots

    def request_ids(self) -> list[str]:
        """The requests whose loads wait for their check (R141)."""
        return list(self.loads)

    def release(self) -> None:
        """Verification stopped: every entry and waiting load dropped (R141)."""
        self.table.clear()
        self.loads.clear()


def is_external(load: Any) -> TypeGuard[PendingExternalLoad]:
    """Whether a pending check is an external load's (R147)."""
    return isinstance(load, PendingExternalLoad)


def judge_external(
    kcs: Any, req_id: str, load: Any, verdict: KVChecksumVerdict
) -> list[tuple[int, int]] | None:
    """R147: `judge` for an external load's check; None for another check
    (a local prefix hit's). Prefix-hit verification's `judge_external`."""
    return judge(kcs, req_id, load, verdict) if is_external(load) else None


def judge(
    kcs: Any, req_id: str, load: PendingExternalLoad, verdict: KVChecksumVerdict
) -> list[tuple[int, int]]:
    """R147: log and count an external load's verdict like a load's (R96,
    R130) and tell the connector of a failure (R121); returns the (position,
    block id) of the blocks the request must not run on: the mismatched
    ones, and under fail-closed those left unverified (R95)."""
    kcs.log.log(req_id, verdict, load.blocks)
    kcs.stats.record_external_load(verdict)
    if verdict.status == KVChecksumStatus.VERIFIED:
        return []
    bad = load.bad_positions(verdict, kcs.fail_closed)
    if bad:
        kcs.offload.report_failure(req_id, load, verdict)
        logger.error(
            "KV checksums: external load of request %s failed verification "
            "(%s) at group %d block positions %s (block ids %s); the blocks "
            "leave the prefix cache and the request is recomputed or failed "
            "per kv_load_failure_policy.",
            req_id,
            verdict.status.value,
            next(iter(load.blocks.groups)),
            [position for position, _ in bad],
            [block_id for _, block_id in bad],
        )
    return bad


class ExternalLoadChecks:
    """One scheduler's external-load verification (R147), a part of its
    prefix-hit verification (`PrefixHitVerifier.external`), whose entries,
    checks and recovery it shares: in each step it notes the loads that no
    P/D receive or offload load registered, turns those whose requests run
    now into checks whose entries come back from their slots first, and
    gives the step's new entries slots."""

    def __init__(self, loads: KVChecksumExternalLoads, kcs: Any) -> None:
        self.loads = loads
        self.kcs = kcs
        self.entries_sent: int | None = None
        # Block ids of the loads checked this step.
        self.checked: list[np.ndarray] = []

    @classmethod
    def create(cls, kcs: Any, hits: Any, limit: int) -> "ExternalLoadChecks":
        loads = KVChecksumExternalLoads(
            limit, hits.group_id, hits.block_size, hits.hash_block_size
        )
        kcs.tracked_sources.append(loads.request_ids)  # R141
        logger.info(
            "KV checksums verify external-cache loads against up to %d entries "
            "(%.1f MiB on each worker's device, about %.0f MiB here).",
            limit,
            limit * DEVICE_BYTES_PER_ENTRY / 2**20,
            limit * HOST_BYTES_PER_ENTRY / 2**20,
        )
        return cls(loads, kcs)

    def release(self) -> None:
        self.loads.release()
        self.checked.clear()

    def note_loads(self, starting: list, output: Any, kv_cache_manager: Any) -> None:
        """The loads this step's `schedule_step` registered that no P/D
        receive or offload load checks (R119): each is an external load,
        checked when its request runs on it."""
        consumer = self.kcs.consumer
        scheduled = output.num_scheduled_tokens
        for request, _, num_external in starting:
            req_id = request.request_id
            if consumer.pending(req_id) is not None:
                continue  # a P/D receive or an offload load checks it (R119)
            local = (
                request.num_computed_tokens - scheduled.get(req_id, 0) - num_external
            )
            block_ids = kv_cache_manager.get_block_ids(req_id)[self.loads.group_id]
            self.loads.note(request, block_ids, local, num_external)

    def add_checks(
        self,
        hits: Any,
        output: Any,
        requests: Any,
        kv_cache_manager: Any,
    ) -> EntryMoves | None:
        """Checks of the loads whose requests run this step; returns the
        (block ids, slots) whose entries come back before the checks read
        them."""
        from vllm.v1.request import RequestStatus

        loads = self.loads
        if not loads.loads:
            return None
        restores: list[EntryMoves] = []
        for req_id, load in list(loads.loads.items()):
            request = load.request
            if requests.get(req_id) is not request or request.is_finished():
                del loads.loads[req_id]  # R141: freed or aborted before its check
                continue
            if request.status != RequestStatus.RUNNING:
                continue  # still loading, or not scheduled yet
            del loads.loads[req_id]
            ids = np.asarray(
                kv_cache_manager.get_block_ids(req_id)[loads.group_id], np.int64
            )
            scheduled = output.num_scheduled_tokens.get(req_id, 0)
            computed = request.num_computed_tokens - scheduled
            checked = loads.check(load, ids[load.start :], computed)
            if checked is None:
                logger.debug(
                    "KV checksums: external load of request %s not checked: "
                    "the request no longer holds the loaded blocks.",
                    req_id,
                )
                continue
            pending, restore = checked
            self.checked.append(load.block_ids)
            hits.add_check(pending, check=bool(restore[0].size))
            if restore[0].size:
                hits.skip_saves(restore[0])
                restores.append(restore)
        if not restores:
            return None
        return (
            np.concatenate([ids for ids, _ in restores]),
            np.concatenate([slots for _, slots in restores]),
        )

    def keep_entries(self, output: Any, restore: EntryMoves | None) -> None:
        """The step's entry writes of computed blocks get slots, copied after
        the writes; the restores join the step's checksum metadata; the entry
        count is reported when it changed."""
        from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
            KVChecksumScheduled,
        )

        meta = output.kv_checksum_scheduled
        saves = [] if meta is None else meta.blocks_to_save
        checked, self.checked = self.checked, []
        if not saves and restore is None:
            return  # most steps (R142)
        # Blocks of loads, checked this step or not yet: their entries were
        # taken from loaded KV, not computed here.
        loaded = np.concatenate([self.loads.loaded_ids(), *checked])
        ids, slots = self.loads.keep(saves, loaded)
        if restore is not None or ids.size:
            if meta is None:
                meta = output.kv_checksum_scheduled = KVChecksumScheduled()
            meta.entries_to_restore = restore
            meta.entries_to_keep = (ids, slots) if ids.size else None
        count = self.loads.table.count
        if count != self.entries_sent:
            self.kcs.stats.external_entries = count
            self.entries_sent = count
