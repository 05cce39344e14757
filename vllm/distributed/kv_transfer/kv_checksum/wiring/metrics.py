# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks on vLLM's metrics: scheduler stats and the connector stat loggers
(R130); the logic is in engine/metrics.py and engine/prom_metrics.py.

Hooks (target; why; how; the upstream change that lets it go):

The hooks make the calls vLLM's own code makes with the subsystem built in
(`KVChecksumScheduler.make_stats`, `create_kv_checksum_metrics`,
`KVChecksumPromMetrics.observe` under `KVChecksumGuard`); only the transport
differs: vLLM 0.33.0's SchedulerStats has no checksum field, so the counts
ride in kv_connector_stats under `STATS_KEY` and are taken out again.

Scheduler.make_stats
    Why: verdict counts reach the API server's stat loggers
    How: after the original, under "kv_checksum" in kv_connector_stats
    Upstream: SchedulerStats.kv_checksum_stats, filled by the Scheduler
KVConnectorProm.__init__, observe
    Why: checksum counters on /metrics; the connector's parser never sees the key
    How: build the counters; record and strip the key
    Upstream: the counters built in KVConnectorProm.__init__ and recorded
    from the separate SchedulerStats field (observe_kv_checksums)
KVConnectorLogging.observe
    Why: as above
    How: strip the key
    Upstream: as above
"""

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.engine.metrics import (
    STATS_KEY,
    split_stats,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.prom_metrics import (
    create_kv_checksum_metrics,
)
from vllm.distributed.kv_transfer.kv_checksum.wiring import (
    _guard,
    _wrap,
)


def install_metrics_hooks() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )
    from vllm.v1.core.sched.scheduler import Scheduler

    # Read when checksums are off: a class default, nothing set on instances.
    KVConnectorProm.kv_checksum_metrics = None  # type: ignore[attr-defined]

    @_wrap(Scheduler, "make_stats")
    def make_stats(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
        """Target: Scheduler.make_stats. Why: the verdict counts must reach the
        API server's stat loggers. How: when vLLM returns SchedulerStats, put
        `KVChecksumScheduler.make_stats()` (the counts since the last call and
        the tracked-requests gauge when it changed, R141, R142) as a plain dict
        under "kv_checksum" into a copy of its kv_connector_stats dict; an
        error disables checksums for the engine (R134).
        Upstream: SchedulerStats.kv_checksum_stats, filled by the Scheduler
        with the same call."""
        stats = original(self, *args, **kwargs)
        kcs = getattr(self, "kv_checksum_scheduler", None)
        if stats is None or kcs is None:
            return stats
        with _guard(self, "kv_checksum_scheduler", "make_stats"):
            data = kcs.make_stats(not self.requests)
            if data is not None:
                merged = {**(stats.kv_connector_stats or {}), STATS_KEY: data}
                stats.kv_connector_stats = merged
        return stats

    @_wrap(KVConnectorProm, "__init__")
    def prom_init(
        original: Callable,
        self: Any,
        vllm_config: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        """Target: KVConnectorProm.__init__. Why: checksum counters on vLLM's
        /metrics. How: also build KVChecksumPromMetrics with this class's
        metric classes and vLLM's labels; set only when checksums are on (the
        class default None answers otherwise). Never raises: an error is
        logged once and leaves the counters out.
        Upstream: the same, next to the connector's build_prom_metrics."""
        original(self, vllm_config, labelnames, per_engine_labelvalues)
        metrics = create_kv_checksum_metrics(
            self, vllm_config, labelnames, per_engine_labelvalues
        )
        if metrics is not None:
            self.kv_checksum_metrics = metrics

    @_wrap(KVConnectorProm, "observe")
    def prom_observe(
        original: Callable, self: Any, data: Any, engine_idx: int = 0
    ) -> None:
        """Target: KVConnectorProm.observe. Why: the connector's own parser
        must never see the "kv_checksum" key. How: record it, pass the rest on
        only if non-empty; an error while recording drops the checksum
        counters of this logger with one error log. Without the key (checksums
        off) an exact pass-through. Upstream: a separate SchedulerStats field,
        recorded by KVConnectorProm.observe_kv_checksums with the same call."""
        ours, rest = split_stats(data)
        if rest is None:
            return original(self, data, engine_idx)
        metrics = getattr(self, "kv_checksum_metrics", None)
        if metrics is not None:
            with _guard(self, "kv_checksum_metrics", "metrics"):
                metrics.observe(ours, engine_idx)
        if rest:
            original(self, rest, engine_idx)

    @_wrap(KVConnectorLogging, "observe")
    def logging_observe(original: Callable, self: Any, data: Any) -> None:
        """Target: KVConnectorLogging.observe. Why and how: as for
        KVConnectorProm.observe, minus the recording. Upstream: as there."""
        _, rest = split_stats(data)
        if rest is None:
            return original(self, data)
        if rest:
            original(self, rest)
