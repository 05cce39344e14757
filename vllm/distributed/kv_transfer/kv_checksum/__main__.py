# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command-line tools of the KV checksum package (R132).

``python -m vllm.distributed.kv_transfer.kv_checksum inspect VALUE`` prints a
``kv_checksums`` payload (VALUE the base64 string, or ``-`` to read it from
standard input); invalid input prints the decode error and exits with 1.
"""

import argparse
import sys
from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_checksum.payload import inspect_payload


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.distributed.kv_transfer.kv_checksum",
        description="Tools for vLLM KV checksums.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser(
        "inspect", help="print a kv_checksums payload (base64)"
    )
    inspect.add_argument(
        "value", metavar="VALUE", help="the base64 payload, or - for standard input"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tool; returns the exit status."""
    args = _parser().parse_args(argv)
    text = sys.stdin.read() if args.value == "-" else args.value
    try:
        print(inspect_payload(text.strip()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
