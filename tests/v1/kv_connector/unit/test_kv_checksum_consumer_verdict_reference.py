# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A P/D consumer's verdicts against a slow reference (R72, R79-R93, R129,
R134-R136; issue 30).

The consumer's verdict path (pending records finalized, reports and payload
bytes stored and decoded, the load verified) runs in a `KVChecksumScheduler`
on random loads: several PP and TP workers and groups, prefix hits, token
counts that differ, replica keys, corrupted values, missing workers, wrong
fingerprints, entries off the scheduled range and truncated or hostile
payload bytes. The verdict it logs must be the one a reference computes
from the spec's definitions with Python ints and loops over every position,
worker and column; the payload bytes are written by the msgpack writer of
the producer's reference test, from the msgpack spec.

Each test's docstring names the requirement and the bug it catches.
"""

import hashlib
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.test_kv_checksum_producer_payload_reference import (
    mp_array,
    mp_bin,
    mp_uint,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumCarrier,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.rows import RowSegment
from vllm.distributed.kv_transfer.kv_checksum.engine.blocks import SchedulerGroup
from vllm.distributed.kv_transfer.kv_checksum.engine.records import (
    KVChecksumPendingRecord,
    PassResult,
    finalize_records,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    KVChecksumScheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    KVChecksumPayloadLimits,
    max_valid_payload_bytes,
)

pytestmark = pytest.mark.cpu

U64 = 1 << 64
MAX_LEN = 4096
REQ = "consumer-load"
OTHER = "finished-earlier"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_of(block_size: int) -> int:
    """R135: tokens per value, min(block size, 16) when that tiles the block."""
    return block_size if block_size <= 16 else math.gcd(block_size, 16)


@dataclass
class Entry:
    start: int
    keys: list[tuple[int, int]]
    rows: list[list[int]]  # rows[i][column]


@dataclass
class Case:
    """One load: the consumer's groups and workers, what each reported and
    the producer's payload bytes (None: none received)."""

    block_sizes: dict[int, int]
    workers: list[tuple[int, int]]
    local: int
    tokens: int
    entries: dict[tuple[int, int], dict[int, Entry]] = field(default_factory=dict)
    skipped: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    fingerprints: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    reporting: list[tuple[int, int]] = field(default_factory=list)
    payload: bytes | None = None
    # The payload's fields as written, for the reference's validity check.
    fields: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Random loads.


def payload_bytes(version: int, tp: int, tokens: int, groups: list) -> bytes:
    """[version, blake2b-8 LE(body), bin(body)] from the msgpack spec (R136)."""
    body = mp_array(
        [
            mp_uint(tp),
            mp_uint(tokens),
            mp_array(
                [mp_array([mp_uint(v) for v in g[:4]] + [mp_bin(g[4])]) for g in groups]
            ),
        ]
    )
    digest = int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")
    return mp_array([mp_uint(version), mp_uint(digest), mp_bin(body)])


