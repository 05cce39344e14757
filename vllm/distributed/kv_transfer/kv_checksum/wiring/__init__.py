# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""All wiring of KV checksums into vLLM 0.33.0 internals (R9, R10).

One module per vLLM part hooked, each starting with the list of its hooks
(target, why, how, the upstream change that would let it go): scheduler,
worker (model runner, ActiveKVConnector, aggregator, V1 refusal),
connector_api (records, carrier API, MultiConnector), nixl_push, mooncake,
offloading, simple_cpu_offload, containment (KV cache coordinator), metrics,
mamba_layers, prefix_cache, and recovery (the series' Scheduler recovery
methods over 0.33.0's internals). External-cache loads (R147) need no module
of their own: the scheduler hooks make their calls.
This module holds what they share: `install()`, the `_wrap` helper and the
last-resort guard. On any other vLLM none of them is
installed, only version_guard (R144), which the plugin installs itself.

Every hook is a thin wrapper that calls the original vLLM method and then a
short call into the core modules. With checksums disabled the scheduler's
`kv_checksum_scheduler` and the connector's `kv_checksum_worker` are None (class
defaults: nothing is set on vLLM's objects) and every hook is an exact
pass-through: no attribute set or deleted, no extra call (R1). With checksums
on, checksum code inside a hook runs under a last-resort guard (`_guard`,
R134): an exception is logged once as an error and turns checksums off for
that engine (scheduler or worker), while the original vLLM call's result or
exception passes through untouched. The only exceptions that reach vLLM on
purpose are start-up errors: invalid flags (R8), and on another vLLM version
the version guard's refusal of a fail-closed configuration (R144,
`version_guard.py`).

The list is repeated in docs/design/kv_checksum.md ("vLLM internals the plugin
hooks").
"""

import contextvars
import functools
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_checksum.config import (
    kv_checksum_enabled,
    read_flags,
)
from vllm.distributed.kv_transfer.kv_checksum.engine.guard import (
    KVChecksumGuard as _guard,  # noqa: F401 (the hooks' guard, engine/guard.py)
)
from vllm.distributed.kv_transfer.kv_checksum.engine.guard import (
    disable_after_error as _disable_after_error,  # noqa: F401
)
from vllm.distributed.kv_transfer.kv_checksum.wire.outbox import ChecksumOutbox
from vllm.distributed.kv_transfer.kv_checksum.wire.payload import (
    DEFAULT_MAX_ENCODED_BYTES,
    max_valid_payload_bytes,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


_installed = False


_kv_cache_config: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "kv_checksum_kv_cache_config", default=None
)


def _wrap(cls: type, name: str) -> Callable[[Callable], Callable]:
    """Install `hook(original, self, *args, **kwargs)` as `cls.name`."""

    def decorator(hook: Callable) -> Callable:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return hook(original, self, *args, **kwargs)

        wrapper.__kv_checksum_original__ = original  # type: ignore[attr-defined]
        setattr(cls, name, wrapper)
        return hook

    return decorator


def _enabled(vllm_config: Any, where: str) -> bool:
    """`kv_checksum_enabled` for a constructor hook: invalid flags raise
    ValueError (a start-up error by design, R8); any other error is logged
    once and leaves checksums off (R134)."""
    try:
        return kv_checksum_enabled(vllm_config)
    except ValueError:
        raise
    except Exception:
        logger.exception(
            "KV checksums disabled for this engine: the configuration could not "
            "be read in %s.",
            where,
        )
        return False


def _payload_byte_limit(vllm_config: Any) -> int:
    """A worker's cap on one request's payload bytes (R129): the operator's
    setting, else derived from this engine's max_model_len and KV cache
    groups (the KVCacheConfig of the worker being built); 16 MiB if unknown."""
    configured = read_flags(vllm_config.kv_transfer_config).max_payload_bytes
    if configured is not None:
        return configured
    kv_cache_config = _kv_cache_config.get()
    if kv_cache_config is None:
        return DEFAULT_MAX_ENCODED_BYTES
    return max_valid_payload_bytes(
        vllm_config.model_config.max_model_len, len(kv_cache_config.kv_cache_groups)
    )


def install() -> None:
    """Install every hook, once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.distributed.kv_transfer.kv_checksum.wiring import (
        connector_api,
        mamba_layers,
        metrics,
        mooncake,
        nixl_push,
        offloading,
        scheduler,
        simple_cpu_offload,
        worker,
    )

    connector_api.install_records()
    connector_api.install_connector_api()
    nixl_push.install_nixl_push()
    mooncake.install_mooncake()
    scheduler.install_scheduler_hooks()
    worker.install_worker_hooks()
    worker.install_config_hooks()
    metrics.install_metrics_hooks()
    offloading.install_offload_connector()
    simple_cpu_offload.install_simple_offload_connector()
    mamba_layers.install_mamba_split_hooks()


OUTBOX_ATTR = "_kv_checksum_outbox"


def _outbox(connector_scheduler: Any) -> ChecksumOutbox:
    """The payloads a carrier connector's scheduler keeps until they travel
    (NIXL push, Mooncake), created on first use on the instance."""
    return connector_scheduler.__dict__.setdefault(OUTBOX_ATTR, ChecksumOutbox())
