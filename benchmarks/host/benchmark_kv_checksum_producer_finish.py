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

With `--compare`, each group kind instead runs the finish path as it was
before the 2026-12-04f rework (`_ReferenceProducer`: the package's own
`request_finished` with the pieces the rework changed swapped back for the
versions of tree f2303ef, kept here only as the reference) against the
package's current one, interleaved step by step on the same inputs; both
must return the same kv_transfer_params (the same payload bytes).

    python benchmarks/host/benchmark_kv_checksum_producer_finish.py \
        [--requests 16] [--blocks 64] [--rounds 5] [--steps 200] [--compare] \
        [--json OUT]
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumCarrier,
    KVChecksumGroup,
    KVChecksumRecord,
    chunk_tokens,
)
from vllm.distributed.kv_transfer.kv_checksum.engine import (
    producer as producer_module,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import (
    SchedulerGroup,
    _null_mask,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.producer import (
    KVChecksumProducer,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    KVChecksumScheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.wire import payload as payload_module
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    _VALUE_DTYPE,
    KV_CHECKSUM_PAYLOAD_VERSION,
    KVChecksumPayload,
    KVChecksumPayloadGroup,
    KVChecksumPayloadLimits,
    _check_payload,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
    KVChecksumWorkerReport,
    WorkerKey,
    completeness_detail,
    other_blocks_detail,
    whole_model_fingerprints,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_checksum_pieces import swapped  # noqa: E402, I001

BLOCK_SIZE = 16
MODES = {"scan (before)": False, "full attention (skips the scan)": True}
# --compare: the group kinds, and the finish path before and after 2026-12-04f.
KINDS = {"may free blocks (scans, R66)": False, "full attention (no scan)": True}
PATHS = ("before", "after")


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


# --------------------------------------------------------------------------
# The finish path before 2026-12-04f (tree f2303ef), the --compare reference:
# the package's own `request_finished` with only the pieces the rework changed
# swapped back for their old versions (`reference_pieces`).
# --------------------------------------------------------------------------


def _ref_chunk_tokens(info: KVChecksumGroupInfo) -> int:
    """KVChecksumGroupInfo.chunk_tokens as it was: computed on every read."""
    return 1 if info.is_mamba else chunk_tokens(info.block_size)


def _ref_chunks_per_block(info: KVChecksumGroupInfo) -> int:
    """KVChecksumGroupInfo.chunks_per_block as it was: computed on every read."""
    return 1 if info.is_mamba else info.block_size // info.chunk_tokens


def _ref_sum_columns(entries: list[KVChecksumGroup], num_positions: int) -> np.ndarray:
    """`_sum_columns` of f2303ef: zeros, errstate and `ndarray.sum`."""
    total = np.zeros(num_positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for entry in entries:
            total += entry.values.sum(axis=1, dtype=np.uint64)
    return total


def _ref_build_producer_payload(
    reports: dict[WorkerKey, KVChecksumWorkerReport],
    scheduled: KVChecksumBlocks,
    num_workers: int,
    tp_size: int,
    groups: dict[int, KVChecksumGroupInfo],
) -> KVChecksumPayload | str:
    """`build_producer_payload` of f2303ef: the workers sorted again for every
    group, `other_blocks_detail` run on every group, the old sums."""
    detail = completeness_detail(len(reports), num_workers)
    if detail is not None:
        return detail
    skipped = {gid for report in reports.values() for gid in report.skipped_groups}
    fingerprints = whole_model_fingerprints(reports)
    payload_groups: list[KVChecksumPayloadGroup] = []
    for group_id in sorted(scheduled.groups):
        start, block_ids = scheduled.groups[group_id]
        info = groups[group_id]
        chunk, per_block = info.chunk_tokens, info.chunks_per_block
        first, count = start * per_block, len(block_ids) * per_block
        detail = other_blocks_detail(reports, group_id, first, count)
        if detail is not None:
            return f"group {group_id}: {detail}"
        entries = [
            report.groups[group_id]
            for _, report in sorted(reports.items())
            if group_id in report.groups
        ]
        if group_id in skipped or not entries:
            continue
        end = min(first + count, -(-scheduled.num_tokens // chunk))
        values = _ref_sum_columns(entries, count)[: max(0, end - first)]
        fingerprint = fingerprints.get(group_id, 0)
        payload_groups.append(
            KVChecksumPayloadGroup(group_id, fingerprint, chunk, first, values)
        )
    return KVChecksumPayload(
        KV_CHECKSUM_PAYLOAD_VERSION, tp_size, scheduled.num_tokens, payload_groups
    )


def _ref_check_encodable(payload: KVChecksumPayload) -> None:
    """`to_bytes`'s check of f2303ef: the full field check, against limits
    built on every call."""
    _check_payload(payload, KVChecksumPayloadLimits())


def _ref_values_buffer(values: np.ndarray) -> memoryview:
    """`_values_buffer` of f2303ef: every values array converted."""
    return np.ascontiguousarray(values, dtype=_VALUE_DTYPE).data


def _ref_first_held_position(blocks: Any, start: int, count: int) -> int | None:
    """`first_held_position` of f2303ef: the NumPy mask of every block."""
    selected = blocks[start : start + count]
    is_null = _null_mask(selected)
    if is_null.size < count or (is_null.size and is_null[-1]):
        return None
    nulls = np.flatnonzero(is_null)
    return start + (int(nulls[-1]) + 1 if nulls.size else 0)


def _ref_finished_normally(request: Any) -> bool:
    """`_finished_normally` of f2303ef: vLLM's statuses imported every call."""
    from vllm.v1.request import RequestStatus

    return request.status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
    )


# (owner, name looked up at call time, the f2303ef version). The producer
# module binds the helpers it calls by name, as the payload module does the
# check and buffer helpers of `KVChecksumPayload.to_bytes`; the group info's
# properties were plain (a data descriptor on the class wins over a value
# that cached_property left in an instance's __dict__).
_REFERENCE_PIECES: tuple[tuple[Any, str, Any], ...] = (
    (producer_module, "build_producer_payload", _ref_build_producer_payload),
    (producer_module, "first_held_position", _ref_first_held_position),
    (producer_module, "_finished_normally", _ref_finished_normally),
    (payload_module, "_check_encodable", _ref_check_encodable),
    (payload_module, "_values_buffer", _ref_values_buffer),
    (KVChecksumGroupInfo, "chunk_tokens", property(_ref_chunk_tokens)),
    (KVChecksumGroupInfo, "chunks_per_block", property(_ref_chunks_per_block)),
)


@contextlib.contextmanager
def reference_pieces() -> Iterator[None]:
    """The package's finish path as of f2303ef while inside: every piece the
    2026-12-04f rework changed is swapped for its old version, and restored
    on exit (also on an exception)."""
    with swapped(_REFERENCE_PIECES):
        yield


class _ReferenceProducer(KVChecksumProducer):
    """The package's producer, marked as the reference: `finish_step` runs
    it inside `reference_pieces`, so its `request_finished` is the path of
    f2303ef."""


def _scheduler(holds_all_blocks: bool, reference: bool = False) -> KVChecksumScheduler:
    """One engine's checksum scheduler; `reference`: the finish path before
    2026-12-04f."""
    kcs = KVChecksumScheduler(
        {0: SchedulerGroup(BLOCK_SIZE, holds_all_blocks=holds_all_blocks)},
        num_workers=1,
        tp_size=1,
        fail_closed=False,
        carrier=lambda request, receiving: KVChecksumCarrier.KV_TRANSFER_PARAMS,
        hit_sources=lambda request, n: set(),
    )
    if reference:
        kcs.producer = _ReferenceProducer(kcs.producer.setup)
    return kcs


def finish_step(
    kcs: KVChecksumScheduler,
    manager: _BlockManager,
    step: int,
    num_requests: int,
    num_blocks: int,
) -> tuple[float, list[Any]]:
    """One step of `num_requests` producers: registered, reported and
    finished; returns the seconds `request_finished` took and its params.

    A reference producer's whole step runs inside `reference_pieces`: the
    swap and its restore are outside the timed calls."""
    from vllm.v1.request import RequestStatus

    reference = isinstance(kcs.producer, _ReferenceProducer)
    with reference_pieces() if reference else contextlib.nullcontext():
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
            kcs.request_finished(r, {"do_remote_decode": True}, manager)
            for r in requests
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


def run_compare(num_requests: int, num_blocks: int, rounds: int, steps: int) -> dict:
    """Per group kind and path (before/after 2026-12-04f), the median over
    rounds of the us per finished request; the four sides alternate step by
    step (same process, same inputs) and must send the same params."""
    sides = {
        (kind, path): (_scheduler(hold, path == "before"), _BlockManager())
        for kind, hold in KINDS.items()
        for path in PATHS
    }
    per_round: dict[tuple[str, str], list[float]] = {key: [] for key in sides}
    for side in sides.values():  # warm-up
        finish_step(*side, 0, num_requests, num_blocks)
    for _ in range(rounds):
        totals = dict.fromkeys(sides, 0.0)
        for step in range(steps):
            sent: dict[tuple[str, str], list[Any]] = {}
            for key, side in sides.items():
                elapsed, params = finish_step(*side, step, num_requests, num_blocks)
                totals[key] += elapsed
                sent[key] = params
            for kind in KINDS:  # the same payload bytes either way
                assert sent[(kind, "before")] == sent[(kind, "after")], kind
        for key in sides:
            per_round[key].append(1e6 * totals[key] / (steps * num_requests))
    medians = {key: statistics.median(v) for key, v in per_round.items()}
    return {
        "requests_per_step": num_requests,
        "blocks_per_request": num_blocks,
        "us_per_request": {
            kind: {path: medians[(kind, path)] for path in PATHS} for kind in KINDS
        },
        "rounds_us_per_request": {
            kind: {path: per_round[(kind, path)] for path in PATHS} for kind in KINDS
        },
        "after_over_before": {
            kind: medians[(kind, "after")] / medians[(kind, "before")] for kind in KINDS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="the finish path before 2026-12-04f against the current one",
    )
    args = parser.parse_args()
    shape = (
        f"{args.requests} producers a step, {args.blocks} blocks each, "
        f"{args.rounds} rounds of {args.steps} steps (median of rounds):"
    )
    if args.compare:
        result = run_compare(args.requests, args.blocks, args.rounds, args.steps)
        print(shape)
        print("| group kind | before (us a request) | after | after / before |")
        print("|---|---|---|---|")
        for kind, paths in result["us_per_request"].items():
            ratio = result["after_over_before"][kind]
            print(
                f"| {kind} | {paths['before']:.1f} | {paths['after']:.1f} "
                f"| {ratio:.3f} |"
            )
    else:
        result = run(args.requests, args.blocks, args.rounds, args.steps)
        print(shape)
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
