# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fault injection into loaded KV, so operators can prove faults are caught (R131).

Off unless `kv_checksum_fault_injection` is configured (see
`config.read_fault_injection`). On a consumer worker, after a load finished and
before the worker checksums it, `KVFaultInjector` corrupts the loaded KV of a
fraction `rate` of the loads. Every decision is a pure function of (seed,
request id, the load's blocks, num_blocks), so all workers of an engine take the
same one without communicating; each corrupts its own caches:

- "bit_flip": one bit of one byte of the first token of the block, in the first
  head of the first layer of the group, on the worker (pp_rank 0, tp_rank 0)
  only. If that stage holds no layer of the group, nothing is corrupted and a
  "skipped" warning is logged instead.
- "zero_block": the block zeroed in every layer of the group on every worker.
- "swap_blocks": the block's contents swapped with another loaded position of
  the group (every layer, every worker); a load with one block in the group
  gets "zero_block" instead.
- "stale_block": the block overwritten with another block of the cache that is
  not part of the load, mimicking a read of a block after its reuse; without
  such a block, "zero_block".
- "prefix_hit" (opt-in, never a default kind): with prefix-hit verification on
  (R140), one bit of one checked local prefix-cache hit block, like
  "bit_flip", before the check's checksums are queued; decided apart from the
  loads (its own draw from seed and request id, its own `rate` test).

Worker (pp_rank 0, tp_rank 0) logs each injection once per request at WARNING:
"KV checksum fault injection: <kind> into request <id> group <G> block position
<P>." The kind logged is the one applied (after fallbacks). A copy whose
source held the same bytes (a "stale_block" source that holds the same prompt's
block, or two equal blocks swapped) changes nothing: the worker compares them on
the device and, a later step, logs "KV checksum fault injection had no effect:
<kind> into request <id> ..." so nobody counts it as a missed fault. Under fail-open the
request itself runs on the corrupted KV (containment keeps it from other
requests, R138); "prefix_hit" corrupts a cached block other requests may share:
use it on test deployments only.
"""

import hashlib
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.config import (
    FAULT_KINDS,
    PREFIX_HIT_FAULT,
    VALID_FAULT_KINDS,
    read_fault_injection,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["FAULT_KINDS", "KVFaultInjector", "create_fault_injector"]

# vLLM's null block: never a meaningful stale source.
_NULL_BLOCK_ID = 0
_STALE_DRAWS = 64


@dataclass(frozen=True)
class Injection:
    """One decided injection and what this worker corrupted for it."""

    req_id: str
    kind: str  # the kind applied (after fallbacks)
    group_id: int
    position: int  # loaded block position corrupted
    block_id: int  # the consumer block at `position`
    # swap_blocks: the other loaded position and its block
    other_position: int | None = None
    # swap_blocks: the block at other_position; stale_block: the block copied
    source_block_id: int | None = None
    # bit_flip: byte within the token's cell bytes (mod their count) and bit
    byte: int = 0
    bit: int = 0
    # layers whose caches this worker changed (empty where it changed nothing)
    layers: tuple[str, ...] = ()

    @property
    def positions(self) -> tuple[int, ...]:
        """The loaded positions whose KV changed."""
        if self.other_position is None:
            return (self.position,)
        return tuple(sorted((self.position, self.other_position)))


@dataclass
class _EffectProbe:
    """Whether a copying injection changed this worker's KV: a flag the device
    writes into host memory, read once its event completed (no host sync)."""

    decision: Injection
    changed: torch.Tensor  # host bool scalar
    event: Any | None  # None: written synchronously (CPU caches)


def _generator(seed: int, req_id: str) -> np.random.Generator:
    """A generator seeded from (seed, request id) alone, equal in every process."""
    key = f"kv_checksum_fault_injection/{seed}/{req_id}".encode()
    digest = hashlib.sha256(key).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def _pick(u: float, n: int) -> int:
    """An index in [0, n) from a uniform draw u in [0, 1)."""
    return min(int(u * n), n - 1)


def _block_view(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_blocks, kernel_blocks, heads, tokens, cell bytes] uint8 view, no copy."""
    return cache.view(torch.uint8).unflatten(0, (num_blocks, -1))


def _distinct(
    layers: Sequence[str], caches: Mapping[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Layers with a cache on this worker, one per distinct cache (KV sharing)."""
    seen: set[tuple] = set()
    out = []
    for name in layers:
        cache = caches.get(name)
        if cache is None:
            continue
        key = (cache.data_ptr(), tuple(cache.shape), tuple(cache.stride()))
        if key not in seen:
            seen.add(key)
            out.append((name, cache))
    return out


class KVFaultInjector:
    """Deterministic corruption of loaded KV on one worker (R131)."""

    def __init__(
        self,
        rate: float,
        kinds: Sequence[str] = FAULT_KINDS,
        seed: int = 0,
        tp_rank: int = 0,
        pp_rank: int = 0,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault injection rate must be in [0, 1], got {rate}")
        unknown = [k for k in kinds if k not in VALID_FAULT_KINDS]
        if not kinds or unknown:
            raise ValueError(
                f"fault kinds must be some of {VALID_FAULT_KINDS}: {kinds}"
            )
        self.rate = rate
        self.kinds = tuple(kinds)
        self.load_kinds = tuple(k for k in self.kinds if k != PREFIX_HIT_FAULT)
        self.injects_hits = PREFIX_HIT_FAULT in self.kinds
        self.seed = seed
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self._probes: deque[_EffectProbe] = deque()

    @property
    def is_first_worker(self) -> bool:
        return self.pp_rank == 0 and self.tp_rank == 0

    # ------------------------------------------------------------------
    # The decision: identical on every worker
    # ------------------------------------------------------------------

    def decide(
        self,
        req_id: str,
        blocks: KVChecksumBlocks,
        num_blocks: int,
        skip_groups: Collection[int] = (),
    ) -> Injection | None:
        """Whether, what and where to inject into this load; touches no cache.

        The group is one of the load's groups except `skip_groups` (groups the
        workers cannot checksum, where an injection could not be detected).
        """
        rng = _generator(self.seed, req_id)
        inject, u_kind, u_group, u_pos, u_other = rng.random(5)
        if not inject < self.rate or not self.load_kinds:
            return None
        groups = [
            (group_id, start, np.asarray(ids, dtype=np.int64))
            for group_id, (start, ids) in sorted(blocks.groups.items())
            if len(ids) > 0 and group_id not in skip_groups
        ]
        if not groups:
            return None
        kind = self.load_kinds[_pick(u_kind, len(self.load_kinds))]
        group_id, start, ids = groups[_pick(u_group, len(groups))]
        index = _pick(u_pos, len(ids))
        base = Injection(req_id, kind, group_id, start + index, int(ids[index]))
        if kind == "bit_flip":
            byte, bit = (int(x) for x in rng.integers(0, [1 << 30, 8]))
            return replace(base, byte=byte, bit=bit)
        if kind == "swap_blocks":
            if len(ids) < 2:
                return replace(base, kind="zero_block")
            other = (index + 1 + _pick(u_other, len(ids) - 1)) % len(ids)
            return replace(
                base,
                other_position=start + other,
                source_block_id=int(ids[other]),
            )
        if kind == "stale_block":
            loaded = np.concatenate([g[2] for g in groups])
            source = self._stale_source(rng, loaded, num_blocks)
            if source is None:
                return replace(base, kind="zero_block")
            return replace(base, source_block_id=source)
        return base

    @staticmethod
    def _stale_source(
        rng: np.random.Generator, loaded: np.ndarray, num_blocks: int
    ) -> int | None:
        """A block id of the cache outside the load (and not the null block)."""
        excluded = set(loaded.tolist()) | {_NULL_BLOCK_ID}
        if num_blocks > _NULL_BLOCK_ID + 1:
            for candidate in rng.integers(_NULL_BLOCK_ID + 1, num_blocks, _STALE_DRAWS):
                if int(candidate) not in excluded:
                    return int(candidate)
        free = np.setdiff1d(np.arange(num_blocks), np.fromiter(excluded, np.int64))
        return int(free[_pick(rng.random(), free.size)]) if free.size else None

    def decide_hit(self, req_id: str, blocks: KVChecksumBlocks) -> Injection | None:
        """Whether and where to flip a bit of a request's checked hit blocks.

        Drawn from (seed, request id) apart from `decide`, so a request's load
        and hit decisions are independent; touches no cache.
        """
        if not self.injects_hits:
            return None
        rng = _generator(self.seed, f"{req_id}/{PREFIX_HIT_FAULT}")
        inject, u_group, u_pos = rng.random(3)
        if not inject < self.rate:
            return None
        groups = [
            (group_id, start, ids)
            for group_id, (start, ids) in sorted(blocks.groups.items())
            if len(ids) > 0
        ]
        if not groups:
            return None
        group_id, start, ids = groups[_pick(u_group, len(groups))]
        index = _pick(u_pos, len(ids))
        byte, bit = (int(x) for x in rng.integers(0, [1 << 30, 8]))
        position, block_id = start + index, int(ids[index])
        kind = PREFIX_HIT_FAULT
        return Injection(req_id, kind, group_id, position, block_id, byte=byte, bit=bit)

    # ------------------------------------------------------------------
    # Applying it to this worker's caches
    # ------------------------------------------------------------------

    def corrupt(
        self,
        req_id: str,
        blocks: KVChecksumBlocks,
        caches: Mapping[str, torch.Tensor],
        group_layers: Mapping[int, Sequence[str]],
        num_blocks: int,
        skip_groups: Collection[int] = (),
    ) -> Injection | None:
        """Decide for this load and corrupt this worker's share of it.

        `caches` are vLLM's per-layer views `[num_blocks * kernel_blocks, heads,
        tokens, C]`; `group_layers` names each group's checksummed layers on
        this worker (one per distinct cache); `skip_groups` as in `decide`.
        Returns the decision (None: no injection) with the layers changed
        here. Queues device work only: no host synchronization (R55).
        """
        decision = self.decide(req_id, blocks, num_blocks, skip_groups)
        if decision is None:
            return None
        return self._corrupt(decision, caches, group_layers, num_blocks)

    def _corrupt(
        self,
        decision: Injection,
        caches: Mapping[str, torch.Tensor],
        group_layers: Mapping[int, Sequence[str]],
        num_blocks: int,
    ) -> Injection:
        """Apply a decision to this worker's caches and log it once."""
        req_id = decision.req_id
        layers = _distinct(group_layers.get(decision.group_id, ()), caches)
        if decision.kind in ("bit_flip", PREFIX_HIT_FAULT):
            layers = layers[:1] if self.is_first_worker else []
            if self.is_first_worker and not layers:
                logger.warning(
                    "KV checksum fault injection skipped for request %s: pipeline "
                    "stage 0 holds no layer of group %d.",
                    req_id,
                    decision.group_id,
                )
                return decision
        views = [_block_view(cache, num_blocks) for _, cache in layers]
        if self.is_first_worker and decision.source_block_id is not None and views:
            self._probe_effect(decision, views)
        for view in views:
            self._apply(decision, view)
        if self.is_first_worker:
            logger.warning(
                "KV checksum fault injection: %s into request %s group %d block "
                "position %d.",
                decision.kind,
                req_id,
                decision.group_id,
                decision.position,
            )
            logger.debug("KV checksum fault injection details: %s", decision)
        return replace(decision, layers=tuple(name for name, _ in layers))

    def _probe_effect(self, decision: Injection, views: list[torch.Tensor]) -> None:
        """Queue the comparison of the block with its copy source in every
        layer, before the copy; `report_no_effect` logs the outcome later."""
        assert decision.source_block_id is not None
        changed = torch.stack(
            [
                (view[decision.block_id] != view[decision.source_block_id]).any()
                for view in views
            ]
        ).any()
        event = None
        if changed.is_cuda:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(changed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            changed = host
        self._probes.append(_EffectProbe(decision, changed, event))

    def report_no_effect(self) -> list[Injection]:
        """Log every earlier copying injection whose source held the same bytes
        on this worker (it corrupted nothing here); only probes whose device
        work completed are read, so nothing waits. Returns them."""
        unchanged = []
        while self._probes and (
            self._probes[0].event is None or self._probes[0].event.query()  # type: ignore[attr-defined]
        ):
            probe = self._probes.popleft()
            if bool(probe.changed):
                continue
            d = probe.decision
            logger.warning(
                "KV checksum fault injection had no effect: %s into request %s "
                "group %d block position %d copied block %d, which held the same "
                "bytes on this worker; no fault to report.",
                d.kind,
                d.req_id,
                d.group_id,
                d.position,
                d.source_block_id,
            )
            unchanged.append(d)
        return unchanged

    @staticmethod
    def _apply(decision: Injection, view: torch.Tensor) -> None:
        block = view[decision.block_id]
        if decision.kind in ("bit_flip", PREFIX_HIT_FAULT):
            cell = block[0, 0, 0]  # first kernel block, first head, first token
            cell[decision.byte % cell.shape[0]].bitwise_xor_(1 << decision.bit)
        elif decision.kind == "zero_block":
            block.zero_()
        elif decision.kind == "swap_blocks":
            assert decision.source_block_id is not None
            other = view[decision.source_block_id]
            saved = block.clone()
            block.copy_(other)
            other.copy_(saved)
        elif decision.kind == "stale_block":
            assert decision.source_block_id is not None
            block.copy_(view[decision.source_block_id])
        else:
            raise ValueError(f"unknown fault kind {decision.kind!r}")

    def corrupt_loads(
        self,
        worker: Any,
        finished_recving: Iterable[str] | None,
        failed_recving: Iterable[str] | None = None,
        finished_req_ids: Iterable[str] = (),
    ) -> list[Injection]:
        """Corrupt the finished loads `worker` (a KVChecksumWorker) checksums next.

        Called with the arguments of the worker's `post_forward`, right before
        it: failed loads and finished requests are left alone, like there.
        """
        self.report_no_effect()
        skip = set(failed_recving or ()) | set(finished_req_ids)
        req_ids = [r for r in finished_recving or () if r not in skip]
        if not req_ids:
            return []
        loads = worker.pending_load_blocks(req_ids)
        if not loads:
            return []
        group_layers = worker.group_layer_names()
        injections = []
        for req_id, blocks in loads.items():
            injection = self.corrupt(
                req_id,
                blocks,
                worker.kv_caches,
                group_layers,
                worker.topology.num_blocks,
                worker.skipped_groups,
            )
            if injection is not None:
                injections.append(injection)
        return injections

    def corrupt_hits(self, worker: Any) -> list[Injection]:
        """Flip bits in the prefix-hit blocks `worker` (a KVChecksumWorker)
        checks this step (R140); called right before its `post_forward`."""
        if not self.injects_hits:
            return []
        checks = worker.pending_hit_checks()
        if not checks:
            return []
        group_layers = worker.group_layer_names()
        injections = []
        for req_id, blocks in checks.items():
            decision = self.decide_hit(req_id, blocks)
            if decision is not None and decision.group_id in group_layers:
                injections.append(
                    self._corrupt(
                        decision,
                        worker.kv_caches,
                        group_layers,
                        worker.topology.num_blocks,
                    )
                )
        return injections


def create_fault_injector(
    vllm_config: Any, tp_rank: int, pp_rank: int
) -> KVFaultInjector | None:
    """The injector configured in `kv_checksum_fault_injection`, else None."""
    config = read_fault_injection(getattr(vllm_config, "kv_transfer_config", None))
    if config is None:
        return None
    if pp_rank == 0 and tp_rank == 0:
        logger.warning(
            "KV checksum fault injection is ON (rate %s, kinds %s, seed %d): "
            "loaded KV will be corrupted on purpose.",
            config.rate,
            ", ".join(config.kinds),
            config.seed,
        )
    return KVFaultInjector(config.rate, config.kinds, config.seed, tp_rank, pp_rank)
