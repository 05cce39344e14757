# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-hit verification in the scheduler (R140): the engine's steps.

`PrefixHitVerifier` keeps the entries of cached blocks in step with the
prefix cache (its `listener`, the block pool's listener), turns each noted
local hit into a check in the step its request first runs on the hit
blocks, and judges each check on its own step's reports. On a mismatch it
hands the bad blocks to the scheduler's invalid-block recovery
(`recover_invalid_blocks`, `evict_cached_blocks_from`): every holder of a
bad block starts over and every block computed over one leaves the prefix
cache. vLLM's Scheduler makes the calls through `KVChecksumScheduler`
(`attach_prefix_cache`, `note_local_hit`, `schedule_prefix_hits`,
`verify_prefix_hits`); on vLLM 0.33.0 the plugin's hooks make the same ones.

An error here turns prefix-hit verification off (one error line) and
leaves the engine's other checksums on; it stops, and drops its state, with
the engine's checksums (R134, R141).
"""

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.config import read_flags
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
    KVChecksumPrefixHits,
    PrefixHitEntryListener,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.records import finalize_records
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumWorkerReport,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


ExternalJudge = Callable[[Any, str, Any, Any], "list[tuple[int, int]] | None"]


class InvalidBlockRecovery(Protocol):
    """What verification needs of the scheduler: vLLM's Scheduler itself (its
    invalid-block recovery), or the plugin's stand-in on vLLM 0.33.0."""

    requests: Mapping[str, Any]
    recompute_kv_load_failures: bool

    def recover_invalid_blocks(
        self,
        invalid_block_ids: set[int],
        kv_cache_group_id: int = 0,
        restart: bool = True,
    ) -> list[Any]: ...

    def evict_cached_blocks_from(
        self, request: Any, start: int, kv_cache_group_id: int = 0
    ) -> None: ...


