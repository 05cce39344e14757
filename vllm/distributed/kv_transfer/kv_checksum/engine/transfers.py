# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the scheduler side's producer and consumer halves share.

The P/D transfers they track until every worker reported (a producer's send
and a consumer's receive share the blocks and the collected worker reports; a
receive also holds what the producer sent, SPEC 9-13), and the setup both
halves read.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import SchedulerGroup
from vllm.distributed.kv_transfer.kv_checksum.engine.verdict_log import VerdictLog
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import KVChecksumPayload
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
    KVChecksumWorkerReport,
    UnverifiedReason,
    WorkerKey,
)

# carrier(request, receiving) -> how the connector moves checksums, or None
CarrierFn = Callable[[Any, bool], KVChecksumCarrier | None]


@dataclass
class PendingTransfer:
    """A send or receive waiting for every worker's report."""

    blocks: KVChecksumBlocks
    reports: dict[WorkerKey, KVChecksumWorkerReport] = field(default_factory=dict)


@dataclass
class PendingReceive(PendingTransfer):
    """A receive, with the producer's checksums once they arrived (or why not)."""

    carrier: KVChecksumCarrier = KVChecksumCarrier.KV_TRANSFER_PARAMS
    expected: KVChecksumPayload | None = None
    expected_error: UnverifiedReason | None = None
    decode_error: str = ""


@dataclass(frozen=True)
class TransferSetup:
    """The engine's transfer groups and workers, how its connector carries
    checksums, and where verdicts go: read by both halves of the scheduler side."""

    groups: dict[int, SchedulerGroup]
    group_infos: dict[int, KVChecksumGroupInfo]
    num_workers: int
    tp_size: int
    carrier: CarrierFn
    log: VerdictLog
