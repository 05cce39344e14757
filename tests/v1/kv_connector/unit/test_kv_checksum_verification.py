# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Producer payload building and load verification (SPEC sections 11-12).

Reports are built directly, without an engine or worker code: every test draws
one random per-token (or per-state) "truth" of the unsharded model, sums it
into blocks for each side's block size, and splits each block value randomly
over the workers and replica columns that hold it, so that the parts add up to
the truth mod 2^64 whatever the layout.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    ReplicaKey,
    sum_fingerprints,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    KVChecksumPayload,
    KVChecksumPayloadGroup,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
    KVChecksumStatus,
    KVChecksumVerdict,
    KVChecksumWorkerReport,
    UnverifiedReason,
    WorkerKey,
    build_producer_payload,
    verify_load,
    whole_model_fingerprints,
)

pytestmark = pytest.mark.cpu

U64 = np.uint64
NUM_LAYERS = 6


# --------------------------------------------------------------------------
# Test data: one truth, split over workers
# --------------------------------------------------------------------------


def random_u64(rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 1 << 64, size=shape, dtype=np.uint64)


def random_split(
    rng: np.random.Generator, total: np.ndarray, parts: int
) -> list[np.ndarray]:
    """`parts` random uint64 vectors summing to `total` mod 2^64."""
    pieces = [random_u64(rng, total.shape) for _ in range(parts - 1)]
    with np.errstate(over="ignore"):
        last = total.copy()
        for piece in pieces:
            last -= piece
    return [*pieces, last]


def block_values(tokens: np.ndarray, block_size: int, start: int, stop: int):
    """Block checksums of positions [start, stop) over a per-token truth.

    Numbering from the request start makes a block's checksum the sum of its
    tokens' contributions (R22); slots past the last token add nothing (R20).
    """
    padded = np.zeros(stop * block_size, dtype=U64)
    held = tokens[: stop * block_size]
    padded[: len(held)] = held
    blocks = padded[start * block_size :].reshape(-1, block_size)
    return blocks.sum(axis=1, dtype=U64)


def layer_identities(group_id: int, num_layers: int = NUM_LAYERS) -> list[tuple]:
    return [
        (f"model.layers.{i}.g{group_id}.attn", "FullAttentionSpec", "torch.bfloat16")
        for i in range(num_layers)
    ]


def stage_layers(layers: list[tuple], pp_rank: int, pp_size: int) -> list[tuple]:
    """The layers PP stage `pp_rank` holds: a contiguous share."""
    bounds = np.linspace(0, len(layers), pp_size + 1).astype(int)
    return layers[bounds[pp_rank] : bounds[pp_rank + 1]]


@dataclass
class Layout:
    """An engine's worker layout for one group's checksums."""

    tp: int = 1
    pp: int = 1
    # Replica count of each cache of the group (R32, R35, R40): an attention
    # cache sharded over TP has 1, one replicated on every rank has TP.
    replicas: tuple[int, ...] = (1,)

    @property
    def workers(self) -> list[WorkerKey]:
        return [(pp, tp) for pp in range(self.pp) for tp in range(self.tp)]


def split_group(
    rng: np.random.Generator,
    truth: np.ndarray,
    start: int,
    layout: Layout,
    replica_zero_only: bool = False,
) -> dict[WorkerKey, KVChecksumGroup]:
    """Splits block values over the layout's workers and replica columns.

    The truth is split randomly over the caches; each copy r of a cache with R
    replicas is split randomly over the workers holding it (tp_rank mod R = r,
    every PP stage). A producer's send plan holds replica 0 only (R46).
    """
    columns: dict[WorkerKey, dict[ReplicaKey, np.ndarray]] = {
        key: {} for key in layout.workers
    }
    caches = random_split(rng, truth, len(layout.replicas))
    with np.errstate(over="ignore"):
        for cache, count in zip(caches, layout.replicas, strict=True):
            for replica in range(1 if replica_zero_only else count):
                holders = [k for k in layout.workers if k[1] % count == replica]
                parts = random_split(rng, cache, len(holders))
                for holder, part in zip(holders, parts, strict=True):
                    worker = columns[holder]
                    key = (count, replica)
                    worker[key] = worker.get(key, np.zeros_like(truth)) + part
    groups = {}
    for worker_key, worker in columns.items():
        keys = tuple(sorted(worker))
        values = np.zeros((len(truth), len(keys)), dtype=U64)
        for column, key in enumerate(keys):
            values[:, column] = worker[key]
        groups[worker_key] = KVChecksumGroup(start, keys, values)
    return groups


