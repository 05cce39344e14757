# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Named trials of the package's module switches (issue 30): one table, two ways.

In one engine only: `trial_site/sitecustomize.py`, first on an engine's
PYTHONPATH with KV_CHECKSUM_TRIAL=NAME[,NAME], installs `install`'s import
hook, which sets the switch right after its module is first imported. The
benchmark's `--trial NAME` runs both slots with checksums on, the trial in the
"on" slot, so its pairs compare the trial with the default directly.

In every engine of a machine: `scripts/gpu_runs.sh trial-NAME` runs
`python3 kv_checksum_trials.py --site DIR NAME`, which rewrites the switch's
assignment in the machine's site copy of the package (`update-package`
undoes it), for runs whose other arm is a later benchmark.
"""

import argparse
import importlib.abc
import importlib.machinery
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

_PACKAGE = "vllm.distributed.kv_transfer.kv_checksum"
_WIRING = f"{_PACKAGE}.wiring"
_KERNELS = f"{_PACKAGE}.definition.kernels"


@dataclass(frozen=True)
class Trial:
    """One module switch and the value the trial gives it."""

    module: str
    name: str
    value: Any


TRIALS: dict[str, Trial] = {
    # Both offload tiers save a step's stores with its loads in start_load_kv
    # when Model Runner V2 calls it after the forward (default False since
    # the 2026-12-05 A/B).
    "early-saves": Trial(f"{_WIRING}.offloading", "SAVE_STORES_WITH_LOADS", True),
    # SimpleCPUOffloadConnector's copy hand-offs go to vLLM's copy thread
    # where vLLM makes them, not after the step's checksum work (default True
    # since 2026-12-05).
    "no-hold": Trial(f"{_WIRING}.simple_cpu_offload", "HOLD_COPY_HAND_OFFS", False),
    # While the hand-offs are held, SimpleCPUOffloadConnector's entry moves
    # (restores, store entries, copies to slots) make uploads of their own,
    # not ride in the checksum pass's (default True since 2026-12-05).
    "own-uploads": Trial(f"{_WIRING}.simple_cpu_offload", "ENTRY_MOVES_IN_PASS", False),
    # A store's copy to its host slots made as a move of its own after the
    # entry write, not in the write (default folded since 2026-12-05e; on
    # CUDA 8-9 % slower a store save, 2026-12-06).
    "copy-apart": Trial(f"{_PACKAGE}.engine.block_table", "FOLD_STORE_COPIES", False),
    # Step results written into pinned host memory by a kernel.
    "zero-copy": Trial(_KERNELS, "ZERO_COPY_RESULTS", True),
    # Chunks of 4,096 pieces (SPEC R57 says 16,384); run cuda-tests after it.
    "kernel": Trial(_KERNELS, "CHUNK_PIECES", 4096),
    # Every launch through Triton's JIT, the other arm of the direct launch.
    "jit-launch": Trial(_KERNELS, "DIRECT_LAUNCH", False),
    # Every checksum pass reuses its pinned upload, device copy and pinned
    # results once the step's record was waited for (off by SPEC R52).
    "step-buffers": Trial(f"{_PACKAGE}.engine.launches", "REUSE_STEP_BUFFERS", True),
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


def edit_site(site: Path, names: str) -> list[str]:
    """Rewrite the named trials' switches in the package copy under `site`
    (each module's one `NAME = ...` line at column 0); returns the new lines.
    A switch without exactly one such line raises (a renamed switch must not
    leave the machine on the default under the trial's name)."""
    lines = []
    for trial in parse(names):
        path = site / (trial.module.replace(".", "/") + ".py")
        text = path.read_text()
        pattern = re.compile(rf"^{re.escape(trial.name)} = .*$", re.MULTILINE)
        found = list(pattern.finditer(text))
        if len(found) != 1:
            raise ValueError(
                f"{path}: {len(found)} assignments of {trial.name}, expected 1"
            )
        line = f"{trial.name} = {trial.value!r}"
        path.write_text(text[: found[0].start()] + line + text[found[0].end() :])
        lines.append(f"{path}: {line}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, required=True, help="e.g. /tmp/site")
    parser.add_argument("names", help=f"comma-separated, of {sorted(TRIALS)}")
    args = parser.parse_args()
    try:
        edited = edit_site(args.site, args.names)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    for line in edited:
        print(line)


if __name__ == "__main__":
    main()
