# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fault injection into host copies of offloaded KV (R131 for R139).

Off unless `kv_connector_extra_config["kv_checksum_host_fault_injection"]` is
set to {"rate": number in [0, 1], "kinds": some of HOST_FAULT_KINDS (default
all), "seed": int (default 0)}. Just before the OffloadingConnector submits a
load, a fraction `rate` of the loads get the host copy of their first loaded
block corrupted, in pinned host memory, before the copy to the GPU:

- "host_bit_flip": one bit of one of the first 256 bytes of that block's
  sub-block, in the first host tensor, on worker (pp 0, tp 0) only;
- "host_other_block": the whole host chunk overwritten with another chunk's
  bytes (every host tensor, every worker), as a host tier returning another
  block's data would.

Decisions are a pure function of (seed, request id, first chunk id), so all
workers take the same one. Worker (pp 0, tp 0) logs each at WARNING:
"KV checksum host fault injection: <kind> into request <id> chunk <C>."
The corrupted copy stays in host memory until a failed check drops it (R121):
use it on test deployments only.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_checksum.config import (
    HOST_FAULT_KEY,
    HOST_FAULT_KINDS,
    FaultInjectionConfig,
    read_fault_setting,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

_BIT_FLIP_BYTES = 256


@dataclass(frozen=True)
class HostFaultConfig(FaultInjectionConfig):
    """The operator's host-copy fault injection settings."""

    kinds: tuple[str, ...] = HOST_FAULT_KINDS


@dataclass(frozen=True)
class HostInjection:
    """One host copy corrupted: the chunk, and the source chunk or bit."""

    req_id: str
    kind: str
    chunk_id: int
    sub_block: int
    source_chunk_id: int | None = None
    byte: int = 0
    bit: int = 0


def read_host_fault_config(kv_transfer_config: Any) -> HostFaultConfig | None:
    """The configured host-copy faults, None when absent; bad values raise
    (the same rules as `kv_checksum_fault_injection`)."""
    config = read_fault_setting(kv_transfer_config, HOST_FAULT_KEY, HOST_FAULT_KINDS)
    if config is None:
        return None
    return HostFaultConfig(config.rate, config.kinds, config.seed)


class HostFaultInjector:
    """Corrupts host copies right before their load is submitted (R131)."""

    def __init__(self, config: HostFaultConfig, first_worker: bool) -> None:
        self.config = config
        self.first_worker = first_worker
        self.injections: list[HostInjection] = []

    def decide(
        self, req_id: str, chunk_id: int, sub_block: int, num_chunks: int
    ) -> HostInjection | None:
        """The same decision on every worker for this load."""
        key = f"kv_checksum_host_fault/{self.config.seed}/{req_id}/{chunk_id}"
        digest = hashlib.sha256(key.encode()).digest()
        rng = np.random.Generator(
            np.random.PCG64(int.from_bytes(digest[:16], "little"))
        )
        draws = rng.random(5)
        if draws[0] >= self.config.rate:
            return None
        kinds = self.config.kinds
        kind = kinds[min(int(draws[1] * len(kinds)), len(kinds) - 1)]
        if kind == "host_other_block":
            if num_chunks < 2:
                return None
            offset = 1 + min(int(draws[2] * (num_chunks - 1)), num_chunks - 2)
            source = (chunk_id + offset) % num_chunks
            return HostInjection(req_id, kind, chunk_id, sub_block, source)
        byte = min(int(draws[3] * _BIT_FLIP_BYTES), _BIT_FLIP_BYTES - 1)
        bit = min(int(draws[4] * 8), 7)
        return HostInjection(req_id, kind, chunk_id, sub_block, None, byte, bit)

    def corrupt(
        self,
        req_id: str,
        chunk_id: int,
        sub_block: int,
        blocks_per_chunk: int,
        host_tensors: Sequence[torch.Tensor],
    ) -> HostInjection | None:
        """Decide, then corrupt this worker's host tensors ([chunks, bytes])."""
        if not host_tensors:
            return None
        num_chunks = int(host_tensors[0].shape[0])
        injection = self.decide(req_id, chunk_id, sub_block, num_chunks)
        if injection is None:
            return None
        if injection.kind == "host_other_block":
            assert injection.source_chunk_id is not None
            for tensor in host_tensors:
                tensor[chunk_id].copy_(tensor[injection.source_chunk_id])
        elif self.first_worker:
            row = host_tensors[0][chunk_id].view(torch.uint8)
            page = row.numel() // max(1, blocks_per_chunk)
            index = sub_block * page + injection.byte % max(1, page)
            row[index] ^= 1 << injection.bit
        if self.first_worker:
            logger.warning(
                "KV checksum host fault injection: %s into request %s chunk %d.",
                injection.kind,
                req_id,
                chunk_id,
            )
        self.injections.append(injection)
        return injection


def create_host_fault_injector(
    vllm_config: Any, tp_rank: int, pp_rank: int
) -> HostFaultInjector | None:
    """The configured injector of one worker, None when not configured."""
    config = read_host_fault_config(getattr(vllm_config, "kv_transfer_config", None))
    if config is None:
        return None
    first = tp_rank == 0 and pp_rank == 0
    if first:
        logger.warning(
            "KV checksum host fault injection is ON (rate %s, kinds %s): host "
            "copies of offloaded KV will be corrupted on purpose.",
            config.rate,
            ", ".join(config.kinds),
        )
    return HostFaultInjector(config, first)