def make_reports(
    rng: np.random.Generator,
    truths: dict[int, tuple[int, np.ndarray]],
    layout: Layout,
    replica_zero_only: bool = False,
    layers: dict[int, list[tuple]] | None = None,
) -> dict[WorkerKey, KVChecksumWorkerReport]:
    """Per worker, reports of the groups `truths` (group -> (start, values))."""
    reports = {key: KVChecksumWorkerReport({}) for key in layout.workers}
    for group_id, (start, truth) in truths.items():
        split = split_group(rng, truth, start, layout, replica_zero_only)
        identities = (layers or {}).get(group_id, layer_identities(group_id))
        for key, entry in split.items():
            reports[key].groups[group_id] = entry
            stage = stage_layers(identities, key[0], layout.pp)
            reports[key].fingerprints[group_id] = sum_fingerprints(stage)
    return reports


def skip_group(reports: dict[WorkerKey, KVChecksumWorkerReport], key, group_id):
    """Worker `key` cannot checksum `group_id` (R34): it lists it as skipped."""
    report = reports[key]
    report.groups.pop(group_id, None)
    report.fingerprints.pop(group_id, None)
    report.skipped_groups = (*report.skipped_groups, group_id)


def corrupt(reports, key: WorkerKey, group_id: int, row: int, column: int = 0):
    """Flips one bit of one worker's partial checksum (a corrupted byte)."""
    values = reports[key].groups[group_id].values
    values[row, column] ^= U64(1 << 17)


