# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a configuration asking for KV checksums gets on another vLLM (R144).

The hooks of this package are written against one vLLM release. On any other
the plugin installs none of them, only a guard (:mod:`.wiring.version_guard`)
that shows each configuration to `UnsupportedVersionGuard.check`: one that
asks for checksums fail-closed is refused with one error naming the supported
version; fail-open it starts unchecked with one error line, and without any
checksum metric (an alert on their absence fires). Never silently unchecked.
"""

import re
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.config import (
    ENABLE_KEY,
    FAIL_CLOSED_KEY,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

SUPPORTED_VLLM_VERSION = "0.33.0"

# The fail-closed flag set to true on a command line, in any spelling vLLM's
# CLI takes: JSON (`"kv_checksum_fail_closed": true`) or a dotted argument
# (`...kv_checksum_fail_closed=true`, `... kv_checksum_fail_closed true`).
_FAIL_CLOSED_ARG = re.compile(
    FAIL_CLOSED_KEY + r"""["']?\s*[:=\s]\s*["']?true\b""", re.IGNORECASE
)


class UnsupportedVLLMError(RuntimeError):
    """A configuration that cannot be served as it asks on this vLLM."""


def is_supported_version(version: str) -> bool:
    """Whether `version` (a local build suffix after "+" ignored) is the one
    release the hooks are written for."""
    return version.split("+", 1)[0] == SUPPORTED_VLLM_VERSION


def _flag(extra: Mapping[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}"
        )
    return value


def requested_flags(kv_transfer_config: Any) -> tuple[bool, bool]:
    """(enable_kv_checksum, kv_checksum_fail_closed) of a KV transfer config
    of any vLLM version: read from its `kv_connector_extra_config` alone,
    false where that is missing or not a mapping; a non-boolean flag raises
    ValueError, as on the supported vLLM (R8)."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    if not isinstance(extra, Mapping):
        return False, False
    return _flag(extra, ENABLE_KEY), _flag(extra, FAIL_CLOSED_KEY)


def fail_closed_on_command_line(argv: Sequence[str]) -> bool:
    """Whether a command line sets `kv_checksum_fail_closed` to true (the last
    resort when no configuration can be seen, R144)."""
    return bool(_FAIL_CLOSED_ARG.search(" ".join(argv)))


def refusal_message(found: str) -> str:
    """The one error a fail-closed configuration is refused with."""
    return (
        f"KV checksums are fail-closed (kv_connector_extra_config"
        f"[{FAIL_CLOSED_KEY!r}]) but vllm-kv-checksum supports vLLM "
        f"{SUPPORTED_VLLM_VERSION} only and this is vLLM {found}: no KV load "
        f"could be verified, so this engine does not start. Install vLLM "
        f"{SUPPORTED_VLLM_VERSION}, or remove {ENABLE_KEY!r} to run without "
        f"KV checksums."
    )


class UnsupportedVersionGuard:
    """Checks each configuration an engine on an unsupported vLLM is built
    from (R144); logs its fail-open error once per process."""

    def __init__(self, found: str) -> None:
        self.found = found
        self.logged = False

    def check(self, kv_transfer_config: Any, log: bool = True) -> None:
        """Raise `UnsupportedVLLMError` if the config asks for checksums
        fail-closed; if it asks fail-open, log one error (once per process,
        and only with `log`). A config without them passes silently."""
        enabled, fail_closed = requested_flags(kv_transfer_config)
        if not enabled:
            return
        if fail_closed:
            raise UnsupportedVLLMError(refusal_message(self.found))
        if log and not self.logged:
            self.logged = True
            logger.error(
                "KV checksums are enabled (kv_connector_extra_config[%r]) but "
                "vllm-kv-checksum supports vLLM %s only and this is vLLM %s: "
                "this engine serves every KV load UNCHECKED and exports no "
                "vllm:kv_checksum_* metric. Install vLLM %s, or set %r to "
                "refuse to start instead.",
                ENABLE_KEY,
                SUPPORTED_VLLM_VERSION,
                self.found,
                SUPPORTED_VLLM_VERSION,
                FAIL_CLOSED_KEY,
            )
