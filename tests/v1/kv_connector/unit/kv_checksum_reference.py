# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An independent reference of the KV checksum definition (SPEC R17-R24).

Shares no code with the package on purpose (it must not import it): tests
compare every worker path to these functions, so a bug shared by both would
hide. Definition v2 (R137): every 8-byte piece x enters as mix64(x), the
SplitMix64 finalizer, before its weight. Parts:

- `mix64` / `exact_mix64`: the finalizer on uint64 arrays and on Python ints.

- `reference_block_checksums`: the NumPy reference of R24 over a global KV
  ``uint8 [layers, tokens, global heads, C]``, all uint64 arithmetic with
  wrap-around (never floats, never Python ints >= 2^63 mixed into NumPy).
- `exact_block_checksums`: the same definition with exact Python ints masked
  to 64 bits, for tiny cases, to cross-check the NumPy reference.
- `scatter_kv`: writes one global truth into a worker's per-layer ``[B, H, N,
  C]`` cache views (any layout, kernel-block splits), given the global heads
  the worker holds and the block id of every position.
"""

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

H = 1 << 16  # MAX_KV_HEADS_PER_LAYER of the definition
MASK64 = (1 << 64) - 1
U64 = np.uint64

MIX_MUL1 = 0xBF58476D1CE4E5B9
MIX_MUL2 = 0x94D049BB133111EB


def exact_mix64(x: int) -> int:
    """SplitMix64's finalizer on one Python int, exact then masked (R137)."""
    z = x & MASK64
    z ^= z >> 30
    z = (z * MIX_MUL1) & MASK64
    z ^= z >> 27
    z = (z * MIX_MUL2) & MASK64
    z ^= z >> 31
    return z


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (logical shifts, wrap-around)."""
    z = np.asarray(x, dtype=U64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> U64(30)
        z *= U64(MIX_MUL1)
        z ^= z >> U64(27)
        z *= U64(MIX_MUL2)
        z ^= z >> U64(31)
    return z


def slice_factors(layer_numbers: Sequence[int], head_numbers: Sequence[int]):
    """m[L, h] = 2 * (layer * H + head) + 1 as uint64 (R19)."""
    layers = np.asarray(layer_numbers, dtype=U64).reshape(-1, 1)
    heads = np.asarray(head_numbers, dtype=U64).reshape(1, -1)
    with np.errstate(over="ignore"):
        return U64(2) * (layers * U64(H) + heads) + U64(1)


def reference_block_checksums(
    kv: np.ndarray,
    block_size: int,
    num_tokens: int | None = None,
    layer_numbers: Sequence[int] | None = None,
    head_numbers: Sequence[int] | None = None,
) -> np.ndarray:
    """Block checksums c_b of R24 for positions 0 .. ceil(N / bs) - 1.

    `kv` is uint8 [layers, tokens, heads, C] with C a multiple of 8; its token
    axis starts at request position 0. `layer_numbers[i]` / `head_numbers[k]`
    are the layer number / global head of axis entry i / k (default: the
    index). Only tokens t < num_tokens count (default: all tokens of `kv`).
    """
    kv = np.ascontiguousarray(kv, dtype=np.uint8)
    num_layers, total_tokens, num_heads, cell = kv.shape
    assert cell % 8 == 0, "cells must be whole 8-byte pieces"
    n = total_tokens if num_tokens is None else num_tokens
    assert 0 <= n <= total_tokens
    if layer_numbers is None:
        layer_numbers = range(num_layers)
    if head_numbers is None:
        head_numbers = range(num_heads)
    pieces = cell // 8
    # x[L, t, h, p]: little-endian unsigned 8-byte pieces, mixed (R137).
    x = mix64(kv[:, :n].view("<u8").astype(U64))
    t = np.arange(n, dtype=U64).reshape(n, 1)
    p = np.arange(pieces, dtype=U64).reshape(1, pieces)
    num_blocks = -(-n // block_size)
    out = np.zeros(num_blocks, dtype=U64)
    with np.errstate(over="ignore"):
        w = U64(2) * (t * U64(pieces) + p) + U64(1)  # w[t, p]
        m = slice_factors(layer_numbers, head_numbers)  # m[L, h]
        # s[L, t, h] = sum_p x * w
        s = (x * w.reshape(1, n, 1, pieces)).sum(axis=3, dtype=U64)
        # per token: sum over L, h of m * s
        per_token = (s * m.reshape(num_layers, 1, num_heads)).sum(
            axis=(0, 2), dtype=U64
        )
        for b in range(num_blocks):
            out[b] = per_token[b * block_size : (b + 1) * block_size].sum(dtype=U64)
    return out


def exact_block_checksums(
    kv: np.ndarray,
    block_size: int,
    num_tokens: int | None = None,
    layer_numbers: Sequence[int] | None = None,
    head_numbers: Sequence[int] | None = None,
) -> list[int]:
    """The definition with exact Python ints, masked to 64 bits (tiny cases only)."""
    kv = np.ascontiguousarray(kv, dtype=np.uint8)
    num_layers, total_tokens, num_heads, cell = kv.shape
    n = total_tokens if num_tokens is None else num_tokens
    layers = list(range(num_layers) if layer_numbers is None else layer_numbers)
    heads = list(range(num_heads) if head_numbers is None else head_numbers)
    pieces = cell // 8
    out = [0] * (-(-n // block_size))
    for li in range(num_layers):
        for hi in range(num_heads):
            m = 2 * (layers[li] * H + heads[hi]) + 1
            for t in range(n):
                cell_bytes = bytes(kv[li, t, hi])
                for p in range(pieces):
                    raw = int.from_bytes(cell_bytes[8 * p : 8 * p + 8], "little")
                    x = exact_mix64(raw)
                    j = t * pieces + p
                    out[t // block_size] += m * x * (2 * j + 1)
    return [value & MASK64 for value in out]


def reference_fingerprint(identities: Sequence[tuple]) -> int:
    """R42: sum of the low 8 bytes (little-endian) of SHA-256(repr(identity))."""
    total = 0
    for identity in identities:
        digest = hashlib.sha256(repr(identity).encode("utf-8")).digest()
        total += int.from_bytes(digest[:8], "little")
    return total & MASK64


def tv4_kv(num_layers: int = 2, num_heads: int = 2, num_tokens: int = 10, cell=16):
    """TV4's global KV: byte k of (L, h, t) = (31 L + 17 h + 7 t + k) mod 256."""
    L = np.arange(num_layers).reshape(-1, 1, 1, 1)
    t = np.arange(num_tokens).reshape(1, -1, 1, 1)
    h = np.arange(num_heads).reshape(1, 1, -1, 1)
    k = np.arange(cell).reshape(1, 1, 1, -1)
    return ((31 * L + 17 * h + 7 * t + k) % 256).astype(np.uint8)


