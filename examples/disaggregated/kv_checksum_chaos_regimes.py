# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a chaos run's wrong answers come from, from its recorded outcomes
(`outcomes_<scenario>.jsonl`) and the consumer's log: per prompt, how many
wrong answers and how many distinct wrong texts; how many wrong and right
answers ran while some mismatched (recomputing) request was in flight; and
which wrong texts of other runs are the same texts.

One alternate text per prompt, repeated, and wrong answers only beside
recomputes say "a second deterministic numerics regime" (a near-tie prompt
answering differently when a local prefill shares the batch); varied texts
and wrong answers without recomputes would say "bad KV".

    python examples/disaggregated/kv_checksum_chaos_regimes.py \\
        --outcomes OUT/outcomes_soak.jsonl --log OUT/consumer.log \\
        --other OUT2/outcomes_lease_expiry.jsonl --json regimes.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

MISMATCH = re.compile(r"KV checksum mismatch for request (\S+): ")
# The consumer's engine request id is the client's id plus "-<n>-<8 hex>".
ENGINE_SUFFIX = re.compile(r"-\d+-[0-9a-f]{8}$")


def read_outcomes(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mismatched_ids(log_text: str) -> set[str]:
    """Client request ids of every load the consumer reported as mismatched."""
    return {ENGINE_SUFFIX.sub("", e) for e in MISMATCH.findall(log_text)}


def overlap_counts(
    rows: list[dict[str, Any]], mismatched: set[str]
) -> dict[str, dict[str, int]]:
    """Right and wrong answers (mismatched requests left out) by whether their
    [sent, finished] interval overlaps a mismatched request's."""
    spans = sorted(
        (r["sent_s"], r["finished_s"]) for r in rows if r["request_id"] in mismatched
    )
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["cls"] not in ("right", "wrong") or r["request_id"] in mismatched:
            continue
        beside = any(a <= r["finished_s"] and b >= r["sent_s"] for a, b in spans)
        row = counts.setdefault(r["cls"], {"beside_recompute": 0, "alone": 0})
        row["beside_recompute" if beside else "alone"] += 1
    return counts


def regimes(
    rows: list[dict[str, Any]], others: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    """Wrong texts per prompt, and whether each other run's wrong answers are
    texts this run already saw wrong for the same prompt."""
    texts: dict[int, Counter[str]] = {}
    for r in rows:
        if r["cls"] == "wrong":
            texts.setdefault(r["prompt"], Counter())[r["text"]] += 1
    per_prompt = {
        str(p): {"wrong": sum(c.values()), "distinct_texts": len(c)}
        for p, c in sorted(texts.items(), key=lambda kv: -sum(kv[1].values()))
    }
    seen = [
        sum(
            1
            for r in other
            if r["cls"] == "wrong" and r["text"] in texts.get(r["prompt"], ())
        )
        for other in others
    ]
    wrong_other = [sum(1 for r in o if r["cls"] == "wrong") for o in others]
    return {
        "per_prompt": per_prompt,
        "others_wrong": wrong_other,
        "others_same_text": seen,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outcomes", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True, help="consumer log")
    parser.add_argument("--other", type=Path, action="append", default=[])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = read_outcomes(args.outcomes)
    mismatched = mismatched_ids(args.log.read_text(errors="replace"))
    result = {
        "outcomes": str(args.outcomes),
        "mismatched": len(mismatched),
        "overlap": overlap_counts(rows, mismatched),
        **regimes(rows, [read_outcomes(p) for p in args.other]),
        "others": [str(p) for p in args.other],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