class PrefixHitVerifier:
    """One scheduler's prefix-hit checker, the hits noted this step and the
    checks waiting for their step's reports (R140)."""

    def __init__(
        self,
        hits: KVChecksumPrefixHits,
        kcs: Any,
        verify_hits: bool = True,
    ) -> None:
        self.hits = hits
        self.kcs = kcs
        # False: entries only, for external loads (R147); hits not checked.
        self.verify_hits = verify_hits
        self.noted: dict[str, int] = {}  # request id -> local hit tokens
        self.step_keys: dict[int, list[str]] = {}  # id(SchedulerOutput) -> keys
        self.restarted: set[str] = set()  # requests restarted after bad hits
        self.released = False
        # External-load verification (R147) judges the checks it registered:
        # (kcs, request id, check, verdict) -> the bad (position, block id)
        # pairs, or None for a check of a local hit.
        self.judge_external: ExternalJudge | None = None
        # External-load verification's part of each step (R147), if on.
        self.external: Any = None
        # Called once verification stopped (the plugin's external loads).
        self.on_release: list[Callable[[], None]] = []
        self.listener = PrefixHitEntryListener(hits, self.live, self.turn_off)

    @classmethod
    def create(
        cls, kcs: Any, vllm_config: Any, kv_cache_config: Any, kv_cache_manager: Any
    ) -> "PrefixHitVerifier | None":
        """The verifier of an engine recording entries (prefix hits, R140, or
        external loads, R147) with prefix caching on; None otherwise."""
        from vllm.v1.kv_cache_interface import MambaSpec

        flags = read_flags(vllm_config.kv_transfer_config)
        if not (flags.verify_prefix_hits or flags.verify_external_loads):
            return None
        if not kv_cache_manager.enable_caching:
            return None
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or isinstance(groups[0].kv_cache_spec, MambaSpec):
            logger.warning(
                "KV checksum prefix-hit verification needs one attention KV "
                "cache group (vLLM recomputes invalid blocks only then); it is off."
            )
            return None
        if 0 not in kcs.groups:
            return None
        pool = kv_cache_manager.block_pool
        hits = KVChecksumPrefixHits(
            pool.num_gpu_blocks,
            0,
            groups[0].kv_cache_spec.block_size,
            getattr(pool, "hash_block_size", None),
            kcs.num_workers,
        )
        verifier = cls(hits, kcs, flags.verify_prefix_hits)
        if flags.verify_external_loads:  # R147: loads checked like hits
            from vllm.distributed.kv_transfer.kv_checksum.engine import (
                external_loads,
            )

            verifier.external = external_loads.ExternalLoadChecks.create(
                kcs, hits, flags.external_entry_limit
            )
            verifier.judge_external = external_loads.judge_external
        return verifier

    # ------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------

    def live(self) -> bool:
        """Whether verification runs. It stops with the engine's checksums
        (the scheduler's guard closed its checksum scheduler, or a worker's
        checksums are off, R134): nothing would take the step's saves and
        checks any more, so its state is released then (R141)."""
        if self.released:
            return False
        if self.kcs.closed or self.kcs.disabled_workers:
            logger.warning(
                "KV checksum prefix-hit verification stopped: checksums are "
                "off for this engine."
            )
            self.release()
            return False
        return True

    def turn_off(self, where: str) -> None:
        """Last-resort guard (R134): log once, prefix-hit verification off."""
        logger.exception(
            "KV checksum prefix-hit verification turned off after an error in "
            "%s; vLLM goes on without it.",
            where,
        )
        self.release()

    def release(self) -> None:
        """Verification off: every entry, check and note dropped."""
        if self.released:
            return
        self.released = True
        self.hits.release()
        self.noted.clear()
        self.step_keys.clear()
        self.restarted.clear()
        if self.external is not None:
            self.external.release()
        for callback in self.on_release:
            callback()

    def request_ids(self) -> list[str]:
        """The requests whose checks wait for their step's reports (R141)."""
        return [] if self.released else self.hits.request_ids()

    def entries_written(self, groups: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
        """R140, issue 30. For the offload tiers' scheduler sides: the mask of
        the GPU blocks whose entries the workers already wrote (all false once
        verification stopped: a store then checksums its blocks itself)."""
        if not self.live():
            return np.zeros(block_ids.shape, dtype=bool)
        return self.hits.entries_written(groups, block_ids)

    # ------------------------------------------------------------------
    # The engine's calls
    # ------------------------------------------------------------------

    def note_local_hit(self, request: Any, num_tokens: int) -> None:
        """At the request's admission, after vLLM's prefix-cache lookup: its
        local hit, checked in the step it first runs on it."""
        if num_tokens <= 0 or not self.verify_hits:
            return
        try:
            if self.live():
                self.noted[request.request_id] = num_tokens
        except Exception:
            self.turn_off("noting a hit")

    def schedule(
        self, output: Any, requests: Mapping[str, Any], kv_cache_manager: Any
    ) -> None:
        """After the step's checksum metadata is built: hits of this step's
        scheduled requests become checks; the step's entries to save and
        checks join `output.kv_checksum_scheduled`."""
        self._guarded("scheduling", self._schedule, output, requests, kv_cache_manager)

    def verify(
        self, scheduler_output: Any, model_output: Any, recovery: InvalidBlockRecovery
    ) -> None:
        """Before vLLM's update_from_output goes on: verify the step's checks;
        with policy "recompute" the requests on mismatched blocks restart,
        with "fail" the blocks join `invalid_block_ids` and vLLM fails those
        requests; every block computed over a bad one leaves the cache."""
        self._guarded(
            "verification", self._verify, scheduler_output, model_output, recovery
        )

    def _guarded(self, where: str, call: Callable[..., None], *args: Any) -> None:
        """One of the engine's calls, unless verification stopped; an error in
        it turns only prefix-hit verification off (R134)."""
        if not self.live():
            return
        try:
            call(*args)
        except Exception:
            self.turn_off(where)

    def _schedule(
        self, output: Any, requests: Mapping[str, Any], kv_cache_manager: Any
    ) -> None:
        hits = self.hits
        external = self.external
        restore = None
        if external is not None:  # R147: before the step's hit checks
            external.note_loads(self.kcs.last_started_loads, output, kv_cache_manager)
            restore = external.add_checks(hits, output, requests, kv_cache_manager)
        noted, self.noted = self.noted, {}
        scheduled = output.num_scheduled_tokens
        for req_id, num_tokens in noted.items():
            if req_id not in scheduled:
                continue
            count = num_tokens // hits.block_size
            ids = kv_cache_manager.get_block_ids(req_id)[hits.group_id][:count]
            request = requests[req_id]
            hits.add_hits(
                request, np.asarray(ids, dtype=np.int64), request.num_preemptions
            )
        step = hits.take_step()
        if step.keys:
            self.step_keys[id(output)] = step.keys
        if step.saves or step.checks:
            meta = output.kv_checksum_scheduled or KVChecksumScheduled()
            meta.blocks_to_save.extend(step.saves)
            meta.reqs_to_check.update(step.checks)
            output.kv_checksum_scheduled = meta
        if external is not None:  # R147: the step's new entries get slots
            external.keep_entries(output, restore)

    def _verify(
        self, output: Any, model_output: Any, recovery: InvalidBlockRecovery
    ) -> None:
        requests: Any = recovery.requests
        if self.restarted:  # R141: nothing kept for requests vLLM dropped
            self.restarted.intersection_update(requests)
        keys = self.step_keys.pop(id(output), None)
        if not keys:
            return
        kcs = self.kcs
        hits = self.hits
        kv_output = model_output.kv_connector_output
        records = finalize_records(getattr(kv_output, "kv_checksums", None))
        for record in records:
            for key in keys:
                load = hits.pending.get(key)
                report = KVChecksumWorkerReport.from_record(record, key)
                if load is not None and report is not None:
                    load.reports[(record.pp_rank, record.tp_rank)] = report
        invalid: set[int] = set()
        for key in keys:
            pending = hits.pending.get(key)
            if pending is None:
                continue
            request = pending.request
            req_id = request.request_id
            if requests.get(req_id) is not request or request.is_finished():
                # R141: aborted since its step was scheduled; vLLM freed (or
                # frees) its blocks: no verdict, and nothing kept for it.
                hits.pending.pop(key, None)
                continue
            result = hits.verify(key)
            if result is None:
                continue
            load, verdict = result
            bad = None
            if self.judge_external is not None:  # R147
                bad = self.judge_external(kcs, req_id, load, verdict)
                if bad is not None and not bad:
                    continue
            if bad is None:
                kcs.stats.record_prefix_hit(verdict)
                if verdict.status != KVChecksumStatus.MISMATCH:
                    logger.debug(
                        "KV checksums of prefix-cache hit of request %s: %s %s",
                        req_id,
                        verdict.status.value,
                        verdict.reasons,
                    )
                    continue
                bad = hits.bad_blocks(load, verdict)
                logger.error(
                    "KV checksum mismatch in prefix-cache hit of request %s: "
                    "group %d block positions %s (block ids %s); the blocks "
                    "leave the prefix cache and the request is recomputed "
                    "from its first bad block.",
                    req_id,
                    hits.group_id,
                    [position for position, _ in bad],
                    [block_id for _, block_id in bad],
                )
            if request.num_preemptions == load.attempt:
                # Still on the checked blocks: they are its own (never freed
                # since) and, through the holders below, its later blocks
                # leave the cache.
                if kcs.on_failed_load is not None:  # R138 containment
                    kcs.on_failed_load(req_id, verdict, load.blocks)
                invalid.update(block_id for _, block_id in bad)
            else:
                invalid |= self._recover_preempted(recovery, request, load, bad)
        if invalid:
            self._recover_holders(recovery, invalid, kv_output)

    def _recover_preempted(
        self,
        recovery: InvalidBlockRecovery,
        request: Any,
        load: Any,
        bad: list[tuple[int, int]],
    ) -> set[int]:
        """A bad hit of a request preempted since its check's step (by vLLM,
        or restarted for another request's check): the output of that step is
        still in flight and is dropped (vLLM delivers a preempted request's
        in-flight output unless `drop_stale_output` is set); every block
        cached under its hashes from the first bad position on leaves the
        prefix cache. Returns the bad blocks still cached as checked, whose
        holders recover too: a block id freed since may be another
        request's now."""
        if request.num_stale_output_tokens:
            request.drop_stale_output = True
        still_bad = self.hits.still_cached(load, bad)
        recovery.evict_cached_blocks_from(request, bad[0][0], self.hits.group_id)
        return still_bad

    def _recover_holders(
        self, recovery: InvalidBlockRecovery, bad: set[int], kv_output: Any
    ) -> None:
        """R140: every request holding a bad block, running or waiting for its
        remote KV, recovers per kv_load_failure_policy, and its blocks from
        the first bad one on leave the prefix cache: they were computed over
        it (R138)."""
        recompute = recovery.recompute_kv_load_failures
        holders = recovery.recover_invalid_blocks(
            bad, self.hits.group_id, restart=recompute
        )
        if not recompute:
            if kv_output is not None:  # "fail": vLLM fails the requests on them
                invalid = set(kv_output.invalid_block_ids or ())
                kv_output.invalid_block_ids = invalid | bad
            return
        for request in holders:
            # The second restart of a request reads no prefix cache, so a
            # block vLLM fails to evict cannot restart it forever.
            if request.request_id in self.restarted:
                request.skip_reading_prefix_cache = True
            self.restarted.add(request.request_id)
