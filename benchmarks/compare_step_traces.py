# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compare two engines' torch traces step by step: where does the "on" engine
spend time that the "off" engine does not (issues 30, 31)?

Reads the traces `benchmark_kv_checksum_prefix_hits.py --profile-warmup
--profile-steps N --keep-traces` leaves under `trace_off/` and `trace_on/`
(vLLM names each engine step `execute_context_C(T)_generation_G(T)`), and prints
per step kind: CPU and GPU duration and period (medians), the GPU's idle time
inside a step, and the host calls and kernels whose time per step differs most,
inside the steps and between them. Standard library only:

    python benchmarks/compare_step_traces.py OFF.pt.trace.json.gz ON.pt.trace.json.gz

Profiling inflates every host call, so read differences as where to look, not
as costs: unprofiled on/off runs judge the cost.
"""

import argparse
import bisect
import gzip
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

HOST = ("cpu_op", "cuda_runtime", "cuda_driver")
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
Event = dict[str, Any]


def load_events(path: Path) -> list[Event]:
    """Complete ("X") events of one trace, sorted by start time."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])


def steps_of(events: list[Event], cat: str) -> dict[str, list[Event]]:
    """The step annotations of category `cat`, by step kind."""
    kinds: dict[str, list[Event]] = {}
    for e in events:
        if e.get("cat") == cat and str(e["name"]).startswith("execute_"):
            kinds.setdefault(e["name"], []).append(e)
    return kinds


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def idle_inside(step: Event, device: list[Event], starts: list[float]) -> float:
    """Microseconds of the step's GPU span with no kernel, copy or memset."""
    end = step["ts"] + step["dur"]
    busy_until, idle = step["ts"], 0.0
    for e in device[bisect.bisect_left(starts, step["ts"]) :]:
        if e["ts"] > end:
            break
        idle += max(0.0, e["ts"] - busy_until)
        busy_until = max(busy_until, e["ts"] + e["dur"])
    return idle + max(0.0, end - busy_until)


def per_step_totals(
    events: list[Event], steps: list[Event], cats: tuple[str, ...], inside: bool
) -> Counter:
    """Microseconds per step of each (category, name) in `cats`, inside the
    steps' spans or (inside=False) between them on the steps' process."""
    spans = sorted((s["ts"], s["ts"] + s["dur"]) for s in steps)
    begins = [b for b, _ in spans]
    first, last = spans[0][0], spans[-1][1]
    pid = steps[0]["pid"]
    totals: Counter = Counter()
    for e in events:
        if e.get("cat") not in cats or not first <= e["ts"] <= last:
            continue
        if cats == HOST and e["pid"] != pid:
            continue
        i = bisect.bisect_right(begins, e["ts"]) - 1
        within = i >= 0 and e["ts"] <= spans[i][1]
        if within == inside:
            totals[(e["cat"], str(e["name"])[:80])] += e["dur"] / len(steps)
    return totals


def print_diff(title: str, off: Counter, on: Counter, top: int) -> None:
    print(f"\n{title} (us per step, on - off)")
    keys = set(off) | set(on)
    rows = sorted(keys, key=lambda k: -abs(on[k] - off[k]))[:top]
    for key in rows:
        print(f"  {on[key] - off[key]:+9.1f}  {off[key]:9.1f} -> {on[key]:9.1f}  {key}")


def compare(off_path: Path, on_path: Path, top: int) -> None:
    traces = {"off": load_events(off_path), "on": load_events(on_path)}
    cpu = {m: steps_of(ev, "user_annotation") for m, ev in traces.items()}
    gpu = {m: steps_of(ev, "gpu_user_annotation") for m, ev in traces.items()}
    device = {m: [e for e in ev if e.get("cat") in DEVICE] for m, ev in traces.items()}
    starts = {m: [e["ts"] for e in device[m]] for m in traces}
    for kind in sorted(set(cpu["off"]) & set(cpu["on"])):
        print(f"\n== {kind}")
        for mode in ("off", "on"):
            c, g = cpu[mode][kind], gpu[mode].get(kind, [])
            period = [b["ts"] - a["ts"] for a, b in zip(c, c[1:])]
            idle = [idle_inside(s, device[mode], starts[mode]) for s in g]
            print(
                f"  {mode:3} n={len(c):4} cpu {median([s['dur'] for s in c]):8.0f} "
                f"period {median(period):8.0f} gpu {median([s['dur'] for s in g]):8.0f}"
                f" gpu idle inside {median(idle):7.0f} us (medians)"
            )
        for cats, label in ((HOST, "host calls"), (DEVICE, "device work")):
            print_diff(
                f"{label} inside {kind}",
                per_step_totals(traces["off"], cpu["off"][kind], cats, True),
                per_step_totals(traces["on"], cpu["on"][kind], cats, True),
                top,
            )
    every = {m: [s for ss in cpu[m].values() for s in ss] for m in traces}
    print_diff(
        "host calls between steps, per step",
        per_step_totals(traces["off"], every["off"], HOST, False),
        per_step_totals(traces["on"], every["on"], HOST, False),
        top,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("off", type=Path)
    parser.add_argument("on", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    compare(args.off, args.on, args.top)


if __name__ == "__main__":
    main()
