# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Named trials of the package's module switches, for one engine only (issue 30).

`scripts/gpu_runs.sh trial-*` edits a switch in the machine's site copy, so
both engines of a benchmark run it and an A/B of two settings takes two
benchmarks, each against checksums off. A trial here is set in one process
tree instead: `trial_site/sitecustomize.py`, first on an engine's PYTHONPATH
with KV_CHECKSUM_TRIAL=NAME[,NAME], installs `install`'s import hook, which sets
the switch right after its module is first imported. The benchmark's
`--trial NAME` runs both slots with checksums on, the trial in the "on" slot,
so its pairs compare the trial with the default directly.
"""

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_WIRING = "vllm.distributed.kv_transfer.kv_checksum.wiring"


@dataclass(frozen=True)
class Trial:
    """One module switch and the value the trial gives it."""

    module: str
    name: str
    value: Any


TRIALS: dict[str, Trial] = {
    # Both offload tiers save a step's stores with its loads (default False).
    "early-saves": Trial(f"{_WIRING}.offloading", "SAVE_STORES_WITH_LOADS", True),
    # SimpleCPUOffloadConnector's copy hand-offs not held (default True).
    "no-hold": Trial(f"{_WIRING}.simple_cpu_offload", "HOLD_COPY_HAND_OFFS", False),
}


def parse(names: str) -> list[Trial]:
    """The trials of a comma-separated list; unknown names raise ValueError."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in TRIALS]
    if unknown:
        raise ValueError(f"unknown trials {unknown}; known: {sorted(TRIALS)}")
    return [TRIALS[n] for n in chosen]


def _set_switches(module: ModuleType, trials: Sequence[Trial]) -> None:
    """The trials' values on `module`; a switch it lacks raises (a renamed
    switch must not turn the trial silently into the default)."""
    for trial in trials:
        if not hasattr(module, trial.name):
            raise AttributeError(f"{module.__name__} has no switch {trial.name}")
        setattr(module, trial.name, trial.value)


class _SetAfterImport(importlib.abc.MetaPathFinder):
    """Finds the trials' modules as the path would, and sets each switch
    once its module has run (`_set_switches`)."""

    def __init__(self, trials: Sequence[Trial]) -> None:
        self.by_module: dict[str, list[Trial]] = {}
        for trial in trials:
            self.by_module.setdefault(trial.module, []).append(trial)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        trials = self.by_module.get(fullname)
        if trials is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _set_switches(module, trials)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(names: str) -> list[Trial]:
    """Set the named trials' switches when their modules are imported (at
    once where already imported); nothing for an empty list."""
    trials = parse(names)
    if not trials:
        return []
    finder = _SetAfterImport(trials)
    for name, of_module in finder.by_module.items():
        if name in sys.modules:
            _set_switches(sys.modules[name], of_module)
    sys.meta_path.insert(0, finder)
    print(f"[kv_checksum_trials] pid {os.getpid()}: {names}", file=sys.stderr)
    return trials
