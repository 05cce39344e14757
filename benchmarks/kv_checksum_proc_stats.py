# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU time and context switches of an engine's processes and threads, from
Linux's /proc (issue 30).

On the tiny model the "on" engine's host ops all ran slower, GPU kernels not
(2026-12-01g). Two readings differ in what /proc shows over a round: more CPU
time in a thread that the "off" engine does not have (work the package adds
somewhere), or the same CPU time with more involuntary switches (the engine
waiting for a core: contention, not work). Standard library only:

    before = sample_tree(pid); ...; after = sample_tree(pid)
    usage = tree_delta(before, after)  # {"process/thread": {...}, ...}
    print(cpu_brief(usage))
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ThreadSample:
    """One thread's counters at one time."""

    process: str  # the process's comm (e.g. "VLLM::EngineCor")
    thread: str  # the thread's comm
    cpu_s: float  # user + system time
    voluntary: int  # switches while waiting (I/O, locks, sleep)
    involuntary: int  # switches forced by the scheduler (waiting for a core)


def _comm(path: Path) -> str:
    try:
        return (path / "comm").read_text().strip()
    except OSError:
        return "?"


def _cpu_seconds(stat: str) -> float:
    """utime + stime of a /proc stat line (fields 14 and 15, after the comm)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _switches(status: str) -> tuple[int, int]:
    values = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            values[key] = int(value)
    return (
        values.get("voluntary_ctxt_switches", 0),
        values.get("nonvoluntary_ctxt_switches", 0),
    )


def children(pid: int, proc: Path = PROC) -> list[int]:
    """`pid` and every descendant process (by parent pid), `pid` first."""
    parents: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    tree, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        tree.append(current)
        queue.extend(sorted(parents.get(current, [])))
    return tree


def sample_threads(pids: Iterable[int], proc: Path = PROC) -> dict[int, ThreadSample]:
    """Per thread id, the counters of every thread of `pids` (gone ones left out)."""
    samples = {}
    for pid in pids:
        process = _comm(proc / str(pid))
        tasks = proc / str(pid) / "task"
        try:
            tids = [int(t.name) for t in tasks.iterdir()]
        except OSError:
            continue
        for tid in tids:
            task = tasks / str(tid)
            try:
                cpu = _cpu_seconds((task / "stat").read_text())
                voluntary, involuntary = _switches((task / "status").read_text())
            except (OSError, ValueError, IndexError):
                continue
            samples[tid] = ThreadSample(
                process, _comm(task), cpu, voluntary, involuntary
            )
    return samples


def sample_tree(pid: int, proc: Path = PROC) -> dict[int, ThreadSample]:
    """The threads of `pid` and its descendants."""
    return sample_threads(children(pid, proc), proc)


def tree_delta(
    before: dict[int, ThreadSample], after: dict[int, ThreadSample], top: int = 8
) -> dict[str, dict[str, float]]:
    """Per "process/thread" name (threads of one name summed), CPU seconds and
    switches between two samples, the `top` by CPU time; "total" sums all.
    A thread that started in between counts from zero."""
    sums: dict[str, dict[str, float]] = {}
    for tid, end in after.items():
        start = before.get(tid)
        name = f"{end.process}/{end.thread}"
        row = sums.setdefault(name, {"cpu_s": 0.0, "voluntary": 0, "involuntary": 0})
        row["cpu_s"] += end.cpu_s - (start.cpu_s if start else 0.0)
        row["voluntary"] += end.voluntary - (start.voluntary if start else 0)
        row["involuntary"] += end.involuntary - (start.involuntary if start else 0)
    total = {
        key: sum(row[key] for row in sums.values())
        for key in ("cpu_s", "voluntary", "involuntary")
    }
    ranked = sorted(sums.items(), key=lambda item: -item[1]["cpu_s"])[:top]
    out = {name: {k: round(v, 3) for k, v in row.items()} for name, row in ranked}
    out["total"] = {k: round(v, 3) for k, v in total.items()}
    return out


def affinity(pid: int, proc: Path = PROC) -> dict[str, list[int]]:
    """The CPUs each process of the tree may run on, by "comm:pid"."""
    cpus = {}
    for child in children(pid, proc):
        try:
            cpus[f"{_comm(proc / str(child))}:{child}"] = sorted(
                os.sched_getaffinity(child)
            )
        except OSError:
            continue
    return cpus


def cpu_brief(usage: dict[str, dict[str, float]], top: int = 3) -> str:
    """ "total 1.20 (30); EngineCor/python 0.90 (12); ..." for a round's log line:
    CPU seconds and involuntary context switches, the total, then the top
    threads."""
    rows = [(n, r) for n, r in usage.items() if n != "total"][:top]
    if "total" in usage:
        rows.insert(0, ("total", usage["total"]))
    return (
        "; ".join(
            f"{name} {row['cpu_s']:.2f} ({int(row['involuntary'])})"
            for name, row in rows
        )
        or "-"
    )
