# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's launch plans, built once at start-up from its KV cache views.

Per covered KV cache group, views sharing a layout are fused into one kernel
launch per pass (R46, R61): P/D receives per chunk over every view, P/D sends
per chunk over replica 0, offloaded-KV loads per block (R135, R117).
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    SEND_COLUMN_KEY,
    ReplicaKey,
    chunk_tokens,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import KVChecksumLaunch
from vllm.distributed.kv_transfer.kv_checksum.definition.views import (
    ChecksumView,
    GroupViews,
    UncoveredGroup,
    WorkerTopology,
    chunk_pieces,
    plan_group_views,
)
from vllm.distributed.kv_transfer.kv_checksum.hybrid.views import plan_mamba_views
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

logger = init_logger(__name__)


@dataclass(frozen=True)
class ChecksumPlan:
    """The launches of one group pass and what its output columns hold.

    Output column c * len(replica_keys) + k holds token chunk c of the row's
    block (R135) over the views of replica key k (R46); a send plan folds its
    replica-0 views into one key. With `chunks` > 1 the rows are read back as
    one value per chunk, in position order.
    """

    replica_keys: tuple[ReplicaKey, ...]
    launches: tuple[KVChecksumLaunch, ...]
    chunks: int = 1

    @property
    def width(self) -> int:
        """Output columns of one row."""
        return self.chunks * len(self.replica_keys)

    @classmethod
    def build(
        cls,
        views: Sequence[ChecksumView],
        block_size: int,
        chunked: bool = True,
        fold_keys: bool = False,
    ) -> "ChecksumPlan":
        """Fuse chunk views sharing one layout into one launch each (R46, R61).

        `chunked`: one value per chunk of `chunk_tokens(block_size)` tokens
        (P/D sends and receives), else per block (offloaded-KV loads, whose
        stored entries are per block). `fold_keys`: one column for every
        replica key (a send pass, whose views are all replica 0). A rank with
        no view has no launch and reports zeros.
        """
        chunk = chunk_tokens(block_size) if chunked else block_size
        keys = (
            (SEND_COLUMN_KEY,)
            if fold_keys
            else tuple(sorted({view.replica_key for view in views}))
        )
        key_column = {key: i for i, key in enumerate(keys)}
        entries = [
            (
                view,
                pieces,
                i * len(keys) + key_column.get(view.replica_key, 0),
                i * chunk,
            )
            for view in views
            for i, pieces in enumerate(chunk_pieces(view.pieces, chunk))
        ]
        return cls(keys, _fused_launches(entries), block_size // chunk)

    def run(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        for launch in self.launches:
            launch(rows, out)


def _fused_launches(
    entries: Sequence[tuple[ChecksumView, torch.Tensor, int, int]],
) -> tuple[KVChecksumLaunch, ...]:
    """One launch per layout over (view, pieces, column, token offset) (R61)."""
    by_layout: dict[tuple, list[tuple[ChecksumView, torch.Tensor, int, int]]] = {}
    for entry in entries:
        pieces = entry[1]
        key = (pieces.dtype, pieces.device, tuple(pieces.shape), pieces.stride())
        by_layout.setdefault(key, []).append(entry)
    return tuple(
        KVChecksumLaunch(
            [pieces for _, pieces, _, _ in same],
            [view.first_slice for view, _, _, _ in same],
            [column for _, _, column, _ in same],
            token_offsets=[offset for _, _, _, offset in same],
        )
        for same in by_layout.values()
    )


@dataclass(frozen=True)
class GroupPlans:
    """A covered group: receive plans over every view (per chunk for P/D loads,
    per block for offloaded-KV loads) and a send plan over replica 0."""

    group_id: int
    block_size: int
    fingerprint: int
    recv: ChecksumPlan
    send: ChecksumPlan
    load: ChecksumPlan
    # One layer per distinct cache the group's checksums cover, in view order.
    layer_names: tuple[str, ...] = ()

    @classmethod
    def build(cls, group: GroupViews) -> "GroupPlans":
        """Raises UncoveredGroup if kernel blocks do not tile the chunks."""
        send_views = [v for v in group.views if v.replica_key[1] == 0]
        recv = ChecksumPlan.build(group.views, group.block_size)
        # Blocks of at most 16 tokens are one chunk: loads share the plan.
        load = (
            recv
            if recv.chunks == 1
            else ChecksumPlan.build(group.views, group.block_size, chunked=False)
        )
        return cls(
            group.group_id,
            group.block_size,
            group.fingerprint,
            recv=recv,
            send=ChecksumPlan.build(send_views, group.block_size, fold_keys=True),
            load=load,
            layer_names=tuple(v.layer_name for v in group.views),
        )


def plan_groups(
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
    topology: WorkerTopology,
    drafter_layer_names: Iterable[str] = (),
) -> tuple[dict[int, GroupPlans], tuple[int, ...]]:
    """The plans of every transfer group this worker covers, and the groups
    it cannot cover (logged once each)."""
    groups: dict[int, GroupPlans] = {}
    skipped: list[int] = []
    drafters = set(drafter_layer_names)
    for group_id in kv_cache_config.transfer_group_ids:
        group = kv_cache_config.kv_cache_groups[group_id]
        names = [n for n in group.layer_names if n not in drafters]
        if not names:
            continue  # R28: drafter-only groups are neither covered nor skipped
        # Mamba groups have their own views (R36-R41).
        planner = (
            plan_mamba_views
            if isinstance(group.kv_cache_spec, MambaSpec)
            else plan_group_views
        )
        try:
            views = planner(group_id, group, names, kv_caches, topology)
            plans = GroupPlans.build(views)
        except UncoveredGroup as reason:
            logger.warning(
                "KV cache group %d is not covered by KV checksums: %s.",
                group_id,
                reason,
            )
            skipped.append(group_id)
            continue
        groups[group_id] = plans
    return groups, tuple(skipped)
