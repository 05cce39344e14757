# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker side: checksums of the blocks the scheduler asks for, each step.

A `KVChecksumWorker` knows, per KV cache group, which caches it covers (see
:mod:`.views`) and fuses views sharing a layout into one launch
(:mod:`.plans`). Each step it is bound to the scheduler's
`KVChecksumScheduled`; after the forward its :mod:`.launches` queue the
checksum kernels on the compute stream and copy the results to pinned host
memory on a side stream, so the engine step never waits on the device (R55).
`KVChecksumPendingRecord.finalize()` (:mod:`.records`) waits for that copy
only when the record is read. Stored block entries live in its
:mod:`.block_table`.
"""

from collections.abc import Iterable, Mapping

import torch

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.full_blocks import (
    EntryCopy,
    EntryRestore,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.views import WorkerTopology
from vllm.distributed.kv_transfer.kv_checksum.engine.block_table import (
    BlockChecksumTable,
    BlockRun,
    fold_copy,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.entry_queue import (
    QueuedEntryMoves,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.launches import ChecksumLauncher
from vllm.distributed.kv_transfer.kv_checksum.engine.plans import plan_groups
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
    hit_request_id,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.records import (
    KVChecksumPendingRecord,
    finalize_records,
)
from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "KVChecksumGroup",
    "KVChecksumPendingRecord",
    "KVChecksumRecord",
    "KVChecksumWorker",
    "WorkerTopology",
    "finalize_records",
]


class KVChecksumWorker:
    """Computes one worker's partial checksums of sent and received blocks: it
    tracks which requests each step checksums and hands the device work to its
    launcher and block table."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        kv_caches: Mapping[str, torch.Tensor],
        topology: WorkerTopology,
        drafter_layer_names: Iterable[str] = (),
    ) -> None:
        self.topology = topology
        self.kv_caches = kv_caches
        self.groups, self.skipped_groups = plan_groups(
            kv_cache_config, kv_caches, topology, drafter_layer_names
        )
        self.fingerprints = {g: p.fingerprint for g, p in self.groups.items()}
        self.block_table = BlockChecksumTable(self.groups, topology)
        self.launcher = ChecksumLauncher(self.groups, topology, self.block_table)
        self._to_send: dict[str, KVChecksumBlocks] = {}
        self._to_recv: dict[str, KVChecksumBlocks] = {}
        self._to_load: dict[str, KVChecksumBlocks] = {}
        # Prefix-cache hits (R140): this step's checks and entries to save.
        self._to_check: dict[str, KVChecksumBlocks] = {}
        self._to_save: list = []
        # An offload tier's entry writes and moves queued for this step's
        # pass (`queue_block_checksums`): made in its one upload.
        self.queued = QueuedEntryMoves()
        # External-load entries (R147): their slots, and this step's moves
        # between the slots and the block table (apart from `queued`, which
        # an offload save may make before this step's entry writes).
        self.external_entries: torch.Tensor | None = None
        self._external = QueuedEntryMoves()

    def warm_up(self) -> None:
        """Compile every launch and load the entry writes' device code at
        start-up, so neither lands in a step (R62)."""
        for plans in self.groups.values():
            for plan in dict.fromkeys((plans.recv, plans.send, plans.load)):
                for launch in plan.launches:
                    launch.warm_up()
        self.block_table.warm_up()

    def bind(self, scheduled: KVChecksumScheduled | None) -> None:
        """Take this step's requests: sends replace, receives and loads accumulate."""
        self.block_table.new_step()
        if self._external.due():
            self._external = QueuedEntryMoves()
        if scheduled is None:  # most steps: nothing new, nothing allocated (R142)
            if self._to_send or self._to_check or self._to_save:
                self._to_send, self._to_check, self._to_save = {}, {}, []
            return
        self._to_send = dict(scheduled.reqs_to_send)
        self._to_check = dict(scheduled.reqs_to_check)
        self._to_save = list(scheduled.blocks_to_save)
        self._to_recv.update(scheduled.reqs_to_recv)
        self._to_load.update(scheduled.reqs_to_load)
        self._bind_external(scheduled)

    def _bind_external(self, scheduled: KVChecksumScheduled) -> None:
        """This step's external-load entry moves (R147), if any."""
        slots = self.external_entries
        restore = getattr(scheduled, "entries_to_restore", None)
        keep = getattr(scheduled, "entries_to_keep", None)
        if slots is None or (restore is None and keep is None):
            return
        self._external.add(
            [],
            None if keep is None else EntryCopy(keep[0], keep[1], slots),
            None if restore is None else EntryRestore(restore[0], restore[1], slots),
        )

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

    def pending_hit_checks(self) -> dict[str, KVChecksumBlocks]:
        """Per request id, the prefix-hit blocks `post_forward` checks this step."""
        return {hit_request_id(key): blocks for key, blocks in self._to_check.items()}

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
        if not (
            finished_recving
            or failed_recving
            or received
            or self._to_send
            or self._to_check
            or self._to_save
            or self.queued.due()
            or self._external.due()
        ):
            return None  # most steps: nothing to checksum (R142)
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
        # This step's prefix entries ride in the launcher's upload, written
        # before the checks read them (R140; issue 30: one upload a step).
        # An offload tier's queued store entries come first: the step's
        # prefix entries skip the blocks they write.
        restores, copies, saves = self.queued.take()
        if self._external.due():
            # Restored before the step's checks read them, kept after every
            # entry write (R147).
            external_restores, external_copies, _ = self._external.take()
            restores = external_restores + restores
            copies = copies + external_copies
        if self._to_save:
            saves += self.block_table.prefix_entry_rows(self._to_save)
        checks = list(self._to_check.items())
        self._to_save, self._to_check = [], {}
        keep_received = self.topology.pp_rank == 0 and self.topology.tp_rank == 0
        received = dict(received or {}) if keep_received else {}
        if not recvs and not loads and not sends and not received and not checks:
            if saves or restores or copies:
                self.launcher.launch((), (), (), (), saves, restores, copies)
            return None
        results, run = self.launcher.launch(
            recvs, loads, sends, checks, saves, restores, copies
        )
        pending = KVChecksumPendingRecord(
            pp_rank=self.topology.pp_rank,
            tp_rank=self.topology.tp_rank,
            req_ids=tuple(dict.fromkeys(r for r, _ in recvs + loads + sends + checks)),
            results=results,
            skipped_groups=self.skipped_groups,
            fingerprints=self.fingerprints,
            received=received,
        )
        if run is not None:
            self.launcher.copy_to_host(pending, run)
        return pending

    # ------------------------------------------------------------------
    # Offloaded-KV and prefix-hit entries (R117, R118, R140)
    # ------------------------------------------------------------------

    def init_block_checksums(self, group_ids: Iterable[int]) -> torch.Tensor:
        """Register the groups a connector offloads; return the block table (R117).

        The table holds, per block id, this worker's stored entry: the block's
        partial checksum summed over columns, XOR the tag of its hash.
        """
        return self.block_table.init(group_ids)

    def enable_prefix_entries(self) -> None:
        """Record and check entries of locally cached blocks of every covered
        group (R140), in the block table the offload tier shares."""
        self.block_table.enable_prefix_entries()

    def enable_external_entries(self, limit: int) -> None:
        """Keep entries of locally computed blocks in `limit` slots, by block
        hash, to check loads from external caches against (R147)."""
        self.enable_prefix_entries()
        if self.external_entries is None:
            self.external_entries = torch.zeros(
                limit, dtype=torch.int64, device=self.topology.device
            )

    def stop_stored_entries(self) -> None:
        """A connector's side failed, so its block table is no longer kept up
        to date: from now on loads report no stored entries, and are
        unverified rather than mismatched against stale entries."""
        self.block_table.stored_groups.clear()
        self.queued = QueuedEntryMoves()

    def save_block_checksums(
        self,
        runs: Iterable[BlockRun],
        copy: EntryCopy | None = None,
        restore: EntryRestore | None = None,
    ) -> None:
        """Write the entries of the registered groups' full blocks (R118); each
        run is (group id, first position, block ids, their block hashes).
        `copy`: then copy entries to an offload tier's slots; `restore`: first
        bring a load's entries back from them; all in one upload. Queued
        moves are made first (they were asked for earlier)."""
        self.flush_queued_entries()
        self.block_table.save(runs, copy=copy, restore=restore)

    def queue_block_checksums(
        self,
        runs: Iterable[BlockRun],
        copy: EntryCopy | None = None,
        restore: EntryRestore | None = None,
    ) -> None:
        """`save_block_checksums`, made by this step's `post_forward` in the
        pass's one upload and launch sequence (issue 30): restores first, then
        every entry write (a store's copy to its slots folded into its write,
        `fold_copy`), then the copies left. For a caller that keeps
        the step's copies back until then (`flush_queued_entries` makes what
        is left if the pass does not run)."""
        rows, rest = fold_copy(self.block_table.store_entry_rows(runs), copy)
        self.queued.add(rows, rest, restore)

    def flush_queued_entries(self) -> None:
        """Make the queued entry moves, in one upload, if any are left."""
        if self.queued.due():
            restores, copies, saves = self.queued.take()
            self.launcher.launch((), (), (), (), saves, restores, copies)


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
    from vllm.distributed.kv_transfer.kv_checksum.config import (
        kv_checksum_enabled,
        read_flags,
    )

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
    flags = read_flags(vllm_config.kv_transfer_config)  # type: ignore[attr-defined]
    if flags.verify_prefix_hits or flags.verify_external_loads:
        worker.enable_prefix_entries()  # R140: entries of cached blocks
    if flags.verify_external_loads:  # R147: their slots, by block hash
        worker.enable_external_entries(flags.external_entry_limit)
    return worker
