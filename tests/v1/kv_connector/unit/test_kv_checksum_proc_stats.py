# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmarks' per-thread CPU counters (issue 30: is the tiny model's "on"
engine doing more work, or waiting for a core?), read from a /proc tree written
by hand, so the expected figures come from the test, not from the reader."""

import os
import threading
from pathlib import Path

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

ROOT = Path(__file__).resolve().parents[4]
stats = load_script("proc_stats", ROOT / "benchmarks/kv_checksum_proc_stats.py")


def _task(
    root: Path, pid: int, tid: int, comm: str, ticks: tuple[int, int], switches
) -> None:
    """One thread of `pid` with utime/stime `ticks` and (voluntary,
    involuntary) `switches`; its stat's comm holds a space and a ")"."""
    task = root / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "comm").write_text(comm + "\n")
    fields = ["S", "1"] + ["0"] * 9 + [str(ticks[0]), str(ticks[1])] + ["0"] * 30
    (task / "stat").write_text(f"{tid} (odd) name) " + " ".join(fields) + "\n")
    (task / "status").write_text(
        f"Name:\t{comm}\nvoluntary_ctxt_switches:\t{switches[0]}\n"
        f"nonvoluntary_ctxt_switches:\t{switches[1]}\n"
    )


def _process(root: Path, pid: int, ppid: int, comm: str) -> None:
    proc = root / str(pid)
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "comm").write_text(comm + "\n")
    fields = ["S", str(ppid)] + ["0"] * 40
    (proc / "stat").write_text(f"{pid} (a (b) c) " + " ".join(fields) + "\n")


def test_children_follow_parent_pids_past_odd_comms(tmp_path: Path) -> None:
    """R142 (where host time goes): the tree of a server: its engine core
    and that one's child, not a stranger. Bug caught (tried): the parent
    pid read by splitting the whole stat line, which a comm with spaces and
    parentheses shifts."""
    _process(tmp_path, 10, 1, "vllm")
    _process(tmp_path, 12, 10, "VLLM::EngineCor")
    _process(tmp_path, 15, 12, "python3")
    _process(tmp_path, 11, 1, "stranger")
    (tmp_path / "self").mkdir()
    assert stats.children(10, tmp_path) == [10, 12, 15]


def test_tree_delta_sums_threads_by_name(tmp_path: Path) -> None:
    """R142: CPU seconds are utime + stime in clock ticks; two threads of one name
    add up, a thread started between the samples counts from zero, and the
    total covers every thread. Bugs caught (tried): stime left out, the
    involuntary count read from the voluntary line, a new thread dropped."""
    tick = stats.TICKS
    _process(tmp_path, 20, 1, "VLLM::EngineCor")
    _task(tmp_path, 20, 20, "python3", (tick, 0), (5, 1))
    _task(tmp_path, 20, 21, "pool", (0, 0), (0, 0))
    _task(tmp_path, 20, 22, "pool", (0, 0), (0, 0))
    before = stats.sample_tree(20, tmp_path)
    _task(tmp_path, 20, 20, "python3", (3 * tick, tick), (9, 4))
    _task(tmp_path, 20, 21, "pool", (tick, 0), (1, 0))
    _task(tmp_path, 20, 22, "pool", (0, tick), (0, 2))
    _task(tmp_path, 20, 23, "new", (tick, tick), (0, 7))
    usage = stats.tree_delta(before, stats.sample_tree(20, tmp_path))
    assert usage["VLLM::EngineCor/python3"] == {
        "cpu_s": 3.0,
        "voluntary": 4,
        "involuntary": 3,
    }
    assert usage["VLLM::EngineCor/pool"] == {
        "cpu_s": 2.0,
        "voluntary": 1,
        "involuntary": 2,
    }
    assert usage["VLLM::EngineCor/new"]["cpu_s"] == 2.0
    assert usage["total"] == {"cpu_s": 7.0, "voluntary": 5, "involuntary": 12}
    assert list(usage)[0] == "VLLM::EngineCor/python3"  # ranked by CPU time
    assert stats.cpu_brief(usage, 1) == (
        "total 7.00 (12); VLLM::EngineCor/python3 3.00 (3)"
    )


def test_real_proc_lists_this_thread() -> None:
    """R142: on Linux's own /proc: this process's tree holds the calling thread."""
    samples = stats.sample_tree(os.getpid())
    assert threading.get_native_id() in samples
    assert all(s.cpu_s >= 0 for s in samples.values())
