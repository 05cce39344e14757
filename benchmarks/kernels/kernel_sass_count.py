# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Instructions per 8-byte piece in the checksum kernel's loops, compiled for
Hopper (sm_90) on any machine: no GPU needed (issue 30 item 1, R143).

Compiles `_kv_checksum_kernel` with the launch constants the package picks
for a block shape (a KVChecksumLaunch built on a CPU cache: its tile, warps and
fast-path constants) under each LaunchConfig variant of VARIANTS, with the
runtime arguments typed as Triton's JIT types them at such a launch (unless
`--generic`), disassembles it with the `nvdisasm` Triton ships, finds every
loop (a label and the branch back to it), and divides each loop's instructions
by the pieces one thread loads per iteration (a 64-bit load one, a 128-bit
load two). The H200 measured the kernel at 0.84-0.92 of a plain read
(2026-12-01): a kernel change that lowers these counts is worth a GPU run; one
that raises them is not.

    python benchmarks/kernels/kernel_sass_count.py [--heads 8 --tokens 16 \\
        --pieces 32 --layout head --variant scalar_8w --generic]

Prints per variant and loop: instructions, loads and the opcode counts per
piece. The SASS is that of the Triton installed here (the H200 host runs
Triton 3.6).
"""

import argparse
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# A SASS line of nvdisasm's text: optional control codes, then the instruction.
LABEL = re.compile(r"^\s*(\.?L\w+|LBB\w+):")
BRANCH_BACK = re.compile(r"BRA\s+(\.?L\w+|LBB\w+)")
PIECES_PER_LOAD = {"LDG.E.64": 1, "LDG.E.128": 2, "LDG.E.64.CONSTANT": 1}


def compile_sass(
    constants: dict[str, Any], num_warps: int, runtime: dict[str, Any] | None = None
) -> str:
    """SASS text of the checksum kernel for sm_90 with these constexprs.

    Without `runtime` every other argument is a generic int64 (pointer); with
    it (argument name -> a launch's value) each is typed and specialized the
    way Triton's JIT does at a launch with those values: an int of 1 becomes a
    constant, ints and pointers divisible by 16 carry that hint, small ints
    are 32-bit (arguments named in the kernel's do_not_specialize keep their
    type only).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm.distributed.kv_transfer.kv_checksum.definition import kernels

    fn = kernels._kv_checksum_kernel
    names = list(fn.arg_names)
    constants = dict(constants)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for name in names:
        if name in constants:
            continue
        if runtime is None:
            signature[name] = "*i64" if name.endswith("_ptr") else "i64"
            continue
        specialize = name not in fn.do_not_specialize
        if name.endswith("_ptr"):
            kind, hint = "*i64", "D" if specialize and runtime[name] % 16 == 0 else ""
        else:
            from triton._C.libtriton import native_specialize_impl
            from triton.backends.nvidia.compiler import CUDABackend

            kind, hint = native_specialize_impl(
                CUDABackend, runtime[name], False, specialize, True
            )
        if kind == "constexpr":
            constants[name] = hint
            continue
        signature[name] = kind
        if hint == "D":
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs=attrs,
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    return compiled.asm["sass"]


def compile_mixed_read_sass(block: int, num_warps: int) -> str:
    """SASS of kernel_plain_read.py's mixed read (the plain read's loop with
    the checksum's arithmetic) for sm_90: pointers and the word count
    16-divisible, as at the benchmark's launches."""
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = Path(__file__).resolve().with_name("kernel_plain_read.py")
    spec = importlib.util.spec_from_file_location("kernel_plain_read", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module._mixed_sum_kernel
    names = list(fn.arg_names)
    source = ASTSource(
        fn=fn,
        signature={
            "x_ptr": "*i64",
            "out_ptr": "*i64",
            "n": "i32",
            "slice_weight": "i32",
            "BLOCK": "constexpr",
            "EVEN": "constexpr",
        },
        constexprs={(names.index("BLOCK"),): block, (names.index("EVEN"),): True},
        attrs={
            (names.index(name),): [["tt.divisibility", 16]]
            for name in ("x_ptr", "out_ptr", "n")
        },
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    return compiled.asm["sass"]


def instruction(line: str) -> str | None:
    """The instruction of a SASS text line (control codes and predicate
    dropped), or None for labels, directives and blanks."""
    text = line.split("\t")[-1].strip().rstrip(";")
    if not text or text.endswith(":") or text.startswith((".", "/")):
        return None
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def loops(sass: str) -> list[dict[str, Any]]:
    """Every loop of the SASS (a label and a later branch back to it): its
    instruction count, the 8-byte pieces its global loads bring a thread, and
    its opcode counts."""
    lines = sass.splitlines()
    labels = {}
    for index, line in enumerate(lines):
        match = LABEL.match(line.split("\t")[-1])
        if match:
            labels[match[1]] = index
    found = []
    for index, line in enumerate(lines):
        match = BRANCH_BACK.search(line)
        if not match or labels.get(match[1], index) >= index:
            continue  # a forward branch, or an unknown label
        body = [instruction(x) for x in lines[labels[match[1]] + 1 : index + 1]]
        ops = Counter(i.split()[0].split(".")[0] for i in body if i)
        # Pieces loaded: an LDG.E.64 one, an LDG.E.128 (a vector load) two.
        loads = sum(PIECES_PER_LOAD.get(i.split()[0], 0) for i in body if i)
        found.append(
            {
                "label": match[1],
                "instructions": sum(ops.values()),
                "loads": loads,
                "ops": dict(ops.most_common()),
            }
        )
    return found


def launch_constants(
    heads: int,
    tokens: int,
    pieces: int,
    kernel_blocks: int,
    config: Any = None,
    layout: str = "head",
    blocks: int = 2048,
) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """The constexprs, warps and runtime arguments KVChecksumLaunch picks for a
    cache of `blocks` blocks of this shape (int64 pieces, torch's 16-byte
    aligned allocation; `layout` "head": [B, KB, H, T, P] dense, "token":
    [B, KB, T, H, P] seen as heads first) under `config` (default LaunchConfig).

    The launch is built on a CPU tensor with the PyTorch backend and asked for
    its Triton constants, so the count follows the package's own choices.
    """
    import torch

    from vllm.distributed.kv_transfer.kv_checksum.definition import kernels

    if layout == "head":
        view = torch.empty(
            (blocks, kernel_blocks, heads, tokens, pieces), dtype=torch.int64
        )
    else:
        view = torch.empty(
            (blocks, kernel_blocks, tokens, heads, pieces), dtype=torch.int64
        ).transpose(2, 3)
    launch = kernels.KVChecksumLaunch([view], [0], [0], "torch", config=config)
    launch._init_triton()
    constants: dict[str, Any] = dict(launch._constants)
    warps = int(constants.pop("num_warps"))
    strides = dict(
        zip(
            (
                "block_stride",
                "kernel_block_stride",
                "head_stride",
                "token_stride",
                "piece_stride",
            ),
            launch._strides,
        )
    )
    # A step's rows [3, R] (R = blocks) and an output [R, 1], 16-byte aligned.
    runtime = dict(
        table_ptr=1 << 20,
        rows_ptr=1 << 20,
        out_ptr=1 << 20,
        rows_field_stride=blocks,
        rows_row_stride=1,
        out_row_stride=1,
        out_col_stride=1,
        num_rows=blocks,
        num_layers=1,
        **strides,
    )
    return constants, warps, runtime


def piece_loops(sass: str) -> list[dict[str, Any]]:
    """The loops that load pieces (not the trap loop after the exit)."""
    return [loop for loop in loops(sass) if loop["loads"]]


# LaunchConfig overrides counted (the variants benchmark_kv_checksum.py
# --variants times on the GPU).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # The default until 2026-12-02c (masked narrow loop, 8 warps).
    "scalar_8w": {"vector_full_tiles": False, "num_warps": 8},
    "vector_full_tiles_8w": {"vector_full_tiles": True, "num_warps": 8},
    # The default until 2026-12-02d: token-major blocks walked in head order.
    "head_order": {"token_order_tiles": False},
}


def main() -> None:
    import dataclasses

    from vllm.distributed.kv_transfer.kv_checksum.definition import kernels

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--pieces", type=int, default=32, help="8-byte pieces a head")
    parser.add_argument("--kernel-blocks", type=int, default=1)
    parser.add_argument("--layout", choices=["head", "token"], default="head")
    parser.add_argument(
        "--variant",
        choices=sorted(VARIANTS),
        action="append",
        help="LaunchConfig variants to count (default: all)",
    )
    parser.add_argument(
        "--mixed-read",
        action="store_true",
        help="also count the benchmark's mixed read (its anchor for what the "
        "arithmetic alone costs) at 4096 words and 8 warps",
    )
    parser.add_argument(
        "--generic",
        action="store_true",
        help="every runtime argument a generic int64, as counted before 2026-12-01b "
        "(default: specialized like the JIT at a launch)",
    )
    args = parser.parse_args()
    for name in args.variant or VARIANTS:
        config = dataclasses.replace(kernels.default_config(), **VARIANTS[name])
        constants, warps, runtime = launch_constants(
            args.heads,
            args.tokens,
            args.pieces,
            args.kernel_blocks,
            config,
            args.layout,
        )
        print(f"{name}: constants {constants}, num_warps {warps}")
        print_loops(compile_sass(constants, warps, None if args.generic else runtime))
    if args.mixed_read:
        print("mixed read: BLOCK 4096, num_warps 8")
        print_loops(compile_mixed_read_sass(4096, 8))


def print_loops(sass: str) -> None:
    """Each piece loop's instructions, loads and opcodes per piece."""
    for loop in piece_loops(sass):
        per = loop["loads"]
        ops = ", ".join(f"{op} {n / per:.1f}" for op, n in loop["ops"].items())
        print(
            f"  loop {loop['label']}: {loop['instructions']} instructions, "
            f"{loop['loads']} pieces loaded a thread: "
            f"{loop['instructions'] / per:.1f} per piece ({ops})"
        )


if __name__ == "__main__":
    main()
