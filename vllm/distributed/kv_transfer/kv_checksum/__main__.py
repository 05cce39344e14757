# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command-line tools of the KV checksum package (R132).

``vllm-kv-checksum inspect VALUE`` (or ``python -m
vllm.distributed.kv_transfer.kv_checksum inspect VALUE``) prints a
``kv_checksums`` payload (VALUE the base64 string, or ``-`` to read it from
standard input); invalid input prints the decode error and exits with 1.

This module imports nothing from vLLM when loaded, so that the
``vllm-kv-checksum`` script (``vllm_kv_checksum_cli.py``) can run it without
vLLM's parent packages, which import torch.
"""

import argparse
import sys
from collections.abc import Callable, Sequence

PROG = "python -m vllm.distributed.kv_transfer.kv_checksum"


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Tools for vLLM KV checksums."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser(
        "inspect", help="print a kv_checksums payload (base64)"
    )
    inspect.add_argument(
        "value", metavar="VALUE", help="the base64 payload, or - for standard input"
    )
    return parser


def main(
    argv: Sequence[str] | None = None,
    inspect: Callable[[str], str] | None = None,
    prog: str = PROG,
) -> int:
    """Run the tool; returns the exit status. `inspect` describes a payload
    (default: the package's `inspect_payload`; the console script passes the
    same function loaded from its file)."""
    args = _parser(prog).parse_args(argv)
    if inspect is None:
        from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
            inspect_payload,
        )

        inspect = inspect_payload
    try:
        # Standard input is read as bytes and decoded here, so input that is
        # not UTF-8 is a decode error like any other, not a traceback.
        text = _read_stdin() if args.value == "-" else args.value
        print(inspect(text.strip()))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _read_stdin() -> str:
    """Standard input as text; ValueError if it is not UTF-8."""
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"invalid KV checksums: standard input is not UTF-8 ({exc.reason} "
            f"at byte {exc.start})"
        ) from None


if __name__ == "__main__":
    sys.exit(main())
