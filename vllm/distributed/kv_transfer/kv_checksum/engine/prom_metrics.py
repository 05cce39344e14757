# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prometheus counters of checksum verdicts, sends and quarantines (R130).

The scheduler's counts (`KVChecksumScheduler.make_stats`) reach the API
server in vLLM's `SchedulerStats`: its `kv_checksum_stats` field on a vLLM
with the subsystem built in, under `metrics.STATS_KEY` in
`kv_connector_stats` with the plugin (vLLM 0.33.0). `KVConnectorProm` builds
`KVChecksumPromMetrics` next to the connector's own metrics
(`create_kv_checksum_metrics`), with the metric classes vLLM chose (plain
prometheus_client or Ray wrappers) and vLLM's per-engine labels, and hands
it the counts. No second HTTP server: the counters appear on vLLM's
`/metrics` endpoint.

- `vllm:kv_checksum_loads{verdict}`: loads by verdict (verified, mismatch,
  unverified);
- `vllm:kv_checksum_unverified_loads{reason}`: unverified loads by fixed
  reason, labelled as in `REASON_LABELS`;
- `vllm:kv_checksum_mismatched_blocks`: consumer block positions of mismatches;
- `vllm:kv_checksum_payloads_sent`: producer payloads handed to a carrier;
- `vllm:kv_checksum_payloads_not_sent{reason}`: finished producer requests
  without a payload, by reason (`REASON_LABELS`);
- `vllm:kv_checksum_quarantined_blocks`: loaded blocks of loads that failed
  verification, kept out of the prefix cache (R138);
- `vllm:kv_checksum_prefix_hits{verdict}`: local prefix-cache hits checked
  against the entries recorded when their blocks were cached (R140);
- `vllm:kv_checksum_external_loads{verdict}`: loads from a connector's
  external cache checked against the entries this engine recorded when it
  computed the blocks (R147); their reasons and mismatched positions count
  in the load counters above too;
- `vllm:kv_checksum_external_entries` (a gauge, R147): entries kept for
  external loads now, at most `kv_checksum_external_entry_limit`;
