# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The cross-machine comparison of two deep hook-timer runs (issue 30)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

pytestmark = pytest.mark.cpu

SCRIPT = (
    Path(__file__).resolve().parents[4]
    / "benchmarks/host/compare_kv_checksum_hook_timer.py"
)


def _engine(port: str, own: float, calls: dict[str, float]) -> dict:
    return {
        "side_channel_port": port,
        "own_us_per_step_without_start_up": own,
        "core_us_per_call": calls,
    }


OLD = {
    "1": _engine("5600", 10.0, {"A.launch": 100.0, "B.upload": 50.0}),
    "2": _engine(
        "5800",
        90.0,
        {
            "A.launch": 100.0,
            "B.upload": 50.0,
            "C.verify": 40.0,
            "D.tiny": 1.0,
            "E.warm_up": 9000.0,
            "F.read": 20.0,
        },
    ),
}
NEW = {
    "7": _engine(
        "5800",
        180.0,
        {
            "A.launch": 200.0,  # 2.0
            "B.upload": 110.0,  # 2.2
            "C.verify": 40.0,  # touched: 1.0, 0.5 scaled
            "D.tiny": 9.0,  # under --min-us in the old run: not in the factor
            "E.warm_up": 90000.0,  # start-up: not in the factor
            "F.read": 36.0,  # 1.8
            "G.new_call": 5.0,  # only in the new run: left out
        },
    ),
    "8": _engine("5600", 5.0, {"A.launch": 1.0}),
}


def test_factor_is_the_untouched_median_and_touched_calls_are_scaled_by_it() -> None:
    """R142, issue 30 (diagnosis): the machine factor is the median new/old ratio of
    the untouched calls of at least `min_us` a call in both runs, start-up
    calls left out, and each call's scaled figure is its ratio over it; the
    engine is the one with the asked port, or the most package time. Bugs
    caught: a touched call in the factor (a rework's gain hidden in the
    machine's speed), a warm-up or a sub-microsecond call setting the factor,
    the wrong engine of a P/D pair compared."""
    compare = load_script("_compare_hook_timer", SCRIPT)
    old = compare.pick_engine(OLD, "5800")
    new = compare.pick_engine(NEW, None)  # the most own time: port 5800
    assert new["side_channel_port"] == "5800"
    rows, factor, (low, high) = compare.compare(old, new, ["verify"], 5.0)
    assert factor == pytest.approx(2.0) and (low, high) == (1.8, 2.2)
    by_name = {row.name: row for row in rows}
    assert set(by_name) == {
        "A.launch",
        "B.upload",
        "C.verify",
        "D.tiny",
        "E.warm_up",
        "F.read",
    }
    assert by_name["C.verify"].touched and not by_name["A.launch"].touched
    assert by_name["C.verify"].ratio / factor == pytest.approx(0.5)
    assert [row.name for row in rows][0] == "E.warm_up"  # largest new time first


def test_the_script_prints_the_factor_and_a_row_per_call(tmp_path) -> None:
    """R142, issue 30 (diagnosis): the command line reads two summary files
    and prints the factor and each call's row as the record quotes them. Bug
    caught: a table whose scaled column is the bare ratio (not over the
    factor), or a touched call not marked."""
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(OLD))
    new.write_text(json.dumps(NEW))
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(old),
            str(new),
            "--port",
            "5800",
            "--touched",
            "verify",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "machine factor 2.00 (untouched calls 1.80-2.20)"
    assert "| C.verify | 40.0 | 40.0 | 1.00 | 0.50 | yes |" in lines


def _compare_lines(tmp_path: Path, old: dict, new: dict) -> list[str]:
    """The command line's output lines for two summaries, engine 5800,
    `verify` touched."""
    old_file, new_file = tmp_path / "old.json", tmp_path / "new.json"
    old_file.write_text(json.dumps(old))
    new_file.write_text(json.dumps(new))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(old_file), str(new_file)]
        + ["--port", "5800", "--touched", "verify"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


def test_a_new_run_with_cpu_time_gives_each_calls_cpu_share(tmp_path) -> None:
    """R142, issue 30 (diagnosis): when the new run counted thread CPU time,
    each row adds the call's CPU microseconds and their share of its wall
    time in that run (a call that waits shows a small share); a call without
    CPU time shows dashes. Bugs caught: the share taken over the old run's
    time, or over the scaled figure, the CPU columns misaligned."""
    new = json.loads(json.dumps(NEW))
    new["7"]["core_cpu_us_per_call"] = {"B.upload": 22.0, "A.launch": 190.0}
    lines = _compare_lines(tmp_path, OLD, new)
    assert lines[1].endswith("| new CPU us | CPU / wall |")
    assert "| B.upload | 50.0 | 110.0 | 2.20 | 1.10 |  | 22.0 | 0.20 |" in lines
    assert "| A.launch | 100.0 | 200.0 | 2.00 | 1.00 |  | 190.0 | 0.95 |" in lines
    assert "| F.read | 20.0 | 36.0 | 1.80 | 0.90 |  | - | - |" in lines
    assert all(line.count("|") == 9 for line in lines[1:])


def test_a_new_run_with_copies_gives_each_calls_time_beside_them(tmp_path) -> None:
    """R142, issue 30 (diagnosis): when the new run told calls beside vLLM's
    batch copies apart, each row adds the share of its calls that overlapped
    a copy and its microseconds a call beside one and alone (dashes where it
    never ran alone or never beside one), after the CPU columns when both
    are there. Bugs caught: the split read from the old run, a call that
    never overlapped a copy dropped or misaligned."""
    new = json.loads(json.dumps(NEW))
    new["7"]["core_cpu_us_per_call"] = {"B.upload": 22.0}
    new["7"]["core_beside_copy"] = {
        "B.upload": {"share": 0.25, "us_beside": 290.0, "us_alone": 50.0},
        "A.launch": {"share": 1.0, "us_beside": 200.0, "us_alone": None},
    }
    old = json.loads(json.dumps(OLD))
    old["2"]["core_beside_copy"] = {
        "F.read": {"share": 1.0, "us_beside": 20.0, "us_alone": None}
    }
    lines = _compare_lines(tmp_path, old, new)
    assert lines[1].endswith(
        "| new CPU us | CPU / wall | beside a copy | us beside | us alone |"
    )
    assert (
        "| B.upload | 50.0 | 110.0 | 2.20 | 1.10 |  | 22.0 | 0.20 "
        "| 0.250 | 290.0 | 50.0 |" in lines
    )
    assert (
        "| A.launch | 100.0 | 200.0 | 2.00 | 1.00 |  | - | - | 1.000 | 200.0 | - |"
        in lines
    )
    assert "| F.read | 20.0 | 36.0 | 1.80 | 0.90 |  | - | - | 0 | - | - |" in lines
    assert all(line.count("|") == 12 for line in lines[1:])
