# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host-side cost of verifying one load's KV checksums (R133).

The target: verifying a 128K-token load (one group, 16-token blocks, 8
consumer workers) within 1 ms. Run as a script to print the time;
`--against REV` also times `verify_load` as of git revision REV in the same
run, alternating calls, on the tiny model's load sizes too (issue 30):

    python benchmarks/kernels/host_verification_bench.py --against HEAD~1
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script  # noqa: E402
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (  # noqa: E402
    KVChecksumBlocks,
    KVChecksumGroup,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (  # noqa: E402
    KV_CHECKSUM_PAYLOAD_VERSION,
    KVChecksumPayload,
    KVChecksumPayloadGroup,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (  # noqa: E402
    KVChecksumGroupInfo,
    KVChecksumStatus,
    KVChecksumWorkerReport,
    verify_load,
)


def _make_load(
    num_tokens: int, block_size: int, num_workers: int, seed: int = 0
) -> tuple[KVChecksumPayload, dict[tuple[int, int], KVChecksumWorkerReport]]:
    """A consistent payload and TP-`num_workers` consumer reports, one column each."""
    rng = np.random.default_rng(seed)
    positions = -(-num_tokens // block_size)
    parts = rng.integers(0, 1 << 64, size=(num_workers, positions), dtype=np.uint64)
    truth = parts.sum(axis=0, dtype=np.uint64)
    fingerprint = int(rng.integers(0, 1 << 63))
    reports = {
        (0, rank): KVChecksumWorkerReport(
            groups={0: KVChecksumGroup(0, ((1, 0),), parts[rank][:, None].copy())},
            fingerprints={0: fingerprint},
        )
        for rank in range(num_workers)
    }
    payload = KVChecksumPayload(
        version=KV_CHECKSUM_PAYLOAD_VERSION,
        tp_size=num_workers,
        num_tokens=num_tokens,
        groups=[KVChecksumPayloadGroup(0, fingerprint, block_size, 0, truth)],
    )
    return payload, reports


def bench_verification(
    num_tokens: int = 128 * 1024,
    block_size: int = 16,
    num_workers: int = 8,
    iterations: int = 2000,
) -> float:
    """Mean time of one `verify_load` call over `iterations` calls, in µs."""
    payload, reports = _make_load(num_tokens, block_size, num_workers)
    block_ids = np.arange(-(-num_tokens // block_size), dtype=np.int64)
    scheduled = KVChecksumBlocks(num_tokens, {0: (0, block_ids)})
    groups = {0: KVChecksumGroupInfo(block_size)}

    def run() -> KVChecksumStatus:
        verdict = verify_load(
            payload, None, reports, scheduled, num_workers, num_workers, groups
        )
        return verdict.status

    assert run() is KVChecksumStatus.VERIFIED
    for _ in range(min(iterations, 50)):  # warm-up
        run()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    return (time.perf_counter() - start) / iterations * 1e6


_MODULE = "vllm/distributed/kv_transfer/kv_checksum/wire/verification.py"


def module_at(revision: str) -> ModuleType:
    """The verification module as of git `revision`, imported under its own name."""
    repo = Path(__file__).resolve().parents[2]
    source = subprocess.run(
        ["git", "-C", str(repo), "show", f"{revision}:{_MODULE}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "verification_at_revision.py"
        path.write_text(source)
        return load_script(path.stem, path)


def compare(revision: str, rounds: int = 15) -> list[str]:
    """Median us a `verify_load` call now and at `revision`, rounds alternating
    which goes first; every call must verify."""
    import vllm.distributed.kv_transfer.kv_checksum.wire.verification as now

    then = module_at(revision)
    lines = []
    for num_tokens, workers in ((1024, 1), (2048, 1), (1024, 2), (128 * 1024, 8)):
        payload, reports = _make_load(num_tokens, 16, workers)
        block_ids = np.arange(-(-num_tokens // 16), dtype=np.int64)
        scheduled = KVChecksumBlocks(num_tokens, {0: (0, block_ids)})
        calls = 300 if num_tokens < 10_000 else 30
        times: dict[str, list[float]] = {"now": [], revision: []}
        for i in range(rounds):
            order = [("now", now), (revision, then)]
            for name, module in order if i % 2 else order[::-1]:
                groups = {0: module.KVChecksumGroupInfo(16)}
                start = time.perf_counter()
                for _ in range(calls):
                    verdict = module.verify_load(
                        payload, None, reports, scheduled, workers, workers, groups
                    )
                times[name].append((time.perf_counter() - start) / calls * 1e6)
                assert verdict.status.value == "verified", verdict
        ours = statistics.median(times["now"])
        theirs = statistics.median(times[revision])
        lines.append(
            f"| {num_tokens} | {workers} | {theirs:.1f} | {ours:.1f} | "
            f"{ours / theirs:.3f} |"
        )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="also time verify_load at this git rev")
    args = parser.parse_args()
    micros = bench_verification()
    print(
        f"verify_load, 128K tokens, 16-token blocks, 8 workers: {micros:.1f} us "
        "(target 1000 us)"
    )
    if args.against:
        print(f"\n| tokens | workers | {args.against} us | now us | now / then |")
        print("|---|---|---|---|---|")
        print("\n".join(compare(args.against)))
