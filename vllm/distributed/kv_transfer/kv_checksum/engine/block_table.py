# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's block checksum table: one stored entry per KV cache block.

An entry is the block's partial checksum summed over columns, XOR the tag of
its hash (R117). The offload tier moves entries with the KV they describe and
loads compare against them (R118-R120); prefix-cache hits check the entries of
locally cached blocks (R140).
"""

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    block_checksum_tags,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import (
    host_to_device,
    pack_segments,
    segment_rows,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
from vllm.distributed.kv_transfer.kv_checksum.engine.plans import GroupPlans

# (group id, first position, block ids at consecutive positions, the request's
# block hash at each block's last token)
BlockRun = tuple[int, int, Sequence[int], Sequence[bytes]]


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
        """Write the entries of full blocks (R118).

        Runs of unregistered groups (or not in `groups`, when given) are
        ignored. Queued on the current stream, after the forward that wrote
        the blocks and before the connector reads them.
        """
        table = self.tensor
        if table is None:
            return
        # One launch per group for every run of the call (a step's stores).
        by_group: dict[int, list[tuple[str, KVChecksumBlocks]]] = {}
        hashes: dict[int, list[bytes]] = {}
        for group_id, start, block_ids, block_hashes in runs:
            allowed = self.stored_groups if groups is None else groups
            if group_id not in allowed or not len(block_ids):
                continue
            size = self.groups[group_id].block_size
            ids = np.asarray(block_ids, dtype=np.int64)
            requests = by_group.setdefault(group_id, [])
            blocks = KVChecksumBlocks(
                (start + len(ids)) * size, {group_id: (start, ids)}
            )
            requests.append((str(len(requests)), blocks))
            hashes.setdefault(group_id, []).extend(block_hashes)
        for group_id, requests in by_group.items():
            self._save_group_entries(table, group_id, requests, hashes[group_id])

    def _save_group_entries(
        self,
        table: torch.Tensor,
        group_id: int,
        requests: list[tuple[str, KVChecksumBlocks]],
        block_hashes: list[bytes],
    ) -> None:
        """Entries of one group's runs: one launch, one table write (R118)."""
        plans = self.groups[group_id]
        rows = segment_rows(requests, group_id, plans.block_size)[3]
        count = rows.shape[1]
        packed, _ = pack_segments([rows])
        out = torch.zeros(
            (count, plans.load.width), dtype=torch.int64, device=self.topology.device
        )
        device = self.topology.device
        plans.load.run(host_to_device(packed, device)[:, :count], out)
        tags = block_checksum_tags(block_hashes, plans.fingerprint).view(np.int64)
        entries = out.sum(dim=1) ^ host_to_device(tags, device)
        table[host_to_device(rows[0], device)] = entries
