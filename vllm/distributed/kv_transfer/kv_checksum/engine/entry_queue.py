# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An offload tier's entry moves waiting for the worker's next launch.

While a connector keeps a step's copies back until the checksum pass (issue
30), its loads' restores and its stores' entry writes and copies to host slots
wait here and ride in the pass's one upload.
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

# (restores, copies, entry rows) in the order a launch makes them.
EntryMoves = tuple[list[EntryRestore], list[EntryCopy], list[EntryRows]]


@dataclass
class QueuedEntryMoves:
    """Restores, entry rows and copies for the step's next launch."""

    restores: list[EntryRestore] = field(default_factory=list)
    rows: list[EntryRows] = field(default_factory=list)
    copies: list[EntryCopy] = field(default_factory=list)

    def add(
        self,
        rows: list[EntryRows],
        copy: EntryCopy | None,
        restore: EntryRestore | None,
    ) -> None:
        """Queue a save's moves (empty ones left out)."""
        if restore is not None and len(restore.slots):
            self.restores.append(restore)
        if copy is not None and len(copy.slots):
            self.copies.append(copy)
        self.rows += rows

    def due(self) -> bool:
        """Whether any move waits."""
        return bool(self.restores or self.rows or self.copies)

    def take(self) -> EntryMoves:
        """Every waiting move, the queue emptied; entry writes of one group
        and destination joined (one kernel for all)."""
        taken = (self.restores, self.copies, merge_entry_rows(self.rows))
        self.restores, self.rows, self.copies = [], [], []
        return taken
