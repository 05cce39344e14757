# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV checksums at work in a P/D simulation on CPU: every fault caught.

Real vLLM 0.33.0 producer and consumer schedulers (with this package's
hooks), real checksum workers over CPU KV caches made by vLLM's own
allocator, and a test transport that moves each request's KV from producer
blocks into consumer blocks. Some loads are corrupted on the way (a flipped
bit, a zeroed block, two swapped blocks, a block of another request as after
a stale read); the consumer must catch each one before the request runs.

The workers copy their results on a side stream, as on a GPU; here through
the CPU stand-ins for CUDA streams and events that the test suite uses
(``cpu_cuda_streams``), so the demo runs the code path a GPU engine runs.

Run from the repository root: ``bash examples/run_demo.sh``. Prints one line
per request, then totals and the checksum counters; exits non-zero unless
every injected fault was detected as a mismatch with its mode's outcome and
every clean load was verified and ran.
"""

import dataclasses
import logging
import os
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import pytest  # noqa: E402

from tests.v1.kv_connector.unit import kv_checksum_pd as pd  # noqa: E402
from tests.v1.kv_connector.unit.kv_checksum_helpers import (  # noqa: E402
    cpu_cuda_streams,
    write_model_dir,
)

# Both sides use a test connector that loads the whole prompt, as vLLM 0.33.0's
# NIXL pull does, so every loaded block (the partial last one too) is compared.
NIXL_LIKE = dict(connector=pd.WHOLE_PROMPT_CONNECTOR_NAME)
CONFIGS = [
    ("TP1 -> TP1", dict(), dict()),
    ("TP2 -> TP1", dict(tp=2), dict()),
    ("TP1 -> TP2", dict(), dict(tp=2)),
    ("PP2 -> TP1", dict(pp=2), dict()),
    ("bs16 -> bs32", dict(), dict(block_size=32)),
]
MODES = [
    ("fail-open", dict(fail_closed=False)),
    ("fail-closed/fail", dict(fail_closed=True, policy="fail")),
    ("fail-closed/recompute", dict(fail_closed=True, policy="recompute")),
]
# What a faulty load must end as, per mode (R94, R95).
FAULT_OUTCOME = {
    "fail-open": "ran",
    "fail-closed/fail": "ended with error",
    "fail-closed/recompute": "recomputed",
}
# One clean and one faulty load per (configuration, mode).
NUM_LOADS = 2 * len(CONFIGS) * len(MODES)


@dataclasses.dataclass
class Row:
    request: str
    config: str
    mode: str
    fault: str
    verdict: str
    outcome: str

    @property
    def ok(self) -> bool:
        if self.fault == "-":
            return self.verdict == "verified" and self.outcome == "ran"
        return self.verdict == "mismatch" and self.outcome == FAULT_OUTCOME[self.mode]


def verdict_of(engine: pd.SimEngine, before: Counter) -> str:
    after = engine.checksums.stats.loads
    changed = [k for k in after if after[k] != before.get(k, 0)]
    return changed[0] if changed else "none"


def outcome_of(result: pd.LoadResult) -> str:
    if result.finish_reason.lower().endswith("error"):
        return "ended with error"
    if result.computed_after_load == 0:
        return "recomputed"
    return "ran"


def add_counters(counters: Counter, engine: pd.SimEngine, side: str) -> None:
    """Add an engine's checksum counters (those behind vllm:kv_checksum_*)."""
    stats = engine.checksums.stats
    for verdict, count in stats.loads.items():
        counters[f"{side} loads {verdict}"] += count
    for reason, count in stats.unverified_reasons.items():
        counters[f"{side} unverified: {reason}"] += count
    counters[f"{side} mismatched block positions"] += stats.mismatched_positions
    counters[f"{side} payloads sent"] += stats.sent
    for reason, count in stats.not_sent.items():
        counters[f"{side} payloads not sent: {reason}"] += count


