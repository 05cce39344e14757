# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The SASS loop counter of the kernel benchmarks (R143: instructions per
piece, offline) on a hand-made listing in nvdisasm's layout, and its count of
the vector_full_tiles variant (issue 30)."""

import dataclasses
from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script
from vllm.distributed.kv_transfer.kv_checksum.definition import kernels

PATH = Path(__file__).resolve().parents[4] / "benchmarks/kernels/kernel_sass_count.py"
sass = load_script("kernel_sass_count", PATH)

LISTING = "\n".join(
    [
        "--:-:-:-:1\tMOV R1, c[0x0][0x28];",
        "--:-:-:-:6\t@P0 BRA LBB1;",
        "LBB2:",
        "--:-:2:-:4\t@!P2 LDG.E.64 R12, desc[UR20][R18.64];",
        "--:-:3:-:4\t@!P0 LDG.E.128 R14, desc[UR20][R26.64];",
        "--:-:-:-:1\tIMAD R13, R13, 0x1ce4e5b9, RZ;",
        "--:-:-:-:1\tIMAD.WIDE.U32 R12, R12, 0x1ce4e5b9, RZ;",
        "--:-:-:-:1\tSHF.R.U64 R41, R12, 0x1e, R13;",
        "--:-:-:-:6\t@P0 BRA LBB2;",
        "LBB1:",
        "--:-:-:-:1\tEXIT;",
    ]
)


def test_loops_count_the_body_and_its_loads() -> None:
    """One loop from its label to the branch back: 6 instructions (the branch
    counted), 3 pieces loaded (a 64-bit and a 128-bit load); IMAD and
    IMAD.WIDE count as one opcode; the forward branch to LBB1 is no loop (bug
    caught: a forward branch read as a loop, predicates read as opcodes, or a
    vector load counted as one piece)."""
    found = sass.loops(LISTING)
    assert found == [
        {
            "label": "LBB2",
            "instructions": 6,
            "loads": 3,
            "ops": {"LDG": 2, "IMAD": 2, "SHF": 1, "BRA": 1},
        }
    ]


def test_instruction_drops_control_codes_and_predicates() -> None:
    assert sass.instruction("--:-:2:-:4\t@!P2 LDG.E.64 R12, [R18.64];") == (
        "LDG.E.64 R12, [R18.64]"
    )
    assert sass.instruction("LBB2:") is None
    assert sass.instruction("") is None


def test_vector_variant_cuts_instructions_per_piece() -> None:
    """Offline sm_90 count of the vLLM block (8 x 16 x 64, head-major) as the
    JIT would specialize it: the vector_full_tiles variant's full-row loop has
    fewer instructions a piece than the default's narrow loop and loads with
    128-bit loads (bug caught: the variant's constants not reaching the
    kernel, so the GPU run would time the default twice)."""
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    if not ptxas.exists():
        pytest.skip("Triton without its bundled ptxas")
    per_piece = {}
    for name in ("scalar_8w", "vector_full_tiles_8w"):
        config = dataclasses.replace(kernels.default_config(), **sass.VARIANTS[name])
        constants, warps, runtime = sass.launch_constants(8, 16, 64, 1, config)
        code = sass.compile_sass(constants, warps, runtime)
        found = sass.piece_loops(code)
        assert found, name
        per_piece[name] = min(x["instructions"] / x["loads"] for x in found)
        if name != "scalar_8w":
            assert "LDG.E.128" in code
    assert per_piece["vector_full_tiles_8w"] < per_piece["scalar_8w"] - 2, per_piece


def test_mixed_read_does_the_kernels_arithmetic() -> None:
    """The kernel benchmark's mixed read (its anchor for what the checksum's
    arithmetic alone costs, R143) compiles for sm_90 to a loop within 1.5
    instructions a piece of the checksum kernel's full-tile loop at the
    benchmark's block (8 heads x 16 tokens x 32 pieces; 32.6 against 31.8 on
    2026-12-03), with 128-bit loads (bug caught: the mix folded away, or a
    64 x 32 weight product instead of the kernel's 64 x 64, so the anchor
    times a cheaper loop than the kernel's: 29.6 a piece)."""
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    if not ptxas.exists():
        pytest.skip("Triton without its bundled ptxas")
    code = sass.compile_mixed_read_sass(4096, 8)
    found = sass.piece_loops(code)
    assert len(found) == 1
    mixed = found[0]["instructions"] / found[0]["loads"]
    constants, warps, runtime = sass.launch_constants(
        8, 16, 32, 1, kernels.default_config()
    )
    loops = sass.piece_loops(sass.compile_sass(constants, warps, runtime))
    kernel = min(x["instructions"] / x["loads"] for x in loops)
    assert abs(mixed - kernel) <= 1.5, (mixed, kernel)
    assert "LDG.E.128" in code
