# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An offload tier's entry moves waiting for the worker's next launch.

While a connector keeps a step's copies back until the checksum pass (issue
30), its loads' restores and its stores' entry writes and copies to host slots
wait here and ride in the pass's one upload. A store's entries may also wait
longer (`defer`): its host copy is read by no load until vLLM learned that the
store completed, and vLLM holds the stored GPU blocks unchanged until then, so
its entries need to be queued on the device only by the step that reports the
completion, or by any earlier launch they can ride in.
"""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
    EntryCopy,
    EntryRestore,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.block_table import (
    EntryRows,
    merge_entry_rows,
)

# Deferred stores' blocks kept at most; more and they are made at once.
DEFERRED_BLOCKS_LIMIT = 1024

# (restores, copies, entry rows) in the order a launch makes them.
EntryMoves = tuple[list[EntryRestore], list[EntryCopy], list[EntryRows]]


@dataclass
class QueuedEntryMoves:
    """Restores, entry rows and copies for the next launch; the deferred
    ones (a store's rows and copies) wait until `take` or a flush asks."""

    restores: list[EntryRestore] = field(default_factory=list)
    rows: list[EntryRows] = field(default_factory=list)
    copies: list[EntryCopy] = field(default_factory=list)
    deferred_rows: list[EntryRows] = field(default_factory=list)
    deferred_copies: list[EntryCopy] = field(default_factory=list)
    deferred_blocks: int = 0

    def add(
        self,
        rows: list[EntryRows],
        copy: EntryCopy | None,
        restore: EntryRestore | None,
        defer: bool = False,
    ) -> None:
        """Queue a save's moves; `defer`: its rows and copy may wait for the
        store's completion (the restore never waits)."""
        if restore is not None and len(restore.slots):
            self.restores.append(restore)
        copies = [copy] if copy is not None and len(copy.slots) else []
        if defer:
            self.deferred_rows += rows
            self.deferred_copies += copies
            # A store's blocks: its copy has one slot each, its rows at most
            # one each (those whose entry is not held already).
            written = sum(r.rows.shape[1] for r in rows)
            self.deferred_blocks += max(written, sum(len(c.slots) for c in copies))
        else:
            self.rows += rows
            self.copies += copies

    def due(self) -> bool:
        """Whether moves wait that this step must make (or deferred ones
        past their bound)."""
        return bool(
            self.restores
            or self.rows
            or self.copies
            or self.deferred_blocks > DEFERRED_BLOCKS_LIMIT
        )

    def pending(self) -> bool:
        """Whether any move waits, deferred ones included."""
        return self.due() or bool(self.deferred_rows or self.deferred_copies)

    def take(self) -> EntryMoves:
        """Every waiting move, deferred ones included (their rows and copies
        first: they were queued in earlier steps), the queue emptied; entry
        writes of one group and destination joined (one kernel for all)."""
        taken = (
            self.restores,
            self.deferred_copies + self.copies,
            merge_entry_rows(self.deferred_rows + self.rows),
        )
        self.restores, self.rows, self.copies = [], [], []
        self.deferred_rows, self.deferred_copies = [], []
        self.deferred_blocks = 0
        return taken
