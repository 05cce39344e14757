# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Judge recorded `benchmark_kv_checksum_prefix_hits.py` summaries (prefix hits
and the offload tiers) and `benchmark_kv_checksum_serve.py` summaries (P/D
through vllm-router) again with their benchmark's current rule: its tables
(means, off spread, paired on - off) and one line per workload with the
throughput ratio of the means beside the median of the pairs' ratios. Runs
anywhere (no vLLM, no GPU):

    python benchmarks/rejudge_kv_checksum_rounds.py \\
        benchmarks/results/h200_bench_prefix_8b_2026-12-01d.json

With `--pool`, the rounds of every summary are judged as one run (each file's
launches kept apart, so its pairs stay its own): the verdict over runs of one
shape taken on different machines.

Each workload also gets a 95 % interval of the pairs' mean throughput on/off
and mean TTFT on - off (the pairs resampled with replacement, a fixed seed):
a target outside it is missed or met whatever the noise, one inside it is not
resolved by these pairs.
"""

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_kv_checksum_prefix_hits import judge, print_tables  # noqa: E402


def pair_line(name: str, row: dict[str, Any]) -> str:
    """Means against pairs for one workload, in one line."""
    rps, ttft = row["request_throughput"], row["median_ttft_ms"]
    rps_pairs, ttft_pairs = rps.get("paired") or {}, ttft.get("paired") or {}
    if "off_mean" not in rps or not rps_pairs or not ttft_pairs:
        return f"{name}: no off/on pairs"
    ratios = rps_pairs["on_over_off"]
    rps_spread, ttft_spread = rps.get("off_spread"), ttft.get("off_spread")
    rps_spread_text = (
        "n/a" if rps_spread is None else f"{rps_spread / rps['off_mean']:.1%}"
    )
    ttft_spread_text = "n/a" if ttft_spread is None else f"{ttft_spread:.2f}"
    return (
        f"{name}: req/s on/off of the means {rps['on_mean'] / rps['off_mean']:.3f} "
        f"(off spread {rps_spread_text}); median of {len(ratios)} "
        f"pairs {rps_pairs['median_on_over_off']:.3f} ({min(ratios):.3f} .. "
        f"{max(ratios):.3f}); median TTFT on - off of the means "
        f"{ttft['on_minus_off']:+.2f} ms (off spread {ttft_spread_text}), "
        f"median of pairs {ttft_pairs['median_on_minus_off']:+.2f} ms "
        f"({ttft_pairs['min_on_minus_off']:+.2f} .. "
        f"{ttft_pairs['max_on_minus_off']:+.2f})"
    )


def bootstrap_interval(
    values: list[float], resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the mean of `values`: the pairs
    drawn with replacement `resamples` times with a fixed seed, so the same
    pairs always give the same interval."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def interval_line(name: str, row: dict[str, Any]) -> str:
    """The 95 % intervals of the pairs' mean throughput on/off and mean TTFT
    on - off, in one line ("" without pairs)."""
    rps_pairs = row["request_throughput"].get("paired") or {}
    ttft_pairs = row["median_ttft_ms"].get("paired") or {}
    if not rps_pairs or not ttft_pairs:
        return ""
    ratios, deltas = rps_pairs["on_over_off"], ttft_pairs["on_minus_off"]
    low, high = bootstrap_interval(ratios)
    ttft_low, ttft_high = bootstrap_interval(deltas)
    return (
        f"{name}: 95 % interval over {len(ratios)} pairs (resampled): mean req/s "
        f"on/off {low:.3f} .. {high:.3f}, mean TTFT on - off {ttft_low:+.2f} .. "
        f"{ttft_high:+.2f} ms"
    )


def pooled_rounds(records: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """The rounds of every record that ran `workload`, launches renumbered so that
    no two files share one (a pair, launch and seed, never joins rounds of two
    runs). Runs that left a workload out do not count as its failures."""
    rounds: list[dict[str, Any]] = []
    offset = 0
    for record in records:
        own = record.get("rounds") or []
        if any(workload in r["results"] for r in own):
            missing = {"error": "missing in this round"}
            rounds += [
                {
                    **r,
                    "launch": r["launch"] + offset,
                    "results": {workload: r["results"].get(workload, missing)},
                }
                for r in own
            ]
        offset += 1 + max((r["launch"] for r in own), default=0)
    return rounds


def is_serve(record: dict[str, Any]) -> bool:
    """A serve benchmark summary: launches in pair order, no rounds."""
    return "launches" in record and "rounds" not in record


def pooled_launches(
    records: list[dict[str, Any]], paths: list[Path], drop_half_pair: bool = False
) -> list[dict[str, Any]]:
    """The launch records of every serve summary, in order, launch numbers
    renumbered per file: its pairs are neighbours (0 and 1, 2 and 3, ...), so
    each file must bring whole pairs and no pair joins two runs. A run cut
    short by its time limit ends in half a pair: refused, or with
    `drop_half_pair` its last record left out (said on stderr)."""
    launches: list[dict[str, Any]] = []
    offset = 0
    for record, path in zip(records, paths):
        own = record["launches"]
        if len(own) % 2 and drop_half_pair:
            print(
                f"--pool: {path.name}: last record left out (half a pair)",
                file=sys.stderr,
            )
            own = own[:-1]
        elif len(own) % 2:
            sys.exit(f"--pool: {path.name} has an odd number of launch records")
        launches += [{**r, "launch": (r.get("launch") or 0) + offset} for r in own]
        offset += 1 + max((r.get("launch") or 0 for r in own), default=0)
    return launches


def print_serve_verdict(
    title: str, launches: list[dict[str, Any]], control: bool
) -> None:
    """The serve benchmark's tables and one pair line per workload."""
    from benchmark_kv_checksum_serve import print_tables as print_serve_tables
    from benchmark_kv_checksum_serve import summarize

    summary = summarize(launches, control)
    print(f"\n# {title}")
    print_serve_tables(launches, summary)
    for name, row in summary["workloads"].items():
        print(pair_line(name, row))
        print(interval_line(name, row))


