# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The checksum definition's constants and the records workers and scheduler share.

A checksum covers one block position of one KV cache group over the unsharded
model (SPEC section 4). Workers report partial sums in a `KVChecksumRecord`; the
scheduler tells workers what to checksum with a `KVChecksumScheduled`.
"""

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_checksum.carrier import (  # noqa: F401 (re-exported)
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumCarrier,
)

# H of the definition: slice factors are m = 2 * (layer * H + head) + 1.
MAX_KV_HEADS_PER_LAYER = 1 << 16
H = MAX_KV_HEADS_PER_LAYER


U64_MASK = (1 << 64) - 1

# A producer sends one checksum per chunk of at most this many tokens (R135).
MAX_CHUNK_TOKENS = 16

# Producer records fold every replica-0 view of a chunk into one column.
SEND_COLUMN_KEY = (1, 0)


def num_valid_tokens(position: int, block_size: int, num_tokens: int) -> int:
    """Tokens of a `num_tokens` prefix held by block `position` (R90)."""
    return max(0, min(num_tokens - position * block_size, block_size))


def chunk_tokens(block_size: int) -> int:
    """Tokens per value a producer sends for blocks of `block_size` (R135).

    min(block size, 16) when that tiles the block; otherwise the largest
    power of two tiling both (gcd with 16), so chunks always tile blocks.
    """
    if block_size <= MAX_CHUNK_TOKENS:
        return block_size
    return math.gcd(block_size, MAX_CHUNK_TOKENS)


def layer_fingerprint(identity: tuple) -> int:
    """First 8 bytes, little-endian, of SHA-256 over repr(identity) (R42)."""
    digest = hashlib.sha256(repr(identity).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def sum_fingerprints(identities: Sequence[tuple]) -> int:
    """A group's fingerprint on one worker: the layer fingerprints mod 2^64."""
    return sum(layer_fingerprint(identity) for identity in identities) & U64_MASK


# hashlib's SHA-256 object type: its methods are called unbound through
# C-level maps (issue 30: a method descriptor calls faster than
# `operator.methodcaller`).
_SHA256 = type(hashlib.sha256())
_SHA256_BYTES = 32


def block_checksum_tags(block_hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
    """Per block, a uint64 binding a stored checksum to its block and group (R116):
    the first 8 bytes, little-endian, of SHA-256(fingerprint as 8 little-endian
    bytes + block hash).

    No Python loop per block (R142): each block's hash continues a copy of
    the fingerprint's hashed state (no concatenation, no new context), through
    C-level maps, and the digests are joined into one buffer that NumPy reads
    as a whole; this runs per offload load on the scheduler and per stored
    block batch on each worker.
    """
    count = len(block_hashes)
    if not count:
        return np.zeros(0, dtype=np.uint64)
    prefix = hashlib.sha256((fingerprint & U64_MASK).to_bytes(8, "little"))
    states = list(map(_SHA256.copy, repeat(prefix, count)))
    deque(map(_SHA256.update, states, block_hashes), maxlen=0)
    digests = b"".join(map(_SHA256.digest, states))
    # Each digest's first 8 bytes: every fourth little-endian word.
    words = np.frombuffer(digests, dtype="<u8")[:: _SHA256_BYTES // 8]
    return words.astype(np.uint64)


@dataclass
class KVChecksumBlocks:
    """Blocks of one request to checksum: per group, a start position and block ids.

    `num_tokens` is the end token of the range: the tokens whose KV the blocks hold.
    Block i of a group holds request tokens [(start + i) * bs, (start + i + 1) * bs).
    """

    num_tokens: int
    # group id -> (start position, block ids at consecutive positions)
    groups: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)


@dataclass
class KVChecksumScheduled:
    """What workers checksum in a step (attached to the SchedulerOutput, R71)."""

    reqs_to_send: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    reqs_to_recv: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    reqs_to_load: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    # Prefix-cache hits checked this step (R140), by hit key.
    reqs_to_check: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    # Entries of blocks cached this step: (group, first position, block ids,
    # block hashes), as `save_block_checksums` takes them (R140).
    blocks_to_save: list[tuple[int, int, Any, list[bytes]]] = field(
        default_factory=list
    )
    # External-load entries (R147): (block ids, slots) whose entries move from
    # their slots into the block table before this step's checks, and those
    # copied from the table into their slots after this step's entry writes.
    entries_to_restore: tuple[Any, Any] | None = None
    entries_to_keep: tuple[Any, Any] | None = None

    def is_empty(self) -> bool:
        return not (
            self.reqs_to_send
            or self.reqs_to_recv
            or self.reqs_to_load
            or self.reqs_to_check
            or self.blocks_to_save
            or self.entries_to_restore is not None
            or self.entries_to_keep is not None
        )


ReplicaKey = tuple[int, int]  # (replica count R, replica index r mod R)


@dataclass
class KVChecksumGroup:
    """One worker's partial checksums of one request's group (R54).

    `values[i, k]` is the partial sum of position `start + i` over the views with
    replica key `replica_keys[k]`. `stored` holds offloaded block entries (R117).
    """

    start: int
    replica_keys: tuple[ReplicaKey, ...]
    values: np.ndarray  # uint64 [rows, len(replica_keys)]
    stored: np.ndarray | None = None  # uint64 [rows]


@dataclass
class KVChecksumRecord:
    """One worker's report for one step (R54); aggregated over all workers."""

    pp_rank: int
    tp_rank: int
    # request id -> group id -> partial checksums
    checksums: dict[str, dict[int, KVChecksumGroup]] = field(default_factory=dict)
    # groups this worker cannot checksum (R34)
    skipped_groups: tuple[int, ...] = ()
    # group id -> sum of this worker's layer fingerprints (R42)
    fingerprints: dict[int, int] = field(default_factory=dict)
    # request id -> producer checksum bytes the connector received (R50)
    received: dict[str, bytes] = field(default_factory=dict)
    # the worker's last-resort guard turned its checksums off (R134): the
    # scheduler stops expecting its records
    disabled: bool = False
    # hit sources whose loads this worker no longer checks: an offload
    # connector's worker side failed (R134); those loads go unchecked
    disabled_sources: tuple[str, ...] = ()
