# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vLLM general plugin that wires KV checksums into the engine (R7).

vLLM calls `register()` in every process it starts (API server, engine core,
workers), possibly more than once. It checks the vLLM version and installs the
hooks of :mod:`.wiring` once; it never raises, so it cannot break start-up.
"""

from vllm.logger import init_logger

logger = init_logger(__name__)

SUPPORTED_VLLM_VERSION = "0.33.0"

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
        if version.split("+", 1)[0] != SUPPORTED_VLLM_VERSION:
            logger.error(
                "vllm-kv-checksum supports vLLM %s only, found %s: KV checksums "
                "are not available and nothing was patched.",
                SUPPORTED_VLLM_VERSION,
                version,
            )
            return
        from vllm.distributed.kv_transfer.kv_checksum import wiring

        wiring.install()
        logger.debug("vllm-kv-checksum hooks installed.")
    except Exception:
        logger.exception("vllm-kv-checksum failed to install its hooks; disabled.")
