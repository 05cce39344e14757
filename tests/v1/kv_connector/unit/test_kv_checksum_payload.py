# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests of the KV checksum payload and its wire format (SPEC R76-R81, R129,
R132, R134-R136).

Version 2 bytes are the envelope ``[2, body_hash, body]``, ``body`` a msgpack
bin of ``[tp_size, num_tokens, [[group_id, fingerprint, chunk_tokens, start,
values]]]``. Tests of malformed bodies wrap them in a correctly hashed envelope
(`envelope`, hashing with hashlib here, independent of the package) so that
they reach the body decoder rather than stopping at the hash check.

Each test's docstring names the requirement and the bug it catches.
"""

import base64
import hashlib
import io
import math
import re
import runpy
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.distributed.kv_transfer.kv_checksum.__main__ import main
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    DEFAULT_MAX_ENCODED_BYTES,
    MAX_TP_SIZE,
    KVChecksumPayload,
    KVChecksumPayloadGroup,
    KVChecksumPayloadLimits,
    decode_kv_checksums_param,
    inspect_payload,
)

pytestmark = pytest.mark.cpu

U64_MAX = 2**64 - 1
INVALID = "invalid KV checksums"
HASH_MISMATCH = "body hash does not match"


def u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def encode(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def blake(body: bytes) -> int:
    """The body hash as R136 defines it, computed without the package."""
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


def envelope_bytes(body: bytes, version: int = 2, hash_value: int | None = None):
    """[version, hash, body] around raw body bytes, hashed correctly by default."""
    return encode([version, blake(body) if hash_value is None else hash_value, body])


def envelope(body_obj: object) -> bytes:
    """A correctly hashed version 2 envelope around msgpack of `body_obj`."""
    return envelope_bytes(encode(body_obj))


def msgpack_uint(value: int) -> bytes:
    """A non-negative int in its shortest msgpack form, from the msgpack spec."""
    if value < 0x80:
        return bytes([value])
    for head, size in [(0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)]:
        if value < 1 << (8 * size):
            return bytes([head]) + value.to_bytes(size, "big")
    raise ValueError(value)


def tiny_payload() -> KVChecksumPayload:
    """Two groups covering the int and bin encodings the layout test spells out."""
    return KVChecksumPayload(
        version=2,
        tp_size=2,
        num_tokens=300,
        groups=[
            KVChecksumPayloadGroup(3, U64_MAX, 16, 1, u64(1, 2**63)),
            KVChecksumPayloadGroup(0, 0x1234, 200, 0, u64()),
        ],
    )


def padded_payload() -> KVChecksumPayload:
    """40 bytes: one past a 3-byte quantum, so base64 ends in "=="."""
    return KVChecksumPayload(
        2, 1, 16, [KVChecksumPayloadGroup(0, U64_MAX, 16, 0, u64(U64_MAX))]
    )


def valid_bytes() -> bytes:
    return tiny_payload().to_bytes()


def valid_body() -> bytes:
    """The body bin of `valid_bytes()`."""
    version, _, body = msgspec.msgpack.decode(valid_bytes())
    assert version == 2
    return body


def assert_invalid(data: object, *, base64_text: bool = False, **limits) -> str:
    """Decoding `data` raises exactly ValueError("invalid KV checksums: ...")."""
    decode: Callable[..., KVChecksumPayload] = KVChecksumPayload.from_bytes
    if base64_text:
        decode = KVChecksumPayload.from_base64
    with pytest.raises(ValueError, match=f"^{INVALID}: ") as info:
        decode(data, KVChecksumPayloadLimits(**limits))
    assert type(info.value) is ValueError
    return str(info.value)


def assert_body_invalid(body: bytes, **limits) -> None:
    """A hashed envelope around `body` is invalid for a reason other than the
    hash, as bytes and as base64: the body decoder or the checks rejected it."""
    data = envelope_bytes(body)
    assert HASH_MISMATCH not in assert_invalid(data, **limits)
    assert_invalid(base64.b64encode(data).decode(), base64_text=True, **limits)


def decode_or_value_error(decode, data: object) -> None:
    """Decode; only ValueError with one of the two documented messages may escape."""
    try:
        payload = decode(data)
    except ValueError as exc:
        assert type(exc) is ValueError
        message = str(exc)
        assert message.startswith(INVALID) or re.fullmatch(
            r"unsupported version -?\d+", message
        ), message
    else:
        assert isinstance(payload, KVChecksumPayload)


# ---------------------------------------------------------------------------
# Byte layout (R77, R78, R81, R135, R136)


def test_exact_byte_layout_matches_hand_built_msgpack():
    """R77/R135/R136: the bytes are msgpack of [2, hash, bin(body)], body the
    msgpack of [tp, tokens, [[id, fp, chunk_tokens, start, bin]]] and hash the
    little-endian uint64 of blake2b(body, digest_size=8).

    Expected bytes are built by hand from the msgpack spec and hashlib. Catches
    a map instead of an array, another field order, the body as an array
    instead of a bin, another hash (function, size or byte order), values as
    ints instead of a bin, big-endian values, or a signed fingerprint.
    """
    body = (
        b"\x93"  # fixarray of 3
        + b"\x02"  # tp_size 2
        + b"\xcd\x01\x2c"  # num_tokens 300 as uint16
        + b"\x92"  # two groups
        + b"\x95"  # group: fixarray of 5
        + b"\x03"  # group_id 3
        + b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff"  # fingerprint 2^64 - 1
        + b"\x10"  # chunk_tokens 16
        + b"\x01"  # start 1
        + b"\xc4\x10"  # bin8 of 16 bytes
        + (1).to_bytes(8, "little")
        + (2**63).to_bytes(8, "little")
        + b"\x95"
        + b"\x00"  # group_id 0
        + b"\xcd\x12\x34"  # fingerprint 0x1234 as uint16
        + b"\xcc\xc8"  # chunk_tokens 200 as uint8
        + b"\x00"  # start 0
        + b"\xc4\x00"  # empty bin8
    )
    digest = hashlib.blake2b(body, digest_size=8).digest()
    expected = (
        b"\x93"  # fixarray of 3
        + b"\x02"  # version 2
        + msgpack_uint(int.from_bytes(digest, "little"))
        + b"\xc4"
        + bytes([len(body)])  # bin8 of the body
        + body
    )
    assert tiny_payload().to_bytes() == expected


def test_large_values_use_bin16():
    """R77: 32 values are one bin16 of 256 bytes, little-endian, in order, and
    the 270-byte body a bin16 too.

    Catches values encoded from a copy in another byte order or truncated.
    """
    values = np.arange(32, dtype=np.uint64) * 0x0101010101010101
    payload = KVChecksumPayload(
        2, 1, 512, [KVChecksumPayloadGroup(0, 0, 16, 0, values)]
    )
    header = b"\x93\x01\xcd\x02\x00\x91\x95\x00\x00\x10\x00\xc5\x01\x00"
    body = header + values.astype("<u8").tobytes()
    expected = b"\x93\x02" + msgpack_uint(blake(body)) + b"\xc5\x01\x0e" + body
    assert payload.to_bytes() == expected


def test_base64_is_padded_standard_alphabet():
    """R78: the carrier value is RFC 4648 base64 with padding, as a str.

    Catches the URL-safe alphabet, stripped padding, or bytes instead of str.
    """
    payload = padded_payload()
    text = payload.to_base64()
    assert isinstance(text, str)
    assert len(text) % 4 == 0
    assert re.fullmatch(r"[A-Za-z0-9+/]*={0,2}", text)
    assert text == base64.b64encode(payload.to_bytes()).decode("ascii")
    assert len(payload.to_bytes()) == 40  # one byte past a 3-byte quantum
    assert text.endswith("==")
    assert "/" in text  # 0xff bytes use the standard alphabet's "/", not "_"


def test_payload_size_for_128k_tokens():
    """R81: 128K tokens, one group, 16-token chunks: ~64 KB raw, ~87 KB base64.

    Catches per-value overhead (e.g. values as msgpack ints: ~9 bytes each).
    """
    values = np.full(128 * 1024 // 16, U64_MAX, dtype=np.uint64)
    payload = KVChecksumPayload(
        2, 8, 128 * 1024, [KVChecksumPayloadGroup(0, U64_MAX, 16, 0, values)]
    )
    raw = payload.to_bytes()
    text = payload.to_base64()
    assert abs(len(raw) - 64 * 1024) <= 0.02 * 64 * 1024
    assert abs(len(text) - 87_000) <= 0.02 * 87_000


# ---------------------------------------------------------------------------
# Round trip and zero copy (R76, R77)


@st.composite
def payloads(draw) -> KVChecksumPayload:
    group_ids = draw(st.lists(st.integers(0, 2**63 - 1), unique=True, max_size=5))
    groups = [
        KVChecksumPayloadGroup(
            group_id=group_id,
            fingerprint=draw(st.integers(0, U64_MAX)),
            chunk_tokens=draw(st.integers(1, 2**63 - 1)),
            start=draw(st.integers(0, 2**63 - 1)),
            values=np.array(
                draw(st.lists(st.integers(0, U64_MAX), max_size=40)), dtype=np.uint64
            ),
        )
        for group_id in group_ids
    ]
    return KVChecksumPayload(
        version=2,
        tp_size=draw(st.integers(1, MAX_TP_SIZE)),
        num_tokens=draw(st.integers(0, U64_MAX)),
        groups=groups,
    )


def assert_same(decoded: KVChecksumPayload, payload: KVChecksumPayload) -> None:
    assert decoded.version == payload.version
    assert decoded.tp_size == payload.tp_size
    assert decoded.num_tokens == payload.num_tokens
    assert len(decoded.groups) == len(payload.groups)
    for got, want in zip(decoded.groups, payload.groups, strict=True):
        assert got.group_id == want.group_id
        assert got.fingerprint == want.fingerprint
        assert got.chunk_tokens == want.chunk_tokens
        assert got.start == want.start
        assert got.values.dtype == np.dtype("<u8")
        np.testing.assert_array_equal(got.values, want.values)


@settings(max_examples=200, deadline=None)
@given(payloads())
def test_round_trip(payload: KVChecksumPayload):
    """R76/R77: decode(encode(p)) == p for any valid payload, base64 or raw.

    Catches lost groups, swapped fields, signed or truncated fingerprints and
    values at 2^64 - 1, and int64 overflow of large counts.
    """
    assert_same(KVChecksumPayload.from_base64(payload.to_base64()), payload)
    assert_same(KVChecksumPayload.from_bytes(payload.to_bytes()), payload)
    assert_same(decode_kv_checksums_param(payload.to_base64()), payload)


def test_decoded_values_are_zero_copy_views():
    """R77: decoded values are views of the input bytes, not copies, also
    inside the envelope's body bin.

    Catches a per-value decode, or a copy of the body, that makes decoding cost
    O(values) Python work.
    """
    data = valid_bytes()
    decoded = KVChecksumPayload.from_bytes(data)
    values = decoded.groups[0].values
    assert np.shares_memory(values, np.frombuffer(data, dtype=np.uint8))
    assert not values.flags.owndata
    assert not values.flags.writeable  # a view of immutable bytes
    from_text = KVChecksumPayload.from_base64(base64.b64encode(data).decode())
    assert not from_text.groups[0].values.flags.owndata


def test_encode_accepts_narrower_unsigned_and_non_contiguous_values():
    """R77: values of any unsigned dtype or stride encode as uint64 bytes.

    Catches encoding a strided array's raw memory (wrong values).
    """
    values = np.arange(10, dtype=np.uint64)[::2]
    small = np.array([1, 2], dtype=np.uint8)
    payload = KVChecksumPayload(
        2,
        1,
        0,
        [
            KVChecksumPayloadGroup(0, 0, 1, 0, values),
            KVChecksumPayloadGroup(1, 0, 1, 0, small),
        ],
    )
    decoded = KVChecksumPayload.from_bytes(payload.to_bytes())
    np.testing.assert_array_equal(decoded.groups[0].values, [0, 2, 4, 6, 8])
    np.testing.assert_array_equal(decoded.groups[1].values, [1, 2])


@pytest.mark.parametrize(
    "group, tp_size",
    [
        (KVChecksumPayloadGroup(0, -1, 16, 0, u64()), 1),
        (KVChecksumPayloadGroup(0, 2**64, 16, 0, u64()), 1),
        (KVChecksumPayloadGroup(0, 0, 0, 0, u64()), 1),
        (KVChecksumPayloadGroup(0, 0, 16, -1, u64()), 1),
        (KVChecksumPayloadGroup(-1, 0, 16, 0, u64()), 1),
        (KVChecksumPayloadGroup(0, 0, True, 0, u64()), 1),
        (KVChecksumPayloadGroup(0, 0, 16, 0, np.array([-1], dtype=np.int64)), 1),
        (KVChecksumPayloadGroup(0, 0, 16, 0, np.zeros((2, 2), np.uint64)), 1),
        (KVChecksumPayloadGroup(0, 0, 16, 0, u64()), 0),
    ],
)
def test_encode_rejects_invalid_fields(group, tp_size):
    """R79: what to_bytes encodes, from_bytes accepts.

    Catches a producer sending a payload every consumer rejects (negative or
    out-of-range ints, zero chunk tokens, bools, signed or 2-D values).
    """
    payload = KVChecksumPayload(2, tp_size, 16, [group])
    with pytest.raises(ValueError, match=INVALID):
        payload.to_bytes()


def test_encode_rejects_duplicate_groups_and_other_versions():
    """R77/R136: one entry per group, version 2 only.

    Catches a duplicated group id, which a consumer would have to resolve, and
    a producer still writing version 1 (which consumers now reject).
    """
    group = KVChecksumPayloadGroup(0, 0, 16, 0, u64())
    with pytest.raises(ValueError, match="appears twice"):
        KVChecksumPayload(2, 1, 16, [group, group]).to_bytes()
    for version in (1, 3):
        with pytest.raises(ValueError, match=f"^unsupported version {version}$"):
            KVChecksumPayload(version, 1, 16, [group]).to_bytes()


def test_encode_rejects_tp_size_decode_rejects():
    """R79/R134: a TP size from_bytes rejects (above MAX_TP_SIZE) is not
    encoded either.

    Catches a producer sending a payload every consumer rejects.
    """
    payload = KVChecksumPayload(2, MAX_TP_SIZE + 1, 16, [])
    try:
        data = payload.to_bytes()
    except ValueError:
        return
    KVChecksumPayload.from_bytes(data)


# ---------------------------------------------------------------------------
# Hostile input (R79, R129, R134, R136)


@pytest.mark.parametrize(
    "text",
    [
        "!!!!",
        "AAA",  # missing padding
        "AA==AA==",  # excess data after padding
        " AAAA",
        "AAAA\n",
        "AA-_",  # URL-safe alphabet
        "A===",
        "éééé",  # non-ASCII
        "\ud800AAA",  # lone surrogate
        b"\xff\xfe\xfd\xfc",
    ],
)
def test_bad_base64_is_invalid(text):
    """R78/R79: malformed base64 is "invalid KV checksums".

    Catches binascii.Error or UnicodeEncodeError escaping, or lenient decoding
    that silently drops characters.
    """
    assert_invalid(text, base64_text=True)


def test_lenient_base64_of_a_valid_payload_is_invalid():
    """R78: only canonical padded base64 is accepted, even if the bytes are fine.

    Catches a lenient decoder that skips whitespace or other characters, or reads
    past the padding, and so accepts values a strict peer rejects.
    """
    text = padded_payload().to_base64()
    KVChecksumPayload.from_base64(text)
    assert text.endswith("==")
    for variant in [
        text[:8] + "\n" + text[8:],
        text[:8] + " " + text[8:],
        text[:8] + "*" + text[8:],
        text + "AAAA",
        text + "=",
        "\n" + text,
    ]:
        assert_invalid(variant, base64_text=True)


def test_base64_with_nonzero_pad_bits_is_invalid():
    """R78: the last character before "=" must leave the unused bits zero;
    "...AAB=" for "...AAA=" is not canonical base64.

    Catches two strings standing for one payload (RFC 4648 3.5: a decoder may
    reject them; the strict decoder of this package rejects every other
    non-canonical form). Harmless for verification: the bytes are the same.
    """
    text = padded_payload().to_base64()
    assert text.endswith("==")
    # One "=": the character before it carries 2 unused bits.
    one_pad = KVChecksumPayload(
        2, 1, 16, [KVChecksumPayloadGroup(0, 0, 16, 0, u64(5))]
    ).to_base64()
    assert one_pad.endswith("A=") and not one_pad.endswith("==")
    assert_invalid(one_pad[:-2] + "B=", base64_text=True)


@pytest.mark.parametrize(
    "value", [None, 1, 1.5, [], {}, object(), bytearray(b"AAAA"), ["AAAA"]]
)
def test_non_string_carrier_value_is_invalid(value):
    """R79: a kv_checksums value of another JSON or Python type is invalid.

    Catches TypeError or AttributeError escaping for a proxy that rewrites the
    value as a number, list or object.
    """
    assert_invalid(value, base64_text=True)


@pytest.mark.parametrize("value", [None, "AAAA", 7, [1, 2]])
def test_non_bytes_input_is_invalid(value):
    """R79: from_bytes of a non-buffer is invalid, not TypeError."""
    assert_invalid(value)


def test_truncation_at_every_offset_is_invalid():
    """R79/R136: every proper prefix of a valid payload is invalid, and so is
    every proper prefix of its body sent in a correctly hashed envelope.

    Catches a decoder that accepts a short bin or a missing group, in the
    envelope or (past the hash check) in the body.
    """
    data = valid_bytes()
    for end in range(len(data)):
        assert_invalid(data[:end])
        assert_invalid(base64.b64encode(data[:end]).decode(), base64_text=True)
    body = valid_body()
    for end in range(len(body)):
        assert_body_invalid(body[:end])


def test_trailing_bytes_are_invalid():
    """R79: extra bytes after the envelope, or after the body inside a hashed
    envelope, are invalid, not ignored."""
    assert_invalid(valid_bytes() + b"\x00")
    assert_body_invalid(valid_body() + b"\x00")


DEEP = 200_000
NESTED = b"\x91" * DEEP + b"\x01"


@pytest.mark.parametrize(
    "data",
    [
        NESTED,  # nested at the top
        b"\x93" + NESTED,  # nested in place of the version
        b"\x93\x02" + NESTED,  # ... of the hash
        b"\x93\x02\x00" + NESTED,  # ... of the body
        b"\x81\x01" * DEEP + b"\x01",  # nested maps
    ],
    ids=["top", "version", "hash", "body", "maps"],
)
def test_deeply_nested_envelope_is_invalid(data):
    """R79: 200000-deep nesting in the envelope is invalid, without
    RecursionError.

    Catches an untyped (recursive) decode of the envelope.
    """
    assert_invalid(data)
    assert_invalid(base64.b64encode(data).decode(), base64_text=True)


@pytest.mark.parametrize(
    "body",
    [
        NESTED,  # nested at the top of the body
        b"\x93" + NESTED,  # nested in place of tp_size
        b"\x93\x01" + NESTED,  # ... of num_tokens
        b"\x93\x01\x01" + b"\x91" * DEEP,  # ... of the groups
        b"\x93\x01\x01\x91\x95" + b"\x91" * DEEP,  # ... of a group id
        b"\x93\x01\x01\x91\x95\x00\x00\x01\x00" + b"\x91" * DEEP,  # of values
        b"\x81\x01" * DEEP + b"\x01",  # nested maps
    ],
    ids=["top", "tp_size", "num_tokens", "groups", "group_id", "values", "maps"],
)
def test_deeply_nested_body_is_invalid(body):
    """R79: 200000-deep nesting in a correctly hashed body is invalid, without
    RecursionError.

    Catches an untyped (recursive) decode of the body once its hash matched.
    """
    assert_body_invalid(body)


def test_nested_other_version_is_unsupported_not_recursion():
    """R79: another version's tail is not decoded, so deep nesting there is fine.

    Catches a version check that walks (and recurses into) the whole payload,
    for version 1's four-element layout and a later version's.
    """
    for head, version in [(b"\x94\x01", 1), (b"\x93\x03", 3)]:
        with pytest.raises(ValueError, match=f"^unsupported version {version}$"):
            KVChecksumPayload.from_bytes(head + NESTED)


GOOD_VALUES = u64(5).tobytes()
BODY_GROUP = [0, 0, 16, 0, GOOD_VALUES]


@pytest.mark.parametrize(
    "obj",
    [
        None,
        1,
        "payload",
        {"tp_size": 1},
        [],
        [1],
        [1, 1],
        [1, 1, [], []],
        ["1", 1, []],
        [1.0, 1, []],
        [True, 1, []],
        [1, True, []],
        [1, None, []],
        [1, 1, {}],
        [1, 1, [None]],
        [1, 1, [[0, 0, 16, 0]]],
        [1, 1, [[0, 0, 16, 0, GOOD_VALUES, 1]]],
        [1, 1, [[0, 0, 16, 0, "AAAAAAAA"]]],
        [1, 1, [[0, 0, 16, 0, [5]]]],
        [1, 1, [[0, 0, 16.0, 0, GOOD_VALUES]]],
        [1, 1, [[False, 0, 16, 0, GOOD_VALUES]]],
        [1, 1, [[0, 0, 16, True, GOOD_VALUES]]],
        [0, 1, []],  # tp_size 0
        [-3, 1, []],
        [2**40, 1, []],  # tp_size above MAX_TP_SIZE
        [1, -1, []],  # negative num_tokens
        [1, 1, [[-1, 0, 16, 0, GOOD_VALUES]]],  # negative group id
        [1, 1, [[0, -1, 16, 0, GOOD_VALUES]]],  # fingerprint below 0
        [1, 1, [[0, -(2**63), 16, 0, GOOD_VALUES]]],
        [1, 1, [[0, 0, 0, 0, GOOD_VALUES]]],  # chunk tokens 0
        [1, 1, [[0, 0, -16, 0, GOOD_VALUES]]],
        [1, 1, [[0, 0, 16, -1, GOOD_VALUES]]],  # negative start
        [1, 1, [[0, 0, 16, 0, b"\x00" * 7]]],  # not a multiple of 8
        [1, 1, [[0, 0, 16, 0, b"\x00" * 17]]],
        [1, 1, [BODY_GROUP, [0, 1, 16, 0, GOOD_VALUES]]],  # group 0 twice
    ],
)
def test_wrong_body_structure_or_ranges_are_invalid(obj):
    """R79/R134: a correctly hashed body with wrong types, bools for ints,
    out-of-range ints or bad bins is invalid.

    Catches TypeError/OverflowError escaping the body decoder, bools accepted
    as ints, negative or oversized sizes reaching verification, and duplicate
    group ids.
    """
    assert_body_invalid(encode(obj))


@pytest.mark.parametrize(
    "obj",
    [
        None,
        2,
        "payload",
        {"version": 2},
        [],
        [2],
        [2, 0],
        [2, "hash", b""],
        [2, 1.5, b""],
        [2, True, b""],
        [2, -1, b""],
        [2, 0, "a body as str"],
        [2, 0, [1, 1, []]],  # the body as an array instead of a bin
        [2, 0, None],
        [2, 0, b"", b""],  # a fourth element
        [2, blake(encode([1, 1, []])) ^ 1, encode([1, 1, []])],  # wrong hash
        [2, blake(encode([1, 1, []])), encode([1, 1, []]) + b"\x00"],
        [2, U64_MAX, encode([1, 1, []])],
    ],
)
def test_wrong_envelope_structure_is_invalid(obj):
    """R79/R136: an envelope that is not [2, uint64 hash, bin body] with the
    body's hash is invalid (version 2 is the supported one, so not
    "unsupported").

    Catches a body taken from a str or an array, a hash compared loosely
    (bool, float, negative) or not at all, and extra envelope elements ignored.
    """
    assert_invalid(encode(obj))
    assert_invalid(base64.b64encode(encode(obj)).decode(), base64_text=True)


def test_huge_lengths_in_headers_are_invalid_without_allocation():
    """R129: a header claiming 2^32 elements or bytes does not allocate them,
    in the envelope or in a correctly hashed body.

    Catches MemoryError or a decode that trusts declared lengths.
    """
    for data in [
        b"\xdd\xff\xff\xff\xff",
        b"\x93\x02\x00\xc6\xff\xff\xff\xff",
        b"\x93\x02\x00\xdd\xff\xff\xff\xff",
    ]:
        assert_invalid(data)
    for body in [
        b"\xdd\xff\xff\xff\xff",
        b"\x93\x01\x01\xdd\xff\xff\xff\xff",
        b"\x93\x01\x01\x91\x95\x00\x00\x01\x00\xc6\xff\xff\xff\xff",
        b"\x93\x01\x01\x91\x95\x00\x00\x01\x00\xdb\xff\xff\xff\xff",
    ]:
        assert_body_invalid(body)


def test_other_version_is_unsupported():
    """R79/R136: a well-formed payload of another version names that version;
    version 1 (the former format) is now unsupported.

    Catches reporting another version as merely malformed, or accepting a
    version 1 payload (no body hash) as version 2.
    """
    body = encode([1, 1, [BODY_GROUP]])
    version_1 = (  # a version 1 payload, built by hand
        b"\x94\x01\x02\xcd\x01\x2c\x91\x95\x03\x00\x10\x01\xc4\x08" + GOOD_VALUES
    )
    for data, version in [
        (version_1, 1),
        (encode([1, 1, 1, [BODY_GROUP]]), 1),
        (envelope_bytes(body, version=1), 1),  # version 1 with a v2 envelope
        (envelope_bytes(body, version=3), 3),
        (encode([3, "new", {"groups": []}]), 3),  # another layout
        (encode([0, 1, 1, []]), 0),
        (encode([-5, 1, 1, []]), -5),
        (encode([300, 1]), 300),
        (encode([2**64 - 1]), 2**64 - 1),
    ]:
        text = base64.b64encode(data).decode()
        with pytest.raises(ValueError) as info:
            KVChecksumPayload.from_base64(text)
        assert type(info.value) is ValueError
        assert str(info.value) == f"unsupported version {version}"


def test_group_and_position_limits():
    """R129: more groups or values than the consumer's config allows are invalid.

    Catches a consumer allocating or summing for a producer-chosen size.
    """
    values = np.zeros(10, dtype=np.uint64)
    groups = [KVChecksumPayloadGroup(i, 0, 16, 0, values) for i in range(3)]
    data = KVChecksumPayload(2, 1, 160, groups).to_bytes()
    KVChecksumPayload.from_bytes(
        data, KVChecksumPayloadLimits(max_groups=3, max_positions=10)
    )
    assert_invalid(data, max_groups=2)  # too many groups
    assert_invalid(data, max_positions=9)  # too many values
    one = KVChecksumPayload(2, 1, 160, [groups[2]]).to_bytes()
    KVChecksumPayload.from_bytes(one, KVChecksumPayloadLimits(max_groups=3))
    assert_invalid(one, max_groups=2)  # group id 2 of groups 0 and 1


def test_group_flood_is_rejected_from_the_array_header():
    """R129: with max_groups, a million tiny groups fail before being decoded.

    Catches decoding every group (hundreds of MB of Python objects for a few MB
    of input) before counting them.
    """
    data = envelope([1, 1, [[0, 0, 1, 0, b""]] * 1_000_000])
    with pytest.raises(ValueError, match=f"{INVALID}: .*length <= 4"):
        KVChecksumPayload.from_bytes(data, KVChecksumPayloadLimits(max_groups=4))


def one_group(
    chunk_tokens: int, start: int, num_values: int, num_tokens: int = 128
) -> bytes:
    values = np.zeros(num_values, dtype=np.uint64)
    group = KVChecksumPayloadGroup(0, 0, chunk_tokens, start, values)
    return KVChecksumPayload(2, 1, num_tokens, [group]).to_bytes()


def test_max_model_len_caps_chunks_by_the_groups_chunk_tokens():
    """R129/R134: start + values <= ⌈max_model_len / chunk tokens⌉ + 1, per
    group chunk size, counted from the group's start chunk.

    A producer with 16-token chunks may send twice the values of one with
    32-token chunks. Catches accepting 1 more chunk or rejecting the last one,
    and a cap on the values alone that lets a large start through.
    """
    limits = KVChecksumPayloadLimits(max_model_len=128)
    for chunk_tokens, cap in [(16, 9), (32, 5), (100, 3), (128, 2)]:
        for start in (0, 1, cap - 1):
            KVChecksumPayload.from_bytes(
                one_group(chunk_tokens, start, cap - start), limits
            )
            assert_invalid(
                one_group(chunk_tokens, start, cap - start + 1), **vars(limits)
            )
        KVChecksumPayload.from_bytes(one_group(chunk_tokens, cap, 0), limits)
        assert_invalid(one_group(chunk_tokens, cap + 1, 0), **vars(limits))


@pytest.mark.parametrize(
    "data",
    [
        one_group(129, 0, 1),  # chunk tokens above max_model_len
        one_group(2**62, 0, 1),
        one_group(1, 0, 1, num_tokens=129),  # tokens above max_model_len
        one_group(16, 2**62, 1),
        one_group(1, 2**63 - 1, 0),
    ],
    ids=["chunk129", "chunk2^62", "tokens129", "start2^62", "start2^63-1"],
)
def test_max_model_len_bounds_every_declared_size(data):
    """R134: chunk tokens and num_tokens above max_model_len, and a start past
    the cap, are invalid even with few values.

    Catches a check of the value count only, which lets a producer-declared
    size drive the consumer's work.
    """
    assert_invalid(data, max_model_len=128)


def test_tp_size_cap():
    """R134: a producer TP size above max_tp_size is invalid; at the cap it is
    accepted.

    Catches an unchecked TP size (it sizes nothing today, but R134 checks every
    declared size against what a model can have).
    """
    for tp_size, ok in [(MAX_TP_SIZE, True), (MAX_TP_SIZE + 1, False)]:
        data = envelope([tp_size, 16, [BODY_GROUP]])
        if ok:
            assert KVChecksumPayload.from_bytes(data).tp_size == tp_size
        else:
            assert_invalid(data)
    assert_invalid(envelope([3, 16, [BODY_GROUP]]), max_tp_size=2)


def test_oversized_value_is_rejected_before_decoding():
    """R129: a value longer than the cap is invalid before base64 or msgpack.

    The oversized text is not even valid base64, so only an early length check
    yields the "exceed" message. Catches decoding unbounded input first.
    """
    huge = "!" * (DEFAULT_MAX_ENCODED_BYTES + 1)
    with pytest.raises(ValueError, match=f"{INVALID}: .*exceed"):
        KVChecksumPayload.from_base64(huge)
    with pytest.raises(ValueError, match=f"{INVALID}: .*exceed"):
        KVChecksumPayload.from_bytes(b"\xc1" * (DEFAULT_MAX_ENCODED_BYTES + 1))
    text = tiny_payload().to_base64()
    assert_invalid(text, base64_text=True, max_encoded_bytes=len(text) - 1)
    KVChecksumPayload.from_base64(
        text, KVChecksumPayloadLimits(max_encoded_bytes=len(text))
    )


def test_oversized_string_inside_msgpack_is_invalid():
    """R79: a msgpack str or bin longer than the input is invalid (truncated),
    in the envelope and in a hashed body."""
    assert_invalid(b"\x93\x02\x00\xc6\x00\x10\x00\x00")
    assert_body_invalid(b"\x93\x01\x01\x91\x95\x00\x00\x01\x00\xc6\x00\x10\x00\x00")
    assert_body_invalid(encode([1, 1, [[0, 0, 16, 0, "x" * 100_000]]]))


msgpack_objects = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64_MAX)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=30,
)

near_bodies = st.lists(
    st.one_of(
        st.integers(-2, 3),
        st.lists(st.lists(st.integers(-2, 20) | st.binary(max_size=24), max_size=6)),
        msgpack_objects,
    ),
    max_size=4,
)

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    """R79: random bytes give a payload or ValueError, nothing else."""
    decode_or_value_error(KVChecksumPayload.from_bytes, data)
    text = base64.b64encode(data).decode()
    decode_or_value_error(KVChecksumPayload.from_base64, text)


@FUZZ
@given(st.text(max_size=100))
def test_fuzz_random_text(text):
    """R79: random (mostly non-base64) strings give only ValueError."""
    decode_or_value_error(KVChecksumPayload.from_base64, text)


@FUZZ
@given(msgpack_objects | near_bodies)
def test_fuzz_random_msgpack_objects(obj):
    """R79: any msgpack value, as the whole payload or as a correctly hashed
    body, including body-shaped ones, decodes or fails with ValueError only.
    Catches exceptions escaping the envelope or body decoder or the checks."""
    decode_or_value_error(KVChecksumPayload.from_bytes, encode(obj))
    decode_or_value_error(KVChecksumPayload.from_bytes, envelope(obj))


@FUZZ
@given(payloads(), st.integers(0, 10_000), st.integers(0, 255))
def test_fuzz_corrupted_valid_payload(payload, where, byte):
    """R79/R136: a valid payload with one byte replaced decodes or fails
    cleanly, and so does one whose body had a byte replaced and was re-hashed
    (reaching the body decoder and the checks)."""
    data = bytearray(payload.to_bytes())
    data[where % len(data)] = byte
    decode_or_value_error(KVChecksumPayload.from_bytes, bytes(data))
    _, _, body = msgspec.msgpack.decode(payload.to_bytes())
    body = bytearray(body)
    body[where % len(body)] = byte
    decode_or_value_error(KVChecksumPayload.from_bytes, envelope_bytes(bytes(body)))


# ---------------------------------------------------------------------------
# Inspect tool (R132)


def sample_text() -> str:
    values = np.arange(1, 11, dtype=np.uint64) * 0x1111
    groups = [
        KVChecksumPayloadGroup(0, 0xDEADBEEF, 16, 2, values),
        KVChecksumPayloadGroup(4, U64_MAX, 1, 0, u64(U64_MAX)),
    ]
    return KVChecksumPayload(2, 4, 160, groups).to_base64()


def test_inspect_prints_every_field():
    """R132: version, TP size, tokens and per group fingerprint, chunk tokens,
    start chunk, number of chunks and the first 8 values in hex. Catches
    missing fields."""
    out = inspect_payload(sample_text())
    assert "version: 2" in out
    assert "producer TP size: 4" in out
    assert "tokens: 160" in out
    assert (
        "group 0: fingerprint 0x00000000deadbeef, chunk tokens 16, start 2, "
        "chunks 10" in out
    )
    assert "0x0000000000001111 0x0000000000002222" in out
    assert "0x0000000000008888" in out
    assert "0x0000000000009999" not in out  # only the first 8 values
    assert "group 4: fingerprint 0xffffffffffffffff, chunk tokens 1, start 0" in out
    assert "0xffffffffffffffff" in out.splitlines()[-1]


def fake_stdin(data: bytes) -> io.TextIOWrapper:
    """A text stdin over `data`, strict UTF-8 like a UTF-8 locale's, whose
    .buffer gives the raw bytes."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="strict")


