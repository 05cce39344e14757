# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Full blocks whose stored entries a worker writes (R118, R142): as runs of
consecutive positions, or as parallel per-block arrays; where a save also
copies them (`EntryCopy`), and which entries a load brings back in the same
upload (`EntryRestore`)."""

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# (group id, first position, block ids at consecutive positions, the request's
# block hash at each block's last token)
BlockRun = tuple[int, int, Sequence[int], Sequence[bytes]]


def _as_int64(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _as_objects(values: Sequence[bytes]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


@dataclass(frozen=True, eq=False)
class FullBlocks:
    """Full blocks whose entries to write, as parallel per-block arrays.

    `hashes` (an object array of bytes) holds each block's request hash at
    its last token. Iterating yields the equivalent `BlockRun`s (maximal runs
    of consecutive positions of one group, in array order), for readers that
    want runs; the block table consumes the arrays directly (R142).
    """

    groups: np.ndarray
    positions: np.ndarray
    block_ids: np.ndarray
    hashes: np.ndarray

    @classmethod
    def from_runs(cls, runs: Iterable[BlockRun]) -> "FullBlocks":
        """The blocks of `runs`, in run order."""
        groups: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        hashes: list[bytes] = []
        for group_id, start, block_ids, block_hashes in runs:
            count = len(block_ids)
            groups.append(np.full(count, group_id, dtype=np.int64))
            positions.append(start + np.arange(count, dtype=np.int64))
            ids.append(_as_int64(block_ids))
            hashes.extend(block_hashes[:count])
        if not groups:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty, _as_objects([]))
        return cls(
            np.concatenate(groups),
            np.concatenate(positions),
            np.concatenate(ids),
            _as_objects(hashes),
        )

    def select(self, mask: np.ndarray) -> "FullBlocks":
        """The blocks where `mask` is true, in the same order."""
        return FullBlocks(
            self.groups[mask],
            self.positions[mask],
            self.block_ids[mask],
            self.hashes[mask],
        )

    def _run_bounds(self) -> list[int]:
        cut = (np.diff(self.groups) != 0) | (np.diff(self.positions) != 1)
        return [0, *(np.flatnonzero(cut) + 1).tolist(), len(self.block_ids)]

    def __len__(self) -> int:
        return len(self._run_bounds()) - 1 if len(self.block_ids) else 0

    def __bool__(self) -> bool:
        """Whether any block is here, without cutting runs (`__len__` does,
        with NumPy over every block: a truth test on a store's blocks would
        pay it, issue 30)."""
        return bool(len(self.block_ids))

    def __iter__(self) -> Iterator[BlockRun]:
        bounds = self._run_bounds() if len(self.block_ids) else [0]
        for lo, hi in zip(bounds, bounds[1:]):
            yield (
                int(self.groups[lo]),
                int(self.positions[lo]),
                self.block_ids[lo:hi].tolist(),
                self.hashes[lo:hi].tolist(),
            )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (FullBlocks, list, tuple)):
            return list(self) == list(other)
        return NotImplemented


@dataclass
class EntryMove:
    """Parallel block ids and host slots of an entry move: one slot per block.
    Unequal lengths raise when the move is made, so no later step packs or
    folds it (assigning one array's row from the other would broadcast a
    single block id over every slot, or a single slot over every block)."""

    block_ids: np.ndarray
    slots: np.ndarray

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.slots):
            raise ValueError(
                f"entry move of {len(self.block_ids)} blocks to {len(self.slots)} slots"
            )


@dataclass
class EntryCopy(EntryMove):
    """Entries a save also copies elsewhere: `dest[slots[i]]` = the table's
    entry of `block_ids[i]` once written (an offload tier's host slots, R118).
    The indices ride in the save's own upload."""

    dest: torch.Tensor


@dataclass
class EntryRestore(EntryMove):
    """Entries a load brings back: the table's entry of `block_ids[i]` =
    `source[slots[i]]` (an offload tier's host slots, R118), queued before
    the save they travel with writes anything."""

    source: torch.Tensor


def move_indices(moved: EntryMove) -> np.ndarray:
    """A move's (block ids, slots, 0) as int64 [3, n], ready to pack into an
    upload."""
    indices = np.empty((3, len(moved.slots)), dtype=np.int64)
    indices[0] = moved.block_ids
    indices[1] = moved.slots
    indices[2] = 0
    return indices
