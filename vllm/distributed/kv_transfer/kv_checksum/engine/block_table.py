# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's block checksum table: one stored entry per KV cache block.

An entry is the block's partial checksum summed over columns, XOR the tag of
its hash (R117). The offload tier moves entries with the KV they describe and
loads compare against them (R118-R120); prefix-cache hits check the entries of
locally cached blocks (R140).
"""

from collections.abc import Iterable

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    block_checksum_tags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
    BlockRun,
    FullBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import (
    host_to_device,
    pack_segments,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
from vllm.distributed.kv_transfer.kv_checksum.engine.plans import GroupPlans


class BlockChecksumTable:
    """Writes and reads the stored entries of full blocks (R117, R118, R140),
    for the groups an offload connector or the prefix cache registered."""

    def __init__(self, groups: dict[int, GroupPlans], topology: WorkerTopology):
        self.groups = groups
        self.topology = topology
        self.tensor: torch.Tensor | None = None
        # Groups whose entries offloaded-KV loads (R117) and prefix hits read.
        self.stored_groups: set[int] = set()
        self.prefix_groups: set[int] = set()

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

    def read_groups(self, kind: str) -> set[int]:
        """The groups whose entries a pass of `kind` reads with its checksums."""
        if kind == "load":
            return self.stored_groups
        return self.prefix_groups if kind == "check" else set()

    def save(self, runs: Iterable[BlockRun], groups: set[int] | None = None) -> None:
        """Write the entries of full blocks (R118); `runs` may be a
        `FullBlocks`, consumed without a Python loop over runs or blocks.

        Runs of unregistered groups (or not in `groups`, when given) are
        ignored. Queued on the current stream, after the forward that wrote
        the blocks and before the connector reads them.
        """
        table = self.tensor
        if table is None:
            return
        blocks = runs if isinstance(runs, FullBlocks) else FullBlocks.from_runs(runs)
        if not len(blocks.block_ids):
            return
        allowed = self.stored_groups if groups is None else groups
        # One launch per group for every block of the call (a step's stores),
        # groups in the order they first appear.
        present, first = np.unique(blocks.groups, return_index=True)
        for group_id in present[np.argsort(first)].tolist():
            if group_id not in allowed:
                continue
            mask = blocks.groups == group_id
            self._save_group_entries(
                table,
                group_id,
                blocks.block_ids[mask],
                blocks.positions[mask],
                blocks.hashes[mask].tolist(),
            )

    def _save_group_entries(
        self,
        table: torch.Tensor,
        group_id: int,
        block_ids: np.ndarray,
        positions: np.ndarray,
        block_hashes: list[bytes],
    ) -> None:
        """Entries of one group's full blocks: one upload, one launch, one
        table write (R118). The rows and the tags travel in one pinned array."""
        plans = self.groups[group_id]
        size = plans.block_size
        count = len(block_ids)
        rows = np.empty((3, count), dtype=np.int64)
        rows[0] = block_ids
        rows[1] = positions * size
        rows[2] = size
        tags = np.zeros((3, count), dtype=np.int64)
        tags[0] = block_checksum_tags(block_hashes, plans.fingerprint).view(np.int64)
        packed, (_, tag_column) = pack_segments([rows, tags])
        uploaded = host_to_device(packed, self.topology.device)
        out = torch.zeros(
            (count, plans.load.width), dtype=torch.int64, device=self.topology.device
        )
        plans.load.run(uploaded[:, :count], out)
        entries = out.sum(dim=1) ^ uploaded[0, tag_column : tag_column + count]
        table[uploaded[0, :count]] = entries
