# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The producer's checksums of one request as sent to the consumer (SPEC 11, 23).

Version 2 bytes are the msgpack array ``[2, body_hash, body]``: ``body`` a bin
holding the msgpack array
``[tp_size, num_tokens, [[group_id, fingerprint, chunk_tokens, start, values]]]``
and ``body_hash`` the little-endian uint64 of an 8-byte BLAKE2b digest of
``body`` (R136). ``values`` is a bin of little-endian uint64, one checksum per
chunk of ``chunk_tokens`` request tokens from chunk ``start`` on (R135; under
definition v2, R137). The kv_transfer_params carrier sends the bytes as padded
standard base64 (R78).

Decoding is total (R79, R129, R134): whatever the input, it returns a valid
payload or raises ``ValueError`` ("invalid KV checksums: ..." or "unsupported
version N"). The input length is capped before anything is decoded; the body
hash is checked before the body is read, so a payload corrupted in transit is
invalid, never the basis of a verdict; the msgpack decoders are typed (a nested
array where an int belongs fails validation at once rather than recursing);
every declared size is checked against the consumer's own limits; and the
values are zero-copy views of the decoded bytes, so time and memory are linear
in the input length.
"""

import base64
import binascii
import functools
import hashlib
from dataclasses import dataclass
from typing import Annotated

import msgspec
import numpy as np

try:  # vLLM's own dependency: SIMD base64, ~50x the standard library here
    import pybase64
except ImportError:  # pragma: no cover - vLLM installs it
    pybase64 = None  # type: ignore[assignment]

KV_CHECKSUM_PAYLOAD_VERSION = 2

# R134: largest producer TP size accepted (a TP size above the per-layer head
# limit of the definition cannot belong to any model).
MAX_TP_SIZE = 1 << 16

# R129: default cap on the base64 text (and the raw bytes) of one payload.
DEFAULT_MAX_ENCODED_BYTES = 16 * 1024 * 1024

# Bytes added to the largest valid payload by `max_valid_payload_bytes`.
PAYLOAD_SLACK_BYTES = 4096
# msgpack bytes around the values of the largest valid payload: the envelope
# (array header, version, uint64 hash, bin32 header), the body's array header,
# uint64 tp_size and num_tokens and an array32 groups header ...
_MAX_PAYLOAD_FRAME = 1 + 1 + 9 + 5 + 1 + 9 + 9 + 5
# ... and per group its array header, four uint64 fields and a bin32 header.
_MAX_GROUP_FRAME = 1 + 4 * 9 + 5

_U64_LIMIT = 1 << 64
_VALUE_DTYPE = np.dtype("<u8")

# A group: [group_id, fingerprint, chunk_tokens, start, values]. A memoryview
# field decodes as a view of the input.
_RawGroup = tuple[int, int, int, int, memoryview]
_ENCODER = msgspec.msgpack.Encoder()
# The envelope [version, body_hash, body], read before anything else.
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(tuple[int, int, memoryview])

# What msgspec may raise on hostile input besides its own errors.
_DECODE_ERRORS = (
    msgspec.MsgspecError,
    RecursionError,
    MemoryError,
    OverflowError,
    BufferError,
    TypeError,
)


@dataclass(frozen=True)
class KVChecksumPayloadLimits:
    """Bounds a consumer puts on a received payload (R129, R134).

    `max_positions` caps the values of any group. `max_model_len` bounds every
    size the payload declares: chunk tokens and num_tokens at most
    max_model_len, and a group's start plus values at most
    ⌈max_model_len / chunk tokens⌉ + 1, so the consumer's work and memory stay
    within its own sizes whatever a producer, proxy or client sends.
    """

    # Cap on the base64 text length and on the raw bytes, checked first.
    max_encoded_bytes: int = DEFAULT_MAX_ENCODED_BYTES
    # The consumer's number of KV cache groups: group ids must be below it.
    max_groups: int | None = None
    # ⌈max_model_len / min block size⌉ + 1.
    max_positions: int | None = None
    # The consumer's max_model_len, bounding every declared size.
    max_model_len: int | None = None
    # Largest producer TP size accepted.
    max_tp_size: int = MAX_TP_SIZE


def max_valid_payload_bytes(max_model_len: int, num_groups: int) -> int:
    """Base64 characters of the largest payload a consumer with these sizes
    accepts, plus `PAYLOAD_SLACK_BYTES` (R129, R134): every group holds
    max_model_len + 1 one-token chunks (the decoder's bound at chunk tokens 1).
    Above the raw bytes too, so one cap serves both carriers."""
    values = 8 * (max(0, max_model_len) + 1)
    raw = _MAX_PAYLOAD_FRAME + max(1, num_groups) * (_MAX_GROUP_FRAME + values)
    return 4 * -(-raw // 3) + PAYLOAD_SLACK_BYTES


@dataclass
class KVChecksumPayloadGroup:
    """The producer's checksums of one KV cache group of one request (R76)."""

    group_id: int
    # Sum of one TP rank's layer fingerprints over PP stages (R87), uint64.
    fingerprint: int
    # Request tokens per value: the producer's chunk size (R135).
    chunk_tokens: int
    # Chunk index of values[0] (it holds tokens from start * chunk_tokens on).
    start: int
    # uint64 [chunks], one checksum per chunk from `start`.
    values: np.ndarray


@dataclass
class KVChecksumPayload:
    """The producer's checksums of one request (R76) and their wire format."""

    version: int
    # The producer's TP size (R85).
    tp_size: int
    # The tokens whose KV the checksummed blocks hold.
    num_tokens: int
    groups: list[KVChecksumPayloadGroup]

    def to_bytes(self) -> bytes:
        """Version 2 msgpack bytes with the body hash (R136); ValueError on
        fields a decoder without limits would reject."""
        _check_encodable(self)
        groups = [
            [
                int(group.group_id),
                int(group.fingerprint),
                int(group.chunk_tokens),
                int(group.start),
                _values_buffer(group.values),
            ]
            for group in self.groups
        ]
        body = _ENCODER.encode([int(self.tp_size), int(self.num_tokens), groups])
        return _ENCODER.encode([int(self.version), body_hash(body), body])

    def to_base64(self) -> str:
        """The kv_transfer_params value: padded standard base64 (R78)."""
        encode = base64.b64encode if pybase64 is None else pybase64.b64encode
        return encode(self.to_bytes()).decode("ascii")

    @classmethod
    def from_bytes(
        cls, data: object, limits: KVChecksumPayloadLimits | None = None
    ) -> "KVChecksumPayload":
        """Decode version 2 bytes; values are views of `data` (R79, R129,
        R134, R136)."""
        if limits is None:
            limits = KVChecksumPayloadLimits()
        buffer = _as_bytes_like(data)
        if buffer.nbytes > limits.max_encoded_bytes:
            raise _invalid(
                f"{buffer.nbytes} bytes exceed the limit of {limits.max_encoded_bytes}"
            )
        payload = _decode(buffer, limits.max_groups)
        _check_payload(payload, limits)
        return payload

    @classmethod
    def from_base64(
        cls, text: object, limits: KVChecksumPayloadLimits | None = None
    ) -> "KVChecksumPayload":
        """Decode a kv_transfer_params value (R78, R79, R129)."""
        if limits is None:
            limits = KVChecksumPayloadLimits()
        if not isinstance(text, (str, bytes)):
            raise _invalid(f"expected a base64 string, got {type(text).__name__}")
        if len(text) > limits.max_encoded_bytes:
            raise _invalid(
                f"{len(text)} base64 characters exceed the limit of "
                f"{limits.max_encoded_bytes}"
            )
        return cls.from_bytes(_b64decode(text), limits)


def decode_kv_checksums_param(
    value: object, limits: KVChecksumPayloadLimits | None = None
) -> KVChecksumPayload:
    """Decode the kv_transfer_params["kv_checksums"] value (R78, R79)."""
    return KVChecksumPayload.from_base64(value, limits)


def inspect_payload(text: str) -> str:
    """Human-readable summary of a base64 payload (R132); ValueError if invalid."""
    payload = KVChecksumPayload.from_base64(text)
    lines = [
        f"version: {payload.version}",
        f"producer TP size: {payload.tp_size}",
        f"tokens: {payload.num_tokens}",
        f"groups: {len(payload.groups)}",
    ]
    for group in payload.groups:
        lines.extend(_describe_group(group))
    return "\n".join(lines)


_INSPECT_MAX_VALUES = 8


def _describe_group(group: KVChecksumPayloadGroup) -> list[str]:
    """Lines of `inspect_payload` for one group."""
    num_values = len(group.values)
    shown = " ".join(
        f"0x{int(value):016x}" for value in group.values[:_INSPECT_MAX_VALUES]
    )
    more = f" ... ({num_values} values)" if num_values > _INSPECT_MAX_VALUES else ""
    return [
        (
            f"group {group.group_id}: fingerprint 0x{group.fingerprint:016x}, "
            f"chunk tokens {group.chunk_tokens}, start {group.start}, "
            f"chunks {num_values}"
        ),
        f"  values: {shown or '(none)'}{more}",
    ]


def _invalid(why: str) -> ValueError:
    return ValueError(f"invalid KV checksums: {why}")


def _as_bytes_like(data: object) -> memoryview:
    """A flat byte view of `data`, which must be bytes, bytearray or memoryview."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _invalid(f"expected bytes, got {type(data).__name__}")
    try:
        return memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise _invalid(f"not a contiguous buffer ({exc})") from None


def _b64decode(text: str | bytes) -> bytes:
    """Strict padded standard base64 (R78): no whitespace, no excess data, and
    canonical (zero) pad bits, so one payload has exactly one encoding."""
    try:
        if pybase64 is not None:
            data = pybase64.b64decode(text, validate=True)
        else:  # Python >= 3.11, as vLLM 0.33.0 requires
            data = binascii.a2b_base64(text, strict_mode=True)
    except ValueError as exc:  # binascii.Error, or non-ASCII str
        raise _invalid(f"bad base64 ({exc})") from None
    tail = len(data) % 3
    if tail:  # the last quantum must re-encode to the same characters
        last = text[-4:] if isinstance(text, str) else text[-4:].decode("ascii")
        if base64.b64encode(data[-tail:]).decode("ascii") != last:
            raise _invalid("bad base64 (non-zero pad bits)")
    return data


def body_hash(body: bytes | memoryview) -> int:
    """The payload's self-check: an 8-byte BLAKE2b digest of the body (R136)."""
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=8)
def _body_decoder(max_groups: int | None) -> msgspec.msgpack.Decoder:
    """The typed decoder of the body [tp_size, num_tokens, [group, ...]].

    With `max_groups`, msgspec checks the groups' array header before decoding
    any group, so a flood of tiny groups costs nothing (R129).
    """
    if max_groups is None:
        return msgspec.msgpack.Decoder(tuple[int, int, list[_RawGroup]])
    bounded = msgspec.Meta(max_length=max_groups)
    return msgspec.msgpack.Decoder(tuple[int, int, Annotated[list[_RawGroup], bounded]])


def _decode(buffer: memoryview, max_groups: int | None) -> KVChecksumPayload:
    """Decode version 2 msgpack; other versions raise "unsupported version N".

    The envelope is read first and the body hash checked before the body is
    decoded (R136).
    """
    try:
        version, expected_hash, body = _ENVELOPE_DECODER.decode(buffer)
    except _DECODE_ERRORS as exc:
        other = _peek_version(buffer)
        if other is not None and other != KV_CHECKSUM_PAYLOAD_VERSION:
            raise _unsupported(other) from None
        raise _invalid(str(exc) or type(exc).__name__) from None
    if version != KV_CHECKSUM_PAYLOAD_VERSION:
        raise _unsupported(version)
    if body_hash(body) != expected_hash:
        raise _invalid("the body hash does not match (corrupted in transit)")
    try:
        tp_size, num_tokens, raw_groups = _body_decoder(max_groups).decode(body)
    except _DECODE_ERRORS as exc:
        raise _invalid(str(exc) or type(exc).__name__) from None
    groups = [_decode_group(*raw_group) for raw_group in raw_groups]
    return KVChecksumPayload(version, tp_size, num_tokens, groups)


def _decode_group(
    group_id: int, fingerprint: int, chunk_tokens: int, start: int, values: memoryview
) -> KVChecksumPayloadGroup:
    """One decoded group; its values are a view of the input bytes."""
    if values.nbytes % _VALUE_DTYPE.itemsize:
        raise _invalid(
            f"group {group_id}: {values.nbytes} value bytes are not a multiple of 8"
        )
    array = np.frombuffer(values, dtype=_VALUE_DTYPE)
    return KVChecksumPayloadGroup(group_id, fingerprint, chunk_tokens, start, array)


def _unsupported(version: int) -> ValueError:
    return ValueError(f"unsupported version {version}")


def _peek_version(buffer: memoryview) -> int | None:
    """The first element of a msgpack array if it is an int, else None.

    Reads only the array header and that int: the rest of another version's
    payload may have any layout, and skipping it could recurse.
    """
    data = bytes(buffer[:10])
    if not data:
        return None
    head = data[0]
    if 0x90 <= head <= 0x9F:
        offset = 1
    elif head == 0xDC:
        offset = 3
    elif head == 0xDD:
        offset = 5
    else:
        return None
    return _peek_int(data[offset:])


# msgpack int formats after the first byte: (byte count, signed).
_MSGPACK_INTS = {
    0xCC: (1, False),
    0xCD: (2, False),
    0xCE: (4, False),
    0xCF: (8, False),
    0xD0: (1, True),
    0xD1: (2, True),
    0xD2: (4, True),
    0xD3: (8, True),
}


def _peek_int(data: bytes) -> int | None:
    """The msgpack int at the start of `data`, or None if there is none."""
    if not data:
        return None
    head = data[0]
    if head <= 0x7F:
        return head
    if head >= 0xE0:
        return head - 0x100
    if head not in _MSGPACK_INTS:
        return None
    size, signed = _MSGPACK_INTS[head]
    if len(data) < 1 + size:
        return None
    return int.from_bytes(data[1 : 1 + size], "big", signed=signed)


def _check_payload(payload: KVChecksumPayload, limits: KVChecksumPayloadLimits) -> None:
    """Raise "invalid KV checksums" unless every field is in range (R79, R129,
    R134).

    Every rule is written once, as a plain comparison; a message is built only
    for the field that fails (issue 30: this runs on every encode and decode).
    """
    version = payload.version
    if type(version) is not int:  # plain ints skip the call (issue 30)
        version = _as_int(version, "version")
    if version != KV_CHECKSUM_PAYLOAD_VERSION:
        raise _unsupported(version)
    tp_size = payload.tp_size
    if type(tp_size) is not int:
        tp_size = _as_int(tp_size, "TP size")
    if tp_size < 1:
        raise _invalid(f"TP size {tp_size} < 1")
    num_tokens = payload.num_tokens
    if type(num_tokens) is not int:
        num_tokens = _as_int(num_tokens, "num_tokens")
    if num_tokens < 0:
        raise _invalid(f"num_tokens {num_tokens} < 0")
    if tp_size > limits.max_tp_size:
        raise _invalid(f"TP size {tp_size} > {limits.max_tp_size}")
    max_len = limits.max_model_len
    if max_len is not None and num_tokens > max_len:
        raise _invalid(f"num_tokens {num_tokens} > {max_len}")
    groups = payload.groups
    if not isinstance(groups, list):
        raise _invalid("groups must be a list")
    max_groups = limits.max_groups
    if max_groups is not None and len(groups) > max_groups:
        raise _invalid(f"{len(groups)} groups exceed {max_groups}")
    seen: set[int] = set()
    for group in groups:
        group_id = _check_group(group, limits)
        if group_id in seen:
            raise _invalid(f"group {group_id} appears twice")
        seen.add(group_id)


# What `to_bytes` checks against: a decoder without limits (R79).
_NO_LIMITS = KVChecksumPayloadLimits()


def _check_encodable(payload: KVChecksumPayload) -> None:
    """Raise as a decoder without limits would (R79): `to_bytes` never sends
    what a consumer must reject."""
    _check_payload(payload, _NO_LIMITS)


def _check_group(group: KVChecksumPayloadGroup, limits: KVChecksumPayloadLimits) -> int:
    """Check one group's fields; returns its group id."""
    group_id, fingerprint = group.group_id, group.fingerprint
    chunk_tokens, start = group.chunk_tokens, group.start
    if type(group_id) is not int:  # plain ints skip the calls (issue 30)
        group_id = _as_int(group_id, "group id")
    if group_id < 0:
        raise _invalid(f"group id {group_id} < 0")
    if type(fingerprint) is not int:
        fingerprint = _as_int(fingerprint, "fingerprint", group_id)
    if not 0 <= fingerprint < _U64_LIMIT:
        raise _invalid(f"group {group_id} fingerprint {fingerprint} is not a uint64")
    if type(chunk_tokens) is not int:
        chunk_tokens = _as_int(chunk_tokens, "chunk tokens", group_id)
    if chunk_tokens < 1:
        raise _invalid(f"group {group_id} chunk tokens {chunk_tokens} < 1")
    if type(start) is not int:
        start = _as_int(start, "start", group_id)
    if start < 0:
        raise _invalid(f"group {group_id} start {start} < 0")
    values = group.values
    if not isinstance(values, np.ndarray) or values.ndim != 1:
        raise _invalid(f"group {group_id} values must be a 1-D array")
    if values.dtype.kind != "u" or values.dtype.itemsize > 8:
        raise _invalid(f"group {group_id} values have dtype {values.dtype}, not uint64")
    _check_group_limits(group_id, chunk_tokens, start, len(values), limits)
    return group_id


def _check_group_limits(
    group_id: int,
    chunk_tokens: int,
    start: int,
    positions: int,
    limits: KVChecksumPayloadLimits,
) -> None:
    """Bound a group's id and geometry by the consumer's config (R129, R134)."""
    if limits.max_groups is not None and group_id >= limits.max_groups:
        raise _invalid(f"group {group_id} >= the {limits.max_groups} groups")
    if limits.max_positions is not None and positions > limits.max_positions:
        raise _invalid(
            f"group {group_id}: {positions} values exceed {limits.max_positions}"
        )
    max_len = limits.max_model_len
    if max_len is None:
        return
    if chunk_tokens > max_len:
        raise _invalid(f"group {group_id} chunk tokens {chunk_tokens} > {max_len}")
    cap = -(-max_len // chunk_tokens) + 1
    if start + positions > cap:
        raise _invalid(
            f"group {group_id}: chunks [{start}, {start + positions}) of "
            f"{chunk_tokens} tokens exceed {cap}"
        )


def _as_int(value: object, name: str, group_id: int | None = None) -> int:
    """`value` as an int; bools and non-integers are invalid. `group_id`
    names the group whose field it is, in the message only."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        where = name if group_id is None else f"group {group_id} {name}"
        raise _invalid(f"{where} must be an int, got {type(value).__name__}")
    return int(value)


def _values_buffer(values: np.ndarray) -> memoryview:
    """The values as little-endian uint64 bytes, without a copy when possible
    (the usual contiguous little-endian uint64 values skip the conversion
    call: issue 30)."""
    if values.dtype == _VALUE_DTYPE and values.flags.c_contiguous:
        return values.data
    return np.ascontiguousarray(values, dtype=_VALUE_DTYPE).data