def split(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` as `parts` random uint64 addends (mod 2^64)."""
    values = [rng.getrandbits(64) for _ in range(parts - 1)]
    return values + [(total - sum(values)) % U64]


def random_case(rng: random.Random) -> Case:
    """A consistent load (the producer's chunks sum the consumer's), then
    some of its parts broken at random."""
    pp, tp = rng.choice([1, 1, 2]), rng.choice([1, 2, 2, 4])
    workers = [(p, t) for p in range(pp) for t in range(tp)]
    sizes = {g: rng.choice([8, 16, 16, 32, 64]) for g in range(rng.randint(1, 3))}
    local = 8 * rng.choice([0, 0, 0, rng.randint(1, 12)])
    tokens = local + rng.randint(1, 400)
    producer_tokens = tokens
    if rng.random() < 0.15:
        producer_tokens = max(1, tokens + rng.randint(-40, 40))
    elif rng.random() < 0.05:  # a producer short of the loaded blocks
        producer_tokens = rng.randint(1, max(1, local))
    case = Case(sizes, workers, local, tokens)
    stage_fp = {p: {g: rng.getrandbits(64) for g in sizes} for p in range(pp)}
    for key in workers:
        fps = dict(stage_fp[key[0]])
        if key[1] > 0 and rng.random() < 0.1:  # only the lowest TP rank counts
            fps = {g: rng.getrandbits(64) for g in sizes}
        case.fingerprints[key] = fps
        case.entries[key] = {}
        case.skipped[key] = tuple(g for g in sizes if rng.random() < 0.015)
    whole_fp = {g: sum(stage_fp[p][g] for p in range(pp)) % U64 for g in sizes}
    groups = []
    for g, bs in sizes.items():
        chunk = chunk_of(bs)
        per_block = bs // chunk
        first = (local // bs) * per_block
        count = (cdiv(tokens, bs) - local // bs) * per_block
        limit = max(tokens, producer_tokens)
        span = cdiv(limit, chunk) + 8
        truth = [rng.getrandbits(64) if p * chunk < limit else 0 for p in range(span)]
        keys = rng.choice([[(1, 0)], [(2, 0), (2, 1)], [(1, 0), (2, 0), (2, 1)]])
        # Per replica key the column's total: every check (one key of each
        # replica count) sums to the truth (R91).
        ones = [rng.getrandbits(64) for _ in range(span)]
        rest = [(t - o) % U64 for t, o in zip(truth, ones)]
        totals = {
            1: ones if len(keys) == 3 else truth,
            2: rest if len(keys) == 3 else truth,
        }
        parts = {
            (p, c): split(rng, totals[key[0]][p], len(workers))
            for p in range(first, first + count)
            for c, key in enumerate(keys)
        }
        for i, key in enumerate(workers):
            if rng.random() < 0.015:
                continue  # this worker does not report the group
            rows = [
                [parts[(p, c)][i] for c in range(len(keys))]
                for p in range(first, first + count)
            ]
            entry = Entry(first, list(keys), rows)
            if len(keys) > 1 and rng.random() < 0.05:  # a replica key missing
                entry.keys, entry.rows = keys[:-1], [r[:-1] for r in rows]
            if rows and rng.random() < 0.1:  # a corrupted value
                r = rng.randrange(len(rows))
                if entry.rows[r]:
                    entry.rows[r][rng.randrange(len(entry.rows[r]))] ^= 1 << 9
            off = rng.random()
            if off < 0.015:  # positions off the scheduled range
                entry.start += 1
            elif off < 0.03:  # a row too many (an earlier prefill's range)
                entry.rows.append([rng.getrandbits(64) for _ in entry.keys])
            case.entries[key][g] = entry
        if rng.random() < 0.06:
            continue  # the producer did not send the group
        p_chunk = 16 if chunk == 8 and rng.random() < 0.5 else chunk
        if rng.random() < 0.03:
            p_chunk = 24  # tiles no consumer chunk (BLOCK_SIZES)
        m = max(1, p_chunk // chunk)
        end = cdiv(producer_tokens, p_chunk)
        values = [sum(truth[q * m : q * m + m]) % U64 for q in range(end)]
        fp = whole_fp[g] if rng.random() > 0.08 else rng.getrandbits(64)
        raw = b"".join(v.to_bytes(8, "little") for v in values)
        groups.append([g, fp, p_chunk, 0, raw])
    case.reporting = [k for k in workers if rng.random() > 0.05]
    fields = {"version": 2, "tp": tp, "tokens": producer_tokens, "groups": groups}
    hostile = rng.random()
    if hostile < 0.12 and groups:
        _make_hostile(rng, fields, len(sizes))
    case.fields = fields
    data = payload_bytes(fields["version"], fields["tp"], fields["tokens"], groups)
    if rng.random() < 0.05:
        data = data[: rng.randrange(len(data))]  # cut short
        case.fields = {"truncated": True}
    if rng.random() < 0.03:
        data = b""
        case.fields = {"truncated": True}
    case.payload = None if rng.random() < 0.03 else data
    return case


def _make_hostile(rng: random.Random, fields: dict, num_groups: int) -> None:
    """One field out of the consumer's bounds (R79, R129, R134)."""
    group = fields["groups"][0]
    kind = rng.randrange(9)
    if kind == 0:
        fields["tokens"] = MAX_LEN + rng.choice([1, 1 << 40])
    elif kind == 1:
        group[0] = num_groups + rng.choice([0, 0, 5])  # at the bound too
    elif kind == 2:
        group[2] = 0
    elif kind == 3:
        group[2] = MAX_LEN + 1
    elif kind == 4:
        cap = cdiv(MAX_LEN, max(1, group[2])) + 1  # one value past the cap
        group[3] = max(0, cap + 1 - len(group[4]) // 8)
    elif kind == 5:
        fields["groups"].append(list(group))  # a group twice
    elif kind == 6:
        fields["tp"] = rng.choice([0, (1 << 16) + 1])
    elif kind == 7:
        fields["version"] = rng.choice([1, 3])
    else:
        group[4] = group[4] + b"\x01"  # values not a multiple of 8 bytes


# ---------------------------------------------------------------------------
# The engine under test.


def engine_verdict(case: Case) -> Any:
    """The verdict the consumer logs for the load, after a step carrying
    every reporting worker's pending record and the payload bytes."""
    limits = KVChecksumPayloadLimits(
        max_encoded_bytes=max_valid_payload_bytes(MAX_LEN, len(case.block_sizes)),
        max_groups=len(case.block_sizes),
        max_model_len=MAX_LEN,
    )
    kcs = KVChecksumScheduler(
        {
            g: SchedulerGroup(bs, holds_all_blocks=True)
            for g, bs in case.block_sizes.items()
        },
        num_workers=len(case.workers),
        tp_size=len({t for _, t in case.workers}),
        fail_closed=True,
        carrier=lambda request, receiving: KVChecksumCarrier.CONNECTOR,
        hit_sources=lambda request, n: {"p2p"},
        limits=limits,
    )
    seen: list[Any] = []
    record = kcs.log.record
    kcs.log.record = lambda r, v, b: (seen.append(v), record(r, v, b))  # type: ignore[method-assign]
    request = SimpleNamespace(
        request_id=REQ,
        kv_transfer_params={"do_remote_prefill": True},
        num_computed_tokens=case.tokens,
    )
    kcs.on_new_request(request)
    blocks = tuple(
        [
            SimpleNamespace(block_id=100 * g + i, is_null=False)
            for i in range(cdiv(case.tokens, bs))
        ]
        for g, bs in sorted(case.block_sizes.items())
    )
    kcs.add_recv(request, SimpleNamespace(blocks=blocks), case.local)
    assert kcs.build_checksum_meta() is not None
    pending = [pending_record(case, key) for key in case.reporting]
    failing = kcs.update_from_output(finalize_records(pending), [REQ])
    assert len(seen) == 1
    verdict = seen[0]
    assert (REQ in failing) == (verdict.status.value != "verified")
    return verdict


def pending_record(case: Case, key: tuple[int, int]) -> KVChecksumPendingRecord:
    """A worker's record whose values sit in one host buffer, a segment a
    group, each segment's rows led by another request's (a load finished
    earlier, not ours)."""
    results, words, at = [], [], 0
    for g, entry in sorted(case.entries[key].items()):
        width, lead = len(entry.keys), 1 + (g + key[1]) % 3
        shape = (lead + len(entry.rows), width)
        starts, counts = np.array([0, entry.start]), np.array([lead, len(entry.rows)])
        segment = RowSegment(g, 0, (OTHER, REQ), starts, counts)
        device = torch.empty(shape, dtype=torch.int64, device="meta")
        results.append(PassResult(segment, tuple(entry.keys), device, host_at=at))
        words.extend([0xDEAD] * lead * width)
        words.extend(v for row in entry.rows for v in row)
        at += shape[0] * shape[1]
    host = torch.from_numpy(np.array(words + [0], dtype=np.uint64).view(np.int64))
    received = {REQ: case.payload} if key == (0, 0) and case.payload is not None else {}
    return KVChecksumPendingRecord(
        key[0],
        key[1],
        (OTHER, REQ),
        results,
        case.skipped[key],
        dict(case.fingerprints[key]),
        received,
        host=host,
    )


# ---------------------------------------------------------------------------
# The reference verdict, from the spec's definitions.


def payload_valid(case: Case) -> bool:
    """R79, R129, R134, R136: the bytes decode and every field is in bounds."""
    f = case.fields
    if f.get("truncated") or f["version"] != 2 or not 1 <= f["tp"] <= 1 << 16:
        return False
    if f["tokens"] > MAX_LEN or len(f["groups"]) > len(case.block_sizes):
        return False
    ids = [g[0] for g in f["groups"]]
    for group_id, _, chunk, start, raw in f["groups"]:
        if group_id >= len(case.block_sizes) or not 1 <= chunk <= MAX_LEN:
            return False
        if len(raw) % 8 or start + len(raw) // 8 > cdiv(MAX_LEN, chunk) + 1:
            return False
    return len(set(ids)) == len(ids)


def chunk_sums(
    values: list[int], start: int, block: int, tokens: int, n: int
) -> tuple[int, int, dict[int, int]]:
    """R89: (first, last, sums) of `n` values a chunk; values reaching the
    last token's block pad their last chunk with zeros."""
    end = start + len(values)
    if n > 1 and end >= cdiv(tokens, block):
        values = values + [0] * (cdiv(end, n) * n - end)
        end = cdiv(end, n) * n
    first = cdiv(start, n)
    last = max(first, end // n)
    sums = {
        k: sum(values[k * n + j - start] for j in range(n)) % U64
        for k in range(first, last)
    }
    return first, last, sums


def valid_tokens(k: int, size: int, tokens: int) -> int:
    return min(max(tokens - k * size, 0), size)


def reference_group(
    case: Case, g: int, producer: list | None, producer_tokens: int
) -> tuple[str, str] | list[int] | None:
    """One group (R83-R92): (reason, detail), the mismatching blocks, or None
    when not compared for no reason."""
    bs = case.block_sizes[g]
    b_d = chunk_of(bs)
    per_block = bs // b_d
    first = (case.local // bs) * per_block
    count = (cdiv(case.tokens, bs) - case.local // bs) * per_block
    reports = sorted(case.reporting)
    entries = [(k, case.entries[k][g]) for k in reports if g in case.entries[k]]
    for (pp, tp), e in entries:
        if e.start != first or len(e.rows) != count:
            return "OTHER_BLOCKS", (
                f"worker (pp {pp}, tp {tp}) reported positions "
                f"[{e.start}, {e.start + len(e.rows)}), scheduled "
                f"[{first}, {first + count})"
            )
    ours = bool(entries) and not any(g in case.skipped[k] for k in reports)
    if not ours and producer is None:
        return None
    if producer is None or not ours:
        side = "consumer" if producer is None else "producer"
        return "ONE_SIDE_ONLY", f"checksummed by the {side} only"
    lowest = {pp: min(t for p, t in reports if p == pp) for pp, _ in reports}
    fp = sum(case.fingerprints[(p, t)].get(g, 0) for p, t in lowest.items()) % U64
    if producer[1] != fp:
        return (
            "OTHER_LAYERS",
            f"producer fingerprint {producer[1]:#018x}, consumer {fp:#018x}",
        )
    b_p = producer[2]
    if max(b_d, b_p) % min(b_d, b_p):
        return "BLOCK_SIZES", f"consumer block size {b_d}, producer block size {b_p}"
    size = max(b_d, b_p)
    n_d, n_p = size // b_d, size // b_p
    if n_d > first + count + 1:
        return "BLOCK_SIZES", (
            f"producer chunks of {b_p} tokens exceed the consumer's "
            f"{first + count} blocks of {b_d}"
        )
    if first % n_d:
        return "UNALIGNED_START", (
            f"consumer position {first} of block size {b_d}, producer block size {b_p}"
        )
    totals: dict[tuple[int, int], list[int]] = {}
    for _, e in entries:
        for c, key in enumerate(e.keys):
            column = totals.setdefault(key, [0] * count)
            for i in range(count):
                column[i] = (column[i] + e.rows[i][c]) % U64
    if not totals:
        return "REPLICA_MISSING", "no replica columns"
    counts = sorted({r for r, _ in totals})
    checks = []
    for k in range(counts[-1]):
        check = [0] * count
        for r in counts:
            if (r, k % r) not in totals:
                return "REPLICA_MISSING", f"replica key {(r, k % r)} missing"
            check = [(a + b) % U64 for a, b in zip(check, totals[(r, k % r)])]
        checks.append(check)
    raw = producer[4]
    theirs_values = [
        int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)
    ]
    f_t, l_t, theirs = chunk_sums(theirs_values, producer[3], b_p, producer_tokens, n_p)
    ours_sums = [chunk_sums(c, first, b_d, case.tokens, n_d) for c in checks]
    f_o, l_o = ours_sums[0][0], ours_sums[0][1]
    compared = [
        k
        for k in range(max(f_o, f_t), min(l_o, l_t))
        if valid_tokens(k, size, case.tokens) == valid_tokens(k, size, producer_tokens)
    ]
    if not compared:
        return "NO_COMMON_BLOCK", (
            f"consumer chunks [{f_o}, {l_o}), producer chunks [{f_t}, {l_t}) "
            f"of {size} tokens"
        )
    bad = [k for k in compared if any(s[2][k] != theirs[k] for s in ours_sums)]
    positions = [
        k * n_d + j for k in bad for j in range(n_d) if k * n_d + j < first + count
    ]
    return sorted({p // per_block for p in positions})


def reference_verdict(case: Case) -> tuple[str, list[tuple[str, str]], dict]:
    """R80-R93: (status, reasons with details, mismatching blocks per group);
    an invalid payload's detail is only checked for its prefix."""
    if len(case.reporting) < len(case.workers):
        detail = f"{len(case.reporting)} of {len(case.workers)} workers reported"
        return "unverified", [("NOT_ALL_WORKERS", detail)], {}
    if (0, 0) not in case.reporting or case.payload is None:
        return "unverified", [("NO_CHECKSUMS", "")], {}
    if not payload_valid(case):
        return "unverified", [("INVALID_CHECKSUMS", "invalid KV checksums")], {}
    sent = {g[0]: g for g in case.fields["groups"]}
    reasons, mismatches, compared = [], {}, 0
    for g in sorted(case.block_sizes):
        out = reference_group(case, g, sent.get(g), case.fields["tokens"])
        if isinstance(out, tuple):
            reasons.append((out[0], f"group {g}: {out[1]}"))
        elif isinstance(out, list):
            compared += 1
            if out:
                mismatches[g] = out
    if mismatches:
        return "mismatch", reasons, mismatches
    if not compared and not reasons:
        reasons.append(("NO_LOADED_GROUP", "no group was compared"))
    return ("unverified" if reasons else "verified"), reasons, mismatches


def observed(verdict: Any) -> tuple[str, list[tuple[str, str]], dict]:
    """The engine's verdict in the reference's terms."""
    reasons = []
    for reason, detail in verdict.reasons:
        if reason.name == "INVALID_CHECKSUMS" and "unsupported version" in detail:
            detail = "invalid KV checksums"  # another version: invalid too
        elif reason.name == "INVALID_CHECKSUMS":
            assert detail.startswith("invalid KV checksums"), detail
            detail = "invalid KV checksums"
        reasons.append((reason.name, detail))
    return verdict.status.value, reasons, dict(verdict.mismatches)


# ---------------------------------------------------------------------------
# Tests.


@pytest.mark.parametrize("seed", range(6))
def test_random_loads_match_the_reference(seed: int) -> None:
    """R72, R80-R93, R135: over random loads (PP and TP workers, replica
    keys, prefix hits, chunk sizes 8 against 16, token counts that differ)
    the consumer's verdict, reasons with their details and mismatching
    blocks are the reference's. Bugs caught: a comparison that skips a
    replica check or a worker's column (a corrupted copy verified), chunk
    sums off by one chunk at the padded end, mismatches reported as chunks
    instead of blocks, a group's reason or detail lost or reordered, a
    group some worker skipped still compared, an entry with a row too many
    taken for the scheduled range, token counts that differ ignored, or a
    record's rows read from the wrong offset of its segment (the rows of the
    request before ours)."""
    rng = random.Random(1000 + seed)
    statuses: dict[str, int] = {}
    for _ in range(60):
        case = random_case(rng)
        want = reference_verdict(case)
        assert observed(engine_verdict(case)) == want, case
        statuses[want[0]] = statuses.get(want[0], 0) + 1
    assert len(statuses) == 3, statuses  # verified, mismatch and unverified


def test_hostile_and_truncated_payloads_are_unverified_not_raised() -> None:
    """R79, R129, R134, R136: payload bytes cut short, emptied, of another
    version, with a field out of the consumer's bounds (tokens or chunk
    tokens past max_model_len, a group id past its groups, a group twice,
    a TP size of 0 or past 2^16, values past the positions cap or not a
    multiple of 8 bytes) leave the load unverified with INVALID_CHECKSUMS,
    never an exception; a payload in bounds is still compared. Bugs caught:
    a fast check of decoded fields that lets an out-of-bounds field through
    (the load compared or mismatched instead), or one that rejects a valid
    payload (unverified instead of verified)."""
    rng = random.Random(7)
    kinds: dict[bool, int] = {}
    for _ in range(120):
        case = random_case(rng)
        case.reporting = list(case.workers)
        if case.payload is None:
            continue
        if rng.random() < 0.5 and case.fields.get("groups"):
            _make_hostile(rng, case.fields, len(case.block_sizes))
            f = case.fields
            case.payload = payload_bytes(
                f["version"], f["tp"], f["tokens"], f["groups"]
            )
        want = reference_verdict(case)
        assert observed(engine_verdict(case)) == want, case
        valid = payload_valid(case)
        kinds[valid] = kinds.get(valid, 0) + 1
        if not valid:
            assert want[1] == [("INVALID_CHECKSUMS", "invalid KV checksums")]
    assert kinds.get(True, 0) > 10 and kinds.get(False, 0) > 10, kinds


def test_every_worker_and_fingerprint_counts() -> None:
    """R80, R82, R87: a worker's missing record leaves the load unverified
    ("k of W workers reported"); a fingerprint other than the sum over PP
    stages of each stage's lowest TP rank makes the group OTHER_LAYERS; the
    intact load verifies. Bugs caught: fingerprints summed over every TP
    rank or taken from the first reporting worker instead of the lowest
    rank, or a verdict reached before every worker reported."""
    rng = random.Random(11)
    checked = 0
    while checked < 20:
        case = random_case(rng)
        if len(case.workers) < 2 or case.payload is None or not payload_valid(case):
            continue
        case.reporting = list(case.workers)
        for key in case.workers:
            case.skipped[key] = ()
        want = reference_verdict(case)
        assert observed(engine_verdict(case)) == want, case
        case.reporting = case.workers[1:] if checked % 2 else case.workers[:-1]
        want = reference_verdict(case)
        assert want[1][0][0] == "NOT_ALL_WORKERS"
        assert observed(engine_verdict(case)) == want, case
        case.reporting = list(case.workers)
        for key in case.workers:  # one TP rank's fingerprints change
            if key[1] == 1:
                case.fingerprints[key] = {g: 0 for g in case.block_sizes}
        assert observed(engine_verdict(case)) == reference_verdict(case), case
        checked += 1