@dataclass
class Side:
    """One engine's view of one request: block size, tokens, loaded range."""

    block_size: int = 16
    num_tokens: int = 200
    start: int = 0
    layout: Layout = field(default_factory=Layout)

    @property
    def stop(self) -> int:
        return -(-self.num_tokens // self.block_size)


@dataclass
class Case:
    """A P/D load of one or more attention groups with consistent checksums."""

    reports: dict[WorkerKey, KVChecksumWorkerReport]
    payload: KVChecksumPayload
    scheduled: KVChecksumBlocks
    infos: dict[int, KVChecksumGroupInfo]
    consumer: Side

    def verify(self) -> KVChecksumVerdict:
        return verify_load(
            self.payload,
            None,
            self.reports,
            self.scheduled,
            len(self.consumer.layout.workers),
            self.consumer.layout.tp,
            self.infos,
        )


def make_case(
    seed: int = 0,
    producer: Side | None = None,
    consumer: Side | None = None,
    group_ids: Sequence[int] = (0,),
) -> Case:
    """Producer payload (built from producer reports) and consumer reports."""
    rng = np.random.default_rng(seed)
    producer = producer or Side()
    consumer = consumer or Side()
    tokens = random_u64(rng, max(producer.num_tokens, consumer.num_tokens))
    producer_truths, consumer_truths = {}, {}
    # Producer workers report one value per 16-token chunk of their blocks,
    # trailing empty chunks included (R135).
    chunk = min(producer.block_size, 16)
    per_block = producer.block_size // chunk
    for group_id in group_ids:
        group_tokens = tokens + U64(group_id)
        producer_truths[group_id] = (
            producer.start * per_block,
            block_values(
                group_tokens[: producer.num_tokens],
                chunk,
                producer.start * per_block,
                producer.stop * per_block,
            ),
        )
        # Consumer workers report per chunk of their blocks too (R135).
        c_chunk = min(consumer.block_size, 16)
        c_per_block = consumer.block_size // c_chunk
        consumer_truths[group_id] = (
            consumer.start * c_per_block,
            block_values(
                group_tokens[: consumer.num_tokens],
                c_chunk,
                consumer.start * c_per_block,
                consumer.stop * c_per_block,
            ),
        )
    producer_reports = make_reports(
        rng, producer_truths, producer.layout, replica_zero_only=True
    )
    producer_scheduled = scheduled_blocks(producer, group_ids)
    payload = build_producer_payload(
        producer_reports,
        producer_scheduled,
        len(producer.layout.workers),
        producer.layout.tp,
        {gid: KVChecksumGroupInfo(producer.block_size) for gid in group_ids},
    )
    assert isinstance(payload, KVChecksumPayload), payload
    return Case(
        reports=make_reports(rng, consumer_truths, consumer.layout),
        payload=payload,
        scheduled=scheduled_blocks(consumer, group_ids),
        infos={gid: KVChecksumGroupInfo(consumer.block_size) for gid in group_ids},
        consumer=consumer,
    )


def scheduled_blocks(side: Side, group_ids: Sequence[int]) -> KVChecksumBlocks:
    """Blocks [start, stop) per group at arbitrary block ids."""
    block_ids = np.arange(side.start, side.stop, dtype=np.int64) + 1000
    return KVChecksumBlocks(
        side.num_tokens, {gid: (side.start, block_ids) for gid in group_ids}
    )


def reasons(verdict: KVChecksumVerdict) -> list[UnverifiedReason]:
    return [reason for reason, _ in verdict.reasons]


def assert_verified(verdict: KVChecksumVerdict) -> None:
    assert verdict.status is KVChecksumStatus.VERIFIED, verdict
    assert not verdict.mismatches and not verdict.reasons


# --------------------------------------------------------------------------
# Fixed texts, load level
# --------------------------------------------------------------------------


def test_reason_texts_are_the_spec_table():
    """Section 12 table, R96: the fixed reasons are logged once each and counted
    by reason; catches a reworded text splitting the once-only logs and metrics."""
    assert {reason.value for reason in UnverifiedReason} == {
        "not every worker reported its checksums",
        "the producer sent no checksums",
        "the producer's checksums are invalid",
        "no loaded group can be checksummed",
        "a worker checksummed other blocks than scheduled",
        "a group is checksummed by one side only",
        "a group holds other layers or dtype on the producer",
        "block sizes are not multiples of each other",
        "the first loaded block starts inside a producer block",
        "a group has no block in common",
        "a replica was not checksummed",
        # R134: this project's last-resort guard (not in the spec's table).
        "verifying the checksums raised an error",
        # R147: an external load's block with no entry (not in the table).
        "a loaded block has no entry this engine recorded",
    }


def test_missing_worker_is_unverified_before_anything_else():
    """R82: fewer than W workers reported -> unverified "k of W workers reported",
    checked before the payload; catches verifying with a worker's part absent."""
    case = make_case(consumer=Side(layout=Layout(tp=2)))
    del case.reports[(0, 1)]
    for expected in (case.payload, None):
        verdict = verify_load(
            expected, None, case.reports, case.scheduled, 2, 2, case.infos
        )
        assert verdict.status is KVChecksumStatus.UNVERIFIED
        assert verdict.reasons == [
            (UnverifiedReason.NOT_ALL_WORKERS, "1 of 2 workers reported")
        ]


@pytest.mark.parametrize(
    "error, expected_reason",
    [
        (None, UnverifiedReason.NO_CHECKSUMS),
        (UnverifiedReason.NO_CHECKSUMS, UnverifiedReason.NO_CHECKSUMS),
        (UnverifiedReason.INVALID_CHECKSUMS, UnverifiedReason.INVALID_CHECKSUMS),
    ],
)
def test_no_payload_is_unverified(error, expected_reason):
    """R82, R79: a P/D load without a valid payload is unverified with the
    caller's reason; catches treating a missing payload as verified."""
    case = make_case()
    verdict = verify_load(
        None, error, case.reports, case.scheduled, 1, 1, case.infos, "bad base64"
    )
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert verdict.reasons == [(expected_reason, "bad base64")]
    assert not verdict.compared_groups


# --------------------------------------------------------------------------
# Layouts, fingerprints, producer payload
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "producer_layout, consumer_layout",
    [
        (Layout(1, 1), Layout(1, 1)),
        (Layout(2, 1), Layout(1, 1)),
        (Layout(1, 1), Layout(2, 1)),
        (Layout(1, 2), Layout(1, 1)),
        (Layout(1, 1), Layout(2, 2)),
        (Layout(2, 2, (2,)), Layout(4, 1, (2,))),
        (Layout(4, 1, (1, 4)), Layout(2, 2, (1, 2))),
    ],
    ids=str,
)
def test_correct_load_verifies_across_layouts(producer_layout, consumer_layout):
    """R3, R80, R87, R91: TP/PP parts sum to one value per position on both
    sides; catches a layout-dependent sum (e.g. a column or worker dropped)."""
    case = make_case(
        producer=Side(layout=producer_layout), consumer=Side(layout=consumer_layout)
    )
    verdict = case.verify()
    assert_verified(verdict)
    assert verdict.compared_groups == [0]


def test_corrupted_block_is_a_mismatch_at_its_position():
    """R91-R93: one bit of one worker's part flipped -> mismatch at exactly that
    consumer position; catches disabled comparison."""
    case = make_case(consumer=Side(layout=Layout(tp=2)))
    corrupt(case.reports, (0, 1), 0, row=7)
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {0: [7]}
    assert verdict.compared_groups == [0]


