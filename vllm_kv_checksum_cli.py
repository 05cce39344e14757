# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm-kv-checksum`` command: the KV checksum package's tools without
importing vLLM (R132).

``python -m vllm.distributed.kv_transfer.kv_checksum`` imports the package's
parents first, and ``vllm.distributed`` imports torch and the distributed
runtime: about 20 s and torch's warnings before one line of output. The inspect
tool needs only the payload decoder (``wire/payload.py``: the standard library,
msgspec and NumPy), so this module loads it and the tool (``__main__.py``) from
their files, which lie next to this one in a checkout and in site-packages
alike, under private names. Where they do not, it imports the package.
"""

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).resolve().parent / "vllm/distributed/kv_transfer/kv_checksum"
PROG = "vllm-kv-checksum"


def _load(name: str, path: Path) -> ModuleType:
    """The module at `path`, executed under `name` (none of its parents)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Dataclasses and msgspec look the defining module up while it runs.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tool; returns the exit status."""
    payload_path = PACKAGE / "wire" / "payload.py"
    tool_path = PACKAGE / "__main__.py"
    if payload_path.is_file() and tool_path.is_file():
        payload = _load("_vllm_kv_checksum_payload", payload_path)
        tool = _load("_vllm_kv_checksum_tool", tool_path)
        return tool.main(argv, payload.inspect_payload, PROG)
    from vllm.distributed.kv_transfer.kv_checksum.__main__ import main as tool_main

    return tool_main(argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
