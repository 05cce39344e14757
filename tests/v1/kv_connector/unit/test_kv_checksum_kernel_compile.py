# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Triton kernels compile for the H200 (sm_90) on this CPU machine (R55, R143).

Triton's CPU interpreter runs the kernel as Python and accepts code that its
compiler front end rejects: on 2026-12-01 a kernel whose `valid` was an int64
before an `if` and redefined as int32 inside it passed every interpreter test
and failed to compile on the H200, so every GPU engine ran with checksums
switched off by the last-resort guard. These tests compile the checksum
kernel for every test case's compile-time constants under every launch
configuration the benchmark sweeps, and the benchmark's plain-read kernel,
through Triton's real compiler to an sm_90 binary (ptxas ships with Triton);
they fail on that bug.
"""

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tests.v1.kv_connector.unit.test_kv_checksum_kernels import (  # noqa: E402
    CASES,
    launch_constants,
)
from vllm.distributed.kv_transfer.kv_checksum.definition import kernels  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
POINTERS = {"table_ptr", "rows_ptr", "out_ptr", "x_ptr", "order_ptr"}
BASE = kernels.default_config()
CONFIGS = {
    "default": BASE,
    "small_items": kernels.LaunchConfig(
        **{**vars(BASE), "chunk_pieces": 2048, "num_warps": 4}
    ),
    # The default is the vector loop (issue 30): the masked loop compiles too.
    "scalar": kernels.LaunchConfig(**{**vars(BASE), "vector_full_tiles": False}),
    # The default walks dense token-major blocks in memory order: the vector
    # loops they took before compile too.
    "head_order": kernels.LaunchConfig(**{**vars(BASE), "token_order_tiles": False}),
}


def _ptxas_available() -> bool:
    backend = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    return backend.exists()


pytestmark = pytest.mark.skipif(
    not _ptxas_available(), reason="Triton without its bundled ptxas"
)


def compile_for_h200(fn: Any, constants: dict[str, Any]) -> Any:
    """Compile a @triton.jit function with these compile-time constants
    (num_warps included) for sm_90; runtime arguments are int64 scalars or
    int64 pointers."""
    constants = dict(constants)
    num_warps = constants.pop("num_warps", 4)
    names = fn.arg_names
    signature = {
        name: "constexpr"
        if name in constants
        else ("*i64" if name in POINTERS else "i64")
        for name in names
    }
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    source = ASTSource(fn, signature, constexprs)
    return triton.compile(source, target=H200, options={"num_warps": num_warps})


@functools.cache
def _case_constants(name: str, config: str) -> list[tuple[Any, ...]]:
    """The distinct compile-time constants of a case's launches."""
    seen: dict[tuple[Any, ...], None] = {}
    for spec in CASES[name]("cpu").launches:
        # The CUDA path's constants, built on CPU views.
        constants = launch_constants(spec, CONFIGS[config])
        seen[tuple(sorted(constants.items()))] = None
    return list(seen)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_checksum_kernel_compiles_for_sm90(name: str, config: str) -> None:
    """Every case's launch compiles to an sm_90 binary under `config`."""
    for items in _case_constants(name, config):
        compiled = compile_for_h200(kernels._kv_checksum_kernel, dict(items))
        assert compiled.asm.get("cubin"), "no sm_90 binary"


def test_plain_read_kernel_compiles_for_sm90() -> None:
    """The benchmark's plain-read anchor compiles too (a broken anchor would
    leave the R143 ratio unmeasured on the GPU)."""
    path = Path(__file__).resolve().parents[4] / "benchmarks/kernels"
    spec = importlib.util.spec_from_file_location(
        "kernel_plain_read", path / "kernel_plain_read.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for even in (True, False):
        compiled = compile_for_h200(
            module._plain_sum_kernel, {"BLOCK": 1024, "EVEN": even, "num_warps": 8}
        )
        assert compiled.asm.get("cubin")


def test_interpreter_accepted_bug_fails_to_compile(tmp_path: Path) -> None:
    """Positive control: the exact shape of the 2026-12-01 bug (a variable
    redefined with another type inside an `if`) does not compile, so the
    tests above can fail."""
    source = tmp_path / "bad_kernel.py"
    source.write_text(
        "import triton\nimport triton.language as tl\n\n\n"
        "@triton.jit\n"
        "def bad(x_ptr, out_ptr):\n"
        "    valid = tl.load(x_ptr)\n"
        "    if valid > 0:\n"
        "        valid = tl.minimum(valid, 16).to(tl.int32)\n"
        "    tl.store(out_ptr, valid)\n"
    )
    spec = importlib.util.spec_from_file_location("bad_kernel", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    with pytest.raises(triton.compiler.errors.CompilationError):
        compile_for_h200(module.bad, {})