def test_fingerprints_of_pp2_producer_equal_pp1_consumer():
    """R87: the whole-model fingerprint is one TP rank per stage summed over
    stages, so a PP2 producer and a TP2 PP1 consumer agree; catches summing
    fingerprints over all workers (multiplies by TP) or of one stage only."""
    case = make_case(
        producer=Side(layout=Layout(tp=1, pp=2)),
        consumer=Side(layout=Layout(tp=2, pp=1)),
    )
    whole = sum_fingerprints(layer_identities(0))
    assert whole_model_fingerprints(case.reports) == {0: whole}
    assert case.payload.groups[0].fingerprint == whole
    assert_verified(case.verify())


def test_fingerprint_counts_the_lowest_reporting_rank_of_each_stage():
    """R87: a stage counts once even when its rank 0 lists different groups
    first; catches keying stages by report order instead of pp_rank."""
    reports = {
        (1, 1): KVChecksumWorkerReport({}, fingerprints={0: 5}),
        (0, 1): KVChecksumWorkerReport({}, fingerprints={0: 1, 1: 7}),
        (1, 0): KVChecksumWorkerReport({}, fingerprints={0: (1 << 64) - 2}),
        (0, 0): KVChecksumWorkerReport({}, fingerprints={0: 3, 1: 7}),
    }
    assert whole_model_fingerprints(reports) == {0: 1, 1: 7}


def test_other_layers_on_producer_is_unverified():
    """R87: another fingerprint (other layers or dtype) is unverified, not a
    mismatch; catches comparing values of differently built caches."""
    case = make_case()
    case.payload.groups[0].fingerprint ^= 1
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.OTHER_LAYERS]
    assert not verdict.compared_groups


def test_producer_payload_fields():
    """R80/R135: values = Σ workers Σ columns, fingerprint per R87, chunk tokens
    of the group spec's blocks, scheduled start, version 2; catches a dropped
    worker or stage."""
    rng = np.random.default_rng(1)
    truth = random_u64(rng, 9)
    layout = Layout(tp=2, pp=2, replicas=(1, 2))
    reports = make_reports(rng, {3: (4, truth)}, layout, replica_zero_only=True)
    block_ids = np.arange(9, dtype=np.int64)
    payload = build_producer_payload(
        reports,
        KVChecksumBlocks(200, {3: (4, block_ids)}),
        num_workers=4,
        tp_size=2,
        groups={3: KVChecksumGroupInfo(block_size=16)},
    )
    assert isinstance(payload, KVChecksumPayload)
    assert (payload.version, payload.tp_size, payload.num_tokens) == (2, 2, 200)
    [group] = payload.groups
    assert (group.group_id, group.chunk_tokens, group.start) == (3, 16, 4)
    assert group.fingerprint == sum_fingerprints(layer_identities(3))
    assert group.values.dtype == U64
    np.testing.assert_array_equal(group.values, truth)
    KVChecksumPayload.from_bytes(payload.to_bytes())  # encodable


def test_producer_with_missing_worker_sends_nothing():
    """R80: nothing is sent unless all W workers reported; catches sending a
    partial sum that would fail every load as a mismatch."""
    rng = np.random.default_rng(2)
    reports = make_reports(rng, {0: (0, random_u64(rng, 4))}, Layout(tp=2, pp=2))
    del reports[(1, 0)]
    scheduled = KVChecksumBlocks(64, {0: (0, np.arange(4))})
    result = build_producer_payload(
        reports, scheduled, 4, 2, {0: KVChecksumGroupInfo(16)}
    )
    assert result == "3 of 4 workers reported"


@pytest.mark.parametrize("start, rows", [(1, 4), (0, 3)])
def test_producer_worker_with_other_blocks_sends_nothing(start, rows):
    """R80, R84: a worker's entry with another start or length than scheduled
    (e.g. an earlier prefill of a preempted request) -> nothing sent; catches
    sending checksums of other blocks."""
    rng = np.random.default_rng(3)
    reports = make_reports(rng, {0: (0, random_u64(rng, 4))}, Layout(tp=2))
    reports[(0, 1)].groups[0] = make_reports(
        rng, {0: (start, random_u64(rng, rows))}, Layout()
    )[(0, 0)].groups[0]
    scheduled = KVChecksumBlocks(64, {0: (0, np.arange(4))})
    result = build_producer_payload(
        reports, scheduled, 2, 2, {0: KVChecksumGroupInfo(16)}
    )
    assert isinstance(result, str)
    assert "tp 1" in result and "scheduled [0, 4)" in result