def test_inspect_main_in_process(capsys, monkeypatch):
    """R132: `inspect VALUE` and `inspect -` print; invalid input exits 1.

    Catches the error going to stdout or a zero exit status on bad input.
    """
    assert main(["inspect", sample_text()]) == 0
    assert "producer TP size: 4" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", fake_stdin(sample_text().encode() + b"\n"))
    assert main(["inspect", "-"]) == 0
    assert "tokens: 160" in capsys.readouterr().out
    assert main(["inspect", "!!!"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert INVALID in captured.err


@pytest.mark.parametrize(
    "data", [b"\xff\xfe\x00garbage", b"AAAA\x80", "é".encode("latin-1")]
)
def test_inspect_stdin_not_utf8_exits_1(capsys, monkeypatch, data):
    """R132: `inspect -` with standard input that is not UTF-8 prints its one
    line error and exits 1.

    Catches reading standard input as text outside the error handling, which
    let UnicodeDecodeError escape main as a traceback.
    """
    monkeypatch.setattr(sys, "stdin", fake_stdin(data))
    assert main(["inspect", "-"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"error: {INVALID}: ")
    assert "UTF-8" in lines[0]


ROOT = Path(__file__).resolve().parents[4]
# The `vllm-kv-checksum` console script's module, run from this checkout.
SCRIPT = [sys.executable, str(ROOT / "vllm_kv_checksum_cli.py"), "inspect"]


def test_inspect_script_prints_a_payload_and_nothing_on_stderr():
    """R132: `vllm-kv-checksum inspect VALUE` prints every field to standard
    output, writes nothing to standard error and exits 0, without importing
    torch or vLLM's packages.

    Catches the script loading the tool through `vllm.distributed` (torch's
    warnings on stderr, 20 s a call), or its output or exit status lost.
    """
    check = (
        "import sys; sys.path.insert(0, sys.argv[1]); import vllm_kv_checksum_cli"
        " as cli; status = cli.main(['inspect', sys.argv[2]]); heavy = sorted("
        "m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'));"
        " print('imported', heavy); sys.exit(status)"
    )
    done = subprocess.run(
        [sys.executable, "-c", check, str(ROOT), sample_text()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "producer TP size: 4" in done.stdout
    assert "group 4: fingerprint 0xffffffffffffffff" in done.stdout
    assert done.stdout.splitlines()[-1] == "imported []"


def test_inspect_script_invalid_stdin_exits_1():
    """R132: `vllm-kv-checksum inspect -` reads standard input; an invalid
    payload exits 1 with one line on stderr and nothing on stdout.

    Catches the script's status not reaching the exit code, or the error
    going to stdout.
    """
    bad = base64.b64encode(envelope([1, 1, [[0, 0, 16, 0, b"\x00" * 7]]])).decode()
    done = subprocess.run(
        [*SCRIPT, "-"], input=bad, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: {INVALID}") and "not a multiple of 8" in line


def test_inspect_module_runs_as_main(capsys, monkeypatch):
    """R132: `python -m vllm.distributed.kv_transfer.kv_checksum inspect`
    still runs (in process here: vLLM is imported already).

    Catches a missing `__main__` guard, or main's status not reaching the
    exit code.
    """
    monkeypatch.setattr(sys, "argv", ["kv_checksum", "inspect", "!!!"])
    with warnings.catch_warnings():
        # `__main__` is imported above; runpy warns about running it again.
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_module(
                "vllm.distributed.kv_transfer.kv_checksum", run_name="__main__"
            )
    assert exit_info.value.code == 1
    assert INVALID in capsys.readouterr().err


def test_console_script_names_the_shipped_module():
    """The `vllm-kv-checksum` entry point names a module the wheel ships
    (`py-modules`) and its `main`. Catches an entry point left pointing at a
    module not installed (the command then fails at its first import)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = project["project"]["scripts"]["vllm-kv-checksum"]
    module, _, function = target.partition(":")
    assert module in project["tool"]["setuptools"]["py-modules"]
    assert (ROOT / f"{module}.py").is_file()
    assert function == "main"


# Fields at and around every bound the full check applies, mostly plain ints
# near the limits below (so that many payloads pass the fast check), and now
# and then a value the full check treats apart (a NumPy int, a bool, a
# float, None).
_EDGES = {
    "version": [2, 2, 2, 2, 2, 1, 3],
    "tp": [1, 1, 1, 1, 2, 8, 9, 0, 2**16, 2**16 + 1],
    "tokens": [0, 1, 16, 16, 63, 64, 65, 1024, 1025, -1],
    "group": [0, 0, 0, 0, 1, 1, 2, 3, -1],
    "fingerprint": [0, 5, 5, U64_MAX, U64_MAX + 1, -1],
    "chunk": [16, 16, 16, 8, 1, 2, 17, 64, 65, 0, -1],
    "start": [0, 0, 0, 0, 1, 2, 4, 5, 60, 65, -1],
    "max_groups": [None, 1, 2, 3],
    "max_positions": [None, 4, 64],
    "max_model_len": [None, None, 16, 64, 1024],
    "max_tp_size": [1, 8, MAX_TP_SIZE],
}
_ODD: list[object] = [np.int64(0), np.int64(2), True, False, 1.0, None]


def _values(rng) -> object:
    """Mostly uint64 arrays of lengths around the positions caps; now and
    then a narrower, signed, 2-D or object array, or a list."""
    n = rng.choice([0, 1, 1, 3, 3, 4, 5, 17, 63, 64, 65, 66, 70])
    kind = rng.randrange(10)
    if kind == 0:
        return np.arange(min(n, 4), dtype=np.uint32)
    if kind == 1:
        return np.arange(min(n, 4), dtype=np.int64)
    if kind == 2:
        return np.zeros((1 + n % 3, 2), dtype=np.uint64)
    if kind == 3:
        return np.arange(min(n, 3), dtype=np.uint64).astype(object)
    if kind == 4:
        return list(range(min(n, 3)))
    return np.arange(n, dtype=np.uint64)


def _spec_accepts(payload: KVChecksumPayload, limits: KVChecksumPayloadLimits) -> bool:
    """The field rules of R79, R129 and R134, written out for the test: ints
    (numpy's too, never bools), version 2, TP size 1..max, tokens 0..max model
    length, a list of at most max-groups groups with distinct ids below it,
    uint64 fingerprints, chunks of 1..max model length tokens, starts >= 0,
    1-D unsigned values of at most 8 bytes, at most max positions, and
    start + values <= ceil(max model length / chunk tokens) + 1."""

    def is_int(value: object) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    max_len, max_groups = limits.max_model_len, limits.max_groups
    if not (
        is_int(payload.version)
        and payload.version == 2
        and is_int(payload.tp_size)
        and 1 <= payload.tp_size <= limits.max_tp_size
        and is_int(payload.num_tokens)
        and 0 <= payload.num_tokens <= (max_len if max_len is not None else 1 << 63)
        and isinstance(payload.groups, list)
        and (max_groups is None or len(payload.groups) <= max_groups)
    ):
        return False
    ids = []
    for group in payload.groups:
        fields = (group.group_id, group.fingerprint, group.chunk_tokens, group.start)
        if not all(is_int(f) for f in fields):
            return False
        group_id, fingerprint, chunk, start = (int(f) for f in fields)
        values = group.values
        if not (
            group_id >= 0
            and (max_groups is None or group_id < max_groups)
            and 0 <= fingerprint < 1 << 64
            and chunk >= 1
            and start >= 0
            and isinstance(values, np.ndarray)
            and values.ndim == 1
            and values.dtype.kind == "u"
            and values.dtype.itemsize <= 8
        ):
            return False
        if limits.max_positions is not None and len(values) > limits.max_positions:
            return False
        if max_len is not None and (
            chunk > max_len or start + len(values) > math.ceil(max_len / chunk) + 1
        ):
            return False
        ids.append(group_id)
    return len(set(ids)) == len(ids)


def test_field_check_accepts_exactly_what_the_spec_allows():
    """R79, R129, R134: the one field check that every decoded and every
    producer-built payload takes accepts exactly the payloads the rules
    allow, under any limits (30,000 payloads around every bound, against the
    rules written out in `_spec_accepts`); what it rejects raises "invalid
    KV checksums" or "unsupported version". Bugs caught: a bound missing or
    off by one (a group id, positions, start, chunk size, TP size or token
    count past the consumer's sizes accepted, or one at the bound refused),
    a group twice, a value the rules reject (a bool, a float, a narrow
    signed, 2-D or object values array, a tuple of groups) taken as valid, or
    a numpy int refused."""
    import random

    from vllm.distributed.kv_transfer.kv_checksum.wire import payload as module

    rng = random.Random(20261204)

    def field(kind: str) -> object:
        if kind.startswith("max_") or rng.random() >= 0.04:
            return rng.choice(_EDGES[kind])
        return rng.choice(_ODD)

    accepted = rejected = 0
    for _ in range(30_000):
        limits = KVChecksumPayloadLimits(
            max_groups=field("max_groups"),  # type: ignore[arg-type]
            max_positions=field("max_positions"),  # type: ignore[arg-type]
            max_model_len=field("max_model_len"),  # type: ignore[arg-type]
            max_tp_size=field("max_tp_size"),  # type: ignore[arg-type]
        )
        groups: list | tuple = [
            KVChecksumPayloadGroup(
                field("group"),
                field("fingerprint"),
                field("chunk"),
                field("start"),
                _values(rng),
            )
            for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))
        ]
        if rng.random() < 0.02:
            groups = tuple(groups)
        payload = KVChecksumPayload(
            field("version"), field("tp"), field("tokens"), groups
        )
        expected = _spec_accepts(payload, limits)
        try:
            module._check_payload(payload, limits)
        except ValueError as exc:
            assert not expected, (payload, limits, exc)
            assert str(exc).startswith(("invalid KV checksums", "unsupported version"))
            rejected += bool(groups)
        else:
            assert expected, (payload, limits)
            accepted += bool(groups)
    assert accepted > 300 and rejected > 3_000  # both sides exercised
