# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A finishing P/D producer's payload cost per request, on CPU (issue 30, R142).

The scheduler side's `request_finished` for a step of producer requests whose
prompts were checksummed, with the freed-block scan (R66) that every group
ran before 2026-12-04 (a sliding-window group still does) against the same
requests in a full-attention group, which holds every block and skips it.
Both run interleaved in one process on plain inputs (no vLLM scheduler), so
the ratio is what the skipped scan saves; the absolute figures depend on the
machine.

    python benchmarks/host/benchmark_kv_checksum_producer_finish.py \
        [--requests 16] [--blocks 64] [--rounds 5] [--steps 200] [--json OUT]
"""

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
    KVChecksumGroup,
    KVChecksumRecord,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import SchedulerGroup
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    KVChecksumScheduler,
)

BLOCK_SIZE = 16
MODES = {"scan (before)": False, "full attention (skips the scan)": True}


@dataclass
class _Block:
    block_id: int
    is_null: bool = False


class _BlockManager:
    """`get_blocks(req_id).blocks` as vLLM's KVCacheManager answers it."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[_Block]] = {}

    def get_blocks(self, req_id: str) -> Any:
        return SimpleNamespace(blocks=(self.blocks[req_id],))


def _scheduler(holds_all_blocks: bool) -> KVChecksumScheduler:
    return KVChecksumScheduler(
        {0: SchedulerGroup(BLOCK_SIZE, holds_all_blocks=holds_all_blocks)},
        num_workers=1,
        tp_size=1,
        fail_closed=False,
        carrier=lambda request, receiving: KVChecksumCarrier.KV_TRANSFER_PARAMS,
        hit_sources=lambda request, n: set(),
    )


def finish_step(
    kcs: KVChecksumScheduler,
    manager: _BlockManager,
    step: int,
    num_requests: int,
    num_blocks: int,
) -> tuple[float, list[Any]]:
    """One step of `num_requests` producers: registered, reported and
    finished; returns the seconds `request_finished` took and its params."""
    from vllm.v1.request import RequestStatus

    tokens = num_blocks * BLOCK_SIZE
    requests = []
    for i in range(num_requests):
        req_id = f"s{step}-r{i}"
        first = i * num_blocks
        manager.blocks[req_id] = [_Block(first + j) for j in range(num_blocks)]
        request = SimpleNamespace(
            request_id=req_id,
            kv_transfer_params={"do_remote_decode": True},
            num_computed_tokens=tokens,
            num_prompt_tokens=tokens,
            status=RequestStatus.RUNNING,
        )
        kcs.on_new_request(request)
        requests.append(request)
    kcs.add_sends(
        {r.request_id: tokens for r in requests},
        {r.request_id: r for r in requests},
        manager,
    )
    scheduled = kcs.build_checksum_meta()
    assert scheduled is not None
    values = np.arange(num_blocks, dtype=np.uint64).reshape(num_blocks, 1)
    record = KVChecksumRecord(
        0,
        0,
        checksums={
            req_id: {0: KVChecksumGroup(0, ((1, 0),), values + np.uint64(step + 1))}
            for req_id in scheduled.reqs_to_send
        },
        fingerprints={0: 0x1234},
    )
    kcs.update_from_output([record], None)
    for request in requests:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    start = time.perf_counter()
    params = [
        kcs.request_finished(r, {"do_remote_decode": True}, manager) for r in requests
    ]
    elapsed = time.perf_counter() - start
    for request in requests:
        del manager.blocks[request.request_id]
    return elapsed, params


def run(num_requests: int, num_blocks: int, rounds: int, steps: int) -> dict:
    """Per mode, the median over rounds of the us per finished request;
    the modes alternate within each round (same process, same inputs)."""
    sides = {name: (_scheduler(hold), _BlockManager()) for name, hold in MODES.items()}
    per_round: dict[str, list[float]] = {name: [] for name in MODES}
    sent: dict[str, list[Any]] = {}
    for side in sides.values():  # warm-up
        finish_step(*side, -1, num_requests, num_blocks)
    for _ in range(rounds):
        totals = dict.fromkeys(MODES, 0.0)
        for step in range(steps):
            for name, side in sides.items():
                elapsed, params = finish_step(*side, step, num_requests, num_blocks)
                totals[name] += elapsed
                sent[name] = params
        for name in MODES:
            per_round[name].append(1e6 * totals[name] / (steps * num_requests))
    # The same inputs give the same payloads either way.
    assert sent[next(iter(MODES))] == sent[list(MODES)[1]]
    medians = {name: statistics.median(v) for name, v in per_round.items()}
    before, after = medians.values()
    return {
        "requests_per_step": num_requests,
        "blocks_per_request": num_blocks,
        "us_per_request": medians,
        "rounds_us_per_request": per_round,
        "after_over_before": after / before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run(args.requests, args.blocks, args.rounds, args.steps)
    print(
        f"{args.requests} producers a step, {args.blocks} blocks each, "
        f"{args.rounds} rounds of {args.steps} steps (median of rounds):"
    )
    print("| request_finished | us a request |")
    print("|---|---|")
    for name, value in result["us_per_request"].items():
        print(f"| {name} | {value:.1f} |")
    print(f"after / before: {result['after_over_before']:.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