def test_producer_omits_skipped_and_unchecksummed_groups():
    """R80: a group skipped by any worker, or checksummed by none (drafter-only),
    is left out; catches sending a partial sum of a skipped group."""
    rng = np.random.default_rng(4)
    truths = {gid: (0, random_u64(rng, 4)) for gid in (0, 1)}
    reports = make_reports(rng, truths, Layout(tp=2))
    skip_group(reports, (0, 1), 1)
    scheduled = KVChecksumBlocks(64, {gid: (0, np.arange(4)) for gid in (0, 1, 2)})
    infos = {gid: KVChecksumGroupInfo(16) for gid in (0, 1, 2)}
    payload = build_producer_payload(reports, scheduled, 2, 2, infos)
    assert isinstance(payload, KVChecksumPayload)
    assert [group.group_id for group in payload.groups] == [0]


def test_worker_report_from_record():
    """R51, R54: a record lists every request asked for; a request absent from
    it was not reported by that worker (counts against completeness, R82)."""
    entry = KVChecksumGroup(0, ((1, 0),), np.zeros((2, 1), dtype=U64))
    record = KVChecksumRecord(
        0, 1, {"a": {0: entry}, "b": {}}, skipped_groups=(2,), fingerprints={0: 9}
    )
    report = KVChecksumWorkerReport.from_record(record, "a")
    assert report is not None
    assert report.groups == {0: entry}
    assert report.skipped_groups == (2,) and report.fingerprints == {0: 9}
    assert KVChecksumWorkerReport.from_record(record, "b") is not None
    assert KVChecksumWorkerReport.from_record(record, "c") is None


# --------------------------------------------------------------------------
# Block sizes, alignment, partial chunks
# --------------------------------------------------------------------------


@pytest.mark.parametrize("b_d, b_p", [(16, 32), (32, 16), (16, 64), (64, 16)], ids=str)
def test_different_block_sizes_verify(b_d, b_p):
    """R88-R89: blocks are summed into chunks of the larger block size, and
    both sides' partial last chunks hold the same tokens; catches comparing
    unsummed blocks across block sizes."""
    case = make_case(
        producer=Side(block_size=b_p, num_tokens=1000),
        consumer=Side(block_size=b_d, num_tokens=1000, layout=Layout(tp=2)),
    )
    verdict = case.verify()
    assert_verified(verdict)
    assert verdict.compared_groups == [0]


@pytest.mark.parametrize(
    "b_d, b_p, row, expected",
    [
        # Producers send 16-token chunks (R135): a 16-token consumer block is
        # compared on its own, whatever the producer's block size.
        (16, 32, 5, [5]),
        (16, 64, 5, [5]),
        # Rows are consumer chunks of min(bs, 16) tokens: row 5 is block 2.
        (32, 16, 5, [2]),
        (8, 32, 5, [4, 5]),
        # The last chunk holds blocks 62 and the padding block 63 (R89).
        (8, 16, 124, [124]),
    ],
    ids=str,
)
def test_different_block_sizes_catch_a_corrupted_block(b_d, b_p, row, expected):
    """R92, R135: a bad chunk reports every loaded consumer position of the
    larger of the consumer block and the producer chunk; catches localizing to
    the wrong block or reporting unloaded ones."""
    case = make_case(
        producer=Side(block_size=b_p, num_tokens=1000),
        consumer=Side(block_size=b_d, num_tokens=1000),
    )
    corrupt(case.reports, (0, 0), 0, row=row)
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {0: expected}


@pytest.mark.parametrize("start", [1, 2, 3])
def test_start_inside_a_producer_block_verifies(start):
    """R135 (issue 13): a 16k-token local hit before 16-token consumer blocks
    loading 32-token producer blocks verifies, the first loaded block
    included; only loaded blocks are compared. Under v1 (per-block producer
    values) odd starts were unverified "the first loaded block starts inside
    a producer block"; catches a producer sending per block again."""
    case = make_case(
        producer=Side(block_size=32, num_tokens=300),
        consumer=Side(block_size=16, num_tokens=300, start=start),
    )
    assert_verified(case.verify())
    corrupt(case.reports, (0, 0), 0, row=0)
    assert case.verify().mismatches == {0: [start]}


