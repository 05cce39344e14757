# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TTFT distributions, checksums off vs on, from a recorded
`benchmark_kv_checksum_serve.py` summary (one panel per workload, one
empirical CDF per launch) or `benchmark_kv_checksum_prefix_hits.py` summary
(one CDF per round). Runs on any machine with matplotlib:

    python benchmarks/plot_kv_checksum_serve.py \\
        benchmarks/results/h200_bench_serve_tiny_2026-12-01.json

writes the PNG next to the JSON (same name, `.png`).
"""

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = {"off": "tab:blue", "on": "tab:orange"}


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical cumulative fractions."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot(record: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = "launch" if "launches" in record else "round"
    launches = record["launches"] if kind == "launch" else record["rounds"]
    names = list(dict.fromkeys(w for launch in launches for w in launch["results"]))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for index, launch in enumerate(launches):
            ttfts = launch["results"].get(name, {}).get("ttfts_ms") or []
            if not ttfts:
                continue
            xs, ys = cdf(ttfts)
            ax.step(
                xs,
                ys,
                where="post",
                color=COLORS.get(launch["mode"], "gray"),
                label=f"{kind} {index} ({launch['mode']})",
            )
        ax.set_title(name)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    config = record.get("config", {})
    title = config.get("title", "TTFT through vllm-router, checksums off vs on")
    fig.suptitle(
        f"{title}\n{config.get('shape', '?')} model, TP {config.get('tp', '?')}",
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", type=Path)
    args = parser.parse_args()
    record = json.loads(args.summary.read_text())
    out = args.summary.with_suffix(".png")
    plot(record, out)
    print(out)


if __name__ == "__main__":
    main()
