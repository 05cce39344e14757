# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Two versions of the payload module against each other, on CPU (issue 30).

The payload module imports no other part of the package, so another tree's
version is loaded from its file (`git show REV:vllm/.../wire/payload.py >
FILE`) beside the current one. A payload's decode, encode and field check
are timed alternately, version by version, round by round (best of 5 x
`--calls` a round), on the same inputs; both versions must give the same
bytes and the same decoded values.

    git show 2f98bc2:vllm/distributed/kv_transfer/kv_checksum/wire/payload.py \\
        > /tmp/payload_old.py
    python benchmarks/host/benchmark_kv_checksum_payload_check.py \\
        --old /tmp/payload_old.py [--rounds 5] [--calls 20000]
"""

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CURRENT = ROOT / "vllm/distributed/kv_transfer/kv_checksum/wire/payload.py"

sys.path.insert(0, str(ROOT))

from tests.v1.kv_connector.unit.kv_checksum_scripts import (  # noqa: E402
    load_script,
)


def calls(module: ModuleType, values: int = 64) -> dict[str, Callable[[], object]]:
    """The timed calls: a one-group payload as a consumer with a 2,048-token
    model decodes it, and as a producer encodes it."""
    group = module.KVChecksumPayloadGroup(
        0, 5, 16, 0, np.arange(values, dtype=np.uint64)
    )
    payload = module.KVChecksumPayload(2, 1, 1000, [group])
    limits = module.KVChecksumPayloadLimits(
        max_groups=1, max_positions=200, max_model_len=2048
    )
    data = payload.to_bytes()
    return {
        "decode (from_bytes)": lambda: module.KVChecksumPayload.from_bytes(
            data, limits
        ),
        "encode (to_bytes)": payload.to_bytes,
        "field check (_check_payload)": lambda: module._check_payload(payload, limits),
    }


def run(old_path: Path, rounds: int, number: int) -> dict[str, tuple[float, ...]]:
    """Per call: (old us, current us, current / old), medians of the rounds."""
    versions = {
        "old": load_script("_payload_old", old_path),
        "new": load_script("_payload_new", CURRENT),
    }
    made = {tag: calls(module) for tag, module in versions.items()}
    encoded = {tag: made[tag]["encode (to_bytes)"]() for tag in made}
    assert encoded["old"] == encoded["new"], "the two versions encode differently"
    decoded = {tag: made[tag]["decode (from_bytes)"]() for tag in made}
    assert decoded["old"].groups[0].values.tolist() == (
        decoded["new"].groups[0].values.tolist()
    )
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for tag in versions:
            for name, call in made[tag].items():
                best = min(timeit.repeat(call, number=number, repeat=5)) / number
                times.setdefault((name, tag), []).append(1e6 * best)
    result = {}
    for name in made["new"]:
        old, new = times[(name, "old")], times[(name, "new")]
        ratio = statistics.median(b / a for a, b in zip(old, new))
        result[name] = (statistics.median(old), statistics.median(new), ratio)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    result = run(args.old, args.rounds, args.calls)
    print("| call | old, us | current, us | current / old (median of rounds) |")
    print("|---|---|---|---|")
    for name, (old, new, ratio) in result.items():
        print(f"| {name} | {old:.2f} | {new:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
