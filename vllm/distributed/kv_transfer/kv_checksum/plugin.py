# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vLLM general plugin that wires KV checksums into the engine (R7, R144).

vLLM calls `register()` in every process it starts (API server, engine core,
workers), possibly more than once. On the supported vLLM it installs the
hooks of :mod:`.wiring` once. On any other it installs none of them, only the
version guard (:mod:`.wiring.version_guard`): a configuration asking for
checksums fail-closed is then refused, fail-open it starts with one error
line and no checksum metric. `register()` raises only to refuse: when no
guard hook could be installed and the command line asks for fail-closed.
"""

import sys

from vllm.distributed.kv_transfer.kv_checksum.version import (
    SUPPORTED_VLLM_VERSION,
    UnsupportedVLLMError,
    fail_closed_on_command_line,
    is_supported_version,
    refusal_message,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["SUPPORTED_VLLM_VERSION", "register"]

_registered = False


def _installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _vllm_has_native_kv_checksums() -> bool:
    """Whether vLLM has KV checksums built in (the in-tree patch series,
    upstream/), told by its KVTransferConfig having an `enable_kv_checksum`
    field; the plugin must then install nothing (R146)."""
    import dataclasses

    from vllm.config import KVTransferConfig

    fields = dataclasses.fields(KVTransferConfig)
    return any(f.name == "enable_kv_checksum" for f in fields)


def register() -> None:
    """Install the checksum hooks into vLLM, once per process."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        if _vllm_has_native_kv_checksums():
            logger.info("vLLM has KV checksums built in: the plugin installs nothing.")
            return
        version = _installed_vllm_version()
        if not is_supported_version(version):
            _register_unsupported(version)
            return
        from vllm.distributed.kv_transfer.kv_checksum import wiring

        wiring.install()
        logger.debug("vllm-kv-checksum hooks installed.")
    except UnsupportedVLLMError:
        raise
    except Exception:
        logger.exception("vllm-kv-checksum failed to install its hooks; disabled.")


def _register_unsupported(version: str) -> None:
    """Another vLLM: the version guard only (R144)."""
    from vllm.distributed.kv_transfer.kv_checksum.wiring.version_guard import (
        install_version_guard,
    )

    try:
        guarded = install_version_guard(version)
    except Exception:
        logger.exception("vllm-kv-checksum could not install its version guard.")
        guarded = False
    if guarded:
        logger.warning(
            "vllm-kv-checksum supports vLLM %s only, found %s: KV checksums are "
            "not available and only its version guard is installed (a "
            "configuration asking for them is refused fail-closed, and logs "
            "an error fail-open).",
            SUPPORTED_VLLM_VERSION,
            version,
        )
        return
    if fail_closed_on_command_line(sys.argv):
        raise UnsupportedVLLMError(refusal_message(version))
    logger.error(
        "vllm-kv-checksum supports vLLM %s only, found %s: KV checksums are not "
        "available and a configuration asking for them cannot be refused here: "
        "an engine with enable_kv_checksum serves KV unchecked.",
        SUPPORTED_VLLM_VERSION,
        version,
    )
