# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The package's layers (R6, R10; issue 28): imports point down, from the wiring
through the engine and the connector-specific parts to the wire format and the
checksum definition, and only the wiring reaches into vLLM internals."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

PKG = "vllm.distributed.kv_transfer.kv_checksum"
ROOT = Path(__file__).resolve().parents[4] / "vllm/distributed/kv_transfer/kv_checksum"

# Lower layers first; a module may import its own subpackage or a lower layer.
LAYERS = {
    "config": 0,
    "definition": 0,
    # carrier.py: the carrier enum, below the definition that re-exports it
    # (imports nothing; the file of the series' 0002).
    "carrier": -1,
    "wire": 1,
    # version.py: what a checksum configuration gets on another vLLM (R144).
    "version": 1,
    "carriers": 2,
    "offload": 2,
    "hybrid": 2,
    "faults": 2,
    "engine": 3,
    "wiring": 4,
    "plugin": 5,
    "__main__": 5,
    "__init__": 5,
}
# What the core (everything but wiring/ and plugin.py) imports from vLLM: its
# logger, public types and small utilities, read-only.
ALLOWED_VLLM = {
    "vllm.logger",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.request",
    "vllm.utils.math_utils",
    "vllm.model_executor.models.utils",
    "vllm.distributed.kv_transfer.kv_connector.utils",
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config",
    # config.py: whether the configured connector declares a carrier (R15).
    "vllm.config",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
    "vllm.v1.executor.multiproc_executor",
    "vllm.utils.import_utils",
}


def _part(module: str) -> str:
    """The layer name of a package module: its subpackage or top-level module."""
    return module[len(PKG) + 1 :].split(".")[0] if module != PKG else "__init__"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        modules[".".join([PKG, *parts])] = path
    return modules


def _imports(module: str, path: Path, top_level_only: bool = False) -> set[str]:
    """Every module `module` imports (`from pkg import sub` yields pkg.sub)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _package_imports(modules: dict[str, Path], module: str, **kw: bool) -> set[str]:
    return {
        name for name in _imports(module, modules[module], **kw) if name in modules
    } - {module}


def test_imports_point_down() -> None:
    """No module imports from a higher layer or from a sibling part of its own
    layer (wiring -> engine -> carriers/offload/hybrid/faults -> wire ->
    definition). Catches, e.g., the offload tier importing the engine's worker
    (the old `offload_connectors -> worker.host_to_device` arrow) or the
    payload importing the scheduler: the layers would form a circle."""
    modules = _modules()
    wrong = []
    for module in modules:
        own = _part(module)
        for target in _package_imports(modules, module):
            other = _part(target)
            if other == own or target == PKG:
                continue
            if LAYERS[other] >= LAYERS[own]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_import_cycle_at_module_level() -> None:
    """The modules' top-level imports form no cycle, so any of them can be
    imported first. Catches two modules importing each other at import time
    (one of them would see the other half-initialized)."""
    modules = _modules()
    graph = {m: _package_imports(modules, m, top_level_only=True) for m in modules}
    # A package's own __init__ is imported before its submodules: no edge back.
    graph = {
        m: {t for t in targets if not (m.startswith(t + ".") and t != PKG)}
        for m, targets in graph.items()
    }
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = 2

    for module in modules:
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_only_the_wiring_reaches_into_vllm() -> None:
    """Outside wiring/ and plugin.py, imports from vLLM are limited to the
    allow-list of public types and utilities. Catches a core module starting to
    read or wrap a vLLM internal (e.g. the Scheduler or a connector class),
    which belongs in the wiring layer."""
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        if _part(module) in ("wiring", "plugin"):
            continue
        for name in _imports(module, path):
            if not name.startswith("vllm.") or name.startswith(PKG):
                continue
            if not any(name == a or name.startswith(a + ".") for a in ALLOWED_VLLM):
                wrong.append(f"{module} -> {name}")
    assert wrong == []


def test_kernels_import_only_torch_and_triton() -> None:
    """The kernel module stays loadable by file path (benchmarks, CUDA tests):
    it imports only the standard library, torch and triton. Catches a kernel
    module that starts importing the package or vLLM."""
    path = ROOT / "definition" / "kernels.py"
    tops = {name.split(".")[0] for name in _imports(PKG + ".definition.kernels", path)}
    assert not tops & {"vllm", "numpy", "msgspec"}, tops