def test_unaligned_start_is_unverified():
    """R88: an 8-token local hit before 8-token consumer blocks loading
    producer chunks of 16 tokens starts inside a producer chunk -> unverified,
    even though the first loaded block is corrupted; catches removing the
    alignment check (the first loaded block would go unchecked and the load
    pass)."""
    case = make_case(
        producer=Side(block_size=32, num_tokens=300),
        consumer=Side(block_size=8, num_tokens=300, start=1),
    )
    corrupt(case.reports, (0, 0), 0, row=0)
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.UNALIGNED_START]
    assert not verdict.compared_groups


def test_block_sizes_not_multiples_are_unverified():
    """R88: 16 vs 12 tokens cannot be regrouped -> unverified; catches comparing
    chunks that hold different tokens (false mismatches)."""
    case = make_case(
        producer=Side(block_size=12, num_tokens=240),
        consumer=Side(block_size=16, num_tokens=240),
    )
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.BLOCK_SIZES]


def test_last_block_with_other_token_counts_is_not_compared():
    """R90: the last block is compared only if both sides hold the same number
    of tokens in it (here 4 vs 3); catches a false mismatch from comparing it,
    while the earlier blocks are still checked."""
    case = make_case(producer=Side(num_tokens=100), consumer=Side(num_tokens=99))
    assert_verified(case.verify())
    corrupt(case.reports, (0, 0), 0, row=5)
    assert case.verify().mismatches == {0: [5]}


def test_padding_applies_only_when_values_reach_the_last_token():
    """R89: a producer's values stopping before the last token's block are not
    padded: the half chunk at the end is left out; catches padding it with zero
    blocks (a false mismatch against the consumer's full chunk)."""
    case = make_case(
        producer=Side(block_size=16, num_tokens=128),
        consumer=Side(block_size=32, num_tokens=128),
    )
    case.payload.groups[0].values = case.payload.groups[0].values[:7]
    assert_verified(case.verify())


def test_no_common_block_is_unverified():
    """R90: the only loaded block holds other token counts on the two sides ->
    unverified, not verified with nothing compared."""
    case = make_case(
        producer=Side(num_tokens=100), consumer=Side(num_tokens=99, start=6)
    )
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.NO_COMMON_BLOCK]


# --------------------------------------------------------------------------
# Replicas
# --------------------------------------------------------------------------


def test_corrupted_replica_on_one_rank_fails_its_check():
    """R91: TP4 with 2 KV heads holds replica keys (2,0) and (2,1); a corrupted
    copy on rank 1 fails replica 1's check; catches checking replica 0 only."""
    case = make_case(consumer=Side(layout=Layout(tp=4, replicas=(2,))))
    assert_verified(case.verify())
    corrupt(case.reports, (0, 1), 0, row=3)
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {0: [3]}


def test_compensating_corruption_across_replicas_is_caught():
    """R91: +d on a replica-0 rank and -d on a replica-1 rank keeps the sum of
    all columns; catches comparing that sum (÷R) instead of each replica."""
    case = make_case(consumer=Side(layout=Layout(tp=4, replicas=(2,))))
    with np.errstate(over="ignore"):
        case.reports[(0, 0)].groups[0].values[2, 0] += U64(12345)
        case.reports[(0, 1)].groups[0].values[2, 0] -= U64(12345)
    assert case.verify().mismatches == {0: [2]}


def test_missing_replica_is_unverified():
    """R91: a replica key no worker reported leaves a check incomplete ->
    unverified; catches verifying with one copy never checked."""
    case = make_case(consumer=Side(layout=Layout(tp=4, replicas=(2,))))
    for key in ((0, 1), (0, 3)):
        entry = case.reports[key].groups[0]
        entry.replica_keys = ()
        entry.values = entry.values[:, :0]
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.REPLICA_MISSING]


def test_one_copy_sum_only_when_every_worker_holds_one_copy():
    """R91 (issue 30's one-copy sum): TP2 where rank 1 also reports a (2, 1)
    column. Check 0 then needs T[(2, 0)], which no worker reported, so the
    load is unverified. Catches the one-copy check taken while another
    replica key is present (rank 1's second column never checked)."""
    case = make_case(consumer=Side(layout=Layout(tp=2)))
    assert_verified(case.verify())
    entry = case.reports[(0, 1)].groups[0]
    extra = np.zeros((entry.values.shape[0], 1), dtype=U64)
    entry.values = np.concatenate([entry.values, extra], axis=1)
    entry.replica_keys = ((1, 0), (2, 1))
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.REPLICA_MISSING]


