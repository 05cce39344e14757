# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A worker step that caches blocks and checks prefix hits (R140, R142).

The entries of the blocks vLLM cached in a step and the checks of the step's
hits share the step's one upload, and a group's entry write runs in the same
checksum launch as its hit checks (issue 30: on the H200 the first step of a
prefix-hit request paid two uploads and two launches, about 80 us a step of
`post_forward`). The entries, the checks and the stored entries the checks
read must still be what the independent reference gives.
"""

from collections.abc import Sequence

import numpy as np
import pytest

from tests.v1.kv_connector.unit import kv_checksum_reference as ref
from tests.v1.kv_connector.unit.test_kv_checksum import blocks, hexes, truth_worker
from tests.v1.kv_connector.unit.test_kv_checksum_offload import (
    fake_hashes,
    reference_tags,
    table_entries,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.checksum import (
    KVChecksumScheduled,
)
from vllm.distributed.kv_transfer.kv_checksum.definition.kernels import (
    KVChecksumLaunch,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.prefix_hits import (
    HIT_KEY_SUFFIX,
)

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("cuda_stream_stubs")]

U64 = np.uint64
# The request's positions 0..7 live in these blocks; the other slots hold
# random garbage (truth_worker).
BLOCK_IDS = [9, 4, 12, 1, 6, 14, 3, 11]
KEY = "req-hit" + HIT_KEY_SUFFIX


def step(
    worker,
    cached: Sequence[int],
    hit: Sequence[int],
    hashes: Sequence[bytes],
):
    """One step caching positions `cached` (one run, their hashes) and
    checking a hit on positions `hit` (from position 0): the record's group."""
    runs = []
    if cached:
        ids = [BLOCK_IDS[p] for p in cached]
        runs.append((0, cached[0], ids, [hashes[p] for p in cached]))
    checks = {}
    if hit:
        checks[KEY] = blocks(16 * len(hit), (0, 0, [BLOCK_IDS[p] for p in hit]))
    worker.bind(KVChecksumScheduled(reqs_to_check=checks, blocks_to_save=runs))
    pending = worker.post_forward(finished_recving=set(), failed_recving=set())
    if not hit:
        assert pending is None
        return None
    assert pending is not None
    return pending.finalize().checksums[KEY][0]


def expected_entries(whole: np.ndarray, hashes, fingerprint: int, positions):
    """R117 from the reference: checksum of the block XOR the tag of its hash."""
    tags = reference_tags([hashes[p] for p in positions], fingerprint)
    return whole[list(positions)] ^ tags


@pytest.mark.parametrize(
    "cached, hit",
    [
        ([5, 6, 7], [0, 1, 2, 3, 4, 5]),  # odd count: a padding row between
        ([4, 5, 6, 7], [0, 1, 2, 3, 4]),  # even count: none
        ([6, 7], []),  # entries only, no check in the step
    ],
)
def test_R140_entries_and_checks_of_one_step_match_the_reference(
    cached: list[int], hit: list[int]
) -> None:
    """The step's entries (R117) and hit checks (R140) from one upload and
    one launch equal the reference's, and a hit on a block cached in the same
    step reads that block's new entry. Bugs caught (tried): the entries
    written after the checks gather theirs (the same-step hit reads the old
    entry); the check rows read without the padding row (every check value
    shifted by one block); the entry sums taken from the check rows."""
    kv = ref.random_kv(np.random.default_rng(31), 2, 16 * len(BLOCK_IDS), 2, 16)
    whole = ref.reference_block_checksums(kv, 16)
    worker = truth_worker(kv, BLOCK_IDS, num_blocks=16)
    worker.enable_prefix_entries()
    table = worker.block_table.tensor
    fingerprint = worker.fingerprints[0]
    hashes = fake_hashes(len(BLOCK_IDS), seed=2)
    old = [p for p in range(len(BLOCK_IDS)) if p not in cached]
    # The older blocks were cached in an earlier step, with no hit.
    assert step(worker, old, [], hashes) is None
    table[BLOCK_IDS[cached[0]]] = 12345  # a stale entry the new one replaces
    group = step(worker, cached, hit, hashes)
    every = range(len(BLOCK_IDS))
    assert hexes(table_entries(table, BLOCK_IDS)) == hexes(
        expected_entries(whole, hashes, fingerprint, every)
    )
    if not hit:
        return
    assert hexes(group.values.sum(axis=1, dtype=U64)) == hexes(whole[hit])
    assert group.stored is not None
    assert hexes(group.stored) == hexes(
        expected_entries(whole, hashes, fingerprint, hit)
    )


def test_R142_one_launch_for_a_steps_entries_and_hit_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 30: a step that caches blocks and checks hits of the same group
    makes one checksum launch over both and one upload; a step that only
    caches makes one launch too. Bug caught (tried): the entries written by
    the table's own save path before the launcher (two launches, two
    uploads a step, as up to 2026-12-02g)."""
    kv = ref.random_kv(np.random.default_rng(32), 2, 16 * len(BLOCK_IDS), 2, 16)
    worker = truth_worker(kv, BLOCK_IDS, num_blocks=16)
    worker.enable_prefix_entries()
    hashes = fake_hashes(len(BLOCK_IDS), seed=3)
    calls: list[int] = []
    original = KVChecksumLaunch.__call__

    def counted(launch, rows, out) -> None:
        calls.append(rows.shape[1])
        original(launch, rows, out)

    uploads: list[int] = []
    from vllm.distributed.kv_transfer.kv_checksum.engine import (
        block_table,
        launches,
    )

    real_upload = launches.upload_segments

    def counted_upload(*args, **kwargs):
        uploaded, columns = real_upload(*args, **kwargs)
        uploads.append(uploaded.shape[1])
        return uploaded, columns

    monkeypatch.setattr(KVChecksumLaunch, "__call__", counted)
    # Every upload of the launcher and of the table's own save path.
    monkeypatch.setattr(launches, "upload_segments", counted_upload)
    monkeypatch.setattr(block_table, "upload_segments", counted_upload)
    step(worker, [0, 1, 2], [], hashes)
    assert calls == [3] and len(uploads) == 1
    calls.clear()
    uploads.clear()
    step(worker, [3, 4, 5], [0, 1, 2, 3], hashes)
    # Three entry rows, one padding row, four check rows: one launch.
    assert calls == [3 + 1 + 4]
    assert len(uploads) == 1
