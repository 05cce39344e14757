# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Counters of checksum verdicts, sends and quarantined blocks (R130, R138),
and the number of requests holding checksum state (R141, a gauge).

The counts are plain integers here. vLLM's `Scheduler.make_stats` sends
`KVChecksumScheduler.make_stats()` (`KVChecksumStats.take().to_dict()`) to
the API server in `SchedulerStats.kv_checksum_stats`, and
:mod:`.prom_metrics` records it. vLLM 0.33.0's SchedulerStats has no such
field: there the plugin puts the dict under `STATS_KEY` into
`SchedulerStats.kv_connector_stats` and takes it out again (`split_stats`)
before the connector's stats parsers see it.
"""

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    KVChecksumVerdict,
)

# The key of the checksum counts in SchedulerStats.kv_connector_stats, with the
# plugin on vLLM 0.33.0 (R130).
STATS_KEY = "kv_checksum"

# Busy steps between two recounts of the requests holding checksum state (R141):
# a recount walks every such request, so a busy engine does not pay it every
# step (R142).
TRACKED_RECOUNT_STEPS = 16


def _counts(value: Any) -> Counter:
    """A Counter of str -> non-negative int from a plain mapping; drops the rest."""
    if not isinstance(value, Mapping):
        return Counter()
    return Counter(
        {
            str(k): int(v)
            for k, v in value.items()
            if isinstance(v, int) and not isinstance(v, bool) and v > 0
        }
    )


def _count(value: Any) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return int(value) if ok else 0


def _gauge(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return int(value) if ok else None


@dataclass
class KVChecksumStats:
    """Verdict, payload and quarantine counts since the last `take()`."""

    loads: Counter = field(default_factory=Counter)  # status value -> loads
    unverified_reasons: Counter = field(default_factory=Counter)  # reason -> loads
    mismatched_positions: int = 0
    sent: int = 0
    not_sent: Counter = field(default_factory=Counter)  # reason -> requests
    # loaded blocks of failed loads kept out of the prefix cache (R138)
    quarantined_blocks: int = 0
    # workers whose checksums (or offload tier's) the last-resort guard
    # turned off (R134)
    disabled_workers: int = 0
    # prefix-cache hit checks by verdict (R140)
    prefix_hits: Counter = field(default_factory=Counter)
    # requests holding checksum state now (R141); None: unchanged since sent
    tracked_requests: int | None = None
    # external-cache loads checked against this engine's entries (R147)
    external_loads: Counter = field(default_factory=Counter)
    # entries kept for external loads now (R147); None: unchanged since sent
    external_entries: int | None = None

    def record_prefix_hit(self, verdict: KVChecksumVerdict) -> None:
        self.prefix_hits[verdict.status.value] += 1

    def record_external_load(self, verdict: KVChecksumVerdict) -> None:
        """An external load's verdict (R147): counted by source and, its
        reasons and mismatched positions, as every load's are."""
        self.external_loads[verdict.status.value] += 1
        self._record_details(verdict)

    def record_verdict(self, verdict: KVChecksumVerdict) -> None:
        self.loads[verdict.status.value] += 1
        self._record_details(verdict)

    def _record_details(self, verdict: KVChecksumVerdict) -> None:
        """A load verdict's mismatched positions or unverified reasons."""
        if verdict.status == KVChecksumStatus.MISMATCH:
            self.mismatched_positions += sum(
                len(p) for p in verdict.mismatches.values()
            )
        elif verdict.status == KVChecksumStatus.UNVERIFIED:
            for reason in dict.fromkeys(r for r, _ in verdict.reasons):
                self.unverified_reasons[reason.value] += 1

    def record_sent(self) -> None:
        self.sent += 1

    def record_not_sent(self, reason: str) -> None:
        self.not_sent[reason] += 1

    def record_quarantined(self, num_blocks: int) -> None:
        self.quarantined_blocks += num_blocks

    def record_worker_disabled(self) -> None:
        self.disabled_workers += 1

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.sent
            or self.not_sent
            or self.quarantined_blocks
            or self.disabled_workers
            or self.prefix_hits
            or self.tracked_requests is not None
            or self.external_loads
            or self.external_entries is not None
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain, serializable counts (they cross processes in SchedulerStats)."""
        data: dict[str, Any] = {
            "loads": dict(self.loads),
            "unverified_reasons": dict(self.unverified_reasons),
            "mismatched_positions": self.mismatched_positions,
            "sent": self.sent,
            "not_sent": dict(self.not_sent),
            "quarantined_blocks": self.quarantined_blocks,
            "disabled_workers": self.disabled_workers,
            "prefix_hits": dict(self.prefix_hits),
        }
        if self.tracked_requests is not None:
            data["tracked_requests"] = self.tracked_requests
        if self.external_loads:
            data["external_loads"] = dict(self.external_loads)
        if self.external_entries is not None:
            data["external_entries"] = self.external_entries
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "KVChecksumStats":
        """The inverse of `to_dict`; missing or malformed entries count zero."""
        if not isinstance(data, Mapping):
            return cls()
        return cls(
            loads=_counts(data.get("loads")),
            unverified_reasons=_counts(data.get("unverified_reasons")),
            mismatched_positions=_count(data.get("mismatched_positions")),
            sent=_count(data.get("sent")),
            not_sent=_counts(data.get("not_sent")),
            quarantined_blocks=_count(data.get("quarantined_blocks")),
            disabled_workers=_count(data.get("disabled_workers")),
            prefix_hits=_counts(data.get("prefix_hits")),
            tracked_requests=_gauge(data.get("tracked_requests")),
            external_loads=_counts(data.get("external_loads")),
            external_entries=_gauge(data.get("external_entries")),
        )

    def take(self) -> "KVChecksumStats":
        """Return the counts so far and start new ones."""
        taken = replace(self)
        fresh = KVChecksumStats()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))
        return taken


@dataclass
class TrackedRecount:
    """When to recount the requests holding checksum state for the R141 gauge:
    on a step that leaves the engine with no request, on the first step after
    such a step, and every `every` busy steps between. Starting and draining
    are exact; a busy engine's gauge lags at most `every` steps."""

    every: int = TRACKED_RECOUNT_STEPS
    _since: int = field(default=0, init=False)
    _was_empty: bool = field(default=True, init=False)

    def due(self, engine_empty: bool) -> bool:
        """Whether this step recounts; `engine_empty`: the engine holds no
        request after the step."""
        self._since += 1
        due = engine_empty or self._was_empty or self._since >= self.every
        self._was_empty = engine_empty
        if due:
            self._since = 0
        return due


def split_stats(data: Mapping[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(the checksum counts, the connector's own stats) of a kv_connector_stats dict.

    Returns (None, None) when `data` holds no checksum counts: the caller then
    passes `data` on untouched. Otherwise the second item is a new dict without
    `STATS_KEY` (the input is shared by every stat logger, so it is never
    mutated), possibly empty.
    """
    if not isinstance(data, Mapping) or STATS_KEY not in data:
        return None, None
    rest = {k: v for k, v in data.items() if k != STATS_KEY}
    return data[STATS_KEY], rest
