# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hostile and corrupted payloads on the consumer's decode and verify path
(SPEC R79, R129, R134, R136).

The consumer is a real `KVChecksumScheduler`, built by
`KVChecksumScheduler.create` from a vLLM `KVCacheConfig` as the plugin builds
it (two groups: full attention and a 32-token sliding window, 16-token blocks,
max_model_len 1024, two TP workers, fail-closed so that `update_from_output`
names every load that did not verify). Each load goes through the scheduler's
own entry points: `on_new_request`, `add_recv` (which decodes the
kv_transfer_params value) and `update_from_output` with the workers' records
(which verifies). The workers' checksums are the truth: per group a random
uint64 per token, summed per block and split randomly over the two workers.
One SimEngine test runs hostile geometry through vLLM's real `Scheduler` and
the plugin's hooks too.

Memory is bounded with tracemalloc (peak allocation of one scheduler call
below `PEAK_LIMIT`). Time is never asserted (speed lives in the benchmarks).

Environment: ``KV_CHECKSUM_FULL=1`` runs the full counts (at least 100,000
fuzz cases instead of a few thousand) and prints a summary line per test
(cases, verdict counts, max peak memory, max and mean time per load); run
with ``-s`` to see it, e.g.
``KV_CHECKSUM_FULL=1 pytest -s tests/v1/kv_connector/unit/test_kv_checksum_hostile.py``.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import logging
import os
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from tests.v1.kv_connector.unit.kv_checksum_helpers import make_kv_cache_config
from tests.v1.kv_connector.unit.kv_checksum_pd import (
    SideConfig,
    SimEngine,
    consume,
    produce,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumBlocks,
    KVChecksumCarrier,
    KVChecksumGroup,
    KVChecksumRecord,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.scheduler import (
    P2P_SOURCE,
    KVChecksumScheduler,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    DEFAULT_MAX_ENCODED_BYTES,
    KVChecksumPayload,
    KVChecksumPayloadGroup,
)
from vllm.distributed.kv_transfer.kv_checksum.wire.verification import (
    KVChecksumStatus,
    UnverifiedReason,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import SlidingWindowSpec

pytestmark = pytest.mark.cpu

FULL = os.environ.get("KV_CHECKSUM_FULL", "") == "1"
FUZZ_CASES = 100_000 if FULL else 3_000

U64_MAX = 2**64 - 1
MAX_MODEL_LEN = 1024
NUM_TOKENS = 60
BLOCK_SIZE = 16
WORKERS = ((0, 0), (0, 1))  # (pp_rank, tp_rank): TP 2
PEAK_LIMIT = 8 * 1024 * 1024
INVALID = UnverifiedReason.INVALID_CHECKSUMS.value
INTERNAL = UnverifiedReason.INTERNAL_ERROR.value
HASH_MISMATCH = "body hash does not match"


def encode(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def blake(body: bytes) -> int:
    """R136's body hash, computed here without the package."""
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


def envelope_bytes(body: bytes) -> bytes:
    """A version 2 envelope around raw body bytes, correctly hashed."""
    return encode([2, blake(body), body])


def envelope(body_obj: object) -> bytes:
    return envelope_bytes(encode(body_obj))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_outcome(decode: Callable[[], KVChecksumPayload]) -> Any:
    """The payload, or the ValueError message; anything else fails the test."""
    try:
        return decode()
    except ValueError as exc:
        assert type(exc) is ValueError, repr(exc)
        message = str(exc)
        assert message.startswith("invalid KV checksums: ") or message.startswith(
            "unsupported version "
        ), message
        return message


# --------------------------------------------------------------------------
# Memory and time of scheduler calls
# --------------------------------------------------------------------------


@dataclass
class Meter:
    """Peak traced allocation and time of the scheduler calls it wraps."""

    max_peak: int = 0
    max_seconds: float = 0.0
    total_seconds: float = 0.0
    loads: int = 0

    def call(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, int, float]:
        """fn(*args), its allocation peak above the memory in use, its time."""
        assert tracemalloc.is_tracing()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        begin = time.perf_counter()
        result = fn(*args)
        seconds = time.perf_counter() - begin
        peak = tracemalloc.get_traced_memory()[1] - base
        self.max_peak = max(self.max_peak, peak)
        return result, peak, seconds

    def add_load(self, seconds: float) -> None:
        self.loads += 1
        self.total_seconds += seconds
        self.max_seconds = max(self.max_seconds, seconds)

    def summary(self) -> str:
        mean = self.total_seconds / max(1, self.loads)
        return (
            f"max peak memory {self.max_peak / 1024:.1f} KiB, max time per load "
            f"{self.max_seconds * 1e3:.3f} ms, mean {mean * 1e3:.3f} ms"
        )


@pytest.fixture
def traced() -> Iterator[None]:
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        yield
    finally:
        if started:
            tracemalloc.stop()


# --------------------------------------------------------------------------
# The consumer: a real KVChecksumScheduler and the truth its workers report
# --------------------------------------------------------------------------


@dataclass
class Outcome:
    """One load's verdict as the scheduler counted it."""

    failing: bool  # update_from_output named it (fail-closed: not verified)
    status: str
    reasons: set[str]
    scheduled: KVChecksumBlocks
    peak: int
    seconds: float


def random_split(
    rng: np.random.Generator, total: np.ndarray, parts: int
) -> list[np.ndarray]:
    """`parts` random uint64 vectors summing to `total` mod 2^64."""
    pieces = [
        rng.integers(0, 1 << 64, total.shape, dtype=np.uint64) for _ in range(parts - 1)
    ]
    with np.errstate(over="ignore"):
        last = total.copy()
        for piece in pieces:
            last -= piece
    return [*pieces, last]


class Consumer:
    """A consumer engine's checksum scheduler, as the plugin creates it, with
    random per-token truths per group and fingerprints its workers report."""

    def __init__(self, seed: int = 0, meter: Meter | None = None) -> None:
        config = make_kv_cache_config(None, groups="both", block_size=BLOCK_SIZE)
        self.scheduler = KVChecksumScheduler.create(
            config,
            num_workers=len(WORKERS),
            tp_size=2,
            fail_closed=True,
            carrier=lambda request, receiving: KVChecksumCarrier.KV_TRANSFER_PARAMS,
            hit_sources=lambda request, num_tokens: {P2P_SOURCE},
            max_model_len=MAX_MODEL_LEN,
            max_payload_bytes=DEFAULT_MAX_ENCODED_BYTES,
        )
        self.group_ids = list(config.transfer_group_ids)
        assert self.group_ids == [0, 1]
        self.sliding = {
            g
            for g in self.group_ids
            if isinstance(config.kv_cache_groups[g].kv_cache_spec, SlidingWindowSpec)
        }
        self.rng = np.random.default_rng(seed)
        self.prefix = {}
        for g in self.group_ids:
            tokens = self.rng.integers(0, 1 << 64, NUM_TOKENS, dtype=np.uint64)
            self.prefix[g] = np.concatenate(
                [np.zeros(1, np.uint64), np.cumsum(tokens, dtype=np.uint64)]
            )
        self.fingerprints = {
            g: int(self.rng.integers(0, 1 << 64, dtype=np.uint64))
            for g in self.group_ids
        }
        self.meter = meter or Meter()
        self._splits: dict[tuple[int, int, int], list[np.ndarray]] = {}
        self._count = 0

    def truth(self, group: int, chunk: int, first: int, count: int) -> np.ndarray:
        """The true checksums of chunks [first, first + count) of `chunk` tokens
        (zero past the last token)."""
        # Python ints: exact for any declared geometry (`count` is small).
        ks = range(first, first + count)
        lo = np.array([min(k * chunk, NUM_TOKENS) for k in ks], dtype=np.int64)
        hi = np.array([min((k + 1) * chunk, NUM_TOKENS) for k in ks], dtype=np.int64)
        with np.errstate(over="ignore"):
            return self.prefix[group][hi] - self.prefix[group][lo]

    def body(self, chunk: int = 16) -> list:
        """The body a fault-free producer with `chunk`-token chunks sends:
        every chunk holding a token, the sliding group from token 16 on (the
        last three 16-token blocks of the window)."""
        groups = []
        for g in self.group_ids:
            start = 16 // chunk if g in self.sliding else 0
            count = -(-NUM_TOKENS // chunk) - start
            values = self.truth(g, chunk, start, count).astype("<u8").tobytes()
            groups.append([g, self.fingerprints[g], chunk, start, values])
        return [2, NUM_TOKENS, groups]

    def _records(self, req_id: str, scheduled: KVChecksumBlocks) -> list:
        per_worker: dict[tuple[int, int], dict[int, KVChecksumGroup]] = {
            key: {} for key in WORKERS
        }
        for g, (start, ids) in scheduled.groups.items():
            key = (g, start, len(ids))
            if key not in self._splits:
                truth = self.truth(g, BLOCK_SIZE, start, len(ids))
                self._splits[key] = random_split(self.rng, truth, len(WORKERS))
            for worker, part in zip(WORKERS, self._splits[key], strict=True):
                per_worker[worker][g] = KVChecksumGroup(start, ((1, 0),), part[:, None])
        return [
            KVChecksumRecord(
                pp_rank=pp,
                tp_rank=tp,
                checksums={req_id: per_worker[(pp, tp)]},
                fingerprints=dict(self.fingerprints),
            )
            for pp, tp in WORKERS
        ]

    def load(self, value: object, local: int = 0) -> Outcome:
        """One P/D load of NUM_TOKENS tokens (`local` of them a local prefix
        hit) whose kv_transfer_params carry `value` as "kv_checksums"."""
        self._count += 1
        req_id = f"load-{self._count}"
        request = SimpleNamespace(
            request_id=req_id,
            kv_transfer_params={
                "do_remote_prefill": True,
                KV_TRANSFER_PARAMS_KEY: value,
            },
            num_computed_tokens=NUM_TOKENS,
        )
        num_blocks = -(-NUM_TOKENS // BLOCK_SIZE)
        blocks = KVCacheBlocks(
            tuple(
                [KVCacheBlock(1 + g * num_blocks + i) for i in range(num_blocks)]
                for g in self.group_ids
            )
        )
        scheduler = self.scheduler
        scheduler.on_new_request(request)
        _, peak_recv, t_recv = self.meter.call(
            scheduler.add_recv, request, blocks, local
        )
        meta = scheduler.build_checksum_meta()
        assert meta is not None and req_id in meta.reqs_to_recv
        scheduled = meta.reqs_to_recv[req_id]
        records = self._records(req_id, scheduled)
        failing, peak_verify, t_verify = self.meter.call(
            scheduler.update_from_output, records, [req_id]
        )
        self.meter.add_load(t_recv + t_verify)
        stats = scheduler.stats.take()
        assert sum(stats.loads.values()) == 1, stats
        (status,) = stats.loads
        return Outcome(
            failing=req_id in failing,
            status=status,
            reasons=set(stats.unverified_reasons),
            scheduled=scheduled,
            peak=max(peak_recv, peak_verify),
            seconds=t_recv + t_verify,
        )

    def differs(self, payload: KVChecksumPayload, scheduled: KVChecksumBlocks) -> str:
        """Why `payload` disagrees with the truth over the loaded tokens ("" if
        it does not): another fingerprint of a loaded group, or a value of a
        chunk holding a loaded token that is not that chunk's true checksum."""
        for group in payload.groups:
            if group.group_id not in scheduled.groups:
                continue
            start, ids = scheduled.groups[group.group_id]
            lo = start * BLOCK_SIZE
            hi = min((start + len(ids)) * BLOCK_SIZE, scheduled.num_tokens)
            if group.fingerprint != self.fingerprints[group.group_id]:
                return f"group {group.group_id} fingerprint"
            c = group.chunk_tokens
            first = max(group.start, lo // c)
            stop = min(group.start + len(group.values), -(-hi // c))
            if stop <= first:
                continue
            got = group.values[first - group.start : stop - group.start]
            want = self.truth(group.group_id, c, first, stop - first)
            if not np.array_equal(got, want):
                return f"group {group.group_id} values"
        return ""


def check_load(consumer: Consumer, data: bytes | str, local: int = 0) -> Outcome:
    """Decode `data` with the consumer's limits and run it as a load; check the
    invariants every hostile input must keep:

    - decoding gives a payload or ValueError (R79), never another exception;
    - the scheduler raises nothing and needs no last-resort guard (R134);
    - an undecodable payload ends "the producer's checksums are invalid";
    - a payload that disagrees with the truth never verifies (R136, R84-R93);
    - fail-closed fails exactly the loads that did not verify (R95);
    - one scheduler call allocates at most PEAK_LIMIT (R129, R134).
    """
    limits = consumer.scheduler.limits
    if isinstance(data, bytes):
        decoded = decode_outcome(lambda: KVChecksumPayload.from_bytes(data, limits))
        value: object = b64(data)
    else:
        decoded = decode_outcome(lambda: KVChecksumPayload.from_base64(data, limits))
        value = data
    outcome = consumer.load(value, local)
    assert INTERNAL not in outcome.reasons, (outcome, decoded)
    assert outcome.failing == (outcome.status != KVChecksumStatus.VERIFIED.value)
    if isinstance(decoded, str):
        assert outcome.status == KVChecksumStatus.UNVERIFIED.value, decoded
        assert INVALID in outcome.reasons, (outcome, decoded)
    else:
        assert INVALID not in outcome.reasons, outcome
        why = consumer.differs(decoded, outcome.scheduled)
        if why:
            assert outcome.status != KVChecksumStatus.VERIFIED.value, (why, decoded)
    assert outcome.peak < PEAK_LIMIT, outcome
    return outcome


@pytest.fixture
def consumer(traced: None) -> Consumer:
    return Consumer()


# --------------------------------------------------------------------------
# The harness itself
# --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [16, 8, 4, 1])
@pytest.mark.parametrize("local", [0, 16])
def test_fault_free_payload_verifies(consumer: Consumer, chunk: int, local: int):
    """R135: the truth's payload verifies for producer chunks of 16, 8, 4 and 1
    tokens, with and without a local prefix hit; one value off by one is a
    mismatch.

    Catches a harness whose truth, reports or oracle are wrong, which would
    make the fuzz below vacuous (every load unverified).
    """
    body = consumer.body(chunk)
    outcome = check_load(consumer, envelope(body), local)
    assert outcome.status == "verified", outcome
    assert (
        consumer.differs(
            KVChecksumPayload.from_bytes(envelope(body)), outcome.scheduled
        )
        == ""
    )
    values = bytearray(body[2][0][4])
    values[-8] ^= 1  # the last chunk of group 0, which the consumer loaded
    body[2][0][4] = bytes(values)
    assert check_load(consumer, envelope(body), local).status == "mismatch"


# --------------------------------------------------------------------------
# R136: the body hash
# --------------------------------------------------------------------------


def two_group_payload() -> KVChecksumPayload:
    groups = [
        KVChecksumPayloadGroup(
            0, 2**64 - 5, 16, 0, np.arange(1, 11, dtype=np.uint64) * 2**60
        ),
        KVChecksumPayloadGroup(
            1, 12345678901234, 16, 1, np.arange(1, 10, dtype=np.uint64) * 2**59
        ),
    ]
    return KVChecksumPayload(2, 2, 300, groups)


def test_every_single_bit_flip_is_rejected():
    """R136: each of the 1608 single-bit flips of a 201-byte payload with two
    groups decodes to ValueError (invalid or unsupported version), never to a
    payload; a flip inside the hash or the body is reported as a body hash
    mismatch.

    Catches a payload without a hash check (flips in values, start, chunk
    tokens or num_tokens decode to another valid payload) and a hash checked
    after the body is decoded and validated (a flip making the body malformed
    or out of range would then be reported as that, not as a hash mismatch).
    """
    data = two_group_payload().to_bytes()
    assert len(data) == 201
    body = msgspec.msgpack.decode(data)[2]
    body_at = data.index(body)
    hash_at = 2  # after the array header and the version
    assert data[:hash_at] == b"\x93\x02"
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ValueError) as info:
            KVChecksumPayload.from_bytes(bytes(flipped))
        message = str(info.value)
        assert type(info.value) is ValueError
        assert message.startswith("invalid KV checksums: ") or message.startswith(
            "unsupported version "
        ), (bit, message)
        in_hash = hash_at + 1 <= bit // 8 < body_at - 2  # the 8 hash bytes
        if in_hash or bit // 8 >= body_at:
            assert HASH_MISMATCH in message, (bit, message)


def test_changed_num_tokens_with_the_old_hash_is_invalid():
    """R136: a body whose num_tokens changed in transit, sent with the hash of
    the original body, is invalid; the same body re-hashed decodes (so only the
    hash rejects it). Also for a changed value and a changed start.

    Catches a hash over part of the body (e.g. the values only), or a decoder
    that trusts the sender's hash without recomputing it.
    """
    payload = two_group_payload()
    tp_size, num_tokens, groups = msgspec.msgpack.decode(
        msgspec.msgpack.decode(payload.to_bytes())[2]
    )
    old_hash = blake(encode([tp_size, num_tokens, groups]))
    changed_values = copy.deepcopy(groups)
    changed_values[1][4] = b"\x01" + changed_values[1][4][1:]
    changed_start = copy.deepcopy(groups)
    changed_start[0][3] = 1
    for body_obj in [
        [tp_size, num_tokens + 1, groups],
        [tp_size, num_tokens ^ 0x100, groups],
        [tp_size, num_tokens, changed_values],
        [tp_size, num_tokens, changed_start],
    ]:
        body = encode(body_obj)
        with pytest.raises(ValueError, match=HASH_MISMATCH):
            KVChecksumPayload.from_bytes(encode([2, old_hash, body]))
        KVChecksumPayload.from_bytes(envelope_bytes(body))


def test_hash_is_checked_before_the_body_is_decoded():
    """R136/R129: a body that would fail decoding (deep nesting, a group flood,
    a bad bin) with a wrong hash is reported as a hash mismatch.

    Catches decoding (and paying for) a body before its hash is checked.
    """
    for body in [
        b"\x91" * 200_000 + b"\x01",
        encode([1, 1, [[0, 0, 1, 0, b""]] * 100_000]),
        encode([1, 1, [[0, 0, 16, 0, b"\x00" * 7]]]),
    ]:
        wrong = encode([2, blake(body) ^ (1 << 63), body])
        with pytest.raises(ValueError, match=HASH_MISMATCH):
            KVChecksumPayload.from_bytes(wrong)


def test_corrupted_payload_through_the_scheduler_is_invalid(consumer: Consumer):
    """R136/R79: a fault-free payload with one bit flipped anywhere (every 7th
    bit, to keep the test short) ends "the producer's checksums are invalid"
    on the scheduler path, never verified, never a mismatch blamed on the KV.

    Catches a corrupted payload reaching verification (a false mismatch that
    fail-closed turns into a failed request, or a false match).
    """
    data = envelope(consumer.body())
    for bit in range(0, len(data) * 8, 7):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        outcome = check_load(consumer, bytes(flipped), local=bit % 2 * 16)
        assert outcome.reasons == {INVALID}, (bit, outcome)


# --------------------------------------------------------------------------
# R134: huge declared geometry
# --------------------------------------------------------------------------


def _set(group: int, index: int, value: int) -> Callable[[list], None]:
    def apply(body: list) -> None:
        body[2][group][index] = value

    return apply


def _set_top(index: int, value: int) -> Callable[[list], None]:
    def apply(body: list) -> None:
        body[index] = value

    return apply


def _all_huge(body: list) -> None:
    body[0] = 2**40
    body[1] = 2**40
    for group in body[2]:
        group[2] = 2**40
        group[3] = 2**40


HUGE_GEOMETRY: dict[str, Callable[[list], None]] = {
    **{f"chunk_tokens=2^{k}": _set(0, 2, 2**k) for k in range(12, 63)},
    "sliding chunk_tokens=2^62": _set(1, 2, 2**62),
    "start=2^62": _set(0, 3, 2**62),
    "start=2^62-1": _set(0, 3, 2**62 - 1),
    "start=2^62+1": _set(0, 3, 2**62 + 1),
    "start=2^63-1": _set(0, 3, 2**63 - 1),
    "sliding start=2^62": _set(1, 3, 2**62),
    "num_tokens=2^40": _set_top(1, 2**40),
    "num_tokens=2^63-1": _set_top(1, 2**63 - 1),
    "tp_size=2^40": _set_top(0, 2**40),
    "tp_size=2^64-1": _set_top(0, U64_MAX),
    "all=2^40": _all_huge,
}


@pytest.mark.parametrize("case", list(HUGE_GEOMETRY))
def test_huge_geometry_is_invalid_with_bounded_memory(consumer: Consumer, case: str):
    """R134/R129: a correctly hashed payload declaring chunk tokens 2^12..2^62,
    a start near 2^62, 2^40 tokens or TP size 2^40 ends unverified with "the
    producer's checksums are invalid" on the scheduler path, without an
    exception and with each scheduler call's allocation peak below 8 MiB.

    Catches a declared size that is not checked against the consumer's
    max_model_len / TP limit before verification sizes arrays or loops by it
    (a 2^40-element allocation, an int64 overflow in chunk arithmetic, or an
    exception the last-resort guard has to catch).
    """
    body = Consumer().body()  # same truth as `consumer` (seed 0)
    HUGE_GEOMETRY[case](body)
    times = []
    for local in (0, 16) * (50 if FULL else 1):
        outcome = check_load(consumer, envelope(body), local)
        assert outcome.status == "unverified" and outcome.reasons == {INVALID}
        times.append(outcome.seconds)
    if FULL:
        print(
            f"\n{case}: {len(times)} loads, {consumer.meter.summary()}, "
            f"max time per call {max(times) * 1e3:.3f} ms"
        )


BLOCK_SIZES_REASON = UnverifiedReason.BLOCK_SIZES.value


def _chunked(chunk: int) -> Callable[[list], None]:
    """A fault-free producer's body with `chunk`-token chunks in both groups."""

    def apply(body: list) -> None:
        body[:] = Consumer().body(chunk)

    return apply


def _extra_group(body: list) -> None:
    body[2].append([2, *body[2][0][1:]])  # a third group; the consumer has two


# Every size a payload declares (R134), with the reason SPEC section 12 gives
# the load: sizes that cannot belong to the consumer's model (over its
# max_model_len, its group count or the TP cap) make the payload invalid; a
# decodable chunk size that does not fit the consumer's blocks or loaded
# range is "block sizes are not multiples of each other" (R88, R134).
R134_CASES: dict[str, tuple[Callable[[list], None], str]] = {
    "chunk_tokens=24 (no multiple)": (_set(0, 2, 24), BLOCK_SIZES_REASON),
    "chunk_tokens=128 (past the loaded range)": (_chunked(128), BLOCK_SIZES_REASON),
    "chunk_tokens=1024 (past the loaded range)": (_chunked(1024), BLOCK_SIZES_REASON),
    "chunk_tokens=2048 (past max_model_len)": (_chunked(2048), INVALID),
    "chunk_tokens=0": (_set(0, 2, 0), INVALID),
    "start=70 (past max_model_len)": (_set(0, 3, 70), INVALID),
    "positions=66 (past max_model_len)": (
        _set(0, 4, b"\x00" * 8 * (MAX_MODEL_LEN // BLOCK_SIZE + 2)),
        INVALID,
    ),
    "num_tokens=1025": (_set_top(1, MAX_MODEL_LEN + 1), INVALID),
    "tp_size=2^16+1": (_set_top(0, 2**16 + 1), INVALID),
    "groups=3": (_extra_group, INVALID),
    "group_id=7": (_set(0, 0, 7), INVALID),
}


@pytest.mark.parametrize("local", [0, 16])
@pytest.mark.parametrize("case", list(R134_CASES))
def test_R134_every_declared_size_has_its_reason(
    consumer: Consumer, case: str, local: int
) -> None:
    """R134 (issue 32): each declared size out of the consumer's bounds ends
    the load unverified with its documented reason, with and without a local
    prefix hit. Catches a dropped guard whose input then ends unverified for
    another reason, e.g. the guard for a producer chunk larger than the
    consumer's loaded range (without it such a chunk reads as an unaligned
    start or sizes work by the producer's chunk)."""
    mutate, reason = R134_CASES[case]
    body = Consumer().body()  # same truth as `consumer` (seed 0)
    mutate(body)
    outcome = check_load(consumer, envelope(body), local)
    assert outcome.status == "unverified"
    assert outcome.reasons == {reason}


HUGE_VIA_VLLM = ["chunk_tokens=2^12", "chunk_tokens=2^62", "start=2^62"]
HUGE_VIA_VLLM += ["num_tokens=2^40", "tp_size=2^40"]


@pytest.mark.usefixtures("cuda_stream_stubs")
@pytest.mark.parametrize("case", HUGE_VIA_VLLM)
def test_huge_geometry_through_the_vllm_scheduler(model_dir: str, vllm_caplog, case):
    """R134: the producer's real payload with one huge declared size (re-hashed,
    so only the geometry is wrong) makes a real vLLM consumer's load unverified
    ("the producer's checksums are invalid", warned once), with no error log
    (the last-resort guard did not fire) and the request finishing normally
    under fail-open.

    Catches geometry checks that exist in the payload decoder but are bypassed
    by the limits the plugin passes (e.g. no max_model_len).
    """
    producer = SimEngine(model_dir, SideConfig(), "P")
    consumer = SimEngine(model_dir, SideConfig(), "D")
    prompt = [(7 * i + 3) % 997 + 3 for i in range(NUM_TOKENS)]
    params = produce(producer, "r", prompt)
    data = base64.b64decode(params[KV_TRANSFER_PARAMS_KEY])
    body = msgspec.msgpack.decode(msgspec.msgpack.decode(data)[2])
    HUGE_GEOMETRY[case](body)
    params[KV_TRANSFER_PARAMS_KEY] = b64(envelope(body))
    result = consume(consumer, producer, "r", prompt, params)
    assert dict(consumer.checksums.stats.loads) == {"unverified": 1}
    assert dict(consumer.checksums.stats.unverified_reasons) == {INVALID: 1}
    warnings = [
        r.getMessage()
        for r in vllm_caplog.records
        if r.levelno == logging.WARNING and "KV checksum" in r.getMessage()
    ]
    assert warnings == [f"KV checksums not verified: {INVALID}."]
    assert not [r for r in vllm_caplog.records if r.levelno >= logging.ERROR]
    assert result.finish_reason == "length"


# --------------------------------------------------------------------------
# Fuzz: mutated payloads through decode and verification
# --------------------------------------------------------------------------

SPECIAL_INTS = [
    -1,
    -(2**63),
    0,
    1,
    2,
    3,
    7,
    8,
    15,
    16,
    17,
    32,
    48,
    65,
    66,
    MAX_MODEL_LEN - 1,
    MAX_MODEL_LEN,
    MAX_MODEL_LEN + 1,
    2**12,
    2**16,
    2**16 + 1,
    2**31,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**63,
    U64_MAX,
]
WRONG_TYPES: list[object] = ["16", 16.0, None, True, False, [16], b"\x10", {"a": 1}]


@dataclass
class Mutator:
    """Random mutations of a valid payload (bytes and decoded body)."""

    rng: np.random.Generator
    kinds: Counter = field(default_factory=Counter)

    def _int(self, current: int) -> object:
        rng = self.rng
        pick = rng.integers(0, 10)
        if pick < 5:
            return SPECIAL_INTS[rng.integers(0, len(SPECIAL_INTS))]
        if pick < 7:
            return current + int(rng.choice([-2, -1, 1, 2]))
        if pick < 8:
            return 2 ** int(rng.integers(0, 64))
        if pick < 9:
            return int(rng.integers(0, 1 << 64, dtype=np.uint64))
        return WRONG_TYPES[rng.integers(0, len(WRONG_TYPES))]

    def _values(self, values: bytes, chunk: int) -> object:
        rng = self.rng
        n = len(values) // 8
        array = bytearray(values)
        pick = int(rng.integers(0, 13))
        if pick == 0 and n:  # one value changed
            at = int(rng.integers(0, n)) * 8 + int(rng.integers(0, 8))
            array[at] ^= int(rng.integers(1, 256))
            return bytes(array)
        if pick == 1 and n:  # one value + 1
            i = int(rng.integers(0, n))
            v = (int.from_bytes(array[8 * i : 8 * i + 8], "little") + 1) & U64_MAX
            array[8 * i : 8 * i + 8] = v.to_bytes(8, "little")
            return bytes(array)
        if pick == 2:
            return bytes(array[8:])  # first value dropped
        if pick == 3:
            return bytes(array[:-8])  # last value dropped
        if pick == 4:
            return bytes(array) + rng.bytes(8)  # one more value
        if pick == 5:
            return rng.bytes(8) + bytes(array)  # a value in front
        if pick == 6:
            return bytes(len(array))  # all zero
        if pick == 7:
            return bytes(array[: max(0, len(array) - int(rng.integers(1, 8)))])
        if pick == 8:
            return b""
        if pick == 9:
            return bytes(8 * int(rng.choice([66, 67, 130, 1025, 1026, 4096])))
        if pick == 10 and n >= 2 and chunk == BLOCK_SIZE:  # two values swapped
            i, j = rng.choice(n, size=2, replace=False)
            a, b = array[8 * i : 8 * i + 8], array[8 * j : 8 * j + 8]
            array[8 * i : 8 * i + 8], array[8 * j : 8 * j + 8] = b, a
            return bytes(array)
        if pick == 11:
            return bytes(array) + bytes(8 * int(rng.integers(1, 8)))  # zeros after
        return WRONG_TYPES[rng.integers(0, len(WRONG_TYPES))]

    def body(self, body: list) -> list:
        """One structured mutation of a decoded body."""
        rng = self.rng
        body = copy.deepcopy(body)
        groups = body[2]
        chunk = groups[0][2]
        pick = int(rng.integers(0, 12))
        g = int(rng.integers(0, len(groups)))
        if pick < 2:  # tp_size or num_tokens
            body[pick] = self._int(body[pick])
            self.kinds[("tp_size", "num_tokens")[pick]] += 1
        elif pick < 6:  # a group field: id, fingerprint, chunk tokens, start
            index = int(rng.integers(0, 4))
            groups[g][index] = self._int(groups[g][index])
            self.kinds[("group_id", "fingerprint", "chunk_tokens", "start")[index]] += 1
        elif pick < 8:
            groups[g][4] = self._values(groups[g][4], chunk)
            self.kinds["values"] += 1
        elif pick == 8:  # two fields of a group swapped
            i, j = rng.choice(5, size=2, replace=False)
            groups[g][i], groups[g][j] = groups[g][j], groups[g][i]
            self.kinds["swap fields"] += 1
        elif pick == 9:  # group ids swapped, or one beyond the groups
            if rng.integers(0, 2):
                groups[0][0], groups[1][0] = groups[1][0], groups[0][0]
            else:
                groups[g][0] = int(rng.choice([2, 3, 255, 2**32, 2**63]))
            self.kinds["group ids"] += 1
        elif pick == 10:  # group list: duplicated, dropped, reordered, extra
            choice = int(rng.integers(0, 5))
            if choice == 0:
                groups.append(copy.deepcopy(groups[g]))
            elif choice == 1:
                groups.pop(g)
            elif choice == 2:
                groups.reverse()
            elif choice == 3:
                groups[g].append(0)
            else:
                groups[g].pop(int(rng.integers(0, 5)))
            self.kinds["groups"] += 1
        else:  # the body's shape
            choice = int(rng.integers(0, 3))
            if choice == 0:
                body.append(0)
            elif choice == 1:
                body.pop(int(rng.integers(0, 3)))
            else:
                body[2] = groups[g]
            self.kinds["body shape"] += 1
        return body

    def mutate(self, data: bytes, body: list) -> tuple[bytes | str, bool]:
        """(mutated bytes or base64 text, whether the body hash was recomputed)."""
        rng = self.rng
        pick = int(rng.integers(0, 20))
        if pick < 3:  # 1-3 bit flips, not re-hashed
            flipped = bytearray(data)
            for bit in rng.choice(len(data) * 8, size=int(rng.integers(1, 4))):
                flipped[bit // 8] ^= 1 << (bit % 8)
            self.kinds["raw flips"] += 1
            return bytes(flipped), False
        if pick == 3:  # truncated, at a random length class
            lo, hi = [(0, 3), (3, 14), (14, len(data) - 8), (len(data) - 8, len(data))][
                int(rng.integers(0, 4))
            ]
            self.kinds["raw truncation"] += 1
            return data[: int(rng.integers(lo, hi))], False
        if pick == 4:  # envelope fields
            version, hash_value, raw = msgspec.msgpack.decode(data)
            choice = int(rng.integers(0, 4))
            if choice == 0:
                version = int(rng.choice([0, 1, 3, 255, -1]))
            elif choice == 1:
                hash_value = (hash_value + int(rng.choice([1, -1, 2**63]))) & U64_MAX
            elif choice == 2:
                raw = raw + b"\x00"
            else:
                return encode([version, hash_value, raw, 0]), False
            self.kinds["envelope"] += 1
            return encode([version, hash_value, raw]), False
        if pick == 5:  # the base64 text
            text = b64(data)
            at = int(rng.integers(0, len(text)))
            self.kinds["base64"] += 1
            return text[:at] + str(rng.choice(list("A=/+ \n*"))) + text[at + 1 :], False
        raw_body = encode(body)
        if pick < 8:  # one bit flipped in the body, re-hashed
            flipped = bytearray(raw_body)
            bit = int(rng.integers(0, len(raw_body) * 8))
            flipped[bit // 8] ^= 1 << (bit % 8)
            self.kinds["body flip"] += 1
            return envelope_bytes(bytes(flipped)), True
        if pick == 8:  # the body truncated, re-hashed
            self.kinds["body truncation"] += 1
            return envelope_bytes(raw_body[: int(rng.integers(0, len(raw_body)))]), True
        return envelope(self.body(body)), True


def same_bytes(data: bytes | str) -> bytes | None:
    """The bytes `data` stands for: itself, or its strict base64 decoding.

    Strict base64 accepts nonzero pad bits, so a changed last character can
    stand for the same bytes (and the same payload).
    """
    if isinstance(data, bytes):
        return data
    try:
        return binascii.a2b_base64(data, strict_mode=True)
    except ValueError:
        return None


def test_fuzz_mutated_payloads_through_the_scheduler(consumer: Consumer):
    """R79/R129/R134/R136: mutated fault-free payloads (bit flips, truncation
    at every length class, envelope and base64 damage; and, re-hashed so the
    body decoder and the geometry checks are reached, body bit flips and
    truncation, out-of-range numbers (negative, 2^63, 2^64 - 1, huge chunk
    tokens, start and num_tokens), wrong types, swapped fields, group ids
    beyond the groups, changed, missing or extra values) each run as a load.

    Every case keeps `check_load`'s invariants: no exception (and no
    last-resort guard), undecodable means "invalid", never verified when the
    payload disagrees with the truth over the loaded tokens, fail-closed fails
    exactly the unverified loads, and each scheduler call allocates below
    8 MiB; mutations that keep the old hash are always invalid. Catches any
    mutation that reaches an unchecked code path: an exception, a huge
    allocation, or a false "verified".
    """
    rng = np.random.default_rng(1234)
    mutator = Mutator(rng)
    bases = []
    for chunk in (16, 8):
        body = consumer.body(chunk)
        bases.append((envelope(body), body))
    verdicts: Counter = Counter()
    for case in range(FUZZ_CASES):
        data, body = bases[case % len(bases)]
        mutated, rehashed = mutator.mutate(data, body)
        local = int(rng.choice([0, 16]))
        outcome = check_load(consumer, mutated, local)
        if not rehashed and same_bytes(mutated) != data:
            assert outcome.reasons == {INVALID}, (mutated, outcome)
        verdicts[outcome.status] += 1
    # The fuzz reached every verdict: the mutations are not all rejected early.
    assert set(verdicts) == {"verified", "mismatch", "unverified"}, verdicts
    assert len(mutator.kinds) >= 15, mutator.kinds
    summary = (
        f"fuzz: {FUZZ_CASES} cases, verdicts {dict(verdicts)}, "
        f"{consumer.meter.summary()}"
    )
    if FULL:
        print(f"\n{summary}\nmutations: {dict(mutator.kinds)}")
