# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""All wiring of KV checksums into vLLM 0.33.0 internals.

Each hook is a thin wrapper around one vLLM method that calls the original and
then a short call into the core modules; with checksums disabled every hook is
a pass-through. The hooks are listed in docs/features/kv_checksum.md.
"""

from vllm.logger import init_logger

logger = init_logger(__name__)

_installed = False


def install() -> None:
    """Install every hook, once per process."""
    global _installed
    if _installed:
        return
    _installed = True