def run(counters: Counter) -> list[Row]:
    model_dir = write_model_dir(tempfile.mkdtemp(prefix="kv-checksum-demo-"))
    rows: list[Row] = []
    kinds = iter(pd.FAULT_KINDS * 10)
    number = 0
    for config, producer_side, consumer_side in CONFIGS:
        producer = pd.SimEngine(
            model_dir, pd.SideConfig(**producer_side, **NIXL_LIKE), "producer"
        )
        for mode, mode_side in MODES:
            consumer = pd.SimEngine(
                model_dir,
                pd.SideConfig(**consumer_side, **mode_side, **NIXL_LIKE),
                "consumer",
            )
            for fault_kind in (None, next(kinds)):
                number += 1
                prompt = [(number * 37 + i * 11) % 1000 + 3 for i in range(64)]
                params = pd.produce(producer, f"p{number}", prompt)
                stale = None
                if fault_kind == "stale_block":
                    other = [(t * 7 + 5) % 1000 + 3 for t in prompt]
                    stale = pd.produce(producer, f"p{number}-other", other)
                # Position 1 is the last loaded block at 32-token blocks.
                fault = pd.Fault(fault_kind, position=1) if fault_kind else None
                before = Counter(consumer.checksums.stats.loads)
                result = pd.consume(
                    consumer, producer, f"req{number}", prompt, params, fault, stale
                )
                rows.append(
                    Row(
                        f"req{number}",
                        config,
                        mode,
                        fault_kind or "-",
                        verdict_of(consumer, before),
                        outcome_of(result),
                    )
                )
            add_counters(counters, consumer, "consumer")
        add_counters(counters, producer, "producer")
    return rows


def main() -> int:
    start = time.time()
    # The demo prints its own table; vLLM's per-request logs would drown it.
    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    counters: Counter = Counter()
    with pytest.MonkeyPatch.context() as patch, cpu_cuda_streams(patch):
        rows = run(counters)
    header = ("request", "configuration", "mode", "fault", "verdict", "outcome")
    widths = [9, 14, 22, 15, 11, 17]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        cells = (r.request, r.config, r.mode, r.fault, r.verdict, r.outcome)
        flag = "" if r.ok else "   <-- UNEXPECTED"
        print(" | ".join(c.ljust(w) for c, w in zip(cells, widths)) + flag)
    faults = [r for r in rows if r.fault != "-"]
    clean = [r for r in rows if r.fault == "-"]
    caught = sum(r.verdict == "mismatch" for r in faults)
    verified = sum(r.verdict == "verified" for r in clean)
    print()
    print(f"faulty loads: {len(faults)}, detected as mismatch: {caught}")
    print(f"clean loads: {len(clean)}, verified: {verified}")
    print("outcomes:", dict(Counter((r.mode, r.outcome) for r in faults)))
    print("checksum counters:")
    for name, count in sorted(counters.items()):
        if count:
            print(f"  {name}: {count}")
    print(f"finished in {time.time() - start:.0f} s")
    problems = failures(rows, counters)
    for problem in problems:
        print(f"FAILED: {problem}")
    if not problems:
        print(f"OK: all {len(faults)} injected faults detected")
    return 1 if problems else 0


def failures(rows: list[Row], counters: Counter) -> list[str]:
    """Why the run does not show every injected fault caught (empty if it
    does): a row off its expected verdict or outcome, a load or fault kind
    missing, or counters that disagree with the rows."""
    problems = [
        f"{r.request} ({r.config}, {r.mode}, {r.fault})" for r in rows if not r.ok
    ]
    if len(rows) != NUM_LOADS:
        problems.append(f"{len(rows)} loads run, {NUM_LOADS} expected")
    faults = [r for r in rows if r.fault != "-"]
    missing = set(pd.FAULT_KINDS) - {r.fault for r in faults}
    if missing:
        problems.append(f"fault kinds never injected: {sorted(missing)}")
    for verdict, expected in (
        ("mismatch", len(faults)),
        ("verified", len(rows) - len(faults)),
    ):
        if counters[f"consumer loads {verdict}"] != expected:
            problems.append(
                f"counter 'consumer loads {verdict}' is "
                f"{counters[f'consumer loads {verdict}']}, {expected} expected"
            )
    return problems


if __name__ == "__main__":
    sys.exit(main())
