# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The finishing producer's payload against slow references (R66, R77, R79,
R80, R87, R136; issue 30).

The finish path builds, checks and encodes the payload with few Python calls
and no per-block loop. Here the same payloads are built the slow way, with
Python ints and loops over every position, worker and column, and encoded by
a msgpack writer spelled out from the msgpack spec (no msgspec, no NumPy
buffers), so a shortcut that changes a single byte fails.

Each test's docstring names the requirement and the bug it catches.
"""

import base64
import hashlib
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumBlocks,
    KVChecksumGroup,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import (
    first_held_position,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    KVChecksumPayload,
    KVChecksumPayloadGroup,
    KVChecksumPayloadLimits,
    _check_payload,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumGroupInfo,
    KVChecksumWorkerReport,
    build_producer_payload,
)

pytestmark = pytest.mark.cpu

U64 = 1 << 64


# ---------------------------------------------------------------------------
# A msgpack writer from the spec: shortest uint forms, arrays, bins.


def mp_uint(value: int) -> bytes:
    """A non-negative int in its shortest msgpack form."""
    assert 0 <= value < U64
    if value < 0x80:
        return bytes([value])
    for head, size in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
        if value < 1 << (8 * size):
            return bytes([head]) + value.to_bytes(size, "big")
    raise AssertionError(value)


def mp_array(items: list[bytes]) -> bytes:
    """A msgpack array of already encoded items."""
    n = len(items)
    if n < 16:
        head = bytes([0x90 | n])
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(items)


def mp_bin(data: bytes) -> bytes:
    """A msgpack bin in its shortest form."""
    n = len(data)
    for head, size in ((0xC4, 1), (0xC5, 2), (0xC6, 4)):
        if n < 1 << (8 * size):
            return bytes([head]) + n.to_bytes(size, "big") + data
    raise AssertionError(n)


# ---------------------------------------------------------------------------
# The producer payload by hand (R80, R87, R135).


@dataclass
class RefGroup:
    group_id: int
    fingerprint: int
    chunk_tokens: int
    start: int
    values: list[int]


def reference_groups(
    reports: dict[tuple[int, int], KVChecksumWorkerReport],
    scheduled: KVChecksumBlocks,
    infos: dict[int, KVChecksumGroupInfo],
) -> list[RefGroup] | None:
    """R80 with Python ints: None if an entry is not the scheduled range;
    else per group reported and skipped by none, the sum over every worker
    and column of each chunk, up to the last chunk holding a token."""
    skipped = {g for report in reports.values() for g in report.skipped_groups}
    stages: dict[int, int] = {}
    for pp, tp in reports:
        stages[pp] = min(tp, stages.get(pp, tp))
    groups = []
    for group_id in sorted(scheduled.groups):
        start, block_ids = scheduled.groups[group_id]
        info = infos[group_id]
        per_block = 1 if info.is_mamba else info.block_size // info.chunk_tokens
        first, count = start * per_block, len(block_ids) * per_block
        entries = [r.groups[group_id] for r in reports.values() if group_id in r.groups]
        for entry in entries:
            if entry.start != first or len(entry.values) != count:
                return None
        if group_id in skipped or not entries:
            continue
        sums = [0] * count
        for entry in entries:
            for i in range(count):
                for column in range(entry.values.shape[1]):
                    sums[i] = (sums[i] + int(entry.values[i, column])) % U64
        fingerprint = 0
        for pp, tp in stages.items():
            fingerprint += reports[(pp, tp)].fingerprints.get(group_id, 0)
        last = -(-scheduled.num_tokens // info.chunk_tokens)
        keep = max(0, min(first + count, last) - first)
        groups.append(
            RefGroup(group_id, fingerprint % U64, info.chunk_tokens, first, sums[:keep])
        )
    return groups


def reference_bytes(tp_size: int, num_tokens: int, groups: list[RefGroup]) -> bytes:
    """R77, R136: [2, blake2b-8 LE of body, bin(body)], body
    [tp, tokens, [[id, fp, chunk, start, bin(LE uint64 values)]]]."""
    body = mp_array(
        [
            mp_uint(tp_size),
            mp_uint(num_tokens),
            mp_array(
                [
                    mp_array(
                        [
                            mp_uint(g.group_id),
                            mp_uint(g.fingerprint),
                            mp_uint(g.chunk_tokens),
                            mp_uint(g.start),
                            mp_bin(b"".join(v.to_bytes(8, "little") for v in g.values)),
                        ]
                    )
                    for g in groups
                ]
            ),
        ]
    )
    digest = hashlib.blake2b(body, digest_size=8).digest()
    return mp_array(
        [mp_uint(2), mp_uint(int.from_bytes(digest, "little")), mp_bin(body)]
    )


def random_case(
    rng: random.Random,
) -> tuple[dict, KVChecksumBlocks, dict[int, KVChecksumGroupInfo]]:
    """Workers over PP and TP ranks, each reporting 0-3 columns per group
    (values anywhere in uint64, so sums wrap), some groups unreported or
    skipped, some entries off the scheduled range, Mamba and chunked groups."""
    keys = sorted({(rng.randint(0, 1), rng.randint(0, 3)) for _ in range(4)})
    infos: dict[int, KVChecksumGroupInfo] = {}
    scheduled: dict[int, tuple[int, np.ndarray]] = {}
    groups: dict[tuple[int, int], dict[int, KVChecksumGroup]] = {k: {} for k in keys}
    for group_id in range(rng.randint(1, 3)):
        info = KVChecksumGroupInfo(
            rng.choice([1, 8, 16, 48, 64]), is_mamba=rng.random() < 0.15
        )
        infos[group_id] = info
        start, num_blocks = rng.randint(0, 4), rng.randint(0, 40)
        scheduled[group_id] = (start, np.arange(num_blocks, dtype=np.int64))
        first = start * info.chunks_per_block
        count = num_blocks * info.chunks_per_block
        for key in keys:
            if rng.random() < 0.15:
                continue
            rows = count + (1 if rng.random() < 0.03 else 0)
            columns = rng.choice([1, 1, 2, 3])
            values = np.array(
                [[rng.getrandbits(64) for _ in range(columns)] for _ in range(rows)],
                dtype=np.uint64,
            ).reshape(rows, columns)
            replica_keys = tuple((1, 0) for _ in range(columns))
            groups[key][group_id] = KVChecksumGroup(first, replica_keys, values)
    reports = {
        key: KVChecksumWorkerReport(
            groups[key],
            tuple(g for g in infos if rng.random() < 0.05),
            {g: rng.getrandbits(64) for g in infos if rng.random() < 0.8},
        )
        for key in keys
    }
    num_tokens = rng.randint(0, 2500)
    return reports, KVChecksumBlocks(num_tokens=num_tokens, groups=scheduled), infos


def test_R80_R77_producer_payload_bytes_match_a_slow_reference() -> None:
    """R77, R80, R87, R136: for 400 random producer requests the payload's
    values and its bytes and base64 equal a reference summing every chunk with
    Python ints over sorted workers and columns, encoded by a msgpack writer
    from the spec; entries off the scheduled range send nothing; the workers'
    reports are left as they were.

    Bugs caught: the finish path's shortcuts summing only the first worker or
    column, accumulating into a worker's own array (its report changes and a
    later payload is wrong), dropping the wrap-around, trimming the chunks
    past the last token wrongly, or encoding an int or bin in another form.
    """
    rng = random.Random(20261204)
    built = 0
    for _ in range(400):
        reports, scheduled, infos = random_case(rng)
        tp_size = rng.choice([1, 2, 8])
        before = {
            key: {g: e.values.copy() for g, e in r.groups.items()}
            for key, r in reports.items()
        }
        payload = build_producer_payload(
            reports, scheduled, len(reports), tp_size, infos
        )
        expected = reference_groups(reports, scheduled, infos)
        for key, report in reports.items():
            for group_id, entry in report.groups.items():
                assert np.array_equal(entry.values, before[key][group_id])
        if expected is None:
            assert isinstance(payload, str) and "reported positions" in payload
            continue
        assert isinstance(payload, KVChecksumPayload)
        got = [
            RefGroup(g.group_id, g.fingerprint, g.chunk_tokens, g.start, g.values)
            for g in payload.groups
        ]
        assert [(g.group_id, g.fingerprint, g.chunk_tokens, g.start) for g in got] == [
            (g.group_id, g.fingerprint, g.chunk_tokens, g.start) for g in expected
        ]
        for mine, ref in zip(got, expected):
            assert [int(v) for v in mine.values] == ref.values
        raw = reference_bytes(tp_size, scheduled.num_tokens, expected)
        assert payload.to_bytes() == raw
        assert payload.to_base64() == base64.b64encode(raw).decode("ascii")
        built += 1
    assert built > 200  # most cases send a payload


def _message(payload: KVChecksumPayload) -> str | None:
    try:
        payload.to_bytes()
    except ValueError as exc:
        return str(exc)
    return None


def _full_check_message(payload: KVChecksumPayload) -> str | None:
    try:
        _check_payload(payload, KVChecksumPayloadLimits())
    except ValueError as exc:
        return str(exc)
    return None


class _Values(np.ndarray):
    """An ndarray subclass: not the exact type the fast check accepts."""


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"version": 1},
        {"version": np.int64(2)},
        {"tp_size": 0},
        {"tp_size": (1 << 16) + 1},
        {"tp_size": True},
        {"num_tokens": -1},
        {"num_tokens": np.uint32(7)},
        {"groups": ()},
        {"group_id": -1},
        {"group_id": np.int64(1)},
        {"fingerprint": U64},
        {"fingerprint": -1},
        {"fingerprint": np.uint64(U64 - 1)},
        {"chunk_tokens": 0},
        {"chunk_tokens": True},
        {"start": False},
        {"start": -3},
        {"start": 2.0},
        {"values": np.zeros((2, 1), np.uint64)},
        {"values": np.zeros(2, np.int64)},
        {"values": np.zeros(2, np.uint8)},
        {"values": np.zeros(2, ">u8")},
        {"values": np.arange(6, dtype=np.uint64)[::2]},
        {"values": np.zeros(2, np.uint64).view(_Values)},
        {"values": [1, 2]},
        {"duplicate": True},
    ],
)
def test_R79_to_bytes_accepts_and_rejects_exactly_as_the_full_check(
    change: dict[str, Any],
) -> None:
    """R79, R134: `to_bytes` accepts a payload iff the decoder's full field
    check (without limits) does, with the same message, and then encodes the
    same bytes as from plain ints and a uint64 copy of the values.

    Bugs caught: the fast check accepting a bool, float or out-of-range field,
    a 2-D, signed or subclassed values array, or a duplicated group (a payload
    every consumer rejects), or rejecting a NumPy int field the full check
    accepts (a producer that stops sending).
    """
    fields: dict[str, Any] = {
        "version": 2,
        "tp_size": 2,
        "num_tokens": 40,
        "groups": None,
        "group_id": 1,
        "fingerprint": 0xFEED,
        "chunk_tokens": 16,
        "start": 1,
        "values": np.array([5, U64 - 1], dtype=np.uint64),
    }
    duplicate = change.pop("duplicate", False)
    fields.update(change)
    group = KVChecksumPayloadGroup(
        fields["group_id"],
        fields["fingerprint"],
        fields["chunk_tokens"],
        fields["start"],
        fields["values"],
    )
    groups = [group, group] if duplicate else [group]
    if fields["groups"] is not None:
        groups = fields["groups"]
    payload = KVChecksumPayload(
        fields["version"],
        fields["tp_size"],
        fields["num_tokens"],
        groups,
    )
    message = _message(payload)
    assert message == _full_check_message(payload)
    if message is None:
        values = [int(v) for v in np.asarray(fields["values"]).tolist()]
        ref = RefGroup(
            int(fields["group_id"]),
            int(fields["fingerprint"]),
            int(fields["chunk_tokens"]),
            int(fields["start"]),
            values,
        )
        raw = reference_bytes(
            int(fields["tp_size"]),
            int(fields["num_tokens"]),
            [ref],
        )
        assert payload.to_bytes() == raw


@dataclass
class _Block:
    block_id: int
    is_null: bool


def test_R66_first_held_position_matches_a_loop() -> None:
    """R66: the first of positions [start, start + count) after which every
    block is held, None if the range runs past the blocks or its last block
    is null, checked against a loop over every block for null prefixes,
    scattered nulls and none.

    Bugs caught: the no-null shortcut returning `start` when a null block is
    present (a freed chunk's checksum sent: a false mismatch), or missing a
    null last block, or a range shorter than `count`.
    """

    def reference(blocks: list[_Block], start: int, count: int) -> int | None:
        if count and start + count > len(blocks):
            return None
        first = start
        for position in range(start, start + count):
            if blocks[position].is_null:
                first = position + 1
        if count and first == start + count:
            return None
        return first

    rng = random.Random(66)
    for _ in range(3000):
        n = rng.randint(0, 24)
        kind, cut = rng.random(), rng.randint(0, n)
        blocks = [
            _Block(j, j < cut if kind < 0.5 else kind < 0.8 and rng.random() < 0.25)
            for j in range(n)
        ]
        start, count = rng.randint(0, n + 1), rng.randint(0, n + 1)
        assert first_held_position(blocks, start, count) == reference(
            blocks, start, count
        ), (start, count, [b.is_null for b in blocks])
