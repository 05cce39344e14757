# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The package's own time per scheduler step in decode, on CPU (issue 30, R142).

The host-step benchmark's decode engines (`Bench`: a real vLLM Scheduler with
the plugin's hooks, N running requests, stand-in model output), checksums on
and off, with the hook timer (`kv_checksum_hook_timer.py`) in place of the
wiring's `_wrap`: each hook's whole time minus the vLLM method it wraps,
summed per step. On and off alternate in rounds. The off engine's figure is
the pass-through hooks plus the timer's own cost; on - off is what the
checksums add to a decode step's scheduler hooks. The figure is a mean over
many steps, far steadier on a loaded machine than whole-step timings.

Run from the repository root, as a script (the timer must be in place before
the plugin's hooks are installed):
    python benchmarks/host/benchmark_kv_checksum_hook_time.py
"""

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
os.environ.setdefault("KV_CHECKSUM_HOOK_TIMER_DIR", tempfile.mkdtemp())

# The timer first: it must be in place before any wiring module is imported.
import kv_checksum_hook_timer as timer  # noqa: E402, I001

import benchmark_kv_checksum_step as step_bench  # noqa: E402


def measure(
    model_dir: str,
    name: str,
    n: int,
    rounds: int,
    steps: int,
    recount_every: int | None = None,
) -> dict:
    """Own us per step of the on and the off engine, per round (alternating),
    and each hook's own us per step over all rounds, per engine (`hooks_us`:
    the timer is one per process, so each round's per-hook difference is the
    engine's that ran in it). `recount_every`: the on engine's R141 gauge
    recount period in busy steps (1: every step, as before 2026-12-04)."""
    connector, extra = step_bench.CONNECTORS[name]
    benches = {
        mode: step_bench.Bench(model_dir, connector, extra, mode == "on", n)
        for mode in ("on", "off")
    }
    if recount_every is not None:
        kcs = benches["on"].scheduler.kv_checksum_scheduler
        kcs.tracked_recount.every = recount_every
    for bench in benches.values():
        for _ in range(steps // 4 + 1):  # warm
            bench.step()
    per_round: dict[str, list[float]] = {"on": [], "off": []}
    per_hook: dict[str, Counter] = {"on": Counter(), "off": Counter()}
    for _ in range(rounds):
        for mode, bench in benches.items():
            gc.collect()
            gc.disable()
            try:
                start = timer.own_by_hook()
                for _ in range(steps):
                    bench.step()
                end = timer.own_by_hook()
            finally:
                gc.enable()
            spent = {key: end[key] - start.get(key, 0.0) for key in end}
            per_hook[mode].update(spent)
            per_round[mode].append(1e6 * sum(spent.values()) / steps)
    diffs = [a - b for a, b in zip(per_round["on"], per_round["off"])]
    return {
        "connector": name,
        "running": n,
        "recount_every": recount_every,
        "on_us": statistics.median(per_round["on"]),
        "off_us": statistics.median(per_round["off"]),
        "on_minus_off_us": statistics.median(diffs),
        "spread": [min(diffs), max(diffs)],
        "rounds": per_round,
        "hooks_us": {
            mode: {k: 1e6 * v / (rounds * steps) for k, v in hooks.items()}
            for mode, hooks in per_hook.items()
        },
    }


def print_hooks(rows: list[dict], least_us: float = 0.5) -> None:
    """Each hook's own us per step, on and off, largest on - off first; hooks
    under `least_us` in both engines left out."""
    print("\n| connector | running | recount every | hook | on | off | on - off |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        on, off = row["hooks_us"]["on"], row["hooks_us"]["off"]
        hooks = sorted(set(on) | set(off), key=lambda k: off.get(k, 0) - on.get(k, 0))
        for hook in hooks:
            a, b = on.get(hook, 0.0), off.get(hook, 0.0)
            if max(a, b) >= least_us:
                print(
                    f"| {row['connector']} | {row['running']} | "
                    f"{row.get('recount_every') or 'default'} | `{hook}` | "
                    f"{a:.1f} | {b:.1f} | {a - b:+.1f} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connectors", nargs="+", default=list(step_bench.CONNECTORS))
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None, help="also write rows")
    parser.add_argument(
        "--per-hook", action="store_true", help="also a table of each hook's time"
    )
    parser.add_argument(
        "--recount-every",
        type=int,
        nargs="+",
        default=[None],
        help="the on engine's R141 gauge recount period in busy steps, one row "
        "each (1: every step, as before 2026-12-04; default: the package's)",
    )
    args = parser.parse_args()
    step_bench.plugin.register()
    step_bench.register_carrier_connector()
    model_dir = step_bench.write_model_dir(Path(tempfile.mkdtemp()))
    rows = [
        measure(model_dir, name, n, args.rounds, args.steps, every)
        for name in args.connectors
        for n in args.requests
        for every in args.recount_every
    ]
    print(
        f"\nOwn time of the scheduler hooks per decode step, microseconds "
        f"(median of {args.rounds} alternating rounds of {args.steps} steps):"
    )
    print("| connector | running | recount every | on | off | on - off | spread |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        low, high = row["spread"]
        every = row["recount_every"] or "default"
        print(
            f"| {row['connector']} | {row['running']} | {every} | {row['on_us']:.1f} | "
            f"{row['off_us']:.1f} | {row['on_minus_off_us']:+.1f} | "
            f"{low:+.1f} .. {high:+.1f} |"
        )
    if args.per_hook:
        print_hooks(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