def judged_as(config: dict[str, Any]) -> tuple[str, bool]:
    """What `judge` reads of a summary's config, with its defaults: runs are
    pooled only when they agree on it (an A/A control never joins real runs)."""
    return config.get("tier", "simple-hits"), bool(config.get("control", False))


def print_verdict(title: str, rounds: list[dict[str, Any]], config: dict) -> None:
    """The benchmark's tables and one pair line per workload."""
    verdict = judge(rounds, *judged_as(config))
    print(f"\n# {title}")
    print_tables(rounds, verdict)
    for name, row in verdict["workloads"].items():
        print(pair_line(name, row))
        print(interval_line(name, row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("summaries", type=Path, nargs="+")
    parser.add_argument(
        "--pool", action="store_true", help="judge all summaries' rounds as one run"
    )
    parser.add_argument(
        "--drop-half-pair",
        action="store_true",
        help="--pool: leave out a serve run's last record when its pair was cut short",
    )
    args = parser.parse_args()
    records = [json.loads(path.read_text()) for path in args.summaries]
    serve = [is_serve(record) for record in records]
    if any(serve):
        if not all(serve):
            sys.exit("serve summaries are judged only with serve summaries")
        controls = {bool(r.get("config", {}).get("control")) for r in records}
        if args.pool and len(controls) > 1:
            sys.exit("--pool: an A/A control never joins real runs")
        if args.pool:
            files = ", ".join(path.name for path in args.summaries)
            launches = pooled_launches(records, args.summaries, args.drop_half_pair)
            print_serve_verdict(f"pooled: {files}", launches, controls.pop())
            return
        for path, record in zip(args.summaries, records):
            control = bool(record.get("config", {}).get("control"))
            print_serve_verdict(path.name, record["launches"], control)
        return
    if args.pool:
        kinds = {judged_as(record.get("config", {})) for record in records}
        if len(kinds) > 1:
            sys.exit(f"--pool: summaries judged differently (tier, A/A): {kinds}")
        names = dict.fromkeys(
            n for x in records for r in x.get("rounds") or [] for n in r["results"]
        )
        files = ", ".join(path.name for path in args.summaries)
        config = dict(zip(("tier", "control"), kinds.pop()))
        for name in names:
            print_verdict(
                f"{name} pooled: {files}", pooled_rounds(records, name), config
            )
        return
    for path, record in zip(args.summaries, records):
        rounds = record.get("rounds")
        if not rounds:
            print(f"\n# {path.name}: no rounds (not a prefix-hit benchmark summary)")
            continue
        print_verdict(path.name, rounds, record.get("config", {}))


if __name__ == "__main__":
    main()