def pieces_kv(pieces: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """A one-layer KV from pieces[t][h] = list of uint64 piece values (tiny cases)."""
    tokens = len(pieces)
    heads = len(pieces[0])
    cell = 8 * len(pieces[0][0])
    kv = np.zeros((1, tokens, heads, cell), dtype=np.uint8)
    for t in range(tokens):
        for h in range(heads):
            raw = b"".join(int(v).to_bytes(8, "little") for v in pieces[t][h])
            kv[0, t, h] = np.frombuffer(raw, dtype=np.uint8)
    return kv


def split_row_checksum(elements: Sequence[int], element_bytes: int, slice_id: int):
    """R21/R25 for one TP-split state row: unsigned zero-extended elements, t = 0,
    each mixed after zero-extension (R137)."""
    assert element_bytes in (2, 4)
    s = 0
    for j, value in enumerate(elements):
        s += exact_mix64(value & ((1 << (8 * element_bytes)) - 1)) * (2 * j + 1)
    return (s & MASK64, ((2 * slice_id + 1) * s) & MASK64)


def random_kv(rng: np.random.Generator, layers: int, tokens: int, heads: int, cell):
    """A random global KV, uint8 [layers, tokens, heads, cell]."""
    return rng.integers(0, 256, size=(layers, tokens, heads, cell), dtype=np.uint8)


def scatter_kv(
    kv: np.ndarray,
    caches: Mapping[str, torch.Tensor],
    layer_index: Mapping[str, int],
    heads: Sequence[int],
    block_ids: Sequence[int | None],
    block_size: int,
    num_blocks: int,
) -> None:
    """Write the global KV into a worker's per-layer caches.

    `caches[name]` is vLLM's ``[B * k, heads, N / k, C]`` view of a layer (any
    dtype, any strides, k kernel blocks per block); `layer_index[name]` is the
    layer's index in `kv`'s first axis; `heads` are the global heads the worker
    holds, in the order of the cache's head axis; position b of the request
    lives in block `block_ids[b]` (None: not written, e.g. a consumer's own
    prefix). Slots past the KV's last token are left as they are.
    """
    heads = list(heads)
    num_tokens = kv.shape[1]
    for name, li in layer_index.items():
        cache = caches[name].view(torch.uint8)
        kernel_blocks = cache.shape[0] // num_blocks
        tokens_per_kb = cache.shape[2]
        assert kernel_blocks * tokens_per_kb == block_size
        per_block = cache.unflatten(0, (num_blocks, kernel_blocks))
        for b, block_id in enumerate(block_ids):
            lo = b * block_size
            hi = min(lo + block_size, num_tokens)
            if block_id is None or lo >= hi:
                continue
            for t in range(lo, hi):
                slot = t - lo
                kb, n = divmod(slot, tokens_per_kb)
                data = torch.from_numpy(np.ascontiguousarray(kv[li, t, heads]))
                per_block[block_id, kb, :, n, :] = data


def fill_caches(caches: Mapping[str, torch.Tensor], seed: int) -> None:
    """Fill every cache with random bytes (garbage in slots a test does not set)."""
    gen = torch.Generator().manual_seed(seed)
    for cache in caches.values():
        raw = cache.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
