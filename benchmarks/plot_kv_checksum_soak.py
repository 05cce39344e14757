# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The soak's memory and checksum-state curves from a recorded
`examples/disaggregated/kv_checksum_chaos.py` summary (its `samples`): engine
RSS, GPU memory and `vllm:kv_checksum_tracked_requests` over time, one line
per server. Runs on any machine with matplotlib:

    python benchmarks/plot_kv_checksum_soak.py \\
        benchmarks/results/h200_soak_2026-12-01.json

writes the PNG next to the JSON (same name, `.png`).
"""

import argparse
import json
from pathlib import Path
from typing import Any

PANELS = (("rss_mib", "RSS (MiB)"), ("gpu_mib", "GPU memory (MiB)"))
PANELS += (("tracked", "tracked requests"),)


def series(samples: list[dict[str, Any]], server: str, key: str) -> tuple[list, list]:
    """(times, values) of one server's samples of `key`, unknown values left out."""
    points = [
        (s["t"], s[key])
        for s in samples
        if s["server"] == server and s.get(key) is not None
    ]
    return [t for t, _ in points], [v for _, v in points]


def plot(record: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = record["samples"]
    servers = list(dict.fromkeys(s["server"] for s in samples))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for ax, (key, label) in zip(axes, PANELS):
        for server in servers:
            ts, vs = series(samples, server, key)
            ax.plot(ts, vs, label=server)
        ax.set_xlabel("seconds since the soak began")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("KV checksum soak: memory and checksum state per engine")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("summary", type=Path)
    args = parser.parse_args()
    plot(json.loads(args.summary.read_text()), args.summary.with_suffix(".png"))


if __name__ == "__main__":
    main()
