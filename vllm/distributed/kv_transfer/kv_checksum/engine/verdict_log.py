# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the scheduler side reports outcomes: log lines, counts and containment.

Every verdict of a load, P/D or offloaded KV, and every payload not sent goes
through one `VerdictLog`, so they are logged (R96) and counted (R130) alike,
and a load that did not verify reaches containment (R138).
"""

from collections.abc import Callable

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.metrics import KVChecksumStats
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# on_failed_load(request id, verdict, loaded blocks) -> None: any load that did
# not verify, P/D or offload, in both modes (R138 containment)
FailedLoadFn = Callable[[str, KVChecksumVerdict, KVChecksumBlocks], None]


class VerdictLog:
    """Logs and counts verdicts and warns once per fixed reason (R96, R130);
    hands loads that did not verify to `on_failed_load` (R138)."""

    def __init__(self, stats: KVChecksumStats) -> None:
        self.stats = stats
        self.on_failed_load: FailedLoadFn | None = None
        self._warned: set[str] = set()

    def record(
        self, req_id: str, verdict: KVChecksumVerdict, blocks: KVChecksumBlocks
    ) -> None:
        """Log one load's verdict and count it."""
        self._log_verdict(req_id, verdict, blocks)
        self.stats.record_verdict(verdict)

    def log(
        self, req_id: str, verdict: KVChecksumVerdict, blocks: KVChecksumBlocks
    ) -> None:
        """Log one verdict (R96) that is counted apart (R147)."""
        self._log_verdict(req_id, verdict, blocks)

    def failed(
        self, req_id: str, verdict: KVChecksumVerdict, blocks: KVChecksumBlocks
    ) -> None:
        """A load that did not verify: to containment, when attached (R138)."""
        if self.on_failed_load is not None:
            self.on_failed_load(req_id, verdict, blocks)

    def _log_verdict(
        self, req_id: str, verdict: KVChecksumVerdict, blocks: KVChecksumBlocks
    ) -> None:
        """R96: an error per mismatch, a warning once per fixed reason; the
        loaded block ids of a mismatch at DEBUG, to tell its cause."""
        if verdict.status == KVChecksumStatus.MISMATCH:
            groups = "; ".join(
                f"group {g} block positions {positions}"
                for g, positions in sorted(verdict.mismatches.items())
            )
            logger.error("KV checksum mismatch for request %s: %s", req_id, groups)
            logger.debug(
                "KV checksum mismatch details, request %s: loaded blocks "
                "(group: first position, block ids) %s",
                req_id,
                {
                    g: (int(f), np.asarray(i).tolist())
                    for g, (f, i) in blocks.groups.items()
                },
            )
            return
        if verdict.status == KVChecksumStatus.VERIFIED:
            logger.debug("KV checksums verified for request %s.", req_id)
            return
        for reason, _ in verdict.reasons:
            self.warn_once(f"KV checksums not verified: {reason.value}.")
        details = "; ".join(f"{r.value} ({d})" for r, d in verdict.reasons)
        logger.debug("KV checksums not verified for request %s: %s", req_id, details)

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)
