# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Judge recorded `benchmark_kv_checksum_prefix_hits.py` summaries again with the
benchmark's current rule: its tables (means, off spread, paired on - off) and
one line per workload with the throughput ratio of the means beside the median
of the pairs' ratios. Runs anywhere (no vLLM, no GPU):

    python benchmarks/rejudge_kv_checksum_rounds.py \\
        benchmarks/results/h200_bench_prefix_8b_2026-12-01d.json
"""

import argparse
import json
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
    return (
        f"{name}: req/s on/off of the means {rps['on_over_off']:.3f} (off spread "
        f"{rps['off_spread'] / rps['off_mean']:.1%}); median of {len(ratios)} "
        f"pairs {rps_pairs['median_on_over_off']:.3f} ({min(ratios):.3f} .. "
        f"{max(ratios):.3f}); median TTFT on - off of the means "
        f"{ttft['on_minus_off']:+.2f} ms (off spread {ttft['off_spread']:.2f}), "
        f"median of pairs {ttft_pairs['median_on_minus_off']:+.2f} ms "
        f"({ttft_pairs['min_on_minus_off']:+.2f} .. "
        f"{ttft_pairs['max_on_minus_off']:+.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("summaries", type=Path, nargs="+")
    args = parser.parse_args()
    for path in args.summaries:
        record = json.loads(path.read_text())
        rounds = record.get("rounds")
        if not rounds:
            print(f"\n# {path.name}: no rounds (not a prefix-hit benchmark summary)")
            continue
        config = record.get("config", {})
        verdict = judge(
            rounds, config.get("tier", "simple-hits"), config.get("control", False)
        )
        print(f"\n# {path.name}")
        print_tables(rounds, verdict)
        for name, row in verdict["workloads"].items():
            print(pair_line(name, row))


if __name__ == "__main__":
    main()
