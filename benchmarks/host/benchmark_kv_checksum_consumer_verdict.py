# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A P/D consumer's verdict cost per load, on CPU (issue 30, R142).

The scheduler side's `update_from_output` for a step in which one CONNECTOR
carried load (NIXL push) finishes: the workers' pending records are
finalized, their reports and the producer's payload bytes stored and
decoded, and the load verified (`finalize_records`, `_store`,
`store_received`, `finish_loads`, `verify_load`). The path as it was before
the 2026-12-04g rework (`_ReferenceConsumer`: the package's own code with
only the pieces the rework changed swapped back for their versions of tree
3a89cc1, `reference_pieces`) runs against the package's current one,
except the payload's field check: since 2026-12-04i it is one check that
both arms take (3a89cc1's took about 2.3 us more a decode on CPU),
interleaved step by step on the same inputs in one process; both must reach
the same verdict every step. Registering the load and building the payload
are not timed. Every eighth step a position is corrupted (a mismatch) and
every eighth from the fourth the payload bytes are cut short (unverified):
those are compared too but only the verified loads are timed.

    python benchmarks/host/benchmark_kv_checksum_consumer_verdict.py \
        [--blocks 16 128 512] [--workers 1] [--rounds 5] [--steps 200] \
        [--json OUT]
"""

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_checksum_pieces import Piece, swapped  # noqa: E402, I001

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
    KVChecksumGroup,
    chunk_tokens,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import RowSegment
from vllm.distributed.kv_transfer.kv_checksum.engine import records as records_module
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import SchedulerGroup
from vllm.distributed.kv_transfer.kv_checksum.engine.consumer import (
    KVChecksumConsumer,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.records import (
    KVChecksumPendingRecord,
    PassResult,
    finalize_records,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    KVChecksumScheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.wire import (
    verification as verification_module,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    KV_CHECKSUM_PAYLOAD_VERSION,
    KVChecksumPayload,
    KVChecksumPayloadGroup,
    KVChecksumPayloadLimits,
    max_valid_payload_bytes,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumVerdict,
    UnverifiedReason,
    WorkerKey,
    other_blocks_detail,
    whole_model_fingerprints,
)

BLOCK_SIZE = 16
MAX_MODEL_LEN = 32768
FINGERPRINT = 0x1234
PATHS = ("before", "after")
# Step kinds by step % 8: a corrupted position, cut-short bytes, else intact.
KINDS = {0: "mismatch", 4: "truncated"}


@dataclass
class _Block:
    block_id: int
    is_null: bool = False


# --------------------------------------------------------------------------
# The verdict path before 2026-12-04g (tree 3a89cc1): the package's own
# `update_from_output` with only the pieces the rework changed swapped back
# for their old versions (`reference_pieces`). Where the old version was the
# current one inside `np.errstate`, it is written as that.
# --------------------------------------------------------------------------

_CURRENT_REPLICA_TOTALS = verification_module._replica_totals
_CURRENT_CHUNK_SUMS = verification_module._chunk_sums


def _ref_replica_totals(entries: list[KVChecksumGroup]) -> dict:
    """`_replica_totals` of 3a89cc1: the same sums inside `np.errstate`."""
    with np.errstate(over="ignore"):
        return _CURRENT_REPLICA_TOTALS(entries)


def _ref_chunk_sums(
    values: np.ndarray, start: int, block_size: int, num_tokens: int, n: int
) -> Any:
    """`_chunk_sums` of 3a89cc1: chunks of several values summed inside
    `np.errstate`."""
    if n == 1:
        return _CURRENT_CHUNK_SUMS(values, start, block_size, num_tokens, n)
    with np.errstate(over="ignore"):
        return _CURRENT_CHUNK_SUMS(values, start, block_size, num_tokens, n)


def _ref_differing(
    checks: np.ndarray, expected: np.ndarray, equal: np.ndarray | None
) -> np.ndarray:
    """The comparison of `_bad_chunks` of 3a89cc1: `any` and `flatnonzero`."""
    bad = (checks != expected).any(axis=0)
    return np.flatnonzero(bad if equal is None else bad & equal)


def _ref_bad_positions(bad_chunks: np.ndarray, n_d: int, end: int) -> np.ndarray:
    """The positions of `_compare_group` of 3a89cc1: built for no chunk too."""
    positions = (bad_chunks[:, None] * n_d + np.arange(n_d)).ravel()
    return positions[positions < end]


class _RefConsumerReports:
    """`_verify_group`'s view of the reports in 3a89cc1: every group ran
    `other_blocks_detail` and sorted the reports again for its entries."""

    def __init__(self, reports: dict[WorkerKey, Any]) -> None:
        self.reports = reports
        self.fingerprints = whole_model_fingerprints(reports)

    @classmethod
    def of(cls, reports: dict[WorkerKey, Any]) -> "_RefConsumerReports":
        return cls(reports)

    def entries(self, group_id: int, first: int, count: int) -> list | None:
        detail = other_blocks_detail(self.reports, group_id, first, count)
        if detail is not None:
            raise verification_module._GroupUnverified(
                UnverifiedReason.OTHER_BLOCKS, detail
            )
        found = [
            r.groups[group_id]
            for _, r in sorted(self.reports.items())
            if group_id in r.groups
        ]
        left_out = any(group_id in r.skipped_groups for r in self.reports.values())
        return None if left_out or not found else found


def _ref_segment_rows(seg: RowSegment) -> Iterator[tuple[str, int, int, int]]:
    """`finalize`'s rows of 3a89cc1: a cumsum and NumPy scalars a request."""
    bounds = np.cumsum(seg.counts)
    for i, req_id in enumerate(seg.req_ids):
        end = int(bounds[i])
        yield req_id, int(seg.starts[i]), end - int(seg.counts[i]), end


# The verification module's pieces by the names it looks up at call time.
# The one-copy path of `_replica_checks` the benchmark takes did not change;
# its table (several replica keys) only lost an `np.errstate`, not swapped
# back here.
_OLD_VERIFICATION = {
    "_ConsumerReports": _RefConsumerReports,
    "_differing": _ref_differing,
    "_bad_positions": _ref_bad_positions,
    "_replica_totals": _ref_replica_totals,
    "_chunk_sums": _ref_chunk_sums,
}
# (owner, name looked up at call time, the 3a89cc1 version).
_REFERENCE_PIECES: tuple[Piece, ...] = (
    *((verification_module, name, old) for name, old in _OLD_VERIFICATION.items()),
    (records_module, "_segment_rows", _ref_segment_rows),
)


@contextlib.contextmanager
def reference_pieces() -> Iterator[None]:
    """The package's verdict path as of 3a89cc1 while inside: every piece the
    2026-12-04g rework changed is swapped for its old version, and restored
    on exit (also on an exception)."""
    with swapped(_REFERENCE_PIECES):
        yield


class _ReferenceConsumer(KVChecksumConsumer):
    """The package's consumer, marked as the reference: `verdict_step` runs
    its step inside `reference_pieces`."""


@dataclass
class Side:
    """One engine's checksum scheduler and the verdicts it reached."""

    kcs: KVChecksumScheduler
    verdicts: list[tuple[str, KVChecksumVerdict]] = field(default_factory=list)


def make_side(num_workers: int, reference: bool = False) -> Side:
    """A consumer engine of `num_workers` TP workers taking NIXL-push
    (CONNECTOR-carried) loads; `reference`: the path before 2026-12-04g."""
    limits = KVChecksumPayloadLimits(
        max_encoded_bytes=max_valid_payload_bytes(MAX_MODEL_LEN, 1),
        max_groups=1,
        max_model_len=MAX_MODEL_LEN,
    )
    kcs = KVChecksumScheduler(
        {0: SchedulerGroup(BLOCK_SIZE, holds_all_blocks=True)},
        num_workers=num_workers,
        tp_size=num_workers,
        fail_closed=True,
        carrier=lambda request, receiving: KVChecksumCarrier.CONNECTOR,
        hit_sources=lambda request, n: {"p2p"},
        limits=limits,
    )
    if reference:
        kcs.consumer = _ReferenceConsumer(
            kcs.consumer.setup, True, kcs.consumer.hit_sources, limits, kcs.offload
        )
    side = Side(kcs)
    record = kcs.log.record

    def keep(req_id: str, verdict: KVChecksumVerdict, blocks: Any) -> None:
        side.verdicts.append((req_id, verdict))
        record(req_id, verdict, blocks)

    kcs.log.record = keep  # type: ignore[method-assign]
    return side


def step_kind(step: int) -> str:
    return KINDS.get(step % 8, "verified")


def _worker_values(step: int, worker: int, rows: int) -> np.ndarray:
    """A worker's partial checksums of the load's chunks, uint64 [rows]."""
    base = np.arange(rows, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return base + np.uint64(step * 7919 + worker)


def _payload_bytes(step: int, num_workers: int, rows: int, tokens: int) -> bytes:
    """The producer's payload: per chunk the sum over its workers."""
    total = _worker_values(step, 0, rows)
    for worker in range(1, num_workers):
        total = total + _worker_values(step, worker, rows)
    group = KVChecksumPayloadGroup(0, FINGERPRINT, chunk_tokens(BLOCK_SIZE), 0, total)
    payload = KVChecksumPayload(KV_CHECKSUM_PAYLOAD_VERSION, 1, tokens, [group])
    data = payload.to_bytes()
    return data[: len(data) // 2] if step_kind(step) == "truncated" else data


def _record(
    req_id: str, worker: int, values: np.ndarray, received: dict[str, bytes]
) -> KVChecksumPendingRecord:
    """A worker's pending record whose values already sit in its host buffer."""
    rows = values.shape[0]
    segment = RowSegment(0, 0, (req_id,), np.zeros(1, np.int64), np.full(1, rows))
    device = torch.empty((rows, 1), dtype=torch.int64, device="meta")
    result = PassResult(segment, ((1, 0),), device, host_at=0)
    host = torch.from_numpy(values.view(np.int64).copy())
    return KVChecksumPendingRecord(
        0, worker, (req_id,), [result], (), {0: FINGERPRINT}, received, host=host
    )


def verdict_step(side: Side, step: int, num_blocks: int) -> float:
    """One load of `num_blocks` registered, reported and verified; returns
    the seconds `update_from_output` took (finalizing the records included).

    A reference side's whole step runs inside `reference_pieces`: the swap
    and its restore are outside the timed call."""
    kcs = side.kcs
    reference = isinstance(kcs.consumer, _ReferenceConsumer)
    with reference_pieces() if reference else contextlib.nullcontext():
        req_id = f"c{step}"
        tokens = num_blocks * BLOCK_SIZE
        request = SimpleNamespace(
            request_id=req_id,
            kv_transfer_params={"do_remote_prefill": True},
            num_computed_tokens=tokens,
        )
        kcs.on_new_request(request)
        blocks = [_Block(step * num_blocks + j) for j in range(num_blocks)]
        kcs.add_recv(request, SimpleNamespace(blocks=(blocks,)), 0)
        assert kcs.build_checksum_meta() is not None
        rows = num_blocks * (BLOCK_SIZE // chunk_tokens(BLOCK_SIZE))
        workers = kcs.num_workers
        data = _payload_bytes(step, workers, rows, tokens)
        pending = []
        for worker in range(workers):
            values = _worker_values(step, worker, rows)
            if worker == 0 and step_kind(step) == "mismatch":
                values[rows // 2] ^= np.uint64(1 << 17)
            received = {req_id: data} if worker == 0 else {}
            pending.append(_record(req_id, worker, values, received))
        start = time.perf_counter()
        kcs.update_from_output(finalize_records(pending), [req_id])
        return time.perf_counter() - start


def _summary(verdict: KVChecksumVerdict) -> tuple:
    """What must be equal on both paths: status, reasons, mismatches."""
    return (verdict.status, verdict.reasons, verdict.mismatches)


def run_compare(num_blocks: int, num_workers: int, rounds: int, steps: int) -> dict:
    """Per path (before/after 2026-12-04g), the median over rounds of the us
    per verified load; the paths alternate step by step, which goes first
    alternating too, and must reach the same verdict every step."""
    sides = {path: make_side(num_workers, path == "before") for path in PATHS}
    for side in sides.values():  # warm-up
        verdict_step(side, 1, num_blocks)
    per_round: dict[str, list[float]] = {path: [] for path in PATHS}
    kinds: dict[str, int] = {}
    for _ in range(rounds):
        totals = dict.fromkeys(PATHS, 0.0)
        timed = 0
        for step in range(steps):
            order = PATHS if step % 2 else PATHS[::-1]
            elapsed = {
                path: verdict_step(sides[path], step, num_blocks) for path in order
            }
            before, after = (sides[path].verdicts[-1] for path in PATHS)
            assert before[0] == after[0] == f"c{step}", (before, after)
            assert _summary(before[1]) == _summary(after[1]), (before, after)
            kind = step_kind(step)
            kinds[kind] = kinds.get(kind, 0) + 1
            assert (kind == "verified") == (after[1].status.value == "verified")
            if kind == "verified":
                timed += 1
                for path in PATHS:
                    totals[path] += elapsed[path]
        for path in PATHS:
            per_round[path].append(1e6 * totals[path] / timed)
    medians = {path: statistics.median(v) for path, v in per_round.items()}
    return {
        "blocks_per_load": num_blocks,
        "workers": num_workers,
        "us_per_verified_load": medians,
        "rounds_us_per_verified_load": per_round,
        "after_over_before": medians["after"] / medians["before"],
        "steps_by_kind": kinds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # The mismatches' and cut-short payloads' log lines, in both arms alike.
    logging.disable(logging.ERROR)
    print(
        f"one load a step, {args.workers} worker(s), {args.rounds} rounds of "
        f"{args.steps} steps (median of rounds; verified loads timed):"
    )
    print("| blocks a load | before (us a load) | after | after / before |")
    print("|---|---|---|---|")
    results = []
    for num_blocks in args.blocks:
        result = run_compare(num_blocks, args.workers, args.rounds, args.steps)
        results.append(result)
        us = result["us_per_verified_load"]
        print(
            f"| {num_blocks} | {us['before']:.1f} | {us['after']:.1f} "
            f"| {result['after_over_before']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