@pytest.mark.parametrize("replicas", [(1, 4), (2, 4), (1, 2, 4)], ids=str)
def test_mixed_replica_counts_verify_and_catch_one_copy(replicas):
    """R91, R40: attention at (1,0) or (2,r) plus an indexer on every rank at
    (4,k): check_k = Σ_R T[(R, k mod R)] verifies; a corrupted indexer copy on
    rank 2 fails; catches pairing replicas of different counts wrongly."""
    case = make_case(consumer=Side(layout=Layout(tp=4, replicas=replicas)))
    assert_verified(case.verify())
    entry = case.reports[(0, 2)].groups[0]
    corrupt(case.reports, (0, 2), 0, row=9, column=entry.replica_keys.index((4, 2)))
    assert case.verify().mismatches == {0: [9]}


# --------------------------------------------------------------------------
# Groups: blocks, sides, Mamba, verdict
# --------------------------------------------------------------------------


def test_worker_with_other_blocks_leaves_group_unverified():
    """R83, R84: a consumer worker's entry with another start makes its group
    unverified while other groups still compare; catches comparing positions
    shifted by one."""
    case = make_case(consumer=Side(layout=Layout(tp=2)), group_ids=(0, 1))
    case.reports[(0, 1)].groups[1].start += 1
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.OTHER_BLOCKS]
    assert verdict.reasons[0][1].startswith("group 1: worker (pp 0, tp 1)")
    assert verdict.compared_groups == [0]


def test_group_skipped_on_both_sides_is_ignored():
    """R86: a group neither side checksums is not compared and the load
    verifies on its other groups; catches failing every hybrid load."""
    case = make_case(consumer=Side(layout=Layout(tp=2)), group_ids=(0, 1))
    skip_group(case.reports, (0, 0), 1)
    case.payload.groups = [g for g in case.payload.groups if g.group_id != 1]
    verdict = case.verify()
    assert_verified(verdict)
    assert verdict.compared_groups == [0]


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_group_skipped_on_one_side_is_unverified(side):
    """R86: a group checksummed by one side only is unverified, the detail names
    the side; catches silently ignoring a group the other side covers."""
    case = make_case(consumer=Side(layout=Layout(tp=2)), group_ids=(0, 1))
    if side == "producer":
        skip_group(case.reports, (0, 1), 1)
    else:
        case.payload.groups = [g for g in case.payload.groups if g.group_id != 1]
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert verdict.reasons == [
        (UnverifiedReason.ONE_SIDE_ONLY, f"group 1: checksummed by the {side} only")
    ]
    assert verdict.compared_groups == [0]


def test_no_group_compared_is_unverified():
    """R82, R93: a P/D load with no group compared is unverified ("no loaded
    group can be checksummed"); catches reporting it verified."""
    case = make_case()
    skip_group(case.reports, (0, 0), 0)
    case.payload.groups = []
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.NO_LOADED_GROUP]


def test_mismatch_wins_over_unverified_groups():
    """R93: a mismatch in one group is a mismatch even when another group is
    unverified; catches a corrupted load passing as merely unverified."""
    case = make_case(group_ids=(0, 1))
    corrupt(case.reports, (0, 0), 0, row=1)
    case.payload.groups[1].fingerprint ^= 1
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {0: [1]}
    assert reasons(verdict) == [UnverifiedReason.OTHER_LAYERS]


def mamba_case(
    producer_tp: int, consumer_tp: int, tp_comparable: bool
) -> tuple[Case, dict[int, KVChecksumGroupInfo]]:
    """A hybrid load: attention group 0 and a Mamba group 1 whose one running
    state sits at position 0 (R67) with 16-token producer group spec blocks."""
    case = make_case(
        producer=Side(num_tokens=99, layout=Layout(tp=producer_tp)),
        consumer=Side(block_size=32, num_tokens=99, layout=Layout(tp=consumer_tp)),
    )
    rng = np.random.default_rng(5)
    state = random_u64(rng, 1)
    mamba = make_reports(rng, {1: (0, state)}, Layout(tp=consumer_tp))
    for key, report in mamba.items():
        case.reports[key].groups[1] = report.groups[1]
        case.reports[key].fingerprints[1] = report.fingerprints[1]
    case.payload.groups.append(
        KVChecksumPayloadGroup(1, mamba[(0, 0)].fingerprints[1], 16, 0, state.copy())
    )
    case.scheduled.groups[1] = (0, np.array([7]))
    infos = {
        0: KVChecksumGroupInfo(32),
        1: KVChecksumGroupInfo(64, is_mamba=True, tp_comparable=tp_comparable),
    }
    return case, infos


