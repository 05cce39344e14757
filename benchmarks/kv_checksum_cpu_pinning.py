# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Disjoint CPU sets for the engine slots of a benchmark, whole physical cores
each (issue 30).

Two engines sharing a host differ by where the kernel runs their threads: a
main thread on the SMT sibling of a busy one runs every host op slower. Giving
each slot its own physical cores (both hyperthreads), and the client the rest,
takes that out of an on/off comparison. Standard library only (Linux /sys):

    cores = physical_cores(usable_cpus())
    slots, rest = split_cores(cores, per_slot=3, slots=2)
"""

import os
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    return set(os.sched_getaffinity(0))


def _cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def physical_cores(cpus: set[int], sys_cpu: Path = SYS_CPU) -> list[list[int]]:
    """`cpus` grouped by physical core (SMT siblings together, from each CPU's
    topology/thread_siblings_list), in order of each core's lowest CPU; a CPU
    whose topology cannot be read is a core of its own."""
    cores: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        path = sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            siblings = _cpu_list(path.read_text()) & cpus
        except (OSError, ValueError):
            siblings = {cpu}
        cores.setdefault(min(siblings | {cpu}), []).append(cpu)
    return [cores[key] for key in sorted(cores)]


def split_cores(
    cores: list[list[int]], per_slot: int, slots: int = 2
) -> tuple[list[set[int]], set[int]]:
    """`slots` sets of `per_slot` whole cores each, in core order, and the
    CPUs left for everything else. Raises ValueError when fewer than
    slots * per_slot + 1 cores exist (the client needs one)."""
    if per_slot < 1 or len(cores) < slots * per_slot + 1:
        raise ValueError(
            f"{len(cores)} physical cores cannot give {slots} slots "
            f"{per_slot} each and keep one for the client"
        )
    sets = [
        {cpu for core in cores[k * per_slot : (k + 1) * per_slot] for cpu in core}
        for k in range(slots)
    ]
    rest = {cpu for core in cores[slots * per_slot :] for cpu in core}
    return sets, rest
