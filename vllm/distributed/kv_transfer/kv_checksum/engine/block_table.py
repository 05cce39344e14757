# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's block checksum table: one stored entry per KV cache block.

An entry is the block's partial checksum summed over columns, XOR the tag of
its hash (R117). The offload tier moves entries with the KV they describe and
loads compare against them (R118-R120); prefix-cache hits check the entries of
locally cached blocks (R140).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    block_checksum_tags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.entry_kernels import (
    entry_kernels,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
    BlockRun,
    EntryCopy,
    EntryRestore,
    FullBlocks,
    move_indices,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import (
    upload_segments,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
from vllm.distributed.kv_transfer.kv_checksum.engine.plans import GroupPlans


@dataclass(frozen=True, eq=False)
class EntryRows:
    """The host side of one group's entry write: the kernel's rows (block id,
    first token, valid tokens) and the blocks' hash tags in row 0 of `tags`
    (both int64 [3, n], ready to pack into an upload). With `dest` (an
    offload tier's host slots), row 1 of `tags` holds each block's slot and
    the same write puts its entry there too (`fold_copy`)."""

    group_id: int
    rows: np.ndarray
    tags: np.ndarray
    dest: torch.Tensor | None = None


class BlockChecksumTable:
    """Writes and reads the stored entries of full blocks (R117, R118, R140),
    for the groups an offload connector or the prefix cache registered."""

    def __init__(self, groups: dict[int, GroupPlans], topology: WorkerTopology):
        self.groups = groups
        self.topology = topology
        self.tensor: torch.Tensor | None = None
        # Entry writes and moves (PyTorch operations, shared per device).
        self.kernels = entry_kernels(topology.device)
        # Groups whose entries offloaded-KV loads (R117) and prefix hits read.
        self.stored_groups: set[int] = set()
        self.prefix_groups: set[int] = set()
        # Block ids whose entries an offload store wrote in this step (reset
        # by `new_step`): their prefix entries are the same, not computed
        # again (issue 30).
        self._stored_this_step: list[np.ndarray] = []

    def init(self, group_ids: Iterable[int]) -> torch.Tensor:
        """Register the groups a connector offloads; return the table (R117).

        One int64 tensor on the KV cache's device, the same on every call; the
        connector moves a block's entry wherever it moves the block's KV.
        Groups this worker cannot checksum are not registered.
        """
        self.stored_groups.update(g for g in group_ids if g in self.groups)
        if self.tensor is None:
            self.tensor = torch.zeros(
                self.topology.num_blocks, dtype=torch.int64, device=self.topology.device
            )
        return self.tensor

    def enable_prefix_entries(self) -> None:
        """Entries of locally cached blocks of every covered group (R140)."""
        self.init(())
        self.prefix_groups = set(self.groups)

    def warm_up(self) -> None:
        """Run the device operations of an entry write once on scratch
        tensors (sum over columns, XOR, index select and copy), so a lazily loaded
        CUDA module is loaded at start-up, not in the first step that stores
        blocks (R62: an H200 trace showed 37 ms in these operations over the
        first six stores)."""
        device = self.topology.device
        scratch = torch.zeros((2, 2), dtype=torch.int64, device=device)
        index = torch.zeros(1, dtype=torch.int64, device=device)
        entries = scratch.sum(dim=1)[:1]
        entries.bitwise_xor_(scratch[0, :1])
        scratch[0].index_copy_(0, index, entries)
        scratch[1].index_copy_(0, index, scratch[0].index_select(0, index))

    def new_step(self) -> None:
        """A new engine step: forget the blocks the last one stored."""
        if self._stored_this_step:
            self._stored_this_step = []

    def prefix_blocks_to_write(self, runs: Iterable[BlockRun]) -> FullBlocks:
        """The blocks vLLM cached this step (R140), less those an offload
        store of this step already wrote: one checksum per block."""
        blocks = runs if isinstance(runs, FullBlocks) else FullBlocks.from_runs(runs)
        if self._stored_this_step and len(blocks.block_ids):
            done = np.isin(blocks.block_ids, np.concatenate(self._stored_this_step))
            if done.any():
                blocks = blocks.select(~done)
        return blocks

    def prefix_entry_rows(self, runs: Iterable[BlockRun]) -> list[EntryRows]:
        """Host rows of this step's prefix entries, for the worker's launcher
        to write in the step's one upload and launch (issue 30)."""
        if self.tensor is None:
            return []
        return self.entry_rows(self.prefix_blocks_to_write(runs), self.prefix_groups)

    def read_groups(self, kind: str) -> set[int]:
        """The groups whose entries a pass of `kind` reads with its checksums."""
        if kind == "load":
            return self.stored_groups
        return self.prefix_groups if kind == "check" else set()

    def save(
        self,
        runs: Iterable[BlockRun],
        groups: set[int] | None = None,
        copy: EntryCopy | None = None,
        restore: EntryRestore | None = None,
    ) -> None:
        """Write the entries of full blocks (R118); `runs` may be a
        `FullBlocks`, consumed without a Python loop over runs or blocks.

        Runs of unregistered groups (or not in `groups`, when given) are
        ignored. Queued on the current stream, after the forward that wrote
        the blocks and before the connector reads them. `copy`, if given,
        puts entries in their slots: each written block's with its write
        (`fold_copy`), the rest's after every write, their indices in the
        last group's upload (issue 30: one pinned upload per save). `restore`, if
        given, is queued first, its indices in the first group's upload: a
        step's load and store entries in one upload (issue 30).
        """
        table = self.tensor
        if table is None:
            return
        blocks = runs if isinstance(runs, FullBlocks) else FullBlocks.from_runs(runs)
        copied = copy if copy is not None and len(copy.slots) else None
        restored = restore if restore is not None and len(restore.slots) else None
        if not len(blocks.block_ids) and copied is None and restored is None:
            return  # most steps (R142: no per-step work when nothing is saved)
        allowed = self.stored_groups if groups is None else groups
        # One launch per group for every block of the call (a step's stores),
        # groups in the order they first appear.
        per_group, rest = fold_copy(self.entry_rows(blocks, allowed), copied)
        for i, entry_rows in enumerate(per_group):
            last = i == len(per_group) - 1
            self._save_group_entries(
                entry_rows, rest if last else None, restored if i == 0 else None
            )
        if copy is not None:  # a store: its blocks' entries are in
            self._note_stored(blocks, per_group)
        if not per_group and (rest is not None or restored is not None):
            self._move_entries(rest, restored)

    def store_entry_rows(self, runs: Iterable[BlockRun]) -> list[EntryRows]:
        """Host rows of an offload store's entries (R118), for the worker's
        launcher to write in the step's one upload (issue 30); its blocks
        count as written this step, as a `save` with a copy does."""
        if self.tensor is None:
            return []
        blocks = runs if isinstance(runs, FullBlocks) else FullBlocks.from_runs(runs)
        if not len(blocks.block_ids):
            return []
        per_group = self.entry_rows(blocks, self.stored_groups)
        self._note_stored(blocks, per_group)
        return per_group

    def _note_stored(self, blocks: FullBlocks, per_group: list[EntryRows]) -> None:
        """The blocks of `per_group`'s groups are written this step: the
        step's prefix entries skip them (`prefix_blocks_to_write`); nothing
        to note without prefix entries."""
        if not per_group or not self.prefix_groups:
            return
        kept = [entry_rows.group_id for entry_rows in per_group]
        written = blocks.block_ids
        if not (blocks.groups == kept[0]).all():  # R142: usually one group
            written = written[np.isin(blocks.groups, kept)]
        self._stored_this_step.append(written)

    def _move_entries(
        self, copy: EntryCopy | None, restore: EntryRestore | None
    ) -> None:
        """A save with no block to checksum: `restore` then `copy`, their
        indices in one upload."""
        moves = [moved for moved in (restore, copy) if moved is not None]
        uploaded, columns = upload_segments(
            [move_indices(moved) for moved in moves], self.topology.device
        )
        at = iter(columns)
        if restore is not None:
            self.restore_from(uploaded, next(at), restore)
        if copy is not None:
            self.copy_to(uploaded, next(at), copy)

    def restore_from(
        self, uploaded: torch.Tensor, column: int, restore: EntryRestore
    ) -> None:
        """Queue `restore` (the table's entries back from host slots), its
        `move_indices` uploaded at `column` of `uploaded`."""
        assert self.tensor is not None
        end = column + len(restore.slots)
        self.kernels.move(
            restore.source,
            uploaded[1, column:end],
            self.tensor,
            uploaded[0, column:end],
        )

    def copy_to(self, uploaded: torch.Tensor, column: int, copy: EntryCopy) -> None:
        """Queue `copy` (the table's entries into host slots), its
        `move_indices` uploaded at `column` of `uploaded`."""
        assert self.tensor is not None
        end = column + len(copy.slots)
        self.kernels.move(
            self.tensor, uploaded[0, column:end], copy.dest, uploaded[1, column:end]
        )

    def entry_rows(self, blocks: FullBlocks, allowed: set[int]) -> list[EntryRows]:
        """Per allowed group, in the order groups first appear, the rows and
        tags of its blocks' entry write (R118), without a Python loop over
        blocks (R142)."""
        ordered, single = _groups_in_order(blocks.groups, allowed)
        per_group = []
        for group_id in ordered:
            if single:
                # One group, the usual case: the arrays as they are (R142).
                ids, positions, hashes = (
                    blocks.block_ids,
                    blocks.positions,
                    blocks.hashes,
                )
            else:
                mask = blocks.groups == group_id
                ids = blocks.block_ids[mask]
                positions = blocks.positions[mask]
                hashes = blocks.hashes[mask]
            plans = self.groups[group_id]
            rows = np.empty((3, len(ids)), dtype=np.int64)
            rows[0] = ids
            rows[1] = positions * plans.block_size
            rows[2] = plans.block_size
            tags = np.zeros((3, len(ids)), dtype=np.int64)
            tags[0] = block_checksum_tags(hashes.tolist(), plans.fingerprint).view(
                np.int64
            )
            per_group.append(EntryRows(group_id, rows, tags))
        return per_group

    def write_entries(
        self,
        sums: torch.Tensor,
        tags: torch.Tensor,
        block_ids: torch.Tensor,
        slots: torch.Tensor | None = None,
        dest: torch.Tensor | None = None,
    ) -> None:
        """Queue the table write of entries from a launch's output `sums`
        [n, width], the blocks' `tags` and ids (device tensors), and with
        `slots`, the same entries into `dest[slots]` (R117, R118)."""
        assert self.tensor is not None
        self.kernels.write(sums, tags, block_ids, self.tensor, slots, dest)

    def _save_group_entries(
        self,
        entry_rows: EntryRows,
        copy: EntryCopy | None = None,
        restore: EntryRestore | None = None,
    ) -> None:
        """Entries of one group's full blocks: one upload, one launch, one
        table write (R118), into their host slots too when `entry_rows`
        carries them (`fold_copy`); `restore`'s entries are moved first, and
        `copy`'s slots get their blocks' entries last. The rows, the tags,
        both's (block id, slot) indices and the zeroed launch output travel
        in one pinned array (issue 30: no device allocation or fill of its
        own per save)."""
        assert self.tensor is not None
        plan = self.groups[entry_rows.group_id].load
        count = entry_rows.rows.shape[1]
        width = plan.width
        moves = [m for m in (copy, restore) if m is not None]
        parts = [entry_rows.rows, entry_rows.tags, *map(move_indices, moves)]
        uploaded, columns = upload_segments(
            parts, self.topology.device, reserve=(count * width,)
        )
        out_column = columns[-1]
        row0 = uploaded[0]  # one view for every row-0 slice (issue 30)
        if restore is not None:
            self.restore_from(uploaded, columns[-2], restore)
        out = row0[out_column : out_column + count * width].view(count, width)
        plan.run(uploaded[:, :count], out)
        at, dest = columns[1], entry_rows.dest
        slots = None if dest is None else uploaded[1, at : at + count]
        self.write_entries(out, row0[at : at + count], row0[:count], slots, dest)
        if copy is not None:
            self.copy_to(uploaded, columns[2], copy)


def fold_copy(
    per_group: list[EntryRows], copy: EntryCopy | None
) -> tuple[list[EntryRows], EntryCopy | None]:
    """A store's copy to host slots folded into its entry writes (issue 30):
    each written block's slot rides in row 1 of its tags (set in place), so
    one write puts its entry in the table and in the slot. Returned: the
    writes, and the copy of the blocks no write covers (entries the table
    already holds), None if it covers them all. A group with a block the
    copy does not take stays apart. No Python loop over blocks (R142)."""
    if copy is None or not len(copy.slots) or not per_group:
        return per_group, copy
    ids, slots = copy.block_ids, copy.slots
    if len(per_group) == 1 and np.array_equal(per_group[0].rows[0], ids):
        first = per_group[0]  # every stored block written, in store order
        first.tags[1] = slots
        return [EntryRows(first.group_id, first.rows, first.tags, copy.dest)], None
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    covered = np.zeros(len(ids), dtype=bool)
    folded = []
    for entry_rows in per_group:  # one per group (R142: usually one)
        written = entry_rows.rows[0]
        at = np.minimum(np.searchsorted(sorted_ids, written), len(ids) - 1)
        if not np.array_equal(sorted_ids[at], written):
            folded.append(entry_rows)
            continue
        index = order[at]
        entry_rows.tags[1] = slots[index]
        covered[index] = True
        folded.append(
            EntryRows(entry_rows.group_id, entry_rows.rows, entry_rows.tags, copy.dest)
        )
    if covered.all():
        return folded, None
    rest = ~covered
    return folded, EntryCopy(ids[rest], slots[rest], copy.dest)


def merge_entry_rows(per_group: Sequence[EntryRows]) -> list[EntryRows]:
    """Entry writes of one group and one destination joined into one (a
    launch then makes one write of them, issue 30), in first-seen order;
    as they are when a block id appears twice (a single write would leave
    either entry)."""
    if len(per_group) < 2:
        return list(per_group)
    keyed: dict[tuple[int, int], list[EntryRows]] = {}
    for entry_rows in per_group:
        key = (entry_rows.group_id, id(entry_rows.dest))
        keyed.setdefault(key, []).append(entry_rows)
    if len(keyed) == len(per_group):
        return list(per_group)
    merged = []
    for parts in keyed.values():
        if len(parts) == 1:
            merged += parts
            continue
        rows = np.concatenate([p.rows for p in parts], axis=1)
        if len(np.unique(rows[0])) != rows.shape[1]:
            merged += parts
            continue
        tags = np.concatenate([p.tags for p in parts], axis=1)
        merged.append(EntryRows(parts[0].group_id, rows, tags, parts[0].dest))
    return merged


def _groups_in_order(groups: np.ndarray, allowed: set[int]) -> tuple[list[int], bool]:
    """The allowed group ids of `groups`, in the order they first appear, and
    whether every block is of one group (its arrays then need no mask)."""
    # One C pass over the ids, no NumPy call: a store's few dozen blocks
    # (R142; NumPy's fixed cost is most of the time at these sizes).
    ordered = list(dict.fromkeys(groups.tolist()))
    return [g for g in ordered if g in allowed], len(ordered) <= 1
