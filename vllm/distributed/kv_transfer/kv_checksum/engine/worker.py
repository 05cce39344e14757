# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker side: checksums of the blocks the scheduler asks for, each step.

A `KVChecksumWorker` knows, per KV cache group, which caches it covers (see
:mod:`.views`) and fuses views sharing a layout into one launch. Each step it
is bound to the scheduler's `KVChecksumScheduled`; after the forward it queues
the checksum kernels on the compute stream and copies the results to pinned
host memory on a side stream, so the engine step never waits on the device
(R55). `KVChecksumPendingRecord.finalize()` waits for that copy only when the
record is read.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    SEND_COLUMN_KEY,
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
    ReplicaKey,
    block_checksum_tags,
    chunk_tokens,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import KVChecksumLaunch
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import (
    RowSegment,
    host_to_device,
    pack_segments,
    segment_rows,
)
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

__all__ = [
    "KVChecksumGroup",
    "KVChecksumPendingRecord",
    "KVChecksumRecord",
    "KVChecksumWorker",
    "WorkerTopology",
]


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


@dataclass
class _PassResult:
    """Device output of one (pass, group) and the host copy it lands in."""

    segment: RowSegment
    replica_keys: tuple[ReplicaKey, ...]
    device: torch.Tensor
    host: torch.Tensor | None = None
    # Loads: the stored block entries of the loaded blocks (R117), per row.
    stored_device: torch.Tensor | None = None
    stored_host: torch.Tensor | None = None


@dataclass
class KVChecksumPendingRecord:
    """A step's record whose values are still on their way to host memory (R55)."""

    pp_rank: int
    tp_rank: int
    req_ids: tuple[str, ...]
    results: list[_PassResult]
    skipped_groups: tuple[int, ...]
    fingerprints: dict[int, int]
    received: dict[str, bytes]
    event: object | None = None
    _record: KVChecksumRecord | None = field(default=None, repr=False)

    def __reduce__(self) -> tuple:
        """Serialized for the scheduler as the finished host record (R55)."""
        return (_same, (self.finalize(),))

    def finalize(self) -> KVChecksumRecord:
        """Wait for the side-stream copy and build the host record (idempotent)."""
        if self._record is not None:
            return self._record
        if self.event is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
        checksums: dict[str, dict[int, KVChecksumGroup]] = {r: {} for r in self.req_ids}
        for result in self.results:
            assert result.host is not None
            values = result.host.numpy().view(np.uint64)
            stored = None
            if result.stored_host is not None:
                stored = result.stored_host.numpy().view(np.uint64)
            seg = result.segment
            bounds = np.cumsum(seg.counts)
            for i, req_id in enumerate(seg.req_ids):
                end = int(bounds[i])
                begin = end - int(seg.counts[i])
                checksums[req_id][seg.group_id] = KVChecksumGroup(
                    start=int(seg.starts[i]),
                    replica_keys=result.replica_keys,
                    values=values[begin:end].copy(),
                    stored=None if stored is None else stored[begin:end].copy(),
                )
        self._record = KVChecksumRecord(
            pp_rank=self.pp_rank,
            tp_rank=self.tp_rank,
            checksums=checksums,
            skipped_groups=self.skipped_groups,
            fingerprints=dict(self.fingerprints),
            received=dict(self.received),
        )
        self.results = []
        return self._record


def _same(record: KVChecksumRecord) -> KVChecksumRecord:
    return record


def finalize_records(items: Iterable[object] | None) -> list[KVChecksumRecord]:
    """Host records of pending or finished records, in order."""
    records = []
    for item in items or ():
        if isinstance(item, KVChecksumPendingRecord):
            records.append(item.finalize())
        elif isinstance(item, KVChecksumRecord):
            records.append(item)
    return records