- `vllm:kv_checksum_disabled_workers`: workers whose checksums their
  last-resort guard turned off (R134); from the first one on the engine runs
  as with checksums off (after an offload tier's worker side, only that
  tier's loads go unchecked), so alert on any increase.
- `vllm:kv_checksum_tracked_requests` (a gauge, R141): requests holding
  per-request checksum state on the engine's scheduler now; back to 0 when
  the engine is idle, so a value that only grows is a leak.

All but the gauges are counters (prometheus_client appends `_total`); all have
vLLM's `model_name` and `engine` labels first. A gauge is sent when it
changes (and once at start), like the counters only in steps with log_stats.
An unverified load with several fixed reasons counts once under each of them.
"""

from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from vllm.distributed.kv_transfer.kv_checksum.engine.metrics import KVChecksumStats
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    UnverifiedReason,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

VERDICT_LABELS = tuple(status.value for status in KVChecksumStatus)

# Fixed reason text (section 12) -> its `reason` label value. Stable: a metric
# label, renaming one breaks dashboards.
REASON_LABELS: dict[str, str] = {
    UnverifiedReason.NOT_ALL_WORKERS.value: "not_all_workers",
    UnverifiedReason.NO_CHECKSUMS.value: "no_checksums",
    UnverifiedReason.INVALID_CHECKSUMS.value: "invalid_checksums",
    UnverifiedReason.NO_LOADED_GROUP.value: "no_loaded_group",
    UnverifiedReason.OTHER_BLOCKS.value: "other_blocks",
    UnverifiedReason.ONE_SIDE_ONLY.value: "one_side_only",
    UnverifiedReason.OTHER_LAYERS.value: "other_layers",
    UnverifiedReason.BLOCK_SIZES.value: "block_sizes",
    UnverifiedReason.UNALIGNED_START.value: "unaligned_start",
    UnverifiedReason.NO_COMMON_BLOCK.value: "no_common_block",
    UnverifiedReason.REPLICA_MISSING.value: "replica_missing",
    UnverifiedReason.INTERNAL_ERROR.value: "internal_error",
    UnverifiedReason.NO_ENTRY.value: "no_entry",
}
# The label of a reason text not in REASON_LABELS (a newer scheduler).
OTHER_REASON = "other"


def reason_label(reason: str) -> str:
    """The `reason` label value of a fixed reason text."""
    return REASON_LABELS.get(reason, OTHER_REASON)


class _LabeledCounter:
    """One counter with an extra label, children per (engine, value) made once."""

    def __init__(
        self,
        counter: Any,
        per_engine_labelvalues: Mapping[int, list[object]],
        values: tuple[str, ...],
    ) -> None:
        self._counter = counter
        self._engines = per_engine_labelvalues
        self._children: dict[tuple[int, str], Any] = {}
        for engine_idx in per_engine_labelvalues:
            for value in values:  # present at 0 from the start, for rate()
                self._child(engine_idx, value)

    def _child(self, engine_idx: int, value: str) -> Any:
        child = self._children.get((engine_idx, value))
        if child is None:
            child = self._counter.labels(*self._engines[engine_idx], value)
            self._children[(engine_idx, value)] = child
        return child

    def inc(self, engine_idx: int, value: str, amount: int) -> None:
        if amount > 0:
            self._child(engine_idx, value).inc(amount)


class KVChecksumPromMetrics(KVConnectorPromMetrics):
    """The checksum counters of one `KVConnectorProm` (R130)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = per_engine_labelvalues
        reasons = tuple(dict.fromkeys(REASON_LABELS.values()))

        def counter(name: str, documentation: str, extra: list[str]) -> Any:
            return self._counter_cls(
                name=name,
                documentation=documentation,
                labelnames=[*labelnames, *extra],
            )

        self.loads = _LabeledCounter(
            counter(
                "vllm:kv_checksum_loads",
                "P/D KV loads checked by KV checksums, by verdict.",
                ["verdict"],
            ),
            engines,
            VERDICT_LABELS,
        )
        self.prefix_hits = _LabeledCounter(
            counter(
                "vllm:kv_checksum_prefix_hits",
                "Local prefix-cache hits checked by KV checksums, by verdict.",
                ["verdict"],
            ),
            engines,
            VERDICT_LABELS,
        )
        self.unverified_loads = _LabeledCounter(
            counter(
                "vllm:kv_checksum_unverified_loads",
                "Unverified KV loads by fixed reason (a load counts under each "
                "of its reasons).",
                ["reason"],
            ),
            engines,
            reasons,
        )
        self.not_sent = _LabeledCounter(
            counter(
                "vllm:kv_checksum_payloads_not_sent",
                "Finished producer requests whose KV checksums were not sent, "
                "by reason.",
                ["reason"],
            ),
            engines,
            reasons,
        )
        mismatched = counter(
            "vllm:kv_checksum_mismatched_blocks",
            "Consumer KV block positions whose checksums did not match.",
            [],
        )
        sent = counter(
            "vllm:kv_checksum_payloads_sent",
            "KV checksum payloads a producer handed to its carrier.",
            [],
        )
        quarantined = counter(
            "vllm:kv_checksum_quarantined_blocks",
            "Loaded KV blocks of loads that failed KV checksum verification, "
            "kept out of the prefix cache.",
            [],
        )
        self.mismatched_blocks = {
            i: mismatched.labels(*values) for i, values in engines.items()
        }
        self.payloads_sent = {i: sent.labels(*values) for i, values in engines.items()}
        self.quarantined_blocks = {
            i: quarantined.labels(*values) for i, values in engines.items()
        }
        disabled = counter(
            "vllm:kv_checksum_disabled_workers",
            "Workers whose KV checksums (or whose offload tier's) were turned "
            "off after an error there; the engine (or that tier) then runs as "
            "with KV checksums off.",
            [],
        )
        self.disabled_workers = {
            i: disabled.labels(*values) for i, values in engines.items()
        }
        gauge_cls: Any = self._gauge_cls

        def engine_gauges(name: str, documentation: str) -> dict[int, Any]:
            gauge = gauge_cls(
                name=name,
                documentation=documentation,
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
            return {i: gauge.labels(*values) for i, values in engines.items()}

        self.tracked_requests = engine_gauges(
            "vllm:kv_checksum_tracked_requests",
            "Requests holding per-request KV checksum state on the engine's "
            "scheduler; 0 when idle.",
        )
        self.external_loads = _LabeledCounter(
            counter(
                "vllm:kv_checksum_external_loads",
                "KV loaded from a connector's external cache and checked "
                "against this engine's entries, by verdict.",
                ["verdict"],
            ),
            engines,
            VERDICT_LABELS,
        )
        self.external_entries = engine_gauges(
            "vllm:kv_checksum_external_entries",
            "Entries of blocks this engine computed, kept to check "
            "external-cache loads; at most the configured limit.",
        )

    @classmethod
    def for_connector_prom(
        cls,
        prom: Any,
        vllm_config: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> "KVChecksumPromMetrics | None":
        """The counters of a `KVConnectorProm` (with its metric classes, plain or
        Ray) when checksums are enabled for this config, else None."""
        from vllm.distributed.kv_transfer.kv_checksum.config import (
            kv_checksum_enabled,
        )

        try:
            enabled = kv_checksum_enabled(vllm_config)
        except ValueError:
            enabled = False  # the engine itself refuses to start
        if not enabled:
            return None
        metric_types: dict[Any, Any] = {
            Gauge: prom._gauge_cls,
            Counter: prom._counter_cls,
            Histogram: prom._histogram_cls,
        }
        return cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: Any, engine_idx: int = 0) -> None:
        """Add one `KVChecksumStats.to_dict()` of engine `engine_idx`."""
        if engine_idx not in self.per_engine_labelvalues:
            return
        stats = KVChecksumStats.from_dict(transfer_stats_data)
        for verdict, n in stats.loads.items():
            self.loads.inc(engine_idx, verdict, n)
        for verdict, n in stats.prefix_hits.items():
            self.prefix_hits.inc(engine_idx, verdict, n)
        for reason, n in stats.unverified_reasons.items():
            self.unverified_loads.inc(engine_idx, reason_label(reason), n)
        for reason, n in stats.not_sent.items():
            self.not_sent.inc(engine_idx, reason_label(reason), n)
        if stats.mismatched_positions:
            self.mismatched_blocks[engine_idx].inc(stats.mismatched_positions)
        if stats.sent:
            self.payloads_sent[engine_idx].inc(stats.sent)
        if stats.quarantined_blocks:
            self.quarantined_blocks[engine_idx].inc(stats.quarantined_blocks)
        if stats.disabled_workers:
            self.disabled_workers[engine_idx].inc(stats.disabled_workers)
        if stats.tracked_requests is not None:
            self.tracked_requests[engine_idx].set(stats.tracked_requests)
        for verdict, n in stats.external_loads.items():
            self.external_loads.inc(engine_idx, verdict, n)
        if stats.external_entries is not None:
            self.external_entries[engine_idx].set(stats.external_entries)


def create_kv_checksum_metrics(
    prom: Any,
    vllm_config: Any,
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KVChecksumPromMetrics | None:
    """The checksum counters of `KVConnectorProm` `prom` (built in its
    `__init__`, after the connector's), None when checksums are off for this
    config. Never raises: an error is logged once and leaves the counters
    out, as vLLM's own metrics must come up regardless."""
    try:
        return KVChecksumPromMetrics.for_connector_prom(
            prom, vllm_config, labelnames, per_engine_labelvalues
        )
    except Exception:
        logger.exception("KV checksum metrics could not be created; left out.")
        return None
