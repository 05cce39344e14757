# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Instructions per 8-byte piece in the checksum kernel's loops, compiled for
Hopper (sm_90) on any machine: no GPU needed (issue 30 item 1, R143).

Compiles `_kv_checksum_kernel` with the launch constants the package would pick
for a block shape (its tile, the tuned warps), disassembles it with the
`nvdisasm` Triton ships, finds every loop (a label and the branch back to it),
and divides each loop's instructions by the pieces one thread loads per
iteration (its 64-bit global loads). The H200 measured the kernel at 0.84-0.92
of a plain read (2026-12-01): a kernel change that lowers these counts is worth
a GPU run; one that raises them is not.

    python benchmarks/kernels/kernel_sass_count.py [--heads 8 --tokens 16 --pieces 32]

Prints per loop: instructions, loads and the opcode counts per piece. The
SASS is that of the Triton installed here (the H200 host runs Triton 3.6).
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


def compile_sass(constants: dict[str, Any], num_warps: int) -> str:
    """SASS text of the checksum kernel for sm_90 with these constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm.distributed.kv_transfer.kv_checksum.definition import kernels

    fn = kernels._kv_checksum_kernel
    names = list(fn.arg_names)
    signature = {
        name: "*i64" if name.endswith("_ptr") else "i64"
        for name in names
        if name not in constants
    }
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
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
    heads: int, tokens: int, pieces: int, kernel_blocks: int
) -> tuple[dict[str, Any], int]:
    """The constexprs and warps KVChecksumLaunch would pick for a 16-byte-aligned
    head-major view of this block shape with the default LaunchConfig."""
    from vllm.distributed.kv_transfer.kv_checksum.definition import kernels

    config = kernels.default_config()
    shape = (kernel_blocks, heads, tokens, pieces)
    tile, head_tiles = kernels.pick_tile(shape, config.max_tile, config.chunk_pieces)
    block_pieces = kernel_blocks * heads * tokens * pieces
    constants = dict(
        KERNEL_BLOCKS=kernel_blocks,
        HEADS=heads,
        TOKENS=tokens,
        PIECES=pieces,
        PIECE_BITS=64,
        CHUNK=config.chunk_pieces,
        NUM_CHUNKS=-(-block_pieces // config.chunk_pieces),
        TILE=tile,
        HEAD_TILES=head_tiles,
        ALIGNED=True,
        LANE32=True,
        PERSISTENT=config.programs_per_sm > 0,
        WIDE=config.wide_weights,
    )
    warps = max(1, min(config.num_warps, tile // config.warp_pieces))
    return constants, warps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--pieces", type=int, default=32, help="8-byte pieces a head")
    parser.add_argument("--kernel-blocks", type=int, default=1)
    args = parser.parse_args()
    constants, warps = launch_constants(
        args.heads, args.tokens, args.pieces, args.kernel_blocks
    )
    print(f"constants {constants}, num_warps {warps}")
    for loop in loops(compile_sass(constants, warps)):
        if not loop["loads"]:
            continue  # the trap loop after the exit, bookkeeping loops
        per = loop["loads"]
        ops = ", ".join(f"{op} {n / per:.1f}" for op, n in loop["ops"].items())
        print(
            f"loop {loop['label']}: {loop['instructions']} instructions, "
            f"{loop['loads']} pieces loaded a thread: "
            f"{loop['instructions'] / per:.1f} per piece ({ops})"
        )


if __name__ == "__main__":
    main()
