# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The store-places benchmark measures what it says (issue 30, R142)."""

from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

pytestmark = pytest.mark.cpu

SCRIPT = (
    Path(__file__).resolve().parents[4]
    / "benchmarks/host/benchmark_kv_checksum_block_places.py"
)


def test_both_paths_time_the_same_places_and_attach_stores_them() -> None:
    """R117, R142: the benchmark's keys are a prefill's (every block placed,
    positions 0..127 per request), both paths are timed on them, and the
    timed `attach` runs on each path, the package's `block_places` back in
    place after; the entry tags are timed before and after, and the old
    chain gives the reference tags. Bugs caught: keys that place no block
    (a benchmark timing the early outs), a result missing a path, the plain
    pass left swapped in, a `_ref_tags` that is not the tags' old
    algorithm (its tags differ), a pool whose blocks are not cached under
    the keys given (the key reads time the uncached early out)."""
    bench = load_script("_block_places_bench", SCRIPT)
    places = bench.simple_offload.block_places(bench.prefill_keys(130), [16])
    assert places.positions.tolist() == list(range(128)) + [0, 1]
    result = bench.run(num_blocks=130, rounds=1, calls=2)
    assert set(result["us_per_call"]) == {
        "one_by_one",
        "block_places",
        "attach",
        "attach_one_by_one",
        "tags",
        "tags_before",
        "keys",
        "keys_by_property",
    }
    keys = bench.prefill_keys(5)
    pool = bench.pool_with(keys)
    assert bench.keys_by_property(pool, [1, 2, 3, 4, 5]) == keys
    assert bench.simple_offload.block_places is not bench.PATHS[0][1]  # restored
    assert all(v > 0 for v in result["us_per_call"].values())
    hashes = [bytes([i]) * 32 for i in range(5)]
    fingerprint = 0xD8FE581622DF5382
    prefix = (fingerprint).to_bytes(8, "little")
    expected = [
        int.from_bytes(bench.hashlib.sha256(prefix + h).digest()[:8], "little")
        for h in hashes
    ]
    assert bench._ref_tags(hashes, fingerprint).tolist() == expected
