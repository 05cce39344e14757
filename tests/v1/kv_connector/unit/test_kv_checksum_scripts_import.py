# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every benchmark and GPU driver script still imports (no requirement: the
scripts run on the GPU host, where a stale import costs a device call).

Bug caught: a module move (the 2026-12-01 layout change) leaving a script
importing a path that no longer exists; the host-step benchmark shipped so
for an hour. Each script is imported as a module (its `main` never runs).
"""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
SCRIPTS = sorted(
    str(path.relative_to(ROOT))
    for folder in ("benchmarks", "examples", "scripts")
    for path in (ROOT / folder).rglob("*.py")
)
PACKAGE = "vllm.distributed.kv_transfer.kv_checksum"


def _package_imports(path: Path) -> list[str]:
    """The package modules a script imports, anywhere in its body."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PACKAGE):
                names.append(node.module)
                names.extend(
                    f"{node.module}.{alias.name}"
                    for alias in node.names
                    if node.module == PACKAGE
                )
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names if a.name.startswith(PACKAGE))
    return names


def test_scripts_exist() -> None:
    assert "benchmarks/benchmark_kv_checksum_serve.py" in SCRIPTS


@pytest.mark.kv_checksum_capability("plugin")
@pytest.mark.parametrize("script", SCRIPTS)
def test_package_imports_of_scripts_resolve(script: str) -> None:
    """Every package module a script names (also inside functions) imports."""
    for name in _package_imports(ROOT / script):
        importlib.import_module(name)


def test_a_stale_path_is_caught(tmp_path: Path) -> None:
    """Positive control: the old flat path of the views module is reported."""
    stale = tmp_path / "stale.py"
    stale.write_text(f"from {PACKAGE}.views import attention_views\n")
    (name,) = _package_imports(stale)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
