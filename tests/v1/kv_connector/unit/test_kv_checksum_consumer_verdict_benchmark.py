# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The consumer-verdict benchmark measures what it says (issue 30, R142).

It times `update_from_output` for finishing P/D loads on the path before the
2026-12-04g rework and on the current one; both must reach the verdict the
step's inputs make.
"""

import contextlib
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

pytestmark = pytest.mark.cpu

SCRIPT = (
    Path(__file__).resolve().parents[4]
    / "benchmarks/host/benchmark_kv_checksum_consumer_verdict.py"
)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_both_paths_reach_the_steps_verdicts(num_workers: int) -> None:
    """R72, R79, R92, R142: on both paths an intact load verifies, a step
    with one corrupted position mismatches at that block (of 6 blocks, 3),
    and cut-short payload bytes leave the load unverified with invalid
    checksums. Bugs caught: a benchmark that times loads that never reach
    verification (no payload stored, a worker missing), or a reference
    path whose verdicts differ from the current one's."""
    bench = load_script(f"_consumer_verdict_bench_{num_workers}", SCRIPT)
    for reference in (True, False):
        side = bench.make_side(num_workers, reference)
        assert isinstance(side.kcs.consumer, bench._ReferenceConsumer) is reference
        for step in (1, 8, 12):
            assert bench.verdict_step(side, step, 6) > 0
        verdicts = {req_id: v for req_id, v in side.verdicts}
        assert verdicts["c1"].status.value == "verified"
        assert verdicts["c8"].status.value == "mismatch"
        assert verdicts["c8"].mismatches == {0: [3]}
        (reason,) = verdicts["c12"].reasons
        assert reason[0].name == "INVALID_CHECKSUMS"
        assert verdicts["c12"].status.value == "unverified"
        assert side.kcs.consumer.request_ids() == set()


def test_compare_times_both_paths_on_equal_verdicts() -> None:
    """R142: `run_compare` has a before and after figure per block count,
    from verified loads only, and steps of every kind. Bugs caught: timing
    the mismatch or cut-short steps (other work than a verified load), or
    a result without one of the paths."""
    bench = load_script("_consumer_verdict_bench_compare", SCRIPT)
    result = bench.run_compare(num_blocks=4, num_workers=1, rounds=1, steps=9)
    assert set(result["us_per_verified_load"]) == set(bench.PATHS)
    assert all(v > 0 for v in result["us_per_verified_load"].values())
    assert result["steps_by_kind"] == {"mismatch": 2, "truncated": 1, "verified": 6}


def test_reference_pieces_swap_the_old_versions_in_and_restore_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R142: inside `reference_pieces` the verification, payload and records
    modules look up the 3a89cc1 pieces and the package's again once left,
    by an exception too; the reference consumer's verified load calls the
    old pieces and the current one's does not. Bugs caught: a swap of a
    name the package does not look up (its current path timed twice), a
    swap left in place after a step (the current path timed on the old
    code), or a reference step run outside it."""
    bench = load_script("_consumer_verdict_bench_pieces", SCRIPT)
    current = [vars(owner)[name] for owner, name, _ in bench._REFERENCE_PIECES]
    for fail in (False, True):
        with contextlib.suppress(RuntimeError), bench.reference_pieces():
            for owner, name, old in bench._REFERENCE_PIECES:
                assert vars(owner)[name] is old, name
            if fail:
                raise RuntimeError
        now = [vars(owner)[name] for owner, name, _ in bench._REFERENCE_PIECES]
        assert now == current

    calls: list[str] = []

    def probe(name: str, old: Any) -> Any:
        def call(*args: Any) -> Any:
            calls.append(name)
            return old(*args)

        return call

    traced = tuple(
        (owner, name, probe(name, old) if callable(old) and name[0] == "_" else old)
        for owner, name, old in bench._REFERENCE_PIECES
        if name != "_ConsumerReports"
    )
    monkeypatch.setattr(bench, "_REFERENCE_PIECES", traced)
    bench.verdict_step(bench.make_side(1), 1, 2)
    assert calls == []
    bench.verdict_step(bench.make_side(1, reference=True), 1, 2)
    assert set(calls) == {name for _, name, _ in traced}, calls
