# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmarks' CPU pinning of engine slots (issue 30: two engines sharing a
host must not differ by where their threads run), on a /sys tree written by
hand, and one benchmark run whose fake engines are pinned for real."""

import json
import os
from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script
from tests.v1.kv_connector.unit.test_kv_checksum_bench_prefix_hits import (
    _fake_setup,
    _free_port,
    bench,
)

ROOT = Path(__file__).resolve().parents[4]
pinning = load_script("cpu_pinning", ROOT / "benchmarks/kv_checksum_cpu_pinning.py")


def _sys_tree(root: Path, siblings: dict[int, str]) -> Path:
    """A /sys/devices/system/cpu with each CPU's thread_siblings_list."""
    for cpu, text in siblings.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(text + "\n")
    return root


def test_smt_siblings_stay_in_one_slot(tmp_path: Path) -> None:
    """R142 (measuring host cost fairly): 8 CPUs, 4 cores with siblings n
    and n+4 (the usual Linux numbering):
    slot a gets core 0 (CPUs 0, 4), slot b core 1 (1, 5), the client the rest.
    Bugs caught: cores taken as consecutive CPU numbers (slot a on 0 and 1,
    two cores, while slot b shares core 0's sibling 4), or the client left
    without a core."""
    sys_cpu = _sys_tree(tmp_path, {n: f"{n % 4},{n % 4 + 4}" for n in range(8)})
    cores = pinning.physical_cores(set(range(8)), sys_cpu)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    (a, b), rest = pinning.split_cores(cores, per_slot=1)
    assert (a, b, rest) == ({0, 4}, {1, 5}, {2, 3, 6, 7})
    (a, b), rest = pinning.split_cores(cores, per_slot=1, slots=2)
    assert not a & b and not (a | b) & rest
    with pytest.raises(ValueError, match="keep one for the client"):
        pinning.split_cores(cores, per_slot=2)


def test_unreadable_or_ranged_topology(tmp_path: Path) -> None:
    """R142: ranges ("0-1") parse, siblings outside the usable set are dropped, and
    a CPU without topology is a core of its own (bug caught: a CPU missing
    from /sys dropped, so a slot silently loses it)."""
    sys_cpu = _sys_tree(tmp_path, {0: "0-1", 1: "0-1", 2: "2-3"})
    cores = pinning.physical_cores({0, 1, 2, 5}, sys_cpu)
    assert cores == [[0, 1], [2], [5]]


def test_pinned_run_puts_each_slot_on_its_cpus(tmp_path: Path, monkeypatch) -> None:
    """R142: --pin-cores 1 against fake servers: each slot's engine runs on its own
    CPU (read back from /proc by the driver's `affinity` record), and the
    record names the sets (bug caught: the pin set in the driver but not
    passed to the engines, which then inherit the driver's CPUs)."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs two CPUs")
    first, second = usable[:2]
    # Two one-CPU "cores" for the slots and the usable set for the driver.
    monkeypatch.setattr(
        bench, "physical_cores", lambda cpus: [[first], [second], usable]
    )
    model, fake, out = _fake_setup(tmp_path)
    saved = os.sched_getaffinity(0)
    try:
        rc = bench.main(
            ["--out", str(out), "--model", str(model), "--rounds", "2", "--scale"]
            + ["0.02", "--workloads", "shared_c8", "--pin-cores", "1"]
            + ["--serve-cmd", fake, "--bench-cmd", fake, "--startup-timeout"]
            + ["120", "--port-off", str(_free_port()), "--port-on", str(_free_port())]
        )
    finally:
        os.sched_setaffinity(0, saved)
    record = json.loads((out / "summary.json").read_text())
    assert record["config"]["slot_cpus"] == {"a": [first], "b": [second]}
    placed = record["affinity"]["launch0"]
    assert set(map(tuple, placed["off"].values())) == {(first,)}
    assert set(map(tuple, placed["on"].values())) == {(second,)}
    assert rc == 0


def test_too_few_cores_stops_before_any_engine(tmp_path: Path, monkeypatch) -> None:
    """R142: --pin-cores asking for more cores than the host has: exit status 2 and
    one log line, before the model folder or any engine (bug caught: the
    slots silently sharing cores, or a traceback after engines started)."""
    monkeypatch.setattr(bench, "physical_cores", lambda cpus: [[0], [1]])
    saved = os.sched_getaffinity(0)
    try:
        rc = bench.main(
            ["--out", str(tmp_path / "out"), "--model", str(tmp_path / "model")]
            + ["--pin-cores", "1"]
        )
        assert os.sched_getaffinity(0) == saved  # the driver not pinned either
    finally:
        os.sched_setaffinity(0, saved)
    assert rc == 2
    assert not (tmp_path / "model").exists()
