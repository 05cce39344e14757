# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Two deep hook-timer runs of one engine, call by call, across machines (issue 30).

H200 machines differ by up to 2.5 times in host speed, so a call's time in
two runs compares only against the calls a change did not touch. This reads
two summaries of `kv_checksum_hook_timer.py` (deep mode), picks one engine in
each (by its NIXL side channel port, or the engine with the most package time
a step: the "on" engine of a run without ports), and prints every call timed
in both: its microseconds a call, the ratio new / old, and that ratio over
the machine factor, the median ratio of the untouched calls (those not named
with `--touched`, at least `--min-us` a call in both runs, start-up calls
such as `warm_up` left out).

    python benchmarks/host/compare_kv_checksum_hook_timer.py OLD.json NEW.json \
        [--port 5800] [--touched verify_load finalize] [--min-us 5]

A touched name matches a call whose name ends with it (`finalize` matches
`KVChecksumPendingRecord.finalize`). When the new run counted CPU time
(`KV_CHECKSUM_HOOK_TIMER_CPU=1`), each row also gives its CPU microseconds a
call and their share of its wall time; when it told calls beside vLLM's batch
copies apart (`KV_CHECKSUM_HOOK_TIMER_COPIES=1`), the share of the call's
calls that overlapped a copy and its microseconds a call beside one and
alone.
"""

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CallRow:
    """One call timed in both runs."""

    name: str
    old_us: float
    new_us: float
    touched: bool

    @property
    def ratio(self) -> float:
        return self.new_us / self.old_us


# Calls of start-up (compiling, first launches), never the factor's basis.
START_UP = ("warm_up", "_init_triton", "__init__")


def pick_engine(summary: dict[str, Any], port: str | None) -> dict[str, Any]:
    """The engine record with side channel `port`, else the one with the most
    package time a step (start-up left out)."""
    engines = list(summary.values())
    if port is not None:
        matches = [e for e in engines if str(e.get("side_channel_port")) == port]
        if len(matches) != 1:
            raise SystemExit(f"{len(matches)} engines with side channel port {port}")
        return matches[0]
    return max(engines, key=lambda e: e.get("own_us_per_step_without_start_up", 0))


def _is_touched(name: str, touched: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in touched)


def compare(
    old: dict[str, Any], new: dict[str, Any], touched: list[str], min_us: float
) -> tuple[list[CallRow], float, tuple[float, float]]:
    """Rows of every call timed in both engines (largest new time first), the
    machine factor and the range of the untouched ratios behind it."""
    old_calls, new_calls = old["core_us_per_call"], new["core_us_per_call"]
    rows = [
        CallRow(name, old_calls[name], new_calls[name], _is_touched(name, touched))
        for name in new_calls
        if name in old_calls and old_calls[name] > 0
    ]
    rows.sort(key=lambda row: -row.new_us)
    basis = [
        row.ratio
        for row in rows
        if not row.touched
        and not _is_touched(row.name, list(START_UP))
        and row.old_us >= min_us
        and row.new_us >= min_us
    ]
    if not basis:
        raise SystemExit("no untouched call to take the machine factor from")
    return rows, statistics.median(basis), (min(basis), max(basis))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--port", default=None, help="NIXL side channel port")
    parser.add_argument("--touched", nargs="*", default=[])
    parser.add_argument("--min-us", type=float, default=5.0)
    args = parser.parse_args()
    old = pick_engine(json.loads(args.old.read_text()), args.port)
    new = pick_engine(json.loads(args.new.read_text()), args.port)
    rows, factor, (low, high) = compare(old, new, args.touched, args.min_us)
    # The new run's thread CPU time a call (KV_CHECKSUM_HOOK_TIMER_CPU=1):
    # a call far above it waited rather than worked.
    cpu = new.get("core_cpu_us_per_call") or {}
    # Calls beside vLLM's batch copies (KV_CHECKSUM_HOOK_TIMER_COPIES=1): do
    # they cost more while the copy thread works?
    beside = new.get("core_beside_copy") or {}
    print(f"machine factor {factor:.2f} (untouched calls {low:.2f}-{high:.2f})")
    extra = " new CPU us | CPU / wall |" if cpu else ""
    extra += " beside a copy | us beside | us alone |" if beside else ""
    print("| call | old us | new us | ratio | scaled | touched |" + extra)
    print(
        "|---|---|---|---|---|---|"
        + ("---|---|" if cpu else "")
        + ("---|---|---|" if beside else "")
    )
    for row in rows:
        line = (
            f"| {row.name} | {row.old_us:.1f} | {row.new_us:.1f} | "
            f"{row.ratio:.2f} | {row.ratio / factor:.2f} | "
            f"{'yes' if row.touched else ''} |"
        )
        if cpu:
            spent = cpu.get(row.name)
            line += (
                " - | - |"
                if spent is None
                else f" {spent:.1f} | {spent / row.new_us:.2f} |"
            )
        if beside:
            line += _beside_columns(beside.get(row.name))
        print(line)


def _beside_columns(split: dict[str, Any] | None) -> str:
    """A call's share of calls beside a copy and its us a call beside one
    and alone; 0 and dashes for a call that never overlapped one."""
    if split is None:
        return " 0 | - | - |"
    alone = split.get("us_alone")
    alone_text = "-" if alone is None else f"{alone:.1f}"
    return f" {split['share']:.3f} | {split['us_beside']:.1f} | {alone_text} |"


if __name__ == "__main__":
    main()