def verify_with(case: Case, infos: dict[int, KVChecksumGroupInfo]):
    workers = len(case.consumer.layout.workers)
    tp = case.consumer.layout.tp
    return verify_load(
        case.payload, None, case.reports, case.scheduled, workers, tp, infos
    )


def test_mamba_state_compares_one_state_per_block():
    """R88, R90: Mamba blocks hold one state whatever the group spec block sizes
    (64 vs 16) and skip the token check; catches regrouping states by block size
    (unverified) and a missed state bit flip."""
    case, infos = mamba_case(1, 1, tp_comparable=True)
    verdict = verify_with(case, infos)
    assert_verified(verdict)
    assert verdict.compared_groups == [0, 1]
    corrupt(case.reports, (0, 0), 1, row=0)
    assert verify_with(case, infos).mismatches == {1: [0]}


def test_unsplit_mamba_across_tp_sizes_is_left_out():
    """R85: Mamba without state splits is left out when TP sizes differ (the
    caller warns once) and attention still verifies the load, even with state
    values that differ; catches failing every heterogeneous-TP hybrid load."""
    case, infos = mamba_case(1, 2, tp_comparable=False)
    corrupt(case.reports, (0, 0), 1, row=0)
    verdict = verify_with(case, infos)
    assert_verified(verdict)
    assert verdict.compared_groups == [0]
    assert verdict.tp_incomparable_groups == [1]


def test_pure_ssm_load_across_tp_sizes_has_no_loaded_group():
    """R85, R93: with only an unsplit Mamba group left out, no group is compared:
    unverified "no loaded group can be checksummed"."""
    case, infos = mamba_case(1, 2, tp_comparable=False)
    del case.scheduled.groups[0]
    verdict = verify_with(case, infos)
    assert verdict.status is KVChecksumStatus.UNVERIFIED
    assert reasons(verdict) == [UnverifiedReason.NO_LOADED_GROUP]
    assert verdict.tp_incomparable_groups == [1]


# --------------------------------------------------------------------------
# Randomized layouts
# --------------------------------------------------------------------------


@st.composite
def layouts(draw) -> Layout:
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2]))
    counts = [c for c in (1, 2, 4) if tp % c == 0]
    replicas = draw(st.lists(st.sampled_from(counts), min_size=1, max_size=3))
    return Layout(tp, pp, tuple(replicas))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    b_d=st.sampled_from([16, 32, 64]),
    b_p=st.sampled_from([16, 32, 64]),
    num_tokens=st.integers(1, 700),
    producer_layout=layouts(),
    consumer_layout=layouts(),
    data=st.data(),
)
def test_random_layouts_verify_and_localize_corruption(
    seed, b_d, b_p, num_tokens, producer_layout, consumer_layout, data
):
    """R88-R92, R135 over random TP/PP/replica layouts, block sizes and
    lengths: a correct load verifies; one corrupted part mismatches at exactly
    the loaded consumer positions of the larger of its block and the
    producer's 16-token chunk."""
    c_d = min(b_d, 16)
    chunk = max(c_d, min(b_p, 16))
    n_d = max(1, chunk // b_d)
    stop = -(-num_tokens // b_d)
    start = data.draw(st.integers(0, (stop - 1) // n_d)) * n_d
    case = make_case(
        seed,
        producer=Side(b_p, num_tokens, layout=producer_layout),
        consumer=Side(b_d, num_tokens, start, consumer_layout),
    )
    assert_verified(case.verify())
    key = data.draw(st.sampled_from(consumer_layout.workers))
    entry = case.reports[key].groups[0]
    # Rows are consumer chunks of c_d tokens (R135).
    per_block = b_d // c_d
    row = data.draw(st.integers(0, (stop - start) * per_block - 1))
    if (start * per_block + row) * c_d >= num_tokens:
        row = 0  # a chunk past the last token is never compared
    column = data.draw(st.integers(0, len(entry.replica_keys) - 1))
    corrupt(case.reports, key, 0, row, column)
    bad = (start * per_block + row) * c_d // chunk  # the bad chunk of K tokens
    first, last = bad * chunk // b_d, ((bad + 1) * chunk - 1) // b_d
    expected = list(range(max(first, start), min(last + 1, stop)))
    verdict = case.verify()
    assert verdict.status is KVChecksumStatus.MISMATCH
    assert verdict.mismatches == {0: expected}