class KVChecksumWorker:
    """Computes one worker's partial checksums of sent and received blocks."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        kv_caches: Mapping[str, torch.Tensor],
        topology: WorkerTopology,
        drafter_layer_names: Iterable[str] = (),
    ) -> None:
        self.topology = topology
        self.kv_caches = kv_caches
        self.groups: dict[int, GroupPlans] = {}
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
            self.groups[group_id] = plans
        self.skipped_groups = tuple(skipped)
        self.fingerprints = {g: p.fingerprint for g, p in self.groups.items()}
        self._to_send: dict[str, KVChecksumBlocks] = {}
        self._to_recv: dict[str, KVChecksumBlocks] = {}
        self._to_load: dict[str, KVChecksumBlocks] = {}
        # Prefix-cache hits (R140): this step's checks and entries to save.
        self._to_check: dict[str, KVChecksumBlocks] = {}
        self._to_save: list = []
        self._prefix_groups: set[int] = set()
        self._side_stream: torch.cuda.Stream | None = None
        # Offloaded-KV checksums (R117): registered groups and the block table.
        self._stored_groups: set[int] = set()
        self._block_table: torch.Tensor | None = None

    def warm_up(self) -> None:
        """Compile every launch at start-up so no compilation lands in a step (R62)."""
        for plans in self.groups.values():
            for plan in dict.fromkeys((plans.recv, plans.send, plans.load)):
                for launch in plan.launches:
                    launch.warm_up()

    def bind(self, scheduled: KVChecksumScheduled | None) -> None:
        """Take this step's requests: sends replace, receives and loads accumulate."""
        self._to_send = dict(scheduled.reqs_to_send) if scheduled else {}
        self._to_check = dict(scheduled.reqs_to_check) if scheduled else {}
        self._to_save = list(scheduled.blocks_to_save) if scheduled else []
        if scheduled:
            self._to_recv.update(scheduled.reqs_to_recv)
            self._to_load.update(scheduled.reqs_to_load)

    def pending_load_blocks(
        self, req_ids: Iterable[str]
    ) -> dict[str, KVChecksumBlocks]:
        """The blocks `post_forward` would checksum for these finished loads."""
        pending = {}
        for req_id in req_ids:
            blocks = self._to_load.get(req_id) or self._to_recv.get(req_id)
            if blocks is not None:
                pending[req_id] = blocks
        return pending

    def group_layer_names(self) -> dict[int, list[str]]:
        """Per covered group, the layers (one per distinct cache) it checksums."""
        return {g: list(plans.layer_names) for g, plans in self.groups.items()}

    def post_forward(
        self,
        finished_recving: Iterable[str] | None,
        failed_recving: Iterable[str] | None = None,
        received: Mapping[str, bytes] | None = None,
        finished_req_ids: Iterable[str] = (),
    ) -> KVChecksumPendingRecord | None:
        """Queue the checksums of finished loads and this step's sends (R48)."""
        for req_id in finished_req_ids:
            self._to_recv.pop(req_id, None)
            self._to_load.pop(req_id, None)
        failed = set(failed_recving or ())
        recvs: list[tuple[str, KVChecksumBlocks]] = []
        loads: list[tuple[str, KVChecksumBlocks]] = []
        for req_id in finished_recving or ():
            recv = self._to_recv.pop(req_id, None)
            load = self._to_load.pop(req_id, None)
            if req_id in failed:
                continue
            if load is not None:
                loads.append((req_id, load))
            elif recv is not None:
                recvs.append((req_id, recv))
        for req_id in failed:
            self._to_recv.pop(req_id, None)
            self._to_load.pop(req_id, None)
        sends = list(self._to_send.items())
        self._to_send = {}
        # Entries first: a hit on a block cached this step reads its entry.
        self.save_block_checksums(self._to_save, self._prefix_groups)
        checks = list(self._to_check.items())
        self._to_save, self._to_check = [], {}
        keep_received = self.topology.pp_rank == 0 and self.topology.tp_rank == 0
        received = dict(received or {}) if keep_received else {}
        if not recvs and not loads and not sends and not received and not checks:
            return None
        results = self._launch(recvs, loads, sends, checks)
        pending = KVChecksumPendingRecord(
            pp_rank=self.topology.pp_rank,
            tp_rank=self.topology.tp_rank,
            req_ids=tuple(dict.fromkeys(r for r, _ in recvs + loads + sends + checks)),
            results=results,
            skipped_groups=self.skipped_groups,
            fingerprints=self.fingerprints,
            received=received,
        )
        self._copy_to_host(pending)
        return pending

    # ------------------------------------------------------------------
    # Offloaded-KV checksums (R117, R118)
    # ------------------------------------------------------------------

    def init_block_checksums(self, group_ids: Iterable[int]) -> torch.Tensor:
        """Register the groups a connector offloads; return the block table (R117).

        The table holds, per block id, this worker's stored entry: the block's
        partial checksum summed over columns, XOR the tag of its hash. It is
        one int64 tensor on the KV cache's device, the same on every call; the
        connector moves a block's entry wherever it moves the block's KV.
        Groups this worker cannot checksum are not registered.
        """
        self._stored_groups.update(g for g in group_ids if g in self.groups)
        if self._block_table is None:
            self._block_table = torch.zeros(
                self.topology.num_blocks, dtype=torch.int64, device=self.topology.device
            )
        return self._block_table

    def enable_prefix_entries(self) -> None:
        """Record and check entries of locally cached blocks of every covered
        group (R140), in the block table the offload tier shares."""
        self.init_block_checksums(())
        self._prefix_groups = set(self.groups)

    def stop_stored_entries(self) -> None:
        """A connector's side failed, so its block table is no longer kept up
        to date: from now on loads report no stored entries, and are
        unverified rather than mismatched against stale entries."""
        self._stored_groups.clear()

    def save_block_checksums(
        self,
        runs: Iterable[tuple[int, int, Sequence[int], Sequence[bytes]]],
        groups: set[int] | None = None,
    ) -> None:
        """Write the entries of full blocks into the block table (R118).

        Each run is (group id, first position, block ids at consecutive
        positions, the request's block hash at each block's last token). Runs
        of unregistered groups (or not in `groups`, when given) are ignored.
        Queued on the current stream, after the forward that wrote the blocks
        and before the connector reads them.
        """
        table = self._block_table
        if table is None:
            return
        # One launch per group for every run of the call (a step's stores).
        by_group: dict[int, list[tuple[str, KVChecksumBlocks]]] = {}
        hashes: dict[int, list[bytes]] = {}
        for group_id, start, block_ids, block_hashes in runs:
            allowed = self._stored_groups if groups is None else groups
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

    def _launch(
        self,
        recvs: list[tuple[str, KVChecksumBlocks]],
        loads: list[tuple[str, KVChecksumBlocks]],
        sends: list[tuple[str, KVChecksumBlocks]],
        checks: Sequence[tuple[str, KVChecksumBlocks]] = (),
    ) -> list[_PassResult]:
        """Build all rows, copy them once to the device and queue every launch.

        P/D receives and sends are checksummed per chunk (R135), offloaded-KV
        loads and prefix-hit checks per block with their stored entries
        (R117, R140).
        """
        passes: list[tuple[GroupPlans, str, tuple, np.ndarray, np.ndarray]] = []
        parts: list[np.ndarray] = []
        for requests, kind in (
            (recvs, "recv"),
            (loads, "load"),
            (list(checks), "check"),
            (sends, "send"),
        ):
            if not requests:
                continue
            for plans in self.groups.values():
                req_ids, starts, counts, rows = segment_rows(
                    requests, plans.group_id, plans.block_size
                )
                if req_ids:
                    passes.append((plans, kind, req_ids, starts, counts))
                    parts.append(rows)
        if not passes:
            return []
        on_device = self.topology.device.type != "cpu"
        host_rows: list[torch.Tensor] = []

        def pinned_zeros(shape: tuple[int, int]) -> np.ndarray:
            host_rows.append(
                torch.zeros(shape, dtype=torch.int64, pin_memory=on_device)
            )
            return host_rows[0].numpy()

        _, columns = pack_segments(parts, pinned_zeros)
        rows_dev = self._to_device(host_rows[0])
        results = []
        for (plans, kind, req_ids, starts, counts), part, column in zip(
            passes, parts, columns
        ):
            plan: ChecksumPlan = getattr(plans, "load" if kind == "check" else kind)
            n = part.shape[1]
            out = torch.zeros(
                (n, plan.width), dtype=torch.int64, device=rows_dev.device
            )
            plan.run(rows_dev[:, column : column + n], out)
            if plan.chunks > 1:
                # One row per chunk, in position order (R135).
                out = out.view(n * plan.chunks, len(plan.replica_keys))
                starts, counts = starts * plan.chunks, counts * plan.chunks
            segment = RowSegment(plans.group_id, column, req_ids, starts, counts)
            result = _PassResult(segment, plan.replica_keys, out)
            table = self._block_table
            stored_groups = self._prefix_groups if kind == "check" else set()
            if kind == "load":
                stored_groups = self._stored_groups
            if plans.group_id in stored_groups:
                assert table is not None
                result.stored_device = table[rows_dev[0, column : column + n]]
            results.append(result)
        return results

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One non-blocking host-to-device copy of all rows, from pinned memory."""
        device = self.topology.device
        if device.type == "cpu":
            return host
        return host.to(device, non_blocking=True)

    def _copy_to_host(self, pending: KVChecksumPendingRecord) -> None:
        """Copy results to pinned host memory on a side stream; record an event."""
        if not pending.results:
            return
        on_device = self.topology.device.type != "cpu"
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for result in pending.results:
                result.host = torch.empty(
                    result.device.shape, dtype=torch.int64, pin_memory=on_device
                )
                result.host.copy_(result.device, non_blocking=True)
                if result.stored_device is not None:
                    result.stored_host = torch.empty(
                        result.stored_device.shape,
                        dtype=torch.int64,
                        pin_memory=on_device,
                    )
                    result.stored_host.copy_(result.stored_device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        pending.event = event


def drafter_layer_names(vllm_config: object) -> set[str]:
    """Attention layers marked as draft layers (R28), from the forward context."""
    context = vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
    names: set[str] = set()
    for name, layer in context.items():
        get_spec = getattr(layer, "get_kv_cache_spec", None)
        if get_spec is None:
            continue
        try:
            spec = get_spec(vllm_config)
        except Exception:
            continue
        if spec is not None and getattr(spec, "is_draft", False):
            names.add(name)
    return names


def create_kv_checksum_worker(
    vllm_config: object,
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
    device: torch.device,
    tp_rank: int,
    pp_rank: int,
) -> KVChecksumWorker | None:
    """The checksum worker of one model runner, None when checksums are off."""
    from vllm.distributed.kv_transfer.kv_checksum.config import kv_checksum_enabled

    if not kv_checksum_enabled(vllm_config):
        return None
    model_config = vllm_config.model_config  # type: ignore[attr-defined]
    parallel = vllm_config.parallel_config  # type: ignore[attr-defined]
    topology = WorkerTopology(
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
        pp_rank=pp_rank,
        num_blocks=kv_cache_config.num_blocks,
        uniform_model_kv_heads=model_config.get_total_num_kv_heads(),
        device=device,
    )
    worker = KVChecksumWorker(
        kv_cache_config, kv_caches, topology, drafter_layer_names(vllm_config)
    )
    worker.warm_up()
    return worker
