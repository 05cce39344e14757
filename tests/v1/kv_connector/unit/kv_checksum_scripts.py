# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Import a script of the repository (a benchmark or an example) as a module,
for the tests that check its pure logic; run a check under Triton's
interpreter."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType


def load_script(name: str, path: Path) -> ModuleType:
    """The module at `path`, registered as `name` (dataclasses look their
    module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_interpreted(check: str, *argv: str, timeout: int = 600) -> None:
    """Run the Python source `check` (with `argv`) in a subprocess with
    TRITON_INTERPRET=1, which must be set before Triton is imported; it
    must exit 0 and print "ok" last."""
    done = subprocess.run(
        [sys.executable, "-c", check, *argv],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
