# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The payload-check benchmark compares what it says (issue 30, R142)."""

from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

pytestmark = pytest.mark.cpu

SCRIPT = (
    Path(__file__).resolve().parents[4]
    / "benchmarks/host/benchmark_kv_checksum_payload_check.py"
)


def test_both_versions_are_timed_on_the_same_payload(tmp_path) -> None:
    """R79, R142: the old version is the file given, loaded apart from the
    current module, and every call is timed for both; a version that encodes
    differently is refused. Bugs caught: the current module timed twice (the
    old file ignored), a call missing from one side, two versions with
    different wire bytes compared as if alike."""
    bench = load_script("_payload_check_bench", SCRIPT)
    old = tmp_path / "payload_old.py"
    old.write_text(bench.CURRENT.read_text() + "\nOLD_MARK = 1\n")
    result = bench.run(old, rounds=1, number=5)
    assert set(result) == {
        "decode (from_bytes)",
        "encode (to_bytes)",
        "field check (_check_payload)",
    }
    assert all(o > 0 and n > 0 for o, n, _ in result.values())
    assert bench.sys.modules["_payload_old"].OLD_MARK == 1
    assert not hasattr(bench.sys.modules["_payload_new"], "OLD_MARK")
    changed = tmp_path / "payload_changed.py"
    changed.write_text(
        bench.CURRENT.read_text().replace(
            "_ENCODER.encode([int(self.tp_size),", "_ENCODER.encode([1 + self.tp_size,"
        )
    )
    assert changed.read_text() != bench.CURRENT.read_text()
    with pytest.raises(AssertionError, match="encode differently"):
        bench.run(changed, rounds=1, number=5)
