# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cases and an independent reference for the block table's entry writes and
moves (`definition/entry_kernels.py`, R117, R118): Python integers mod 2^64,
element by element, no torch operation shared with the code under test. Run
by the CPU tests and the CUDA tests."""

import numpy as np
import torch

_MASK = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


def reference_write(sums, tags, ids, table, slots=None, dest=None):
    """(table, dest) after the write, as lists of Python ints; an index out of
    its destination is skipped."""
    table, dest = list(table), None if dest is None else list(dest)
    for i, row in enumerate(sums):
        entry = _signed((sum(row) & _MASK) ^ (tags[i] & _MASK))
        if 0 <= ids[i] < len(table):
            table[ids[i]] = entry
        if dest is not None and slots is not None and 0 <= slots[i] < len(dest):
            dest[slots[i]] = entry
    return table, dest


def reference_move(src, src_idx, dst, dst_idx=None):
    dst = list(dst)
    for i, source in enumerate(src_idx):
        target = i if dst_idx is None else dst_idx[i]
        if 0 <= source < len(src) and 0 <= target < len(dst):
            dst[target] = src[source]
    return dst


def _big(rng: np.random.Generator, shape) -> np.ndarray:
    """int64 values over the whole range, so sums wrap."""
    return rng.integers(-(1 << 63), (1 << 63) - 1, size=shape, dtype=np.int64)


def check_entry_kernels(kernels, device: str, seed: int = 0) -> None:
    """Writes (1-3 columns, with and without the slot copy, one and several
    programs) and moves (gather and scatter) against the reference; raises
    AssertionError naming the case."""
    rng = np.random.default_rng(seed)
    for n, width, copy in [
        (1, 1, False),
        (5, 2, True),
        (300, 1, True),
        (130, 3, False),
    ]:
        table_len, dest_len = 2 * n + 7, 3 * n + 5
        sums = _big(rng, (n, width))
        tags = _big(rng, n)
        ids = rng.permutation(table_len)[:n].astype(np.int64)
        slots = rng.permutation(dest_len)[:n].astype(np.int64)
        table0, dest0 = _big(rng, table_len), _big(rng, dest_len)
        want_table, want_dest = reference_write(
            sums.tolist(),
            tags.tolist(),
            ids.tolist(),
            table0.tolist(),
            slots.tolist() if copy else None,
            dest0.tolist() if copy else None,
        )
        table = torch.tensor(table0, device=device)
        dest = torch.tensor(dest0, device=device)
        kernels.write(
            torch.tensor(sums, device=device),
            torch.tensor(tags, device=device),
            torch.tensor(ids, device=device),
            table,
            torch.tensor(slots, device=device) if copy else None,
            dest if copy else None,
        )
        case = f"write n={n} width={width} copy={copy}"
        assert table.cpu().tolist() == want_table, case + ": table"
        if copy:
            assert dest.cpu().tolist() == want_dest, case + ": slots"
        else:
            assert dest.cpu().tolist() == dest0.tolist(), case + ": dest touched"
    for n, scatter in [(1, False), (7, True), (300, True), (260, False)]:
        src0, dst0 = _big(rng, 2 * n + 3), _big(rng, 2 * n + 9)
        src_idx = rng.integers(0, len(src0), size=n).astype(np.int64)
        dst_idx = rng.permutation(len(dst0))[:n].astype(np.int64) if scatter else None
        want = reference_move(
            src0.tolist(),
            src_idx.tolist(),
            dst0.tolist(),
            None if dst_idx is None else dst_idx.tolist(),
        )
        dst = torch.tensor(dst0, device=device)
        kernels.move(
            torch.tensor(src0, device=device),
            torch.tensor(src_idx, device=device),
            dst,
            None if dst_idx is None else torch.tensor(dst_idx, device=device),
        )
        assert dst.cpu().tolist() == want, f"move n={n} scatter={scatter}"
